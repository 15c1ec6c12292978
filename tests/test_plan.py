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
from tlt.plan import keeps_engine_caches, main, memory_plan
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


def test_kv_cache_with_cuda_graphs_holds_its_batch_buckets_slots_at_rounded_capacity(tiny_llama_dir):
    """Graphed decoding allocates the slots of the running batch's bucket (17 rows: bucket 32; padding rows write
    into free slots) and rounds the capacity to cuda_graph.ROUND, with the speculator's headroom for a draft tree,
    what the engine's static path allocates; enforce_eager (the control) plans what is running (17 rows: 24
    slots)."""
    from tlt.engine.cuda_graph import ROUND
    m = read_config(tiny_llama_dir)
    base = [f"model.path={tiny_llama_dir}", "model.device=cuda", "rollout.max_num_seqs=64", "data.train_batch_size=17",
            "rollout.n=1", "data.max_prompt_length=100", "data.max_response_length=300", "speculative.enabled=true",
            "rollout.dtype=bfloat16", "model.dtype=float32"]
    per_position = m.num_layers * 2 * m.num_kv_heads * m.head_dim * 2  # bf16 on CUDA
    graphed = memory_plan(load_config(None, base), m, 1).bytes("kv cache")
    eager = memory_plan(load_config(None, base + ["rollout.enforce_eager=true"]), m, 1).bytes("kv cache")
    headroom = load_config(None, base).speculative.cache_headroom()  # what the engine reserves at admission
    capacity = -(-(100 + 300 + headroom) // ROUND) * ROUND
    assert graphed == 32 * capacity * per_position
    assert eager == 24 * 480 * per_position  # 17 responses running, 400 + 65 positions rounded up to 32
    # the engine's static path on the CPU allocates those slots for 17 rows
    import tlt
    from tlt.engine.cuda_graph import GraphedForward
    llm = tlt.LLM(tiny_llama_dir, dtype="float32", device="cpu", max_num_seqs=64, enforce_eager=True)
    llm.engine.runner.graphs = GraphedForward(llm.engine.model, llm.engine.kv, capture=False)
    llm.generate([[1, 2, 3]] * 17, tlt.SamplingParams(temperature=0, max_tokens=2))
    assert llm.engine.kv.slots == 32


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


def test_colocated_replicas_keep_their_caches_and_graphs_where_the_gpu_holds_the_plan(tiny_llama_dir):
    """rollout.free_cache_engine unset: a colocated replica keeps its KV caches and CUDA graphs between rollouts where
    the GPU's memory holds the plan (which counts the KV cache in every phase), frees them where it does not or where
    the memory is unknown; set, the key decides. Control: one byte less than the plan frees them."""
    base = [f"model.path={tiny_llama_dir}", "trainer.placement=colocated", "data.train_batch_size=2"]
    cfg = load_config(None, base)
    need = memory_plan(cfg, read_config(tiny_llama_dir), 1).total
    assert keeps_engine_caches(cfg, need) and not keeps_engine_caches(cfg, need - 1)
    assert not keeps_engine_caches(cfg, None)
    assert not keeps_engine_caches(load_config(None, base + ["rollout.free_cache_engine=true"]), 10 * need)
    assert keeps_engine_caches(load_config(None, base + ["rollout.free_cache_engine=false"]), None)


def test_unrolled_drafter_training_is_planned(tiny_llama_dir):
    """drafter_train.ttt_steps=K: K passes of loss tensors, passes laid end to end, and their masks (13 T^2 bytes at
    K = 3) in the drafter-training row; one pass (the control) plans none of it."""
    m = read_config(tiny_llama_dir)
    base = [f"model.path={tiny_llama_dir}", "speculative.enabled=true", "drafter_train.enabled=true",
            "drafter_train.batch_tokens=2048"]
    one = memory_plan(load_config(None, base), m, 1).bytes("drafter training")
    three = memory_plan(load_config(None, base + ["drafter_train.ttt_steps=3"]), m, 1).bytes("drafter training")
    assert three - one > 13 * 2048 ** 2 and three > 2 * one


def test_load_phase_holds_the_shards_not_the_whole_model():
    """Loading (tlt.rl.fsdp.load_sharded_model, then the engine's copy filled from the shards) holds each rank's
    parameter shards and one unit's gather: no gradients, AdamW state or whole fp32 model. The 32B recipe's trainer
    GPU (16 ranks, its engine copy in host memory) loads under a sixth of the fp32 model. Control: the update phase
    holds the gradients and AdamW state too."""
    from tlt.plan import ALL_PHASES, role_plans
    m = read_config("configs/models/qwen2.5-32b-instruct")
    plan = role_plans(load_config("configs/qwen32b_32gpu.yaml"), m, 16, 16)["trainer"]
    assert ALL_PHASES[0] == "load"
    loaded = {r.name for r in plan.rows if "load" in r.phases and r.where == "device"}
    assert loaded == {"parameters", "weight sync gather"}
    assert plan.phase_bytes("load") == sum(plan.bytes(n) for n in loaded)
    with torch.device("meta"):
        from tlt.models.decoder import Decoder
        whole_fp32 = sum(p.numel() for p in Decoder(m).parameters()) * 4
    assert plan.bytes("parameters") < whole_fp32 / 15  # a 1/16 shard
    assert plan.phase_bytes("load") < whole_fp32 / 6
    assert plan.phase_bytes("update") - plan.phase_bytes("load") > plan.bytes("gradients") + plan.bytes("optimizer")


def test_hidden_state_records_are_what_the_speculator_keeps(tmp_path, tiny_llama_dir, monkeypatch):
    """The plan's hidden-state records are the bytes the engine's records hold at their largest in a rollout
    (Sequence.hidden_record: per running row its whole length and the draft headroom, in the engine's dtype), at 2
    and at 4 rows running; at 7B, 256 rows and 8k tokens they come to ~15 GB."""
    import tlt
    from tlt.engine.llm_engine import LLMEngine
    from tlt.speculative.drafter import Drafter
    from tlt.speculative.drafter_io import save_drafter
    m = read_config(tiny_llama_dir)
    drafter_dir = save_drafter(Drafter(m), tmp_path / "d")
    held: list[int] = []
    start = LLMEngine._start_records

    def spy(self, seqs, hidden):
        start(self, seqs, hidden)
        held.append(sum(s.hidden_record.numel() * s.hidden_record.element_size() for s in self.running))
    monkeypatch.setattr(LLMEngine, "_start_records", spy)
    prompt, max_tokens = [3, 5, 7, 9, 11], 12
    for rows in (2, 4):
        held.clear()
        cfg = load_config(None, [f"model.path={tiny_llama_dir}", "model.device=cpu", "speculative.enabled=true",
                                 "speculative.method=eagle", f"speculative.model={drafter_dir}",
                                 f"rollout.max_num_seqs={rows}", "rollout.dtype=float32", "model.dtype=float32",
                                 f"data.max_prompt_length={len(prompt)}", f"data.max_response_length={max_tokens}"])
        llm = tlt.LLM(tiny_llama_dir, dtype="float32", device="cpu", max_num_seqs=rows,
                      speculative_config=cfg.speculative.engine_config(0))
        llm.generate([prompt] * 4, tlt.SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=1, ignore_eos=True))
        plan = memory_plan(cfg, m, 1, prompts_per_rank=1, prompt_len=len(prompt), responses=4)
        assert max(held) == plan.bytes("hidden-state records"), (rows, held)
    big = load_config(None, ["speculative.enabled=true", "speculative.method=eagle", "rollout.max_num_seqs=256",
                             "rollout.dtype=bfloat16", "data.max_prompt_length=1024",
                             "data.max_response_length=7168", "data.train_batch_size=32", "rollout.n=8"])
    records = memory_plan(big, read_config("configs/models/deepseek-r1-distill-qwen-7b"), 1).bytes(
        "hidden-state records")
    assert 14e9 < records < 16e9
