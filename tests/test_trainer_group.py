"""Trainer ranks launched by trainer.placement as Ray actors (tlt.workers.trainer_group) on a local Ray instance
with fake GPUs: each rank and each replica is on the bundle its mode gives it (Ray's own per-bundle accounting and
GPU ids), the ranks' shares meet in rank 0's placed rollout, a 2-rank run takes the same steps as 1 rank (and a
rank normalising its loss by its own tokens does not), and a failing rank ends the run with its traceback and the
placement group removed. Skipped when Ray cannot start here."""
import dataclasses
import json
import re
import time

import pytest
import torch
from safetensors.torch import load_file

from tests.test_placement_ray import CFG, GROUPS, SPOT, ProbedReplica, params
from tests.test_trainer import make_overrides
from tlt.config import load_config
from tlt.rl.tiny_model import build_tiny_model
from tlt.schema import ConfigError
from tlt.bundles import assign_bundles

ray = pytest.importorskip("ray", reason="ray is not installed")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny_policy"))


def rank_functions():
    """Functions the rank actors run, defined here so that Ray ships them by value (the workers cannot import this
    test module)."""
    def bundle_gpus_in_use(pg_hex: str) -> dict[int, float]:
        """Ray's own accounting: GPU taken on each bundle of the group (its GPU_group_<i>_<pg> resources)."""
        total, free = ray.cluster_resources(), ray.available_resources()
        return {int(m[1]): round(v - free.get(k, 0.0), 3) for k, v in total.items()
                if (m := re.fullmatch(rf"GPU_group_(\d+)_{pg_hex}", k))}

    def settled_usage(pg_hex: str, expected: dict[int, float], timeout_s: float = 20) -> dict[int, float]:
        """The usage once it equals `expected`, or the last one seen (Ray's resource view lags an actor start)."""
        deadline = time.monotonic() + timeout_s
        while (seen := bundle_gpus_in_use(pg_hex)) != expected and time.monotonic() < deadline:
            time.sleep(0.2)
        return seen

    def placement_probe(model_dir: str, a, expect_ranks: dict, expect_all: dict, wait_s: float = 20) -> dict:
        """Where every rank and replica runs, by Ray's view, and each rank's share of a shared rollout."""
        import torch.distributed as dist
        from ray.util.placement_group import get_current_placement_group

        from tlt.workers.placement import PlacedRollout
        from tlt.workers.shared_rollout import RankSharedRollout
        dist.init_process_group("gloo")
        rank, pg = dist.get_rank(), get_current_placement_group()
        ctx = ray.get_runtime_context()
        me = {"pg": ctx.get_placement_group_id(), "gpus": ray.get_gpu_ids(), "gpu": ctx.get_assigned_resources()["GPU"]}
        dist.barrier()  # every rank is up
        ranks_only = settled_usage(pg.id.hex(), expect_ranks, wait_s) if rank == 0 else None
        owner = PlacedRollout(model_dir, a, CFG, SPOT, replica_cls=ProbedReplica, placement_group=pg) \
            if rank == 0 else None
        shared = RankSharedRollout(owner)
        share = GROUPS[2 * rank:2 * rank + 2]
        outs = shared.generate(prompt_token_ids=[p for _, p in share], sampling_params=params()[2 * rank:2 * rank + 2],
                               group_ids=[g for g, _ in share])
        mine = {"rank": rank, **me, "groups": [o.group_id for o in outs],
                "tokens": [[list(c.token_ids) for c in o.outputs] for o in outs]}
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        out = None
        if rank == 0:
            replicas = [ray.get(owner.actors[r].where.remote()) for r in sorted(owner.actors)]
            out = {"pg": pg.id.hex(), "ranks": everyone, "replicas": replicas, "ranks_only": ranks_only,
                   "all": settled_usage(pg.id.hex(), expect_all, wait_s), "report": shared.last_report}
        dist.barrier()
        shared.close()
        dist.destroy_process_group()
        return out

    def raise_on_rank_1(kind: str) -> None:
        import torch.distributed as dist

        from tlt.schema import ConfigError
        dist.init_process_group("gloo")
        if dist.get_rank() == 1:
            if kind == "config":
                raise ConfigError("trainer.resume: a config problem found by rank 1")
            raise ValueError("boom on rank 1")
        dist.barrier()  # rank 0 waits for rank 1, which never comes: the launcher must not hang here

    def run_rank_with_local_normalisers(cfg):
        """Control: each rank normalises its loss by its own token and sequence counts (a wrong rank count)."""
        from tlt.rl.actor import Actor
        from tlt.rl.trainer import run_rank
        local = Actor._loss_normalisers
        Actor._loss_normalisers = staticmethod(lambda mask, world: local(mask, 1))
        return run_rank(cfg)

    return placement_probe, raise_on_rank_1, run_rank_with_local_normalisers


placement_probe, raise_on_rank_1, run_rank_with_local_normalisers = rank_functions()


def removed(pg_hex: str) -> bool:
    return ray.util.placement_group_table()[pg_hex]["state"] == "REMOVED"


def test_config_errors_come_before_ray_starts(tmp_path, tiny_dir):
    """Placement checks what it can in the launching process: a batch the 2 ranks cannot split fails there."""
    from tlt.rl.trainer import main
    if ray.is_initialized():
        pytest.skip("Ray is already running in this process")
    bad = make_overrides(tmp_path, tiny_dir, **{"trainer.placement": "colocated", "trainer.n_gpus_per_node": 2,
                                                "actor.ppo_mini_batch_size": 1})
    with pytest.raises(ConfigError, match="ppo_mini_batch_size=1 on 2 ranks"):
        main(bad)
    assert not ray.is_initialized()


@pytest.mark.parametrize("mode,gpus,rollout_gpus", [("colocated", 2, None), ("disaggregated", 4, 2)])
def test_ranks_and_replicas_run_on_their_bundles(ray_fake_gpus, tiny_llama_dir, mode, gpus, rollout_gpus):
    from tlt.workers.trainer_group import run_trainer_ranks
    a = assign_bundles(mode, nnodes=1, n_gpus_per_node=gpus, rollout_gpus=rollout_gpus)
    expect_ranks = {b: (a.trainer_gpu if b in a.trainer_bundles else 0.0) for b in range(a.num_bundles)}
    expect_all = {b: 1.0 for b in range(a.num_bundles)}
    got = run_trainer_ranks(a, placement_probe, tiny_llama_dir, a, expect_ranks, expect_all)
    assert got["ranks_only"] == expect_ranks  # the ranks alone: exactly their bundles taken, by their share
    assert got["all"] == expect_all            # then the replicas fill the rest (colocated: the other half)
    ranks, replicas = got["ranks"], got["replicas"]
    assert [r["rank"] for r in ranks] == list(range(len(a.trainer_bundles)))
    assert all(x["pg"] == got["pg"] for x in ranks + replicas)
    assert all(r["gpu"] == a.trainer_gpu for r in ranks) and all(r["res"]["GPU"] == a.rollout_gpu for r in replicas)
    rank_gpus, replica_gpus = [r["gpus"] for r in ranks], [r["gpus"] for r in replicas]
    assert len({tuple(g) for g in rank_gpus + replica_gpus}) == len(set(a.trainer_bundles + a.rollout_bundles))
    if mode == "colocated":
        assert rank_gpus == replica_gpus  # rank i and replica i on bundle i: one GPU
    else:
        assert not {g for x in rank_gpus for g in x} & {g for x in replica_gpus for g in x}
    # each rank got its own groups back from rank 0's rollout, as one replica set decoded them
    assert [r["groups"] for r in ranks] == [[0, 1], [2, 3]]
    assert got["report"].dead_replicas == [] and len(got["report"].idle_s) == len(a.rollout_bundles)
    assert removed(got["pg"])


def test_the_bundle_check_sees_ranks_on_the_wrong_bundles(ray_fake_gpus, tiny_llama_dir):
    """Control for the test above: ranks started on the rollout bundles do not give the usage it expects."""
    from tlt.workers.trainer_group import run_trainer_ranks
    a = assign_bundles("disaggregated", nnodes=1, n_gpus_per_node=4, rollout_gpus=2)
    swapped = dataclasses.replace(a, trainer_bundles=a.rollout_bundles, rollout_bundles=a.trainer_bundles)
    expect_ranks = {b: (1.0 if b in a.trainer_bundles else 0.0) for b in range(a.num_bundles)}
    got = run_trainer_ranks(swapped, placement_probe, tiny_llama_dir, swapped, expect_ranks,
                            {b: 1.0 for b in range(a.num_bundles)}, 2)
    assert got["ranks_only"] == {0: 0.0, 1: 0.0, 2: 1.0, 3: 1.0} != expect_ranks


def _weights(run_dir) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "global_step_2" / "model.safetensors"))


@pytest.mark.slow
def test_two_placed_ranks_take_the_steps_of_one(ray_fake_gpus, tmp_path, tiny_dir):
    """Disaggregated, one replica: 1 trainer rank vs 2 Ray-launched ranks (the same replica decodes the same whole
    batch) give the same weights after 2 steps, with DDP and with FSDP; ranks that normalise by their own tokens
    do not (control)."""
    from tlt.rl.trainer import main
    from tlt.workers.trainer_group import run_trainer_ranks

    def overrides(name: str, gpus: int, strategy: str = "ddp") -> list[str]:
        return make_overrides(tmp_path / name, tiny_dir, **{"actor.bf16_autocast": False, "rollout.n": 4,
                                                            "actor.strategy": strategy,
                                                            "trainer.placement": "disaggregated",
                                                            "trainer.n_gpus_per_node": gpus,
                                                            "trainer.rollout_gpus": 1})
    assert main(overrides("one", 2)) == 0
    assert main(overrides("two", 3)) == 0
    assert main(overrides("fsdp", 3, "fsdp")) == 0
    one, two, fsdp = (tmp_path / name / "runs" / "tlt" / "default" for name in ("one", "two", "fsdp"))
    w1 = _weights(one)
    moved = [k for k in w1 if not torch.equal(w1[k], load_file(str(tiny_dir) + "/model.safetensors")[k])]
    assert moved, "the policy did not move: the comparison would be empty"
    for w in (_weights(two), _weights(fsdp)):
        for k in w1:
            torch.testing.assert_close(w[k], w1[k], atol=2e-5, rtol=0)
    assert (fsdp / "global_step_2" / "actor_shards").is_dir()  # FSDP's own checkpoint layout, as under torchrun
    m1, m2 = ([json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()] for d in (one, two))
    assert [m["critic/score/mean"] for m in m1] == pytest.approx([m["critic/score/mean"] for m in m2])
    assert (two / "report.html").is_file() and (two / "global_step_2").is_dir()  # rank 0 wrote the outputs

    cfg = load_config(None, overrides("wrong", 3))
    a = assign_bundles("disaggregated", 1, 3, 1)
    run_trainer_ranks(a, run_rank_with_local_normalisers, cfg)
    wrong = _weights(tmp_path / "wrong" / "runs" / "tlt" / "default")
    assert max(float((wrong[k] - w1[k]).abs().max()) for k in moved) > 1e-4


def test_a_failing_rank_ends_the_run_with_its_traceback(ray_fake_gpus):
    from tlt.workers.trainer_group import RankFailed, run_trainer_ranks
    a = assign_bundles("colocated", nnodes=1, n_gpus_per_node=2)
    before = set(ray.util.placement_group_table())
    with pytest.raises(RankFailed, match=r"(?s)trainer rank 1 failed.*raise_on_rank_1.*boom on rank 1"):
        run_trainer_ranks(a, raise_on_rank_1, "error")
    with pytest.raises(ConfigError, match="a config problem found by rank 1"):  # a user error stays one
        run_trainer_ranks(a, raise_on_rank_1, "config")
    new = set(ray.util.placement_group_table()) - before
    assert len(new) == 2 and all(removed(pg) for pg in new)
    deadline = time.monotonic() + 20  # Ray's resource view follows the removal shortly after
    while ray.available_resources().get("GPU") != 4 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("GPU") == 4  # the ranks are gone, their bundles given back
