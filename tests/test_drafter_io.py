"""Drafter save/load round trip, EAGLE export layout (keys checked against transformers' own decoder layer),
and the reduced draft vocabulary."""
from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file

from tlt.models.config import ModelConfig
from tlt.models.decoder import Decoder
from tlt.speculative.drafter import Drafter
from tlt.export.eagle import eagle_state_dict, export_eagle, load_eagle
from tlt.speculative.drafter_io import build_draft_vocab, load_draft_vocab, load_drafter, save_draft_vocab, save_drafter


def hf_config(family: str) -> dict:
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[family]
    cfg = {"architectures": [arch], "model_type": family, "vocab_size": 96, "hidden_size": 32,
           "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
           "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "hidden_act": "silu"}
    if family == "qwen3":
        cfg["head_dim"] = 8
    return cfg


def make_drafter(family: str, seed: int = 0, fc_bias: bool = True) -> Drafter:
    torch.manual_seed(seed)
    cfg = ModelConfig.from_hf(hf_config(family))
    drafter = Drafter(cfg, fc_bias=fc_bias).attach(Decoder(cfg))
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0, 0.05)  # norms and biases too, so a dropped tensor cannot pass unnoticed
    return drafter


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_save_load_round_trip(tmp_path, family):
    drafter = make_drafter(family)
    drafter.d2t = torch.tensor([0, 3, 5, 7])
    save_drafter(drafter, tmp_path, extra={"rl_step": 12})
    loaded = load_drafter(tmp_path).attach(drafter.target)
    for k, v in drafter.trainable_state_dict().items():
        assert torch.equal(v, loaded.trainable_state_dict()[k]), k
    assert torch.equal(loaded.d2t, drafter.d2t)
    assert json.loads((tmp_path / "drafter_config.json").read_text())["extra"] == {"rl_step": 12}
    hidden, ids, pos = torch.randn(2, 5, 32), torch.randint(0, 96, (2, 5)), torch.arange(5).expand(2, 5)
    assert torch.equal(drafter(hidden, ids, pos), loaded(hidden, ids, pos))
    other = make_drafter(family, seed=1)
    load_drafter(tmp_path, other)
    assert torch.equal(other.fc.weight, drafter.fc.weight)


def test_a_drafter_without_fc_bias_saves_loads_and_exports_as_one(tmp_path):
    drafter = make_drafter("llama", fc_bias=False)
    save_drafter(drafter, tmp_path / "d")
    loaded = load_drafter(tmp_path / "d").attach(drafter.target)
    assert loaded.fc.bias is None and set(loaded.trainable_state_dict()) == set(drafter.trainable_state_dict())
    hidden, ids, pos = torch.randn(1, 4, 32), torch.randint(0, 96, (1, 4)), torch.arange(4)[None]
    assert torch.equal(drafter(hidden, ids, pos), loaded(hidden, ids, pos))
    with pytest.raises(ValueError, match="missing"):  # control: into a drafter with a bias it does not fit
        load_drafter(tmp_path / "d", make_drafter("llama"))
    export_eagle(drafter, hf_config("llama"), tmp_path / "sglang")  # SGLang's fc has a bias: zeros, same function
    assert torch.equal(load_file(str(tmp_path / "sglang" / "model.safetensors"))["fc.bias"], torch.zeros(32))
    assert load_eagle(tmp_path / "sglang", make_drafter("llama", seed=2, fc_bias=False)).fc.bias is None


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_export_eagle_layout(tmp_path, family):
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

    drafter = make_drafter(family)
    if family == "qwen3":  # SGLang has no EAGLE-1 class for it, and the vLLM flavour is `tlt export-drafter`'s
        with pytest.raises(ValueError, match="SGLang has no EAGLE-1"):
            export_eagle(drafter, hf_config(family), tmp_path)
        with pytest.raises(ValueError, match="tlt export-drafter"):
            export_eagle(drafter, hf_config(family), tmp_path, flavour="vllm")
        eagle_layout = eagle_state_dict(drafter)
        keys = set(eagle_layout)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            export_eagle(drafter, hf_config(family), tmp_path)
        cfg = json.loads((tmp_path / "config.json").read_text())
        assert cfg["num_hidden_layers"] == 1 and cfg["torch_dtype"] == "bfloat16"
        want_arch = {"llama": "LlamaForCausalLMEagle", "qwen2": "Qwen2ForCausalLMEagle"}
        assert cfg["architectures"] == [want_arch[family]]
        keys = set(load_file(str(tmp_path / "model.safetensors")))
    # the layer keys are exactly transformers' decoder-layer names minus input_layernorm (EAGLE-1 omits it)
    layer_cls = {"llama": LlamaDecoderLayer, "qwen2": Qwen2DecoderLayer, "qwen3": Qwen3DecoderLayer}[family]
    hf_layer = layer_cls(AutoConfig.for_model(**{k: v for k, v in hf_config(family).items() if k != "architectures"}),
                         layer_idx=0)
    expected = {f"layers.0.{k}" for k in hf_layer.state_dict() if not k.startswith("input_layernorm")}
    assert keys == expected | {"fc.weight", "fc.bias"}
    assert not any("embed_tokens" in k or "lm_head" in k for k in keys)
    if family == "qwen3":
        return
    back = load_eagle(tmp_path, make_drafter(family, seed=3))
    for k, v in drafter.trainable_state_dict().items():
        torch.testing.assert_close(back.trainable_state_dict()[k], v.to(torch.bfloat16).float(), msg=k)


def test_export_rejects_unknown_flavour_and_writes_token_map(tmp_path):
    drafter = make_drafter("llama")
    with pytest.raises(ValueError):
        export_eagle(drafter, hf_config("llama"), tmp_path, flavour="trt")
    with pytest.raises(ValueError, match="tlt export-drafter"):  # would load in vLLM and draft otherwise
        export_eagle(drafter, hf_config("llama"), tmp_path, flavour="vllm")
    with pytest.raises(ValueError):
        export_eagle(make_drafter("qwen3"), hf_config("qwen3"), tmp_path, flavour="sglang")
    drafter.d2t = torch.tensor([1, 2, 9])
    export_eagle(drafter, hf_config("llama"), tmp_path)
    assert torch.load(tmp_path / "hot_token_ids.pt", weights_only=True) == [1, 2, 9]


def test_build_draft_vocab(tmp_path):
    counts = torch.tensor([5, 0, 9, 9, 1, 7, 0, 3])
    d2t = build_draft_vocab(counts, 4)
    assert d2t.tolist() == [0, 2, 3, 5]  # top-4 by count, ascending ids
    assert build_draft_vocab({2: 4, 6: 4, 1: 1}, 2, vocab_size=8).tolist() == [2, 6]
    save_draft_vocab(d2t, tmp_path / "v.safetensors")
    assert torch.equal(load_draft_vocab(tmp_path / "v.safetensors"), d2t)
    with pytest.raises(ValueError):
        build_draft_vocab(counts, 9)

