"""SpotRollout on a small local Ray instance (2 CPU replicas, tiny random model): two RL steps with spot drafter
training, preemption at the last replica's finish, drafter publishing (also mid-rollout), and a replica killed
mid-rollout whose groups are rerun elsewhere. Skipped when Ray cannot start here."""
import math
import time

import pytest

import tlt
from tlt.drafter_train.coordinator import AssignGroups, StartTraining, StopTraining
from tlt.workers.rollout_worker import ReplicaConfig, RolloutReplica
from tlt.workers.spot import SpotConfig

ray = pytest.importorskip("ray", reason="ray is not installed")

SPEC = {"method": "eagle", "bs_threshold": None, "adaptive": False, "num_speculative_tokens": 3}
CFG = ReplicaConfig(speculative=SPEC, device="cpu", dtype="float32", holdout_every=0, batch_tokens=64,
                    window_len=32, max_num_seqs=16)
# round-robin split: replica 0 gets groups 0, 2 (short), replica 1 gets 1, 3 (long): replica 0 idles in the tail
GROUPS = [(g, [1 + g, 7, 3 + g]) for g in range(4)]


def params(step, long=96, temperature=1.0):
    return [tlt.SamplingParams(n=2, temperature=temperature, max_tokens=long if g % 2 else 4,
                               seed=1000 * step + 10 * g) for g in range(4)]


@pytest.fixture(scope="module")
def ray_local():
    if not ray.is_initialized():
        try:
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        except (RuntimeError, OSError, ConnectionError, ValueError) as e:
            pytest.skip(f"ray cannot start here: {e}")
    yield
    ray.shutdown()


def greedy_reference(path, ps):
    """Plain (no SD) greedy decoding in one process: what every replica must produce for greedy requests."""
    rep = RolloutReplica(path, 9, ReplicaConfig(device="cpu", dtype="float32"))
    return [[c.token_ids for c in o.outputs] for o in rep.generate_groups(GROUPS, ps, 0).outputs]


def test_spot_rollout_two_steps(ray_local, tiny_llama_dir):
    from tlt.workers.ray_rollout import SpotRollout
    t0 = time.monotonic()
    rollout = SpotRollout(tiny_llama_dir, 2, CFG, SpotConfig(min_train_tokens=8, session_steps=10_000, poll_s=0.05))
    events = []
    rollout.on_action = lambda a: events.append((a, rollout.co.rollout_finished))
    try:
        for step in range(2):
            if step == 1:
                rollout.spot.session_steps = 2  # short sessions: published while replica 1 still generates
            events.clear()
            outs, rep = rollout.run_step(GROUPS, params(step), step)
            assert [o.group_id for o in outs] == [0, 1, 2, 3]
            assert all(len(o.outputs) == 2 for o in outs)
            assert [len(o.outputs[1].token_ids) for o in outs] == [4, 96, 4, 96]  # no EOS: full length
            starts = [a for a, _ in events if isinstance(a, StartTraining)]
            stops = [(a, done) for a, done in events if isinstance(a, StopTraining)]
            assert starts and starts[0].replica == 0  # the early finisher trains
            assert stops and all(done for _, done in stops)  # preempted only once the LAST replica finished
            assert rep.drafter_steps > 0 and rep.published and rep.drafter_version == rep.published[-1]
            assert rep.harvested_s[0] > 0 and rep.idle_s[0] > rep.idle_s[1]
            assert math.isfinite(rep.barrier_delay_steps)
            assert set(rep.accept_length) == {0, 1}
        assert len(rep.published) >= 2 and rep.mid_rollout_pushes >= 1
        assert not any(isinstance(a, AssignGroups) and a.drafter_version != rep.published[0] - 1
                       for a, _ in events)  # step 1 started on the version step 0 published
        stats = rollout.replica_stats()
        assert {s["drafter_version"] for s in stats.values()} == {rollout.drafter_version}
    finally:
        rollout.close()
    print(f"two spot steps: {time.monotonic() - t0:.1f}s, report {rep}")


def test_replica_death_reruns_groups(ray_local, tiny_llama_dir):
    from tlt.workers.ray_rollout import SpotRollout
    rollout = SpotRollout(tiny_llama_dir, 2, CFG, SpotConfig(min_train_tokens=8, session_steps=10_000, poll_s=0.05))
    killed = []

    def kill_replica_1(action):
        if isinstance(action, AssignGroups) and action.replica == 1 and not killed:
            deadline = time.monotonic() + 30
            while ray.get(rollout.actors[1].stats.remote())["num_generated_tokens"] == 0:  # threaded: answers
                assert time.monotonic() < deadline, "replica 1 never started generating"
                time.sleep(0.02)
            ray.kill(rollout.actors[1])  # mid-rollout: its long groups are not done yet
            killed.append(1)

    rollout.on_action = kill_replica_1
    try:
        ps = params(0, long=400, temperature=0.0)
        outs, rep = rollout.run_step(GROUPS, ps, 0)
        assert killed and rep.dead_replicas == [1] and rep.requeued_groups == 2
        assert [[c.token_ids for c in o.outputs] for o in outs] == greedy_reference(tiny_llama_dir, ps)
        assert rollout.live() == [0]
        outs, rep = rollout.run_step(GROUPS, params(1, long=8), 1)  # the run goes on with one replica
        assert len(outs) == 4 and all(len(o.outputs) == 2 for o in outs)
    finally:
        rollout.close()


def test_hung_replica_times_out_and_its_groups_rerun(ray_local, tiny_llama_dir):
    """A replica that hangs (alive, never answering) past replica_timeout_s is treated like a dead one."""
    import threading

    from tlt.workers.ray_rollout import SpotRollout

    class HangingReplica(RolloutReplica):
        def generate_groups(self, groups, params, rl_step):
            if self.replica_id == 1:
                threading.Event().wait()  # hangs forever; the process stays alive
            return super().generate_groups(groups, params, rl_step)

    rollout = SpotRollout(tiny_llama_dir, 2, CFG, SpotConfig(min_train_tokens=8, session_steps=10_000, poll_s=0.05,
                                                             replica_timeout_s=5.0), replica_cls=HangingReplica)
    try:
        ps = params(0, long=24, temperature=0.0)
        outs, rep = rollout.run_step(GROUPS, ps, 0)
        assert rep.timed_out_replicas == [1] and rep.dead_replicas == [1] and rep.requeued_groups == 2
        assert rep.metrics()["spot/num_timed_out_replicas"] == 1.0
        assert [[c.token_ids for c in o.outputs] for o in outs] == greedy_reference(tiny_llama_dir, ps)
        assert rollout.live() == [0]
        outs, rep = rollout.run_step(GROUPS, params(1, long=8), 1)  # the run goes on with one replica
        assert len(outs) == 4 and all(len(o.outputs) == 2 for o in outs) and rep.timed_out_replicas == []
    finally:
        rollout.close()


def test_crashed_drafter_session_keeps_the_last_published_drafter(ray_local, tiny_llama_dir):
    """A drafter session that raises on a live replica publishes nothing; every replica drafts (and trains on)
    the last published drafter, and the rollout finishes."""
    import torch

    from tlt.workers.ray_rollout import SpotRollout

    class CrashingTrainer(RolloutReplica):
        def _session(self, max_steps, rl_step, flag, t0):
            if rl_step >= 1:  # crash mid-session, after a drafter step changed the training copy
                self.trainer.train_steps(self.buffer, 1, flag, step=rl_step)
                raise RuntimeError("simulated drafter trainer crash")
            return super()._session(max_steps, rl_step, flag, t0)

    rollout = SpotRollout(tiny_llama_dir, 2, CFG, SpotConfig(min_train_tokens=8, session_steps=10_000, poll_s=0.05),
                          replica_cls=CrashingTrainer)
    try:
        _, rep = rollout.run_step(GROUPS, params(0), 0)
        assert rep.published and rep.failed_sessions == 0
        version, published = rollout.drafter_version, rollout.drafter_state()
        outs, rep = rollout.run_step(GROUPS, params(1), 1)
        assert len(outs) == 4 and rep.failed_sessions >= 1 and rep.published == []
        assert rollout.drafter_version == version and rollout.live() == [0, 1]
        for r, stats in rollout.replica_stats().items():
            assert stats["drafter_version"] == version
            copy = ray.get(rollout.actors[r].drafter_state.remote())  # the training copy went back too
            assert all(torch.equal(copy[k], v) for k, v in published.items()), f"replica {r} kept crashed weights"
    finally:
        rollout.close()


def test_trainer_over_ray_replicas_trains_and_harvests(tmp_path, monkeypatch, capsys):
    """`tlt train configs/smoke.yaml trainer.use_ray=true trainer.num_rollout_workers=2`: rollouts on two Ray
    replicas, the idle one trains the drafter, spot metrics are logged, the policy still learns from the rollouts."""
    import json
    from pathlib import Path

    from tlt.rl.trainer import main
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    assert main(["configs/smoke.yaml", f"trainer.default_local_dir={tmp_path}", "trainer.logger=[jsonl]",
                 "trainer.use_ray=true", "trainer.num_rollout_workers=2", "trainer.total_steps=2",
                 "trainer.save_freq=-1", "trainer.test_freq=-1", "drafter_train.min_buffer_tokens=16"]) == 0
    steps = [json.loads(x) for x in (tmp_path / "tlt" / "smoke" / "metrics.jsonl").read_text().splitlines()]
    last = steps[-1]
    assert last["step"] == 2 and last["critic/score/mean"] is not None
    assert last["spot/num_dead_replicas"] == 0 and "spot/barrier_delay_steps" in last
    assert last["weight_sync/bytes"] > 0 and last["weight_sync/time_s"] > 0  # the policy pushed to the replicas
    # Whether the idle replica finishes a drafter step before the last replica ends its rollout (preemption) is a
    # matter of timing on this tiny model; publishing under guaranteed idle time is tested in
    # test_spot_rollout_two_steps. Here: the published version counts exactly the completed, unrefused sessions.
    trained = [m for m in steps if m["step"] >= 1]
    completed = sum(1 for m in trained if m["spot/drafter_steps"] > 0 and m["spot/refused_sessions"] == 0)
    assert trained[-1]["spot/drafter_version"] == completed



@pytest.mark.parametrize("dtype,low,high", [("float32", 0.0, 1e-4), ("bfloat16", 1e-3, 0.5)])
def test_ray_replicas_decode_the_rollout_dtype(tmp_path, monkeypatch, dtype, low, high):
    """The replicas decode the policy's own dtype (fp32 master weights, as the in-process engine) with
    rollout.dtype=float32, and bf16 with rollout.dtype=bfloat16 (the weights sent every step, cast on load; what
    auto picks on bf16 hardware). Measured by the trainer's own old log-probs (the update's forward: one
    mini-batch): within fp32 rounding of the replicas' in the first case, bf16's difference (above 1e-3) in the
    second."""
    import json
    from pathlib import Path

    from tlt.rl.trainer import main
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    assert main(["configs/smoke.yaml", f"trainer.default_local_dir={tmp_path}", "trainer.logger=[jsonl]",
                 "trainer.use_ray=true", "trainer.num_rollout_workers=2", "trainer.total_steps=1",
                 "trainer.save_freq=-1", "trainer.test_freq=-1", f"rollout.dtype={dtype}",
                 "rollout.recompute_logprobs=" + ("true" if dtype == "float32" else "false"),
                 "actor.bf16_autocast=false", "speculative.enabled=false"]) == 0
    steps = [json.loads(x) for x in (tmp_path / "tlt" / "smoke" / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1]["step"] == 1 and low <= steps[-1]["rollout/logprob_max_diff"] < high
