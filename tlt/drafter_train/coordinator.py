"""Spot-training coordinator: train the drafter on rollout replicas the long tail leaves idle (docs/design.md §5).

An event-driven state machine, pure Python (Ray actors in tlt/workers drive it and carry out its actions). Each
event method returns the actions the caller must perform; time comes from an injectable clock, so tests drive it
with fake replicas and a fake clock.

    BUSY (generating its prompt groups) -> IDLE (finished its share) -> TRAINING (drafter steps) -> IDLE

- Training starts on an IDLE replica while others are still BUSY and the buffer holds >= min_train_tokens.
- It is preempted (at drafter-step granularity) when the LAST replica finishes rollout, not when the training
  replica's own share ends (fastrl stops there: too early, idle time wasted).
- One logical drafter: a finished session that the trainer accepts bumps `version`; every replica drafts with
  that version in the next rollout (PublishDrafter, and AssignGroups carries the version).
- A replica that dies has its unfinished prompt groups re-queued (IDLE replicas first, then a TRAINING one,
  which is preempted, then the least-loaded BUSY one). Nothing is lost and the step goes on.
- Accounting per step: idle replica-seconds, the part harvested by training, and how long training delayed
  the barrier (goal: at most one drafter step, since the trainer checks its stop flag between steps).
"""
from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from typing import Callable


class ReplicaState(enum.Enum):
    BUSY = "busy"
    IDLE = "idle"
    TRAINING = "training"
    DEAD = "dead"


@dataclass
class AssignGroups:
    replica: int
    group_ids: list[int]
    drafter_version: int          # the drafter the replica must draft with


@dataclass
class StartTraining:
    replica: int
    drafter_version: int          # train on from this version's weights
    rl_step: int                  # for the buffer's one-step offset sampling


@dataclass
class StopTraining:
    replica: int                  # set its stop flag; it answers with training_stopped after the current step


@dataclass
class PublishDrafter:
    version: int
    source: int                   # replica holding the new weights; every replica loads them before next rollout


Action = AssignGroups | StartTraining | StopTraining | PublishDrafter


@dataclass
class Replica:
    rid: int
    state: ReplicaState = ReplicaState.IDLE
    pending: set[int] = field(default_factory=set)   # assigned prompt groups not finished yet
    share_done_at: float | None = None               # when it last ran out of rollout work this step
    train_started_at: float | None = None
    stop_requested: bool = False


@dataclass
class StepReport:
    step: int
    rollout_s: float              # begin_step -> last prompt group done
    idle_s: float                 # replica-seconds between finishing its share and the barrier
    harvested_s: float            # replica-seconds of those spent training the drafter
    barrier_delay_s: float        # last rollout done -> training stopped (0 if nothing was training)
    barrier_delay_steps: float    # barrier_delay_s in units of the session's mean drafter step (nan: no steps)
    drafter_steps: int
    drafter_version: int          # version every replica uses next
    requeued_groups: int
    dead_replicas: list[int]


class SpotCoordinator:
    def __init__(self, replica_ids: list[int], min_train_tokens: int, available_tokens: Callable[[], int],
                 clock: Callable[[], float] = time.monotonic, train_every: int = 1, max_train_replicas: int = 1):
        self.replicas = {r: Replica(r) for r in replica_ids}
        self.min_train_tokens = min_train_tokens
        self.available_tokens = available_tokens  # e.g. DrafterBuffer.num_train_tokens
        self.clock = clock
        self.train_every = train_every            # train in every k-th RL step (updating every step can hurt)
        self.max_train_replicas = max_train_replicas  # 1 = one logical drafter, no data-parallel sync needed
        self.version = 0
        self.step = -1
        self.history: list[StepReport] = []
        self._reset_step_stats()

    # ---- queries -------------------------------------------------------------------------------------------
    def live(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.state != ReplicaState.DEAD]

    def in_state(self, state: ReplicaState) -> list[Replica]:
        return [r for r in self.replicas.values() if r.state == state]

    @property
    def rollout_finished(self) -> bool:
        return all(not r.pending for r in self.live())

    @property
    def step_done(self) -> bool:
        return self.rollout_finished and not self.in_state(ReplicaState.TRAINING)

    # ---- events --------------------------------------------------------------------------------------------
    def begin_step(self, step: int, group_ids: list[int]) -> list[Action]:
        live = self.live()
        if not live:
            raise RuntimeError("no live rollout replica left")
        if self.in_state(ReplicaState.TRAINING):
            raise RuntimeError("begin_step while a drafter session still runs: wait for training_stopped")
        self.step = step
        self._reset_step_stats()
        for r in live:
            r.state, r.pending, r.share_done_at, r.stop_requested = ReplicaState.BUSY, set(), None, False
        actions = []
        for i, r in enumerate(live):
            share = group_ids[i::len(live)]  # round-robin split of the step's prompt groups
            r.pending = set(share)
            actions.append(AssignGroups(r.rid, list(share), self.version))
        for r in live:
            if not r.pending:
                self._share_done(r)
        return actions + self._schedule()

    def group_done(self, replica: int, group_id: int) -> list[Action]:
        r = self.replicas[replica]
        r.pending.discard(group_id)
        if not r.pending and r.state == ReplicaState.BUSY:
            self._share_done(r)
        return self._schedule()

    def rollout_done(self, replica: int) -> list[Action]:
        """The replica finished every group it was given (for engines that report a share at once)."""
        r = self.replicas[replica]
        r.pending.clear()
        if r.state == ReplicaState.BUSY:
            self._share_done(r)
        return self._schedule()

    def poll(self) -> list[Action]:
        """Re-check without an event (e.g. the buffer grew): may start training on an idle replica."""
        return self._schedule()

    def training_stopped(self, replica: int, steps: int, mean_step_s: float = math.nan,
                         publish: bool = True) -> list[Action]:
        """The session on `replica` ended (preempted, or out of steps). publish=False: the trainer refused the
        new weights (held-out accuracy got worse), so the version stays."""
        r = self.replicas[replica]
        if r.state != ReplicaState.TRAINING:
            raise RuntimeError(f"replica {replica} reported training_stopped while {r.state.value}")
        now = self.clock()
        self._harvested += now - r.train_started_at
        self._drafter_steps += steps
        if steps > 0:
            self._step_s = mean_step_s
        if self._last_rollout_at is not None:  # training outlived the rollout: it delayed the barrier
            self._delay_s = max(self._delay_s, now - self._last_rollout_at)
        actions: list[Action] = []
        if publish and steps > 0:
            self.version += 1
            actions.append(PublishDrafter(self.version, replica))
        r.train_started_at, r.stop_requested = None, False
        if r.pending:  # it was handed a dead replica's groups while training
            r.state = ReplicaState.BUSY
            actions.append(AssignGroups(r.rid, sorted(r.pending), self.version))
        else:
            r.state = ReplicaState.IDLE
        return actions + self._schedule()

    def replica_died(self, replica: int) -> list[Action]:
        r = self.replicas[replica]
        lost = sorted(r.pending)
        if r.state == ReplicaState.TRAINING:  # the session dies with it; nothing is published
            self._harvested += self.clock() - r.train_started_at
        r.state, r.pending = ReplicaState.DEAD, set()
        self._dead.append(replica)
        if not self.live():
            raise RuntimeError(f"replica {replica} died and no live rollout replica is left")
        actions = self._requeue(lost) if lost else []
        return actions + self._schedule()

    def end_step(self) -> StepReport:
        if not self.step_done:
            raise RuntimeError("end_step before the step is done (rollout pending or training not stopped)")
        barrier = self._barrier_at if self._barrier_at is not None else self.clock()
        last = self._last_rollout_at if self._last_rollout_at is not None else barrier
        idle = sum(barrier - r.share_done_at for r in self.live() if r.share_done_at is not None)
        steps_delay = self._delay_s / self._step_s if self._step_s and not math.isnan(self._step_s) else math.nan
        rep = StepReport(self.step, last - self._t0, idle, self._harvested, self._delay_s, steps_delay,
                         self._drafter_steps, self.version, self._requeued, list(self._dead))
        self.history.append(rep)
        return rep

    # ---- internals -----------------------------------------------------------------------------------------
    def _reset_step_stats(self) -> None:
        self._t0 = self.clock()
        self._last_rollout_at: float | None = None  # when the last replica finished rollout
        self._barrier_at: float | None = None       # rollout finished and no training left running
        self._harvested, self._drafter_steps, self._requeued = 0.0, 0, 0
        self._delay_s, self._step_s, self._dead = 0.0, math.nan, []

    def _share_done(self, r: Replica) -> None:
        r.state, r.share_done_at = ReplicaState.IDLE, self.clock()

    def _requeue(self, groups: list[int]) -> list[Action]:
        """Give a dead replica's unfinished groups to the replicas that can start them soonest."""
        self._requeued += len(groups)
        idle = self.in_state(ReplicaState.IDLE)
        training = self.in_state(ReplicaState.TRAINING)
        targets = idle or training or sorted(self.in_state(ReplicaState.BUSY), key=lambda r: len(r.pending))[:1]
        actions: list[Action] = []
        for i, r in enumerate(targets):
            share = groups[i::len(targets)]
            if not share:
                continue
            r.pending |= set(share)
            r.share_done_at = None  # it has rollout work again
            if r.state == ReplicaState.TRAINING:  # groups are assigned once its current drafter step ends
                if not r.stop_requested:
                    r.stop_requested = True
                    actions.append(StopTraining(r.rid))
                continue
            r.state = ReplicaState.BUSY
            actions.append(AssignGroups(r.rid, share, self.version))
        return actions

    def _schedule(self) -> list[Action]:
        """Preempt training once the last rollout is done; otherwise start training on an idle replica."""
        actions: list[Action] = []
        if self.rollout_finished:
            if self._last_rollout_at is None:
                self._last_rollout_at = self.clock()
            for r in self.in_state(ReplicaState.TRAINING):
                if not r.stop_requested:
                    r.stop_requested = True
                    actions.append(StopTraining(r.rid))
            if self.step_done and self._barrier_at is None:
                self._barrier_at = self.clock()
            return actions
        if self.step % self.train_every != 0 or len(self.in_state(ReplicaState.TRAINING)) >= self.max_train_replicas:
            return actions
        idle = sorted(self.in_state(ReplicaState.IDLE), key=lambda r: r.share_done_at)
        if idle and self.available_tokens() >= self.min_train_tokens:
            r = idle[0]  # the earliest finisher: it has the longest gap ahead
            r.state, r.train_started_at = ReplicaState.TRAINING, self.clock()
            actions.append(StartTraining(r.rid, self.version, self.step))
        return actions
