"""Decode attention at long contexts: tokens/s of one-token decode steps, flex vs sdpa (rollout.attention).

    tlt bench attention                                             # rand-30m, contexts 512/2k/8k, bs 1/16/64
    tlt bench attention --device cuda --dtype bfloat16               # on a GPU (CUDA graphs as in rollouts)
    tlt bench attention --models rand-tiny --contexts 128,512 --batch-sizes 1,4 --steps 8    # CPU smoke sizes
    tlt bench attention --models path/to/hf_dir --layouts spread     # any local Llama/Qwen2/Qwen3 HF directory

Each cell builds the engine of one backend, fills the KV cache of `bs` rows with random K/V (values do not change
the work) and times `steps` decode forwards (the engine's runner: CUDA graphs on CUDA unless --enforce-eager, the
LM head included) from that context on. Layouts: equal = every row at the context; spread = row lengths evenly
from context / bs up to the context (a rollout's long tail: the cache's capacity follows the longest row, and the
sdpa path attends over all of it for every row). tok/s = bs * steps / median wall time; `speedup` = flex / sdpa.
`mask_us`: microseconds a step spends building what the backend's forward builds before its layers (sdpa: the
mask and bias over the capacity; flex: the block mask), timed alone, median over `steps` builds (part of tok/s).
On CPU flex runs eagerly (every key scored, then masked): expect it slower there; the block-sparse kernel is
compiled on CUDA only.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

import tlt
from tlt.bench.common import print_json_line, print_table
from tlt.bench.decode import RANDOM_MODELS
from tlt.device import DTYPES, resolve_device
from tlt.models.decoder import cache_mask, flex_plan


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="tlt bench attention", description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="rand-30m", help=f"comma-separated: {', '.join(RANDOM_MODELS)} or HF dirs")
    ap.add_argument("--contexts", default="512,2048,8192", help="cached tokens per row before the timed steps")
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--backends", default="sdpa,flex")
    ap.add_argument("--layouts", default="equal,spread", help="equal and/or spread row lengths (see above)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed per repeat")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per cell; the median is reported")
    ap.add_argument("--device", default="auto", help="cpu, cuda or auto")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    args = ap.parse_args(argv)
    try:
        args.context_list = [int(c) for c in args.contexts.split(",")]
        args.bs_list = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError:
        raise SystemExit("tlt bench attention: --contexts and --batch-sizes take comma-separated integers")
    bad = [b for b in args.backends.split(",") if b not in ("sdpa", "flex")] + \
        [x for x in args.layouts.split(",") if x not in ("equal", "spread")] + \
        [d for d in [args.dtype] if d not in DTYPES]
    if bad or min(args.context_list + args.bs_list) < 1 or args.steps < 1 or args.repeats < 1:
        raise SystemExit(f"tlt bench attention: bad option value(s) {bad or 'below 1'}")
    return args


def model_dir(name: str, scratch: Path, max_len: int) -> Path:
    """A random Llama of RANDOM_MODELS built in `scratch` with room for `max_len` positions, or a given directory."""
    if name not in RANDOM_MODELS:
        path = Path(name)
        if not (path / "config.json").is_file():
            raise SystemExit(f"tlt bench attention: {name!r} is neither one of {', '.join(RANDOM_MODELS)} nor an "
                             f"HF directory with config.json")
        return path
    from transformers import LlamaConfig, LlamaForCausalLM
    path = scratch / f"{name}-{max_len}"
    if not (path / "config.json").is_file():
        torch.manual_seed(0)
        cfg = LlamaConfig(**RANDOM_MODELS[name], tie_word_embeddings=True, max_position_embeddings=max_len,
                          bos_token_id=None, eos_token_id=None, pad_token_id=0)
        LlamaForCausalLM(cfg).save_pretrained(str(path))
    return path


def row_lengths(context: int, bs: int, layout: str) -> list[int]:
    if layout == "equal":
        return [context] * bs
    return [max(1, context * (b + 1) // bs) for b in range(bs)]


def time_decode(llm: tlt.LLM, lens: list[int], steps: int, repeats: int) -> list[float]:
    """Wall seconds of `steps` decode forwards (+ LM head) of rows at `lens`, per repeat after one warm run."""
    eng = llm.engine
    dev = eng.device
    bs = len(lens)
    eng.kv.ensure_capacity(max(lens) + steps + 1, bs)
    with torch.inference_mode():  # the engine made its cache in inference mode
        for t in eng.kv.k + eng.kv.v:
            t.normal_()
    start = torch.tensor(lens, device=dev)
    ids = torch.randint(1, llm.model.cfg.vocab_size, (bs, 1), device=dev)

    def run():
        for i in range(steps):
            lens_t = start + i
            eng.runner.cached_forward(ids, lens_t[:, None], lens_t)
        if dev.type == "cuda":
            torch.cuda.synchronize()
    times = []
    with torch.inference_mode():
        run()
        for _ in range(repeats):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
    return times


def time_mask(llm: tlt.LLM, lens: list[int], steps: int) -> float:
    """Median microseconds of building the attention plan of one decode forward of rows at `lens` (the mask of the
    backend the model runs), the device waited for at both ends."""
    eng = llm.engine
    dev = eng.device
    view = eng.kv.view(torch.tensor(lens, device=dev), static=eng.runner.graphs is not None)
    flex = eng.model.attention_backend == "flex"
    times = []
    with torch.inference_mode():
        for _ in range(steps + 1):  # the first build warms up
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            flex_plan(view, 1, dev) if flex else cache_mask(view, 1, dev)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) * 1e6


def bench(name: str, path: Path, args, device) -> list[dict]:
    rows = []
    max_len = max(args.context_list) + args.steps + 8
    for backend in args.backends.split(","):
        llm = tlt.LLM(model=path, dtype=args.dtype, device=str(device), max_num_seqs=max(args.bs_list),
                      max_model_len=max_len, skip_tokenizer_init=True, enforce_eager=args.enforce_eager,
                      attention=backend)
        for layout in args.layouts.split(","):
            for ctx in args.context_list:
                for bs in args.bs_list:
                    times = time_decode(llm, row_lengths(ctx, bs, layout), args.steps, args.repeats)
                    tps = bs * args.steps / statistics.median(times)
                    mask_us = time_mask(llm, row_lengths(ctx, bs, layout), args.steps)
                    rows.append({"model": name, "layout": layout, "context": ctx, "bs": bs, "backend": backend,
                                 "tok_s": tps, "mask_us": mask_us, "times_s": [round(t, 4) for t in times]})
                    print(f"  {name} {backend} {layout} ctx={ctx} bs={bs}: {tps:.1f} tok/s, mask {mask_us:.0f} us",
                          flush=True)
        del llm
    return rows


def speedup_table(rows: list[dict]) -> list[dict]:
    """One row per (model, layout, context, bs): each backend's tok/s and mask-building cost, and flex / sdpa."""
    cells: dict[tuple, dict] = {}
    for r in rows:
        c = cells.setdefault((r["model"], r["layout"], r["context"], r["bs"]),
                             {"model": r["model"], "layout": r["layout"], "context": r["context"], "bs": r["bs"]})
        c[f"{r['backend']}_tok_s"] = r["tok_s"]
        c[f"{r['backend']}_mask_us"] = r["mask_us"]
    for c in cells.values():
        if c.get("sdpa_tok_s") and c.get("flex_tok_s"):
            c["speedup"] = c["flex_tok_s"] / c["sdpa_tok_s"]
    return list(cells.values())


def main(argv: list[str] | None = None) -> int:
    from transformers.utils import logging as hf_logging
    args = parse_args(list(argv or []))
    hf_logging.disable_progress_bar()
    device = resolve_device(args.device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "cpu")
    load0 = os.getloadavg()
    graphs = device.type == "cuda" and not args.enforce_eager
    print(f"attention bench on {where}: torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, "
          f"CUDA graphs {graphs}, {args.steps} decode steps, median of {args.repeats}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="tlt-bench-") as scratch:
        for name in args.models.split(","):
            path = model_dir(name, Path(scratch), max(args.context_list) + args.steps + 8)
            rows += bench(name, path, args, device)
    table = speedup_table(rows)
    print()
    print_table(table, ["model", "layout", "context", "bs", "sdpa_tok_s", "flex_tok_s", "speedup", "sdpa_mask_us",
                        "flex_mask_us"])
    load1 = os.getloadavg()
    print(f"load avg before/after: {load0[0]:.2f} / {load1[0]:.2f}")
    print_json_line("attention", {"device": where, "torch": torch.__version__, "threads": torch.get_num_threads(),
                                  "dtype": args.dtype, "cuda_graphs": graphs, "steps": args.steps,
                                  "repeats": args.repeats, "load_avg": [load0[0], load1[0]], "rows": table,
                                  "raw": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
