"""SpotCoordinator driven by fake replicas and a fake clock: no threads, no Ray."""
import math

import pytest

from tlt.drafter_train.coordinator import (AssignGroups, PublishDrafter, ReplicaState, SpotCoordinator,
                                           StartTraining, StopTraining)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def kinds(actions, cls):
    return [a for a in actions if isinstance(a, cls)]


def make(n=3, tokens=1000, min_tokens=100, **kw):
    clock, data = Clock(), {"tokens": tokens}
    co = SpotCoordinator(list(range(n)), min_tokens, lambda: data["tokens"], clock=clock, **kw)
    return co, clock, data


def test_preempt_only_when_last_replica_finishes():
    co, clock, _ = make()
    acts = co.begin_step(0, list(range(6)))
    shares = {a.replica: a.group_ids for a in kinds(acts, AssignGroups)}
    assert shares == {0: [0, 3], 1: [1, 4], 2: [2, 5]}
    clock.t = 1.0
    acts = co.rollout_done(0)  # first finisher: training starts there
    assert kinds(acts, StartTraining) == [StartTraining(0, 0, 0)]
    assert co.replicas[0].state == ReplicaState.TRAINING
    clock.t = 2.0
    acts = co.rollout_done(1)  # another replica finishes: training keeps going (fastrl would stop here)
    assert not kinds(acts, StopTraining) and not kinds(acts, StartTraining)  # one logical drafter
    clock.t = 5.0
    acts = co.group_done(2, 2)
    assert not acts
    clock.t = 6.0
    acts = co.group_done(2, 5)  # LAST replica finishes: now preempt
    assert acts == [StopTraining(0)]
    assert not co.step_done
    clock.t = 6.4
    acts = co.training_stopped(0, steps=10, mean_step_s=0.5)
    assert acts == [PublishDrafter(1, 0)]
    assert co.step_done
    rep = co.end_step()
    assert rep.rollout_s == 6.0 and rep.drafter_steps == 10 and rep.drafter_version == 1
    assert rep.harvested_s == pytest.approx(5.4)
    assert rep.idle_s == pytest.approx((6.4 - 1) + (6.4 - 2) + (6.4 - 6))
    assert rep.barrier_delay_s == pytest.approx(0.4)
    assert rep.barrier_delay_steps == pytest.approx(0.8)  # goal: at most one drafter step


def test_training_needs_enough_data():
    co, clock, data = make(tokens=50, min_tokens=100)
    co.begin_step(0, list(range(3)))
    clock.t = 1.0
    assert not kinds(co.rollout_done(0), StartTraining)
    assert co.replicas[0].state == ReplicaState.IDLE
    data["tokens"] = 150  # the buffer filled up while others still generate
    clock.t = 2.0
    assert kinds(co.poll(), StartTraining) == [StartTraining(0, 0, 0)]


def test_no_training_when_no_replica_is_still_busy():
    co, clock, _ = make(n=1)
    co.begin_step(0, [0, 1])
    acts = co.rollout_done(0)
    assert not kinds(acts, StartTraining) and co.step_done
    rep = co.end_step()
    assert rep.drafter_steps == 0 and rep.barrier_delay_s == 0 and math.isnan(rep.barrier_delay_steps)


def test_dead_replica_groups_are_rerun():
    co, clock, _ = make(min_tokens=10**9)  # no training in this test
    co.begin_step(0, list(range(6)))
    co.group_done(0, 0)
    clock.t = 1.0
    co.group_done(1, 1)
    co.group_done(1, 4)  # replica 1 idle
    acts = co.replica_died(0)  # had finished group 0; group 3 is lost
    assert acts == [AssignGroups(1, [3], 0)]
    assert co.replicas[1].state == ReplicaState.BUSY and co.replicas[0].state == ReplicaState.DEAD
    co.rollout_done(2)
    assert not co.rollout_finished
    co.group_done(1, 3)
    assert co.step_done
    rep = co.end_step()
    assert rep.requeued_groups == 1 and rep.dead_replicas == [0]
    # the next step goes on without it
    acts = co.begin_step(1, list(range(4)))
    assert {a.replica for a in kinds(acts, AssignGroups)} == {1, 2}


def test_dead_replica_groups_go_to_busy_replicas_when_none_idle():
    co, clock, _ = make(min_tokens=10**9)
    co.begin_step(0, list(range(6)))
    acts = co.replica_died(1)
    assert len(kinds(acts, AssignGroups)) == 1 and sorted(kinds(acts, AssignGroups)[0].group_ids) == [1, 4]
    assert co.replicas[0].pending | co.replicas[2].pending == {0, 1, 2, 3, 4, 5}


def test_training_replica_is_preempted_to_take_requeued_groups():
    co, clock, _ = make()
    co.begin_step(0, list(range(6)))
    clock.t = 1.0
    assert kinds(co.rollout_done(0), StartTraining)
    clock.t = 2.0
    acts = co.replica_died(1)  # no IDLE replica: the trainer stops and takes the groups
    assert acts == [StopTraining(0)]
    clock.t = 2.3
    acts = co.training_stopped(0, steps=3, mean_step_s=0.4)
    assert acts[0] == PublishDrafter(1, 0)
    assert acts[1] == AssignGroups(0, [1, 4], 1)  # drafts with the fresh version
    assert co.replicas[0].state == ReplicaState.BUSY
    clock.t = 3.0
    assert kinds(co.rollout_done(2), StartTraining) == [StartTraining(2, 1, 0)]  # a new session from version 1
    clock.t = 4.0
    assert co.rollout_done(0) == [StopTraining(2)]
    clock.t = 4.1
    assert co.training_stopped(2, steps=2, mean_step_s=0.3) == [PublishDrafter(2, 2)]
    rep = co.end_step()
    assert rep.drafter_steps == 5 and rep.requeued_groups == 2 and rep.barrier_delay_s == pytest.approx(0.1)


def test_dead_trainer_publishes_nothing_and_version_increments_per_session():
    co, clock, _ = make()
    co.begin_step(0, list(range(3)))
    co.rollout_done(0)
    assert co.replica_died(0) == []  # dies while training: nothing published
    assert co.version == 0
    assert kinds(co.rollout_done(1), StartTraining) == [StartTraining(1, 0, 0)]  # another idle replica takes over
    assert co.rollout_done(2) == [StopTraining(1)]
    assert co.training_stopped(1, steps=0) == []  # no step done: nothing to publish
    assert co.step_done and co.end_step().drafter_version == 0
    for step in (1, 2):
        acts = co.begin_step(step, list(range(4)))
        assert all(a.drafter_version == step - 1 for a in kinds(acts, AssignGroups))
        co.rollout_done(1)
        assert co.replicas[1].state == ReplicaState.TRAINING
        assert co.rollout_done(2) == [StopTraining(1)]
        assert co.training_stopped(1, steps=4) == [PublishDrafter(step, 1)]
        assert co.end_step().drafter_version == step
    # a session the trainer refuses to publish (held-out accuracy got worse) keeps the version
    co.begin_step(3, list(range(4)))
    co.rollout_done(2)
    co.rollout_done(1)
    assert co.training_stopped(2, steps=4, publish=False) == []
    assert co.end_step().drafter_version == 2


def test_train_every_k_steps():
    co, clock, _ = make(train_every=2)
    co.begin_step(1, list(range(3)))
    assert not kinds(co.rollout_done(0), StartTraining)
    co.rollout_done(1)
    co.rollout_done(2)
    co.end_step()
    co.begin_step(2, list(range(3)))
    assert kinds(co.rollout_done(0), StartTraining)
