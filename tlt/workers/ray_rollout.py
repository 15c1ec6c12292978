"""SpotRollout: one RL step's rollout over N Ray rollout actors, with the drafter trained on the idle ones.

    ray.init(num_cpus=2, include_dashboard=False)            # or ray.init(address="auto") on a cluster
    rollout = SpotRollout(model_dir, num_replicas=2, replica_cfg=ReplicaConfig(speculative={"method": "eagle"}))
    outputs, report = rollout.run_step([(group_id, prompt_ids), ...], sampling_params, rl_step)

The only Ray file of the rollout path: the actor is `ray.remote(RolloutReplica)` as it is (threaded, so
stop_training and set_drafter reach it while it trains or generates); this driver turns actor replies into
SpotCoordinator events and the coordinator's actions into actor calls (docs/design.md §5):
- AssignGroups -> generate_groups (a replica returns when its share is done);
- StartTraining -> train_drafter (at most `session_steps` steps), StopTraining -> stop_training (the LAST replica
  finished: preempt after the current drafter step);
- PublishDrafter -> fetch the trained weights once, ray.put them, set_drafter on every live replica, also
  mid-rollout (exactness does not depend on the drafter). A session that lowers held-out accuracy is rolled back
  and publishes nothing; so does one that raises (SpotReport.failed_sessions).
- A replica past rollout.replica_timeout_s is killed and handled as dead (SpotReport.timed_out_replicas); a dead
  one's unfinished groups are rerun elsewhere with the same per-request seeds (the same law; token-identical for
  greedy decoding).
Hidden-state buffers stay where they were produced, and each replica trains on its own: gathering them would move
~2H bytes per generated token between nodes, while only the drafter's weights (one layer) need to travel. AdamW
state stays with the replica that trained.
"""
from __future__ import annotations

import itertools
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import ray
from ray.exceptions import RayActorError, RayTaskError

from tlt.drafter_train.coordinator import (Action, AssignGroups, PublishDrafter, ReplicaState, SpotCoordinator,
                                           StartTraining, StopTraining)
from tlt.engine.outputs import RequestOutput
from tlt.models.decoder import Decoder
from tlt.workers.rollout_worker import Group, ReplicaConfig, RolloutReplica
from tlt.workers.spot import SpotConfig, SpotReport, SpotRolloutBase

logger = logging.getLogger(__name__)
RayReplica = ray.remote(RolloutReplica)


@dataclass
class _Step:
    """Driver-side bookkeeping of one RL step."""
    inflight: dict = field(default_factory=dict)        # ObjectRef -> (kind "gen" | "train" | "ctl", replica)
    gen_since: dict = field(default_factory=dict)       # ObjectRef of a "gen" call -> time.monotonic() it was sent
    timed_out: list[int] = field(default_factory=list)
    failed_sessions: int = 0
    outputs: dict[int, RequestOutput] = field(default_factory=dict)
    harvested: dict[int, float] = field(default_factory=dict)
    accept: dict[int, float] = field(default_factory=dict)
    captures: dict[int, tuple[int, float]] = field(default_factory=dict)  # per replica: graphs, seconds this step
    published: list[int] = field(default_factory=list)
    pushes: int = 0
    refused: int = 0
    barrier_at: float | None = None


class SpotRollout(SpotRolloutBase):
    def __init__(self, model, num_replicas: int = 2, replica_cfg: ReplicaConfig | None = None,
                 spot: SpotConfig | None = None, actor_options: dict | None = None, ray_init: dict | None = None,
                 tokenizer=None, replica_cls: type[RolloutReplica] = RolloutReplica,
                 replica_options: Sequence[dict] | None = None, sleep_between_steps: bool = False):
        """model: HF directory (each actor loads it), or a Decoder (actors get its config, then its weights
        through the object store). actor_options: e.g. {"num_gpus": 1}; ray_init: ray.init kwargs if Ray is
        not running yet (default: a small local instance); replica_cls: the actor class (a RolloutReplica
        subclass, e.g. a fault-injecting one in tests); replica_options: per-replica actor options on top of
        actor_options (tlt.workers.placement's bundles); sleep_between_steps: replicas free their KV caches
        after each rollout and wake before the next (colocated placement: the trainer uses the GPU between)."""
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(**(ray_init or {"num_cpus": max(2, num_replicas), "include_dashboard": False}))
        self.spot = spot or SpotConfig()
        opts = {"num_cpus": 1, "max_concurrency": self.spot.max_concurrency, **(actor_options or {})}
        weights = None
        if isinstance(model, Decoder):
            weights = {k: v.detach().cpu() for k, v in model.state_dict().items()}
            model = model.cfg
        remote = RayReplica if replica_cls is RolloutReplica else ray.remote(replica_cls)
        per = list(replica_options) if replica_options is not None else [{}] * num_replicas
        if len(per) != num_replicas:
            raise ValueError(f"{len(per)} replica_options for {num_replicas} replicas")
        self.actors = {r: remote.options(**{**opts, **per[r]}).remote(model, r, replica_cfg, tokenizer)
                       for r in range(num_replicas)}
        self.sleep_between_steps = sleep_between_steps
        self.co = SpotCoordinator(list(self.actors), self.spot.min_train_tokens, self._trainer_tokens,
                                  train_every=self.spot.train_every)
        self.tokens = {r: 0 for r in self.actors}         # each replica's buffered loss tokens (last reply)
        self.sent_version = {r: 0 for r in self.actors}   # drafter version each replica was sent
        self.drafter_version, self.drafter_ref = 0, None
        self.drafter_gain: float | None = None            # the published drafter's gain (set_drafter)
        self.session_gain: dict[int, float | None] = {}   # each replica's last session's held-out gain
        self._sessions: dict[int, int] = {}
        self._session_ids = itertools.count(1)
        self.on_action: Callable[[Action], None] | None = None  # observer (logging, fault-injection tests)
        if weights is not None:
            self.set_policy_weights(weights)
        else:
            ray.get([a.ping.remote() for a in self.actors.values()])  # surface construction errors here

    # ---- public API ----------------------------------------------------------------------------------------
    def live(self) -> list[int]:
        return [r.rid for r in self.co.live()]

    def set_policy_weights(self, state: dict) -> None:
        """Send the trainer's Decoder state dict to every live replica (one object-store copy)."""
        ref = ray.put({k: v.detach().cpu() for k, v in state.items()})
        calls = {r: self.actors[r].set_policy_weights.remote(ref) for r in self.live()}
        for r, call in calls.items():
            try:
                ray.get(call)
            except RayActorError:
                self.co.replica_died(r)

    def _call_live(self, method: str) -> None:
        """Call a no-argument method on every live replica and wait; a replica that died meanwhile is handled
        as dead (its groups, if any, go elsewhere at the next step)."""
        calls = {r: getattr(self.actors[r], method).remote() for r in self.live()}
        for r, call in calls.items():
            try:
                ray.get(call)
            except RayActorError:
                self.co.replica_died(r)

    def drafter_state(self) -> dict | None:
        """The published drafter's trainable weights (None before the first publish)."""
        return None if self.drafter_ref is None else ray.get(self.drafter_ref)

    def replica_stats(self) -> dict[int, dict]:
        return {r: ray.get(self.actors[r].stats.remote()) for r in self.live()}

    def run_step(self, groups: Sequence[Group], params, rl_step: int
                 ) -> tuple[list[RequestOutput], SpotReport]:
        """Roll out every group (outputs in the order given) with spot drafter training; see the module doc."""
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(groups)
        self._work = {g: (list(p), sp) for (g, p), sp in zip(groups, params)}
        if len(self._work) != len(groups):
            raise ValueError("group ids must be distinct within a step")
        st = _Step()
        if self.sleep_between_steps:
            self._call_live("wake")
        self._handle(self.co.begin_step(rl_step, list(self._work)), st)
        while not self.co.step_done or st.inflight:  # then drain set_drafter / stop_training replies
            if st.barrier_at is None and self.co.step_done:
                st.barrier_at = time.monotonic()
            if not st.inflight:
                raise RuntimeError("spot rollout stalled: the coordinator waits but no actor call is in flight")
            ready, _ = ray.wait(list(st.inflight), num_returns=1, timeout=self.spot.poll_s)
            if ready:
                self._on_reply(ready[0], st)
            else:
                self._handle(self.co.poll(), st)
            self._check_hung(st)
        barrier = st.barrier_at or time.monotonic()
        rep = self.co.end_step()
        idle = {r.rid: barrier - r.share_done_at for r in self.co.live() if r.share_done_at is not None}
        report = SpotReport(rl_step, rep.rollout_s, idle, {r: st.harvested.get(r, 0.0) for r in self.actors},
                            rep.drafter_steps, sum(st.harvested.values()), rep.barrier_delay_s,
                            rep.barrier_delay_steps, rep.drafter_version, st.published, st.pushes, st.refused,
                            st.accept, rep.requeued_groups, rep.dead_replicas, st.timed_out, st.failed_sessions,
                            graph_captures={r: c for r, (c, _) in st.captures.items()},
                            graph_capture_time_s={r: s for r, (_, s) in st.captures.items()})
        if self.sleep_between_steps:
            self._call_live("sleep")
        missing = [g for g in self._work if g not in st.outputs]
        if missing:
            raise RuntimeError(f"spot rollout finished without outputs for groups {missing}")
        return [st.outputs[g] for g, _ in groups], report

    def close(self) -> None:
        for a in self.actors.values():
            ray.kill(a)
        if self._owns_ray:
            ray.shutdown()

    # ---- events from actors --------------------------------------------------------------------------------
    def _trainer_tokens(self) -> int:
        """Buffered tokens of the replica the coordinator would train on (the earliest idle one)."""
        idle = sorted(self.co.in_state(ReplicaState.IDLE), key=lambda r: r.share_done_at or 0.0)
        return self.tokens[idle[0].rid] if idle else 0

    def _check_hung(self, st: _Step) -> None:
        """A replica whose generate call outran replica_timeout_s is treated as dead (and killed: a hung actor may
        never answer, and must not hold its groups' results back)."""
        timeout = self.spot.replica_timeout_s
        if timeout is None:
            return
        now = time.monotonic()
        hung = {rid for ref, (kind, rid) in st.inflight.items()
                if kind == "gen" and now - st.gen_since[ref] > timeout}
        for rid in sorted(hung):
            logger.warning("rollout replica %d: no reply within rollout.replica_timeout_s=%s; treated as dead, "
                           "its groups rerun elsewhere", rid, timeout)
            ray.kill(self.actors[rid], no_restart=True)
            st.timed_out.append(rid)
            self._died(rid, st)

    def _on_reply(self, ref, st: _Step) -> None:
        kind, rid = st.inflight.pop(ref)
        st.gen_since.pop(ref, None)
        try:
            res = ray.get(ref)
        except RayActorError:
            self._died(rid, st)
            return
        except RayTaskError as e:
            if kind != "train":
                raise
            # the session crashed, the replica lives: nothing is published, the rollout keeps the last drafter
            logger.warning("drafter session on replica %d failed; keeping drafter version %d: %s", rid,
                           self.drafter_version, e)
            st.failed_sessions += 1
            self._handle(self.co.training_stopped(rid, 0, publish=False), st)
            return
        if kind == "gen":
            self.tokens[rid] = res.train_tokens
            st.accept[rid] = res.stats.get("spec_accept_length", math.nan)
            st.captures[rid] = (res.stats["step_graph_captures"], res.stats["step_graph_capture_time_s"])
            actions = []
            for out in res.outputs:
                st.outputs.setdefault(out.group_id, out)
                actions += self.co.group_done(rid, out.group_id)
            self._handle(actions, st)
        elif kind == "train":
            st.harvested[rid] = st.harvested.get(rid, 0.0) + res.seconds
            st.refused += int(res.steps > 0 and not res.publish)
            self.session_gain[rid] = res.gain if res.publish else None
            self._handle(self.co.training_stopped(rid, res.steps, res.mean_step_s, publish=res.publish), st)

    def _died(self, rid: int, st: _Step) -> None:
        if self.co.replicas[rid].state == ReplicaState.DEAD:
            return
        for ref, (_, r) in list(st.inflight.items()):
            if r == rid:
                del st.inflight[ref]
                st.gen_since.pop(ref, None)
        self._handle(self.co.replica_died(rid), st)

    # ---- coordinator actions -> actor calls ----------------------------------------------------------------
    def _handle(self, actions: list[Action], st: _Step) -> None:
        for a in actions:
            actor = self.actors[a.replica if not isinstance(a, PublishDrafter) else a.source]
            if isinstance(a, AssignGroups):
                self._push_drafter(a.replica, st)
                ref = actor.generate_groups.remote([(g, self._work[g][0]) for g in a.group_ids],
                                                   [self._work[g][1] for g in a.group_ids], self.co.step)
                st.inflight[ref] = ("gen", a.replica)
                st.gen_since[ref] = time.monotonic()
            elif isinstance(a, StartTraining):
                self._sessions[a.replica] = sid = next(self._session_ids)
                ref = actor.train_drafter.remote(self.spot.session_steps, a.rl_step, None, sid)
                st.inflight[ref] = ("train", a.replica)
            elif isinstance(a, StopTraining):
                st.inflight[actor.stop_training.remote(self._sessions[a.replica])] = ("ctl", a.replica)
            elif isinstance(a, PublishDrafter):
                self._publish(a, st)
            if self.on_action is not None:
                self.on_action(a)

    def _publish(self, a: PublishDrafter, st: _Step) -> None:
        """Make the source's trained weights the one logical drafter: one fetch, one put, pushed to all."""
        try:  # a drafter is one layer: fetching it through the driver keeps failure attribution simple
            state = ray.get(self.actors[a.source].drafter_state.remote())
        except RayActorError:
            self._died(a.source, st)
            return
        self.drafter_ref, self.drafter_version = ray.put(state), a.version
        self.drafter_gain = self.session_gain.get(a.source)  # its held-out gain over the weights it started from
        st.published.append(a.version)
        generating = {r for kind, r in st.inflight.values() if kind == "gen"}
        for r in self.live():
            st.pushes += int(self._push_drafter(r, st) and r in generating)  # lands mid-rollout

    def _push_drafter(self, rid: int, st: _Step) -> bool:
        if self.drafter_ref is None or self.sent_version[rid] >= self.drafter_version:
            return False
        ref = self.actors[rid].set_drafter.remote(self.drafter_ref, self.drafter_version, self.drafter_gain)
        st.inflight[ref] = ("ctl", rid)
        self.sent_version[rid] = self.drafter_version
        return True
