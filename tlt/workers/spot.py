"""Spot-rollout drivers' shared pieces (no Ray): SpotConfig, SpotReport, and LocalSpotRollout, the single-process
driver with the same interface as tlt.workers.ray_rollout.SpotRollout.

    rollout = LocalSpotRollout(model_dir, ReplicaConfig(speculative={"method": "eagle"}), SpotConfig())
    outputs, report = rollout.run_step([(group_id, prompt_ids), ...], sampling_params, rl_step)

One process has one replica, so there is no idle replica to harvest: LocalSpotRollout runs the rollout, then a
bounded number of drafter steps (SpotConfig.local_max_steps) on the same buffer, gated by the held-out check, and
publishes the result into its engine for the next step. (tlt.drafter_train.local.run_step_local simulates several
replicas taking turns on rollout generators; it does not fit one real engine, whose groups all decode in one batch.)
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

from tlt.engine.outputs import RequestOutput
from tlt.engine.params import SamplingParams
from tlt.speculative.drafter_io import save_drafter
from tlt.workers.rollout_worker import Group, ReplicaConfig, RolloutReplica


@dataclass
class SpotConfig:
    min_train_tokens: int = 4096    # an idle replica trains only once its buffer holds this many loss tokens
    train_every: int = 1            # train in every k-th RL step
    session_steps: int = 50         # drafter steps per session; each finished session is published, so a long
                                    # tail gets several drafter versions mid-rollout (SpotRollout)
    local_max_steps: int = 20       # LocalSpotRollout: drafter steps after each rollout
    poll_s: float = 0.5             # SpotRollout: driver wake-up interval when no actor reports
    max_concurrency: int = 4        # SpotRollout: actor threads (rollout, training, set_drafter, stop_training)
    replica_timeout_s: float | None = None  # SpotRollout: a generate call running longer is a dead replica's

    @classmethod
    def from_config(cls, cfg) -> "SpotConfig":
        """From a tlt.config.Config (sections drafter_train, rollout.replica_timeout_s)."""
        d = cfg.drafter_train
        return cls(min_train_tokens=d.min_buffer_tokens, train_every=d.every_k_steps,
                   replica_timeout_s=cfg.rollout.replica_timeout_s)


@dataclass
class SpotReport:
    step: int
    rollout_s: float                  # step start -> last prompt group done
    idle_s: dict[int, float]          # per replica: finished its share -> step barrier
    harvested_s: dict[int, float]     # per replica: drafter-training seconds inside the rollout window
    drafter_steps: int
    drafter_train_s: float            # all drafter-training seconds (LocalSpotRollout: serial, after rollout)
    barrier_delay_s: float            # last rollout done -> training stopped
    barrier_delay_steps: float        # ... in drafter steps (goal <= 1; nan: no steps)
    drafter_version: int              # the one logical drafter every replica drafts with next
    published: list[int] = field(default_factory=list)   # versions published during this step
    mid_rollout_pushes: int = 0       # new drafter versions pushed into replicas still generating
    refused_sessions: int = 0         # sessions whose weights lowered held-out accuracy: not published
    accept_length: dict[int, float] = field(default_factory=dict)  # per replica, llm.stats() spec_accept_length
    requeued_groups: int = 0
    dead_replicas: list[int] = field(default_factory=list)
    timed_out_replicas: list[int] = field(default_factory=list)  # hung past replica_timeout_s (also dead)
    failed_sessions: int = 0          # drafter sessions that raised: nothing published, rollout goes on
    # per replica, the CUDA graphs its engine captured in this step and their seconds (a colocated replica's sleep
    # drops its graphs, rollout.free_cache_engine)
    graph_captures: dict[int, int] = field(default_factory=dict)
    graph_capture_time_s: dict[int, float] = field(default_factory=dict)

    def metrics(self, prefix: str = "spot/") -> dict[str, float]:
        """Flat float metrics for the trainer's logger."""
        out = {k: float(v) for k, v in asdict(self).items() if isinstance(v, (int, float)) and k != "step"}
        out["idle_s_total"] = sum(self.idle_s.values())
        out["harvested_s_total"] = sum(self.harvested_s.values())
        out["num_dead_replicas"] = float(len(self.dead_replicas))
        out["num_timed_out_replicas"] = float(len(self.timed_out_replicas))
        out["graph_captures"] = float(sum(self.graph_captures.values()))
        out["graph_capture_time_s"] = float(sum(self.graph_capture_time_s.values()))
        acc = [v for v in self.accept_length.values() if not math.isnan(v)]
        if acc:
            out["accept_length_mean"] = sum(acc) / len(acc)
        return {prefix + k: v for k, v in out.items()}


class SpotRolloutBase:
    """tlt.LLM-shaped `generate` on top of run_step, so tlt.rl.rollout.generate_rollouts can take a driver."""
    rl_step = 0
    last_report: SpotReport | None = None

    def run_step(self, groups: Sequence[Group], params, rl_step: int
                 ) -> tuple[list[RequestOutput], SpotReport]:
        raise NotImplementedError

    def generate(self, prompts=None, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 prompt_token_ids: list[list[int]] | None = None, group_ids: list[int] | None = None,
                 rl_step: int | None = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Like LLM.generate for token-id prompts; rl_step defaults to the last one (set `rl_step` per step)."""
        ids = [list(p) for p in (prompt_token_ids if prompt_token_ids is not None else prompts)]
        gids = list(group_ids) if group_ids is not None else list(range(len(ids)))
        if len(set(gids)) != len(gids):
            raise ValueError("group_ids must be distinct: a spot rollout routes work by group id")
        self.rl_step = self.rl_step if rl_step is None else rl_step
        outputs, self.last_report = self.run_step(list(zip(gids, ids)), sampling_params or SamplingParams(),
                                                  self.rl_step)
        return outputs


class LocalSpotRollout(SpotRolloutBase):
    def __init__(self, model, replica_cfg: ReplicaConfig | None = None, spot: SpotConfig | None = None,
                 tokenizer=None):
        self.replica = RolloutReplica(model, 0, replica_cfg, tokenizer)
        self.spot = spot or SpotConfig()
        self.version = 0

    @property
    def tokenizer(self):
        return self.replica.llm.tokenizer

    def set_policy_weights(self, state) -> None:
        self.replica.set_policy_weights(state)

    def drafter_state(self) -> dict:
        return self.replica.drafter_state()

    def save_drafter(self, out_dir: str | Path) -> Path:
        return save_drafter(self.replica.train_copy, out_dir, {"drafter_version": self.version})

    def run_step(self, groups: Sequence[Group], params, rl_step: int
                 ) -> tuple[list[RequestOutput], SpotReport]:
        t0 = time.perf_counter()
        res = self.replica.generate_groups(groups, params, rl_step)
        rollout_s = time.perf_counter() - t0
        s = self.spot
        tr, published = None, []
        if (self.replica.trainer is not None and s.local_max_steps > 0 and rl_step % s.train_every == 0
                and res.train_tokens >= s.min_train_tokens):
            tr = self.replica.train_drafter(s.local_max_steps, rl_step, stop_flag=threading.Event())
            if tr.publish:
                self.version += 1
                self.replica.set_drafter(self.replica.drafter_state(), self.version, tr.gain)
                published.append(self.version)
        steps = tr.steps if tr else 0
        report = SpotReport(rl_step, rollout_s, {0: 0.0}, {0: 0.0}, steps, tr.seconds if tr else 0.0, 0.0,
                            0.0 if steps else math.nan, self.version, published, 0,
                            int(bool(tr and tr.steps and not tr.publish)),
                            {0: res.stats.get("spec_accept_length", math.nan)},
                            graph_captures={0: res.stats["step_graph_captures"]},
                            graph_capture_time_s={0: res.stats["step_graph_capture_time_s"]})
        return res.outputs, report

    def close(self) -> None:
        return None
