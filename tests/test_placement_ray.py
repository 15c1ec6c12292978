"""Placement on a local Ray instance with fake GPUs (Ray accepts num_gpus on a CPU machine; the actors decode on
CPU because ReplicaConfig.device says so): each actor lands on its bundle, colocated pairs share a GPU and
disaggregated roles never do, colocated replicas sleep between rollouts, and a placed replica that dies mid-rollout
has its prompts rerun elsewhere. Skipped when Ray cannot start here."""
import time

import pytest

import tlt
from tlt.drafter_train.coordinator import AssignGroups
from tlt.bundles import assign_bundles
from tlt.workers.rollout_worker import ReplicaConfig, RolloutReplica
from tlt.workers.spot import SpotConfig

ray = pytest.importorskip("ray", reason="ray is not installed")

CFG = ReplicaConfig(speculative={"method": "eagle", "bs_threshold": None, "adaptive": False,
                                 "num_speculative_tokens": 3},
                    device="cpu", dtype="float32", holdout_every=0, batch_tokens=64, window_len=32, max_num_seqs=16)
GROUPS = [(g, [1 + g, 7, 3 + g]) for g in range(4)]
SPOT = SpotConfig(min_train_tokens=8, session_steps=10_000, poll_s=0.05)


def probe_classes():
    """(a replica and a trainer-rank stand-in that report where they run), defined here so that Ray ships them
    by value (the workers cannot import this test module)."""
    def where() -> dict:
        ctx = ray.get_runtime_context()
        return {"pg": ctx.get_placement_group_id(), "gpus": ray.get_gpu_ids(), "res": ctx.get_assigned_resources()}

    class ProbedReplica(RolloutReplica):
        def where(self) -> dict:
            return {**where(), "kv_tensors": len(self.llm.engine.kv.k), "asleep": self.llm.engine.asleep}

    class TrainerRank:  # stands in for a trainer rank: only its placement is under test
        def where(self) -> dict:
            return where()

    return ProbedReplica, TrainerRank


ProbedReplica, TrainerRank = probe_classes()


def params(long=24, temperature=0.0):
    return [tlt.SamplingParams(n=2, temperature=temperature, max_tokens=long if g % 2 else 4, seed=10 * g)
            for g in range(4)]


def _place_trainer_ranks(rollout):
    from tlt.workers.placement import trainer_options
    a = rollout.assignment
    ranks = [ray.remote(TrainerRank).options(**trainer_options(rollout.placement_group, a, r)).remote()
             for r in range(len(a.trainer_bundles))]
    return ray.get([t.where.remote() for t in ranks]), ranks


def test_colocated_pairs_share_a_gpu_and_replicas_sleep_between_rollouts(ray_fake_gpus, tiny_llama_dir):
    from tlt.workers.placement import PlacedRollout
    a = assign_bundles("colocated", nnodes=1, n_gpus_per_node=2)
    rollout = PlacedRollout(tiny_llama_dir, a, CFG, SPOT, replica_cls=ProbedReplica)
    try:
        pg = rollout.placement_group.id.hex()
        trainers, ranks = _place_trainer_ranks(rollout)
        replicas = [ray.get(rollout.actors[r].where.remote()) for r in range(2)]
        assert all(x["pg"] == pg for x in trainers + replicas)
        assert all(x["res"]["GPU"] == 0.5 for x in trainers + replicas)
        assert [t["gpus"] for t in trainers] == [r["gpus"] for r in replicas]  # rank i and replica i: one GPU
        assert len({tuple(r["gpus"]) for r in replicas}) == 2                   # a GPU per bundle
        outs, rep = rollout.run_step(GROUPS, params(), 0)
        assert len(outs) == 4 and rep.dead_replicas == []
        after = [ray.get(rollout.actors[r].where.remote()) for r in range(2)]
        assert all(x["asleep"] and x["kv_tensors"] == 0 for x in after)  # freed for the trainer's update
        outs2, _ = rollout.run_step(GROUPS, params(), 1)                   # woken: greedy gives the same tokens
        assert [[c.token_ids for c in o.outputs] for o in outs2] == [[c.token_ids for c in o.outputs] for o in outs]
        for t in ranks:
            ray.kill(t)
    finally:
        rollout.close()


def test_colocated_replicas_keep_their_caches_with_free_cache_engine_false(ray_fake_gpus, tiny_llama_dir):
    """rollout.free_cache_engine=false: a colocated replica stays awake between rollouts, its KV cache (and the
    graphs reading it, on a GPU) kept for the next one."""
    from tlt.workers.placement import PlacedRollout
    a = assign_bundles("colocated", nnodes=1, n_gpus_per_node=1)
    rollout = PlacedRollout(tiny_llama_dir, a, CFG, SPOT, replica_cls=ProbedReplica, free_cache_engine=False)
    try:
        outs, _ = rollout.run_step(GROUPS, params(), 0)
        kept = ray.get(rollout.actors[0].where.remote())
        assert not rollout.sleep_between_steps and not kept["asleep"] and kept["kv_tensors"] > 0
        outs2, rep = rollout.run_step(GROUPS, params(), 1)
        assert [[c.token_ids for c in o.outputs] for o in outs2] == [[c.token_ids for c in o.outputs] for o in outs]
        # the replica's captures in the step reach the trainer's metrics (none on CPU)
        assert rep.graph_captures == {0: 0} and rep.metrics()["spot/graph_capture_time_s"] == 0.0
    finally:
        rollout.close()


def test_disaggregated_roles_on_separate_gpus_and_a_dead_replica_reruns(ray_fake_gpus, tiny_llama_dir):
    from tlt.workers.placement import PlacedRollout
    a = assign_bundles("disaggregated", nnodes=1, n_gpus_per_node=4, rollout_gpus=2)
    rollout = PlacedRollout(tiny_llama_dir, a, CFG, SPOT, replica_cls=ProbedReplica)
    killed = []

    def kill_replica_1(action):
        if isinstance(action, AssignGroups) and action.replica == 1 and not killed:
            deadline = time.monotonic() + 30
            while ray.get(rollout.actors[1].stats.remote())["num_generated_tokens"] == 0:
                assert time.monotonic() < deadline, "replica 1 never started generating"
                time.sleep(0.02)
            ray.kill(rollout.actors[1])
            killed.append(1)

    try:
        trainers, ranks = _place_trainer_ranks(rollout)
        replicas = [ray.get(rollout.actors[r].where.remote()) for r in range(2)]
        assert all(x["res"]["GPU"] == 1 for x in trainers + replicas)
        trainer_gpus = {g for t in trainers for g in t["gpus"]}
        rollout_gpus = {g for r in replicas for g in r["gpus"]}
        assert len(trainer_gpus) == len(rollout_gpus) == 2 and not trainer_gpus & rollout_gpus
        for t in ranks:
            ray.kill(t)
        reference, _ = rollout.run_step(GROUPS, params(long=300), 0)
        rollout.on_action = kill_replica_1
        outs, rep = rollout.run_step(GROUPS, params(long=300), 1)
        assert killed and rep.dead_replicas == [1] and rep.requeued_groups == 2
        assert [[c.token_ids for c in o.outputs] for o in outs] == \
            [[c.token_ids for c in o.outputs] for o in reference]  # greedy: the rerun gives the same tokens
        assert rollout.live() == [0] and not ray.get(rollout.actors[0].where.remote())["asleep"]
    finally:
        rollout.close()


def test_a_placement_the_cluster_cannot_hold_fails_clearly(ray_fake_gpus, tiny_llama_dir):
    from tlt.workers.placement import PlacedRollout
    a = assign_bundles("colocated", nnodes=2, n_gpus_per_node=4)  # 8 GPUs on a 4-GPU cluster
    with pytest.raises(RuntimeError, match="could not reserve 8 GPU bundles"):
        PlacedRollout(tiny_llama_dir, a, CFG, SPOT, placement_group_timeout_s=2)


def test_trainer_runs_on_placed_colocated_replicas(ray_fake_gpus, tmp_path, monkeypatch):
    """`tlt train configs/smoke.yaml trainer.placement=colocated trainer.n_gpus_per_node=2` on the fake-GPU
    cluster: two placed replicas roll out (on CPU: model.device=cpu), the policy updates between rollouts."""
    import json
    from pathlib import Path

    from tlt.rl.trainer import main
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    assert main(["configs/smoke.yaml", f"trainer.default_local_dir={tmp_path}", "trainer.logger=[jsonl]",
                 "model.device=cpu", "trainer.placement=colocated", "trainer.n_gpus_per_node=2",
                 "trainer.total_steps=2", "trainer.save_freq=-1", "trainer.test_freq=-1"]) == 0
    steps = [json.loads(x) for x in (tmp_path / "tlt" / "smoke" / "metrics.jsonl").read_text().splitlines()]
    last = steps[-1]
    assert last["step"] == 2 and last["critic/score/mean"] is not None
    assert last["spot/num_dead_replicas"] == 0 and "spot/barrier_delay_steps" in last  # the placed replicas ran it
    assert ray.util.placement_group_table() and all(
        pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())  # close() gave them back
