"""DrafterHook: the seam between the RL trainer (tlt.rl.trainer) and online drafter training.

The trainer calls a hook at fixed points of each step; tlt.drafter_train.online implements it. The hook lives here,
below the trainer, so that drafter training never imports the RL loop (imports point one way).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from tlt.engine.outputs import RequestOutput


class DrafterHook:
    """What the RL trainer calls of online drafter training (tlt.drafter_train.online); this default does nothing.

    before_rollout(step) runs at the start of each step, before its rollout (a hook may start work that overlaps
    it); rollout_done(step) when the rollout and its rewards are done, before the log-probs and update (such work
    yields the cores to them here). after_rollout(step, rollout, outputs) runs once per step after the policy update: `rollout` holds the
    responses trained on (tlt.rl.rollout.RolloutBatch), `outputs` every engine output of the step (groups dropped
    by dynamic sampling too), with target hidden states ([R, H] bf16 per response) when wants_hidden_states is
    True. It returns metrics to log. state_dict() is saved with each checkpoint and load_state_dict() restores it
    on resume; export(dir) writes the drafter in use into each checkpoint (global_step_N/drafter/), the deployable
    by-product.
    """
    wants_hidden_states = False

    def before_rollout(self, step: int) -> None:
        return None

    def rollout_done(self, step: int) -> None:
        return None

    def after_rollout(self, step: int, rollout: Any, outputs: list[RequestOutput]) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None

    def export(self, out_dir: Path) -> None:
        return None
