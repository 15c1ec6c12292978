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

# LlamaConfig fields per shape; smollm2-135m is SmolLM2-135M-Instruct's config.json.
SHAPES: dict[str, dict] = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0, rms_norm_eps=1e-5,
                         max_position_embeddings=8192, tie_word_embeddings=True),
    "small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=8192, max_position_embeddings=8192, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, max_position_embeddings=8192, tie_word_embeddings=True),
}


def build_random_model(shape: str, out_dir: str | Path, dtype: str = "bfloat16", seed: int = 0) -> Path:
    """Write a random LlamaForCausalLM of `shape` with tlt's character-level tokenizer into out_dir."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tlt.rl.tiny_model import build_tiny_tokenizer

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}: use one of {', '.join(SHAPES)}")
    out = Path(out_dir)
    tok = build_tiny_tokenizer(out)
    cfg = LlamaConfig(**SHAPES[shape], bos_token_id=None, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, torch_dtype=dtype)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg).to(getattr(torch, dtype)).eval()
    model.save_pretrained(str(out))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tlt.bench.random_model", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    print(build_random_model(a.shape, a.out, a.dtype, a.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
