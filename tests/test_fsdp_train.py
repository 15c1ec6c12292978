"""`tlt train` with actor.strategy=fsdp on 2 gloo ranks: weight sync from the shards into the rollout engine
(tlt.rl.weight_sync), the same run as actor.strategy=ddp, and sharded checkpoints resumed at another rank count."""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.multiprocessing as mp

from tests.test_fsdp import CFG, _free_port, gloo_rank, make_batch, rank_rows
from tests.test_trainer import make_overrides
from tlt.config import ActorConfig, ConfigError, load_config
from tlt.models import load_model
from tlt.rl.actor import Actor
from tlt.rl.sharded_checkpoint import export_hf, full_state_dict
from tlt.rl.tiny_model import build_tiny_model
from tlt.rl.trainer import GRPOTrainer
from tlt.rl.weight_sync import stream_state, sync_weights

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]


def greedy(model_or_dir, model_dtype: str) -> list[list[int]]:
    from tlt import LLM, SamplingParams
    llm = LLM(model=model_or_dir, dtype=model_dtype, device="cpu", max_num_seqs=4, enforce_eager=True)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def _sync_worker(rank: int, world: int, port: int, model_dir: str, out_dir: str) -> None:
    with gloo_rank(rank, world, port):
        model = load_model(model_dir)
        actor = Actor(model, ActorConfig(**(CFG | {"lr": 1e-2}), strategy="fsdp"), total_steps=1)
        actor.update(make_batch(0).rows(rank_rows(rank, world)), num_mini_batches=1)
        export_hf(model, out_dir, model_dir)  # the consolidated deploy weights
        full = full_state_dict(model)
        result = {}
        for dtype in (torch.float32, torch.bfloat16):
            for name, skip in (("synced", frozenset()), ("skip_layer_1", frozenset({1}))):
                engine_model = load_model(model_dir, dtype=dtype).requires_grad_(False).eval()  # the start weights
                stats = sync_weights(model, engine_model, skip_units=skip)
                if rank == 0:
                    state = engine_model.state_dict()
                    equal = {k: torch.equal(state[k], full[k].to(dtype)) for k in full}
                    result[(name, dtype)] = dict(equal=equal, bytes=stats.bytes, engine=engine_model)
        units = [sorted(u) for u in stream_state(model, torch.bfloat16)]  # one dict a layer, then the root
        if rank == 0:
            result["units"] = units
            result["numel"] = sum(v.numel() for v in full.values())
            result["tokens"] = {key: greedy(r.pop("engine"), "float32" if key[1] == torch.float32 else "bfloat16")
                                for key, r in result.items() if key not in ("units", "numel")}
            torch.save(result, os.path.join(out_dir, "sync.pt"))


def test_weight_sync_from_shards_equals_full_weights(tmp_path, tiny_llama_dir):
    out = tmp_path / "export"
    mp.spawn(_sync_worker, args=(2, _free_port(), tiny_llama_dir, str(out)), nprocs=2, join=True)
    res = torch.load(out / "sync.pt", weights_only=False)
    num_layers = len(res["units"]) - 1  # one dict a decoder layer, then the root's
    assert num_layers >= 2 and all(k.startswith(f"layers.{i}.") for i in range(num_layers)
                                   for k in res["units"][i])
    assert not any(k.startswith("layers.") for k in res["units"][-1])
    fresh = {dtype: greedy(str(out), name) for dtype, name in ((torch.float32, "float32"),
                                                               (torch.bfloat16, "bfloat16"))}
    start = greedy(tiny_llama_dir, "float32")
    assert fresh[torch.float32] != start  # the update changed what the model decodes
    for dtype in (torch.float32, torch.bfloat16):
        synced = res[("synced", dtype)]
        assert all(synced["equal"].values()), [k for k, ok in synced["equal"].items() if not ok]
        assert synced["bytes"] == res["numel"] * dtype.itemsize
        assert res["tokens"][("synced", dtype)] == fresh[dtype]
        # control: one layer not synced keeps its start weights -> those tensors differ, and so does the decode
        skipped = res[("skip_layer_1", dtype)]
        assert not all(skipped["equal"].values())
        assert all(ok == (not k.startswith("layers.1.")) for k, ok in skipped["equal"].items())
        assert 0 < skipped["bytes"] < synced["bytes"]
    assert res["tokens"][("skip_layer_1", torch.float32)] != fresh[torch.float32]


def test_shared_engine_moves_nothing(tiny_llama_dir):
    model = load_model(tiny_llama_dir)
    stats = sync_weights(model, model)
    assert stats.metrics() == {"weight_sync/bytes": 0.0, "weight_sync/time_s": 0.0, "weight_sync/gb_per_s": 0.0}


# ---------------------------------------------------------------- tlt train


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny_policy"))


def train_overrides(tmp_path, tiny_dir, **extra) -> list[str]:
    base = {"actor.bf16_autocast": False, "rollout.recompute_logprobs": True, "actor.use_kl_loss": True}
    return make_overrides(tmp_path, tiny_dir, **(base | extra))


def _train_worker(rank: int, world: int, port: int, overrides: list[str], out: str) -> None:
    with gloo_rank(rank, world, port):
        trainer = GRPOTrainer(load_config(None, overrides))
        trainer.fit()
        weights = full_state_dict(trainer.model)
        if rank == 0:
            torch.save(weights, out)


def train(tmp_path, overrides: list[str], world: int = 2) -> tuple[dict, list[dict]]:
    out = tmp_path / "weights.pt"
    mp.spawn(_train_worker, args=(world, _free_port(), overrides, str(out)), nprocs=world, join=True)
    cfg = load_config(None, overrides)
    run_dir = os.path.join(cfg.trainer.default_local_dir, cfg.trainer.project_name, cfg.trainer.experiment_name)
    rows = [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl"))]
    return torch.load(out), rows


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    diffs = {k: float((a[k] - b[k]).abs().max()) for k in a}
    assert max(diffs.values()) <= 2e-5, {k: d for k, d in diffs.items() if d > 2e-5}


@pytest.mark.slow
def test_fsdp_train_equals_ddp_train(tmp_path, tiny_dir):
    """2 ranks, 2 steps, KL to a (sharded) reference: the same rewards, metrics and weights as ddp."""
    # 2 prompts a rank, 2 mini-batches: the second's old log-probs are recomputed through the shards
    extra = {"data.train_batch_size": 4, "actor.ppo_mini_batch_size": 2}
    ddp_w, ddp_rows = train(tmp_path / "ddp", train_overrides(tmp_path / "ddp", tiny_dir, **extra,
                                                              **{"actor.strategy": "ddp"}))
    fsdp_w, fsdp_rows = train(tmp_path / "fsdp", train_overrides(tmp_path / "fsdp", tiny_dir, **extra,
                                                                 **{"actor.strategy": "fsdp"}))
    start = load_model(tiny_dir).state_dict()
    assert max(float((ddp_w[k] - start[k]).abs().max()) for k in start) > 1e-4  # the run trained
    assert_same_weights(fsdp_w, ddp_w)
    assert [r["step"] for r in fsdp_rows] == [1, 2]
    timings = ("timing_s/", "throughput/", "weight_sync/", "rollout/decode_time", "rollout/prefill_time")
    for d, f in zip(ddp_rows, fsdp_rows):
        assert f.keys() == d.keys() and "actor/kl_loss" in d and "critic/score/mean" in d
        for key in (k for k in d if not k.startswith(timings)):  # rewards, lengths, losses, grad norm, entropy
            assert f[key] == pytest.approx(d[key], abs=1e-5), key
        assert d["weight_sync/bytes"] == 0  # ddp in fp32: the engine decodes the policy's own parameters
        assert f["weight_sync/bytes"] == sum(t.numel() * 4 for t in start.values())  # fsdp: every weight, fp32
        assert f["weight_sync/time_s"] > 0 and f["weight_sync/gb_per_s"] > 0
        assert f["rollout/logprob_max_diff"] < 1e-4  # the engine decoded the synced policy, not stale weights


@pytest.mark.slow
def test_fsdp_checkpoint_resumes_on_one_rank(tmp_path, tiny_dir, monkeypatch):
    """fsdp on 2 ranks saves every step; resuming its step-1 checkpoint in one plain process (ddp) ends with the
    uninterrupted run's weights. Control: the same resume without the sharded optimiser state differs."""
    full_w, _ = train(tmp_path / "full", train_overrides(tmp_path / "full", tiny_dir, **{
        "actor.strategy": "fsdp", "trainer.save_freq": 1}))
    ckpt = tmp_path / "full" / "runs" / "tlt" / "default" / "global_step_1"
    assert (ckpt / "actor_shards" / ".metadata").is_file() and (ckpt / "model.safetensors").is_file()
    resumed = GRPOTrainer(load_config(None, train_overrides(tmp_path / "resumed", tiny_dir, **{
        "trainer.resume": str(ckpt)})))
    assert resumed.start_step == 1
    resumed.fit()
    assert_same_weights(full_state_dict(resumed.model), full_w)
    # control: the same resume without loading the shards (the safetensors weights, a fresh AdamW state)
    monkeypatch.setattr("tlt.rl.trainer.load_sharded", lambda actor, path: None)
    weights_only = GRPOTrainer(load_config(None, train_overrides(tmp_path / "weights_only", tiny_dir, **{
        "trainer.resume": str(ckpt)})))
    weights_only.fit()
    diff = max(float((weights_only.model.state_dict()[k] - full_w[k]).abs().max()) for k in full_w)
    assert diff > 1e-4


def test_fsdp_without_torchrun_fails_before_loading(tmp_path, tiny_dir, monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match="torchrun --nproc_per_node 2 -m tlt train"):
        GRPOTrainer(load_config(None, train_overrides(tmp_path, tiny_dir, **{"actor.strategy": "fsdp"})))


def test_fsdp_refuses_a_ddp_checkpoint_before_loading(tmp_path, tiny_dir, monkeypatch):
    """A one-rank torchrun group (the env torchrun sets) joins for fsdp; a ddp checkpoint has no shards to resume."""
    from tests.conftest import checkpoint_parts
    from tlt.rl.checkpoint import CheckpointManager
    ckpt = CheckpointManager(tmp_path / "ddp_run").save(1, *checkpoint_parts(tiny_dir, 1), load_config(None, []))
    assert not (ckpt / "actor_shards").exists()  # whole, but no shards
    for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(_free_port())).items():
        monkeypatch.setenv(key, value)
    try:
        with pytest.raises(ConfigError, match="saved by an actor.strategy=ddp run"):
            GRPOTrainer(load_config(None, train_overrides(tmp_path, tiny_dir, **{
                "actor.strategy": "fsdp", "trainer.resume": str(ckpt)})))
        assert torch.distributed.is_initialized() and torch.distributed.get_world_size() == 1
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
