"""Model core vs transformers: logits in fp32, cached decode, HF round trip, bad input."""
import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from tlt.models import CacheView, load_model, save_model
from tlt.models.loader import hf_state_dict


def test_logits_match_transformers(tiny_family_dir):
    _, path = tiny_family_dir
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = load_model(path)
    ids = torch.randint(0, 128, (3, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (hf(ids).logits - ours.logits(ours(ids))).abs().max() < 1e-4


def test_cached_incremental_forward_equals_full(tiny_family_dir):
    _, path = tiny_family_dir
    m = load_model(path)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(2))
    k = [torch.zeros(2, m.cfg.num_kv_heads, 64, m.cfg.head_dim) for _ in range(m.cfg.num_layers)]
    v = [torch.zeros_like(x) for x in k]
    with torch.no_grad():
        full = m.logits(m(ids))
        # rows at different cache lengths: row 0 prefilled 10 tokens, row 1 prefilled 14
        for row, n in ((0, 10), (1, 14)):
            m(ids[row:row + 1, :n], torch.arange(n)[None], CacheView(k, v, torch.zeros(1, dtype=torch.long), row))
        lens = torch.tensor([10, 14])
        for _ in range(6):
            step_ids = ids[torch.arange(2), lens][:, None]
            out = m.logits(m(step_ids, lens[:, None], CacheView(k, v, lens.clone())))[:, 0]
            assert (out - full[torch.arange(2), lens]).abs().max() < 1e-4
            lens += 1


def test_tree_mask_forward_equals_branch_forwards(tiny_llama_dir):
    """Two branches verified in one forward with a tree mask equal each branch run on its own."""
    m = load_model(tiny_llama_dir)
    g = torch.Generator().manual_seed(3)
    prefix, a, b = torch.randint(0, 128, (8,), generator=g), torch.randint(0, 128, (2,), generator=g), \
        torch.randint(0, 128, (2,), generator=g)
    k = [torch.zeros(1, m.cfg.num_kv_heads, 32, m.cfg.head_dim) for _ in range(m.cfg.num_layers)]
    v = [torch.zeros_like(x) for x in k]
    with torch.no_grad():
        m(prefix[None], torch.arange(8)[None], CacheView(k, v, torch.zeros(1, dtype=torch.long)))
        tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]], dtype=torch.bool)  # a0-a1, b0-b1
        toks = torch.cat([a, b])[None]
        pos = torch.tensor([[8, 9, 8, 9]])
        out = m.logits(m(toks, pos, CacheView(k, v, torch.tensor([8]), 0, tree[None])))[0]
        ref_a = m.logits(m(torch.cat([prefix, a])[None]))[0, 8:]
        ref_b = m.logits(m(torch.cat([prefix, b])[None]))[0, 8:]
    assert (out[:2] - ref_a).abs().max() < 1e-4 and (out[2:] - ref_b).abs().max() < 1e-4


def test_save_model_loads_in_transformers(tiny_family_dir, tmp_path):
    _, path = tiny_family_dir
    m = load_model(path)
    save_model(m, tmp_path, json.loads(open(f"{path}/config.json").read()))
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    ids = torch.randint(0, 128, (1, 9))
    with torch.no_grad():
        assert (hf(ids).logits - m.logits(m(ids))).abs().max() < 1e-4
    assert set(hf_state_dict(m)) <= set(hf.state_dict())


def test_bad_model_paths(tmp_path, tiny_llama_dir):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(open(f"{tiny_llama_dir}/config.json").read())
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_model(tmp_path)
    cfg = json.loads(open(f"{tiny_llama_dir}/config.json").read())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    cfg["model_type"] = "gpt2"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load_model(tmp_path)


def test_safetensors_files_get_the_umasks_mode(tmp_path):
    """safetensors writes owner-only files; a checkpoint's weights are as readable as its other files."""
    from tlt.models.loader import umask, write_safetensors
    before = os.umask(0o027)
    try:
        assert umask() == 0o027
        write_safetensors({"w": torch.zeros(2)}, tmp_path / "w.safetensors")
        assert (tmp_path / "w.safetensors").stat().st_mode & 0o777 == 0o640
    finally:
        os.umask(before)
