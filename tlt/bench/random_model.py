"""Random-weight models of a real model's shape, built locally from a config (no download, no GGUF).

A benchmark machine that cannot receive the converted SmolLM2-135M-Instruct (538 MB in fp32, ~270 MB in bf16)
builds one of the same shape here in seconds: the same layers, widths, heads and 49,152-token vocabulary, so
decode, verification and update costs are the real model's. The tokenizer is tlt's character-level one (ids
beyond it decode to nothing). Weights are random, so the outputs carry no meaning: response lengths run to
max_tokens and rewards are 0; acceptance of a drafter is not the real model's.

    python -m tlt.bench.random_model --shape smollm2-135m --out /tmp/smollm2-shaped
"""
from __future__ import annotations

import argparse
from pathlib import Path

# LlamaConfig fields per shape (Qwen2Config where "arch" says qwen2); smollm2-135m is SmolLM2-135M-Instruct's
# config.json, qwen2-* are Qwen2.5-*-Instruct's (q/k/v biases; 7B unties the LM head).
_QWEN2 = dict(arch="qwen2", rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=32768)
SHAPES: dict[str, dict] = {
    "qwen2-0.5b": dict(_QWEN2, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2-1.5b": dict(_QWEN2, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                       num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2-3b": dict(_QWEN2, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                     num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2-7b": dict(_QWEN2, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                     num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0, rms_norm_eps=1e-5,
                         max_position_embeddings=8192, tie_word_embeddings=True),
    "small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=8192, max_position_embeddings=8192, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, max_position_embeddings=8192, tie_word_embeddings=True),
}


def build_random_model(shape: str, out_dir: str | Path, dtype: str = "bfloat16", seed: int = 0,
                       device: str = "cpu") -> Path:
    """Write a random LlamaForCausalLM (Qwen2ForCausalLM for qwen2-*) of `shape` with tlt's character-level
    tokenizer into out_dir; device="cuda" initialises the weights there (seconds for 7B, where CPU takes minutes)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from tlt.rl.tiny_model import build_tiny_tokenizer

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}: use one of {', '.join(SHAPES)}")
    out = Path(out_dir)
    tok = build_tiny_tokenizer(out)
    fields = dict(SHAPES[shape])
    qwen2 = fields.pop("arch", "llama") == "qwen2"
    config_cls, model_cls = (Qwen2Config, Qwen2ForCausalLM) if qwen2 else (LlamaConfig, LlamaForCausalLM)
    cfg = config_cls(**fields, bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                     torch_dtype=dtype)
    default_dtype = torch.get_default_dtype()
    with torch.random.fork_rng(), torch.device(device):
        torch.manual_seed(seed)
        torch.set_default_dtype(getattr(torch, dtype))  # initialised in the saved dtype: no fp32 copy of a 7B model
        try:
            model = model_cls(cfg).eval()
        finally:
            torch.set_default_dtype(default_dtype)
    model.save_pretrained(str(out))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tlt.bench.random_model", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="where the weights are initialised (cpu, cuda)")
    a = ap.parse_args(argv)
    print(build_random_model(a.shape, a.out, a.dtype, a.seed, a.device))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
