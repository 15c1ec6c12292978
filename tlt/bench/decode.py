"""Plain decode throughput: tlt's engine (tlt.LLM.generate) vs transformers' `generate` on the same model.

    tlt bench decode                                   # SmolLM2-135M + a random 30M Llama, bs 1/4/16/64, fp32 and bf16
    tlt bench decode --models rand-30m --batch-sizes 1,16 --dtype bfloat16 --max-tokens 128 --repeats 5
    tlt bench decode --quick                           # seconds: a tiny random model, for smoke tests
    tlt bench decode --models path/to/hf_dir           # any local Llama/Qwen2/Qwen3 HF directory
    tlt bench decode --device cuda --dtype bfloat16    # on a GPU (default: cpu, the setting of the 2x goal)

Both sides decode greedily the same random-token prompts (fixed length) for exactly max_tokens new tokens (ours:
ignore_eos; transformers: min_new_tokens = max_new_tokens), in the same dtype and process, one thread pool.
tok/s = batch_size * max_tokens / wall time of the whole call (prefill included, for both). Each repeat times
ours then transformers back to back after one shorter warm run each; the median over repeats is reported, since
a shared machine is noisy (the load average is printed). On CPU, bf16 can be much slower than fp32 for some
matmul shapes (torch 2.13): run both dtypes before choosing one. `same` is the fraction of rows whose greedy
tokens agree between the two. Random-token prompts give near-tied logits, so rows part after rounding differences:
tlt's CPU matmuls run on prepacked weights (oneDNN in bf16, bit-identical to torch's matmul; in fp32 oneDNN or
tlt's small-row kernel, which sum in another order than MKL) and its decode attention is transformers' eager
arithmetic, not SDPA's.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

import tlt
from tlt.bench.common import print_json_line, print_table
from tlt.device import DTYPES, resolve_device

# Random Llamas with SmolLM2's tokenizer shape (vocab 49152, tied embeddings); random weights are fine for speed.
RANDOM_MODELS = {
    "rand-30m": dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=2,
                     intermediate_size=1024, vocab_size=49152),
    "rand-tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, vocab_size=512),
}
MODEL_ALIASES = ("smollm2-135m", *RANDOM_MODELS)


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="tlt bench decode", description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="smollm2-135m,rand-30m",
                    help=f"comma-separated: {', '.join(MODEL_ALIASES)} or HF directories")
    ap.add_argument("--batch-sizes", default="1,4,16,64")
    ap.add_argument("--dtype", default="float32,bfloat16", help="comma-separated dtypes to run")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per cell; the median is reported")
    ap.add_argument("--no-hf", action="store_true", help="time only tlt (no transformers baseline)")
    ap.add_argument("--device", default="cpu", help="cpu (the 2x goal's setting), cuda or auto")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (tlt.LLM(enforce_eager=True))")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads; 0 = torch's default")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true",
                    help="smoke-test sizes: rand-tiny (unless --models), bs 1,2, 4 tokens, 1 repeat, fp32")
    args = ap.parse_args(argv)
    if args.quick:
        given = {a.split("=")[0] for a in argv}
        args.models = args.models if "--models" in given else "rand-tiny"
        args.batch_sizes, args.max_tokens, args.repeats, args.prompt_len = "1,2", 4, 1, 8
        args.dtype = args.dtype if "--dtype" in given else "float32"
    return args


def resolve_model(name: str, scratch: Path) -> Path:
    """An HF directory for `name`: the converted SmolLM2, a random Llama built in `scratch`, or a given path."""
    if name == "smollm2-135m":
        from tlt.models.smollm import default_model_path
        return default_model_path()
    if name in RANDOM_MODELS:
        from transformers import LlamaConfig, LlamaForCausalLM
        path = scratch / name
        if not (path / "config.json").is_file():
            torch.manual_seed(0)
            cfg = LlamaConfig(**RANDOM_MODELS[name], tie_word_embeddings=True, max_position_embeddings=2048,
                              bos_token_id=None, eos_token_id=None, pad_token_id=0)
            LlamaForCausalLM(cfg).save_pretrained(str(path))
        return path
    path = Path(name)
    if not (path / "config.json").is_file():
        raise SystemExit(f"tlt bench decode: model {name!r} is neither one of {', '.join(MODEL_ALIASES)} "
                         f"nor an HF directory with config.json")
    return path


def _timed(fn) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def bench_model(name: str, model_dir: Path, dtype_name: str, args) -> list[dict]:
    """One model in one dtype: rows for every batch size."""
    from transformers import AutoModelForCausalLM, GenerationConfig
    dtype = DTYPES[dtype_name]
    bss = [int(b) for b in args.batch_sizes.split(",")]
    device = resolve_device(args.device)
    ours = tlt.LLM(model=model_dir, dtype=dtype_name, device=str(device), max_num_seqs=max(bss),
                   skip_tokenizer_init=True, max_model_len=args.prompt_len + args.max_tokens + 1,
                   enforce_eager=args.enforce_eager)
    hf = None if args.no_hf else AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    vocab = ours.model.cfg.vocab_size
    g = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(min(100, vocab // 2), vocab, (max(bss), args.prompt_len), generator=g)

    def run_ours(bs: int, n: int) -> list[list[int]]:
        p = tlt.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        return [o.outputs[0].token_ids for o in ours.generate(prompt_token_ids=prompts[:bs].tolist(),
                                                              sampling_params=p)]

    def run_hf(bs: int, n: int) -> list[list[int]]:
        # a fresh GenerationConfig: no EOS to stop at or suppress, exactly n new tokens
        gc = GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0,
                              eos_token_id=None, bos_token_id=None)
        ids = prompts[:bs].to(device)
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc)
        return out[:, ids.shape[1]:].tolist()

    rows = []
    for bs in bss:
        warm = min(8, args.max_tokens)
        run_ours(bs, warm)
        if hf is not None:
            run_hf(bs, warm)
        t_ours, t_hf, out_ours, out_hf = [], [], None, None
        for _ in range(args.repeats):  # interleaved, so a load spike hits both sides alike
            t, out_ours = _timed(lambda: run_ours(bs, args.max_tokens))
            t_ours.append(t)
            if hf is not None:
                t, out_hf = _timed(lambda: run_hf(bs, args.max_tokens))
                t_hf.append(t)
        n_tok = bs * args.max_tokens
        ours_tps = n_tok / statistics.median(t_ours)
        hf_tps = n_tok / statistics.median(t_hf) if t_hf else None
        same = (sum(a == b for a, b in zip(out_ours, out_hf)) / bs) if out_hf is not None else None
        rows.append({"model": name, "bs": bs, "dtype": dtype_name, "ours_tok_s": ours_tps, "hf_tok_s": hf_tps,
                     "ratio": ours_tps / hf_tps if hf_tps else None, "same": same,
                     "ours_s": [round(t, 3) for t in t_ours], "hf_s": [round(t, 3) for t in t_hf]})
        r = rows[-1]
        print(f"  {name} bs={bs} {dtype_name}: ours {ours_tps:.1f} tok/s"
              + (f", hf {hf_tps:.1f} tok/s, x{r['ratio']:.2f}, same {same:.2f}" if hf_tps else ""), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    from transformers.utils import logging as hf_logging
    args = parse_args(list(argv or []))
    hf_logging.disable_progress_bar()  # keep the output to the table and the JSON line
    dtypes = args.dtype.split(",")
    bad = [d for d in dtypes if d not in DTYPES]
    if bad:
        raise SystemExit(f"tlt bench decode: unknown dtype {bad}: use float32 and/or bfloat16")
    if args.threads:
        torch.set_num_threads(args.threads)
    load0 = os.getloadavg()
    device = resolve_device(args.device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"decode bench on {where}: torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"load avg {load0[0]:.2f}; prompt {args.prompt_len} + {args.max_tokens} new tokens, greedy, "
          f"median of {args.repeats}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="tlt-bench-") as scratch:
        for name in args.models.split(","):
            model_dir = resolve_model(name, Path(scratch))
            for d in dtypes:
                rows += bench_model(name, model_dir, d, args)
    print()
    print_table(rows, ["model", "bs", "dtype", "ours_tok_s", "hf_tok_s", "ratio", "same"])
    load1 = os.getloadavg()
    print(f"load avg before/after: {load0[0]:.2f} / {load1[0]:.2f} (above the core count, numbers are noisy)")
    print_json_line("decode", {"device": where, "torch": torch.__version__, "threads": torch.get_num_threads(),
                               "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
                               "repeats": args.repeats, "load_avg": [load0[0], load1[0]], "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
