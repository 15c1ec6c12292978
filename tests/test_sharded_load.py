"""tlt.rl.fsdp.load_sharded_model on 2 gloo ranks: each rank reads only its shard's rows, so the resident memory it
adds while loading (its peak above its own baseline) is under 0.65x of what one process loading the whole model
adds, and the gathered weights equal a whole load bit for bit (untied, biased and tied checkpoints, uneven shards)."""
from __future__ import annotations

import os
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.conftest import make_tiny_checkpoint
from tests.test_fsdp import _free_port, gloo_rank
from tlt.bench.memory_meter import reset_rss_peak, rss_now, rss_peak
from tlt.config import ActorConfig
from tlt.models import load_model
from tlt.rl import fsdp
from tlt.rl.sharded_checkpoint import full_state_dict

MAX_RATIO = 0.65


def _added_while(fn):
    """(fn(), resident bytes this process added while it ran: its peak above the resident set before)."""
    base = rss_now()
    reset_rss_peak()
    out = fn()
    return out, rss_peak() - base


def _whole_worker(_rank: int, model_dir: str, out: str) -> None:
    torch.set_num_threads(1)
    model, added = _added_while(lambda: load_model(model_dir, dtype=torch.float32, device="cpu"))
    torch.save(added, out)


_SHARD_ROWS = fsdp.shard_rows


def _wrong_rows(param):
    """Negative control: every rank reads the rows at the start of the tensor."""
    start, stop = _SHARD_ROWS(param)
    return 0, stop - start


def _sharded_worker(rank: int, world: int, port: int, big_dir: str, small_dirs: list[str], out: str) -> None:
    with gloo_rank(rank, world, port):
        cfg = ActorConfig(strategy="fsdp")
        model, added = _added_while(lambda: fsdp.load_sharded_model(big_dir, torch.float32, torch.device("cpu"), cfg))
        local = sum(p.to_local().numel() for p in model.parameters())
        result = {"added": added, "local_numel": local, "weights": {big_dir: full_state_dict(model)}}
        del model
        for path in small_dirs:
            result["weights"][path] = full_state_dict(fsdp.load_sharded_model(path, torch.float32, "cpu", cfg))
        frozen = fsdp.load_sharded_model(small_dirs[0], torch.float32, "cpu", cfg, trainable=False)
        result["frozen"] = not any(p.requires_grad for p in frozen.parameters())
        with mock.patch.object(fsdp, "shard_rows", _wrong_rows):
            result["wrong_rows"] = full_state_dict(fsdp.load_sharded_model(small_dirs[0], torch.float32, "cpu", cfg))
        ranks = [None] * world
        dist.all_gather_object(ranks, {"added": added, "local_numel": local})
        if rank == 0:
            result["ranks"] = ranks
            torch.save(result, out)


def write_random_checkpoint(path, vocab_size: int, hidden_size: int, num_layers: int, seed: int = 0) -> str:
    """A Llama checkpoint of random bf16 weights (as HF checkpoints are stored; the fp32 policy casts them), written
    directly: seconds faster than initialising a transformers model of this size."""
    from transformers import LlamaConfig
    from tlt.models.loader import write_safetensors
    heads, kv_heads, inter = 8, 2, 2 * hidden_size
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=inter,
                      num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    cfg.save_pretrained(str(path))
    hd = hidden_size // heads
    shapes = {"model.embed_tokens.weight": (vocab_size, hidden_size), "lm_head.weight": (vocab_size, hidden_size),
              "model.norm.weight": (hidden_size,)}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (heads * hd, hidden_size),
                   p + "self_attn.k_proj.weight": (kv_heads * hd, hidden_size),
                   p + "self_attn.v_proj.weight": (kv_heads * hd, hidden_size),
                   p + "self_attn.o_proj.weight": (hidden_size, heads * hd),
                   p + "mlp.gate_proj.weight": (inter, hidden_size), p + "mlp.up_proj.weight": (inter, hidden_size),
                   p + "mlp.down_proj.weight": (hidden_size, inter),
                   p + "input_layernorm.weight": (hidden_size,), p + "post_attention_layernorm.weight": (hidden_size,)}
    g = torch.Generator().manual_seed(seed)
    write_safetensors({k: torch.randn(s, generator=g).to(torch.bfloat16) for k, s in shapes.items()},
                      os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return str(path)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded_load")
    # ~43M parameters (86 MB in bf16, 172 MB as the fp32 policy): far above the few MB a process's allocations move
    # by themselves; an odd vocabulary splits the embedding and the LM head unevenly over 2 ranks
    big = write_random_checkpoint(root / "big", vocab_size=32769, hidden_size=512, num_layers=4)
    small = [make_tiny_checkpoint(root / "qwen2", "qwen2", vocab_size=129),
             make_tiny_checkpoint(root / "qwen3", "qwen3", tie=True, vocab_size=127)]
    return big, small


def test_each_rank_loads_its_shard_only(tmp_path, checkpoints):
    big, small = checkpoints
    mp.spawn(_whole_worker, args=(big, str(tmp_path / "whole.pt")), nprocs=1, join=True)
    whole_added = torch.load(tmp_path / "whole.pt")
    mp.spawn(_sharded_worker, args=(2, _free_port(), big, small, str(tmp_path / "sharded.pt")), nprocs=2, join=True)
    res = torch.load(tmp_path / "sharded.pt")
    whole = load_model(big, dtype=torch.float32).state_dict()
    numel = sum(v.numel() for v in whole.values())
    assert whole_added > numel * 4  # the control: the whole fp32 model (and more) became resident
    for r in res["ranks"]:
        assert r["local_numel"] < 0.51 * numel  # half the rows each
        assert r["added"] < MAX_RATIO * whole_added, (r["added"] / whole_added, res["ranks"], whole_added)
    for path in [big, *small]:
        want, got = load_model(path, dtype=torch.float32).state_dict(), res["weights"][path]
        assert got.keys() == {k for k in want if not k.startswith("rotary.")}
        assert all(torch.equal(got[k], want[k]) for k in got), [k for k in got if not torch.equal(got[k], want[k])]
    assert res["frozen"]
    # control: rank 1 reading rank 0's rows is caught
    want = load_model(small[0], dtype=torch.float32).state_dict()
    assert not all(torch.equal(res["wrong_rows"][k], want[k]) for k in res["wrong_rows"])


def test_a_checkpoint_missing_a_weight_is_refused_before_loading(tmp_path):
    """A missing weight is named (as a whole load names it) before any shard is read."""
    path = make_tiny_checkpoint(tmp_path / "m", "llama")
    from safetensors.torch import load_file, save_file
    weights = load_file(os.path.join(path, "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    from tlt.models.loader import CheckpointRows
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        CheckpointRows(path)
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        load_model(path)
