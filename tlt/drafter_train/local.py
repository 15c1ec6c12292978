"""Single-process spot training (laptops, tests): simulated replicas take turns, the drafter trains in the gaps.

Each replica's rollout is a generator that does a slice of decoding per `next()` and yields the prompt groups it
finished in that slice. The loop round-robins the live generators and, while the SpotCoordinator says a replica
is TRAINING, runs one drafter step per round in its place, so training overlaps the long tail the same way it
does across real replicas (minus the parallelism). The Ray workers drive the same coordinator with real actors.
"""
from __future__ import annotations

import itertools
from typing import Callable, Iterator

from tlt.drafter_train.buffer import DrafterBuffer
from tlt.drafter_train.coordinator import (AssignGroups, PublishDrafter, SpotCoordinator, StartTraining, StepReport,
                                           StopTraining)
from tlt.drafter_train.packing import PackedBatch
from tlt.drafter_train.trainer import DrafterTrainer, should_publish

# rollout(replica, group_ids, drafter_version) -> iterator over lists of group ids finished per slice
RolloutFn = Callable[[int, list[int], int], Iterator[list[int]]]


def run_step_local(co: SpotCoordinator, step: int, group_ids: list[int], rollout: RolloutFn,
                   trainer: DrafterTrainer, buffer: DrafterBuffer, heldout: PackedBatch | None = None,
                   on_publish: Callable[[int], None] | None = None) -> StepReport:
    """One RL step's rollout with drafter training in the gaps; returns the coordinator's StepReport.

    With `heldout`, a session whose held-out top-1 accuracy got worse is refused: its weights are rolled back
    and the drafter version stays."""
    gens: dict[int, Iterator[list[int]]] = {}
    sessions: dict[int, dict] = {}  # replica -> {"steps", "seconds", "baseline", "snapshot"}

    def handle(actions) -> None:
        for a in actions:
            if isinstance(a, AssignGroups):
                new = rollout(a.replica, a.group_ids, a.drafter_version)
                gens[a.replica] = itertools.chain(gens[a.replica], new) if a.replica in gens else new
            elif isinstance(a, StartTraining):
                sessions[a.replica] = {
                    "steps": 0, "seconds": 0.0, "stop": False,
                    "baseline": trainer.evaluate(heldout) if heldout is not None else None,
                    "snapshot": {k: v.clone() for k, v in trainer.drafter.trainable_state_dict().items()}}
            elif isinstance(a, StopTraining):
                sessions[a.replica]["stop"] = True
            elif isinstance(a, PublishDrafter) and on_publish is not None:
                on_publish(a.version)

    handle(co.begin_step(step, group_ids))
    while not co.step_done:
        actions = []
        for r in list(gens):
            try:
                for g in next(gens[r]):
                    actions += co.group_done(r, g)
            except StopIteration:
                del gens[r]
                actions += co.rollout_done(r)
        handle(actions)  # a stop raised by this round's rollout takes effect before the next drafter step
        actions = []
        for r, s in list(sessions.items()):
            if s["stop"]:  # preempted: decide whether to publish what it trained
                del sessions[r]
                ok = s["steps"] > 0 and (s["baseline"] is None
                                         or should_publish(trainer.evaluate(heldout), s["baseline"]))
                if not ok:
                    trainer.drafter.load_state_dict(s["snapshot"], strict=False)
                mean = s["seconds"] / max(s["steps"], 1)
                actions += co.training_stopped(r, s["steps"], mean, publish=ok)
            else:
                stats = trainer.train_steps(buffer, max_steps=1, step=step)
                s["steps"] += stats.steps
                s["seconds"] += stats.seconds
        handle(actions)
    return co.end_step()
