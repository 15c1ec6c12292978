"""tlt plan: its parameter / gradient / optimiser figures are a real run's tensor bytes; a config that will not fit
exits 2 naming the key to change."""
from __future__ import annotations

import os

import torch
import torch.multiprocessing as mp

from tests.test_fsdp import CFG, _free_port, gloo_rank, make_batch, rank_rows
from tlt.config import ActorConfig, load_config
from tlt.models import load_model
from tlt.models.loader import read_config
from tlt.plan import main, memory_plan
from tlt.rl.actor import Actor


def _local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def measured(model_dir: str, world: int = 1, rank: int = 0, **cfg) -> dict[str, int]:
    """Bytes this rank holds after one update: parameter, gradient and AdamW-state shards."""
    actor = Actor(load_model(model_dir), ActorConfig(**CFG, **cfg), total_steps=1)
    actor.update(make_batch(0).rows(rank_rows(rank, world)), num_mini_batches=1)
    params = list(actor.model.parameters())
    state = [t for p in params for k, t in actor.optimizer.state[p].items() if k != "step"]
    return {"parameters": sum(map(_local_bytes, params)), "gradients": sum(_local_bytes(p.grad) for p in params),
            "optimizer": sum(map(_local_bytes, state))}


def _worker(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    with gloo_rank(rank, world, port):
        sizes = measured(model_dir, world, rank, strategy="fsdp")
        if rank == 0:  # rank 0 holds the largest shards (dim 0 split in ceil-sized rows)
            torch.save(sizes, out)


def _plan(model_dir: str, world: int, strategy: str):
    cfg = load_config(None, [f"model.path={model_dir}", f"actor.strategy={strategy}", "actor.bf16_autocast=false"])
    return memory_plan(cfg, read_config(model_dir), world)


def test_plan_matches_measured_tensor_bytes(tmp_path, tiny_llama_dir):
    ddp = measured(tiny_llama_dir)
    out = str(tmp_path / "sizes.pt")
    mp.spawn(_worker, args=(2, _free_port(), tiny_llama_dir, out), nprocs=2, join=True)
    fsdp = torch.load(out)
    for strategy, world, real in (("ddp", 1, ddp), ("fsdp", 2, fsdp)):
        plan = _plan(tiny_llama_dir, world, strategy)
        for name, size in real.items():
            assert abs(plan.bytes(name) - size) <= 0.1 * size, (strategy, name, plan.bytes(name), size)
    # control: sharding halves the figures, so the DDP plan does not match the FSDP run
    assert _plan(tiny_llama_dir, 1, "ddp").bytes("parameters") > 1.5 * fsdp["parameters"]


def test_plan_fails_early_naming_the_key(capsys, tiny_llama_dir):
    args = [f"model.path={tiny_llama_dir}", "--device-memory", "64GiB"]
    assert main(args) == 0
    assert "parameters" in capsys.readouterr().out
    assert main(args[:1] + ["speculative.enabled=false", "--device-memory", "1MiB"]) == 2
    assert "actor.ppo_max_token_len" in capsys.readouterr().err
    # the biggest part names its key: a huge KV cache (many sequences running at once) names rollout.max_num_seqs
    assert main(args[:1] + ["rollout.max_num_seqs=100000", "data.train_batch_size=100000", "--device-memory",
                            "1GiB"]) == 2
    assert "rollout.max_num_seqs" in capsys.readouterr().err
    assert main(args[:1] + ["--device-memory", "lots"]) == 2
    assert "80GiB" in capsys.readouterr().err


def test_kv_cache_with_cuda_graphs_holds_every_slot_at_rounded_capacity(tiny_llama_dir):
    """Graphed decoding allocates every rollout.max_num_seqs slot (padding rows write into free ones) and rounds the
    capacity to cuda_graph.ROUND, with the speculator's headroom for a draft tree; enforce_eager (the control)
    plans what is running."""
    from tlt.engine.cuda_graph import ROUND
    m = read_config(tiny_llama_dir)
    base = [f"model.path={tiny_llama_dir}", "model.device=cuda", "rollout.max_num_seqs=64", "data.train_batch_size=2",
            "rollout.n=4", "data.max_prompt_length=100", "data.max_response_length=300", "speculative.enabled=true",
            "rollout.dtype=bfloat16", "model.dtype=float32"]
    per_position = m.num_layers * 2 * m.num_kv_heads * m.head_dim * 2  # bf16 on CUDA
    graphed = memory_plan(load_config(None, base), m, 1).bytes("kv cache")
    eager = memory_plan(load_config(None, base + ["rollout.enforce_eager=true"]), m, 1).bytes("kv cache")
    headroom = load_config(None, base).speculative.cache_headroom()  # what the engine reserves at admission
    capacity = -(-(100 + 300 + headroom) // ROUND) * ROUND
    assert graphed == 64 * capacity * per_position
    assert eager == 8 * 480 * per_position  # 8 responses running, 400 + 65 positions rounded up to 32


def test_colocated_counts_the_replica_weights_beside_the_ranks_engine(tiny_llama_dir):
    """Colocated, a GPU holds the trainer rank (with its engine's copy under FSDP) and the replica's own copy;
    without placement (the control) only the rank's."""
    m = read_config(tiny_llama_dir)
    base = [f"model.path={tiny_llama_dir}", "actor.strategy=fsdp", "rollout.dtype=bfloat16", "model.dtype=float32",
            "data.train_batch_size=2"]
    alone = memory_plan(load_config(None, base), m, 1)
    colocated = memory_plan(load_config(None, base + ["trainer.placement=colocated"]), m, 1)
    copy = alone.bytes("rollout weights")
    assert colocated.bytes("replica weights") == copy and colocated.bytes("rollout weights") == copy
    assert colocated.total - alone.total == copy
    assert "replica weights" not in [r.name for r in alone.rows]


def test_unrolled_drafter_training_is_planned(tiny_llama_dir):
    """drafter_train.ttt_steps=K: K passes of loss tensors, passes laid end to end, and their masks (13 T^2 bytes at
    K = 3) in the drafter-training row; one pass (the control) plans none of it."""
    m = read_config(tiny_llama_dir)
    base = [f"model.path={tiny_llama_dir}", "speculative.enabled=true", "drafter_train.enabled=true",
            "drafter_train.batch_tokens=2048"]
    one = memory_plan(load_config(None, base), m, 1).bytes("drafter training")
    three = memory_plan(load_config(None, base + ["drafter_train.ttt_steps=3"]), m, 1).bytes("drafter training")
    assert three - one > 13 * 2048 ** 2 and three > 2 * one
