"""`tlt bench soak`: a long run holds its memory and its pace, and its metrics stay finite (CPU).

    tlt bench soak --results docs/results --machine cpu-zen5   # 200 smoke steps (twice), 1,000 SD generate calls
    tlt bench soak --train-steps 12 --warmup-steps 4 --generate-calls 60 --warmup-calls 20   # a quick look

Run it from the repository root (the smoke recipe's data paths are relative to it). Each part runs in a fresh
spawned process, so that none's memory is another's:
- train: GRPOTrainer on configs/smoke.yaml as `tlt train` runs it (trainer.retain_freed_memory applied first; eagle
  SD, the online drafter, a checkpoint every 2 steps, 2 kept). After each step: resident memory, what glibc's
  malloc has handed out, the online drafter buffer's bytes (it fills, by design, up to drafter_train.buffer_max_tokens),
  the step's seconds and tokens, and the logged metrics that are not finite.
- train_small_caches: the same with oneDNN's primitive cache and ideep's LRU cache (one entry per bf16 matmul
  shape, 1024 each by default) cut to --control-cache-capacity entries: the control that tells their growth apart.
- engine: tlt.LLM on the same tiny model with eagle SD on every step (the fixed arm, no batch-size threshold),
  --generate-calls calls of --batch prompts sampled at temperature 1; every --swap-every calls the drafter's
  weights are swapped (SpecDecoder.load_drafter_state, what publishing a drafter does). After each call: the
  same memory figures, the call's seconds and tokens, the log-probs that are not finite.
Figures, from the warm-up point on (step 20, call 100): resident memory's growth to the end and to its peak, its
least-squares slope, and the same less the buffer's bytes; drift: the median seconds per token of the last quarter
over the first's, with a 95% bootstrap interval and Mann-Whitney's p. Bounds: growth under 5% (or its cause
named), drift within noise (the interval holds 1, or the change is under 5%). A table, then one JSON line.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import io
import json
import math
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from tlt.bench.common import print_json_line, print_table

GROWTH_BOUND, DRIFT_BOUND = 0.05, 0.05


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


def memory() -> dict[str, int | None]:
    """This process's resident bytes, and the bytes glibc's malloc has handed out and not been given back (heap
    and mmapped blocks; None off glibc)."""
    rss = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    try:
        fn = ctypes.CDLL(None).mallinfo2
        fn.restype = _Mallinfo2
        info = fn()
        in_use = int(info.uordblks + info.hblkhd)
    except (AttributeError, OSError):
        in_use = None
    return {"rss": rss, "malloc_in_use": in_use}


def _not_finite(values: dict) -> list[str]:
    return sorted(k for k, v in values.items()
                  if isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isfinite(v))


# ---------------------------------------------------------------- the two parts (each in its own process)


def train_part(config: str, steps: int, threads: int, out_dir: str, cache_capacity: int | None = None,
               overrides: tuple[str, ...] = ()) -> list[dict]:
    if cache_capacity is not None:  # the control: oneDNN's and ideep's per-shape kernel caches kept small
        os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = os.environ["LRU_CACHE_CAPACITY"] = str(cache_capacity)
    import torch
    torch.set_num_threads(threads)
    from tlt.config import load_config
    from tlt.rl.trainer import GRPOTrainer, retain_freed_memory_for
    cfg = load_config(config, [f"trainer.total_steps={steps}", f"trainer.default_local_dir={out_dir}",
                               "trainer.experiment_name=soak", "trainer.logger=[jsonl]", "trainer.max_ckpt_to_keep=2",
                               "trainer.resume=disable", *overrides])
    retain_freed_memory_for(cfg)  # before any tensor, as `tlt train` does
    trainer = GRPOTrainer(cfg)
    records: list[dict] = []
    inner = trainer.logger

    class Recorder:
        def log(self, step, metrics, advance=True):
            inner.log(step, metrics, advance=advance)
            if step >= 1:
                buffer = getattr(trainer.drafter_hook, "buffer", None)
                held = sum(s.hidden.nbytes + s.token_ids.nbytes for s in buffer.samples) if buffer else 0
                seconds, bad = metrics["timing_s/step"], _not_finite(metrics)
                # the accept length of a step that drafted nothing (every step took the "off" arm) is 0 / 0 by
                # definition, logged as null
                undefined = [k for k in bad if k == "rollout/spec_accept_length"
                             and not metrics.get("rollout/spec_on_fraction")]
                records.append({"i": step, "seconds": seconds, "tokens": metrics["throughput/tokens_per_s"] * seconds,
                                "buffer_bytes": held, "not_finite": [k for k in bad if k not in undefined],
                                "undefined": undefined, **memory()})

        def __getattr__(self, name):
            return getattr(inner, name)
    trainer.logger = Recorder()
    trainer.fit()
    return records


def engine_part(calls: int, batch: int, swap_every: int, threads: int, max_tokens: int, seed: int) -> list[dict]:
    import time

    import torch
    torch.set_num_threads(threads)
    from tlt.engine.params import SamplingParams
    from tlt.llm import LLM
    from tlt.models.loader import read_config
    from tlt.rl.tiny_model import tiny_random_model_path
    from tlt.speculative.drafter import Drafter
    from tlt.speculative.drafter_io import save_drafter
    model_dir = tiny_random_model_path()
    torch.manual_seed(seed)
    with tempfile.TemporaryDirectory(prefix="tlt-soak-drafter-") as drafter_dir:  # read once, when the engine starts
        save_drafter(Drafter(read_config(model_dir)), drafter_dir)
        llm = LLM(model=model_dir, max_num_seqs=batch, seed=seed, speculative_config={
            "method": "eagle", "model": drafter_dir, "adaptive": False, "bs_threshold": None})
    first = {k: v.detach().clone() for k, v in llm.spec.drafter.trainable_state_dict().items()}
    states = [first, {k: v + 0.01 * torch.randn_like(v) for k, v in first.items()}]
    gen = torch.Generator().manual_seed(seed)
    vocab = llm.model.cfg.vocab_size
    records: list[dict] = []
    swaps = 0
    for i in range(1, calls + 1):
        if i % swap_every == 0:
            llm.spec.load_drafter_state(states[(i // swap_every) % 2])
            swaps += 1
        prompts = [torch.randint(6, vocab, (int(n),), generator=gen).tolist()
                   for n in torch.randint(8, 48, (batch,), generator=gen)]
        params = SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed + i)
        spec_before = llm.stats()["num_spec_steps"]
        start = time.perf_counter()
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        seconds = time.perf_counter() - start
        logprobs = [lp for o in outs for c in o.outputs for lp in c.logprobs]
        records.append({"i": i, "seconds": seconds, "tokens": len(logprobs), "buffer_bytes": 0, "swaps": swaps,
                        "spec_steps": llm.stats()["num_spec_steps"] - spec_before,
                        "not_finite": ["logprob"] if not all(math.isfinite(x) for x in logprobs) else [],
                        **memory()})
    return records


def _in_fresh_process(fn, *args) -> list[dict]:
    with ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


# ---------------------------------------------------------------- figures


def growth(values: list[int], warmup: int) -> dict:
    """From records[warmup - 1] (the value after the warm-up) to the end: growth and peak as fractions of it, and
    the least-squares slope in MiB per 100 records, over all of them and over the second half (still rising, or
    levelled off)."""
    base, rest = values[warmup - 1], values[warmup - 1:]
    return {"base_mib": base / 2**20, "end_mib": values[-1] / 2**20, "growth": (values[-1] - base) / base,
            "peak_growth": (max(rest) - base) / base, "slope_mib_per_100": _slope(rest),
            "late_slope_mib_per_100": _slope(rest[len(rest) // 2:])}


def _slope(values: list[int]) -> float:
    import numpy as np
    if len(values) < 3:
        return 0.0
    return float(np.polyfit(np.arange(len(values)), np.asarray(values, dtype=float), 1)[0]) * 100 / 2**20


def drift(per_token: list[float], seed: int = 0) -> dict:
    """The last quarter's median over the first quarter's, a 95% bootstrap interval of that ratio, and Mann-Whitney's
    p that the two quarters come from one law."""
    import numpy as np
    from scipy.stats import bootstrap, mannwhitneyu
    q = max(len(per_token) // 4, 2)
    first, last = np.asarray(per_token[:q]), np.asarray(per_token[-q:])
    ratio = float(np.median(last) / np.median(first))
    ci = bootstrap((first, last), lambda a, b, axis=-1: np.median(b, axis=axis) / np.median(a, axis=axis),
                   n_resamples=2000, vectorized=True, random_state=seed).confidence_interval
    low, high = float(ci.low), float(ci.high)
    return {"ratio": ratio, "ci_low": low, "ci_high": high, "p": float(mannwhitneyu(first, last).pvalue),
            "within_noise": bool(low <= 1.0 <= high or abs(ratio - 1) < DRIFT_BOUND),
            "first_median_ms_per_token": float(np.median(first)) * 1e3, "noise_iqr": _iqr_rel(first)}


def _iqr_rel(xs) -> float:
    import numpy as np
    q1, q3 = np.percentile(xs, [25, 75])
    return float((q3 - q1) / np.median(xs))


def summarize(name: str, records: list[dict], warmup: int) -> dict:
    rss = [r["rss"] for r in records]
    less_buffer = [r["rss"] - r["buffer_bytes"] for r in records]
    malloc = [r["malloc_in_use"] for r in records]
    kept = records[warmup:]
    out = {"part": name, "records": len(records), "warmup": warmup, "rss": growth(rss, warmup),
           "rss_less_buffer": growth(less_buffer, warmup),
           "malloc_in_use": growth(malloc, warmup) if None not in malloc else None,
           "buffer_mib": records[-1]["buffer_bytes"] / 2**20,
           "drift": drift([r["seconds"] / max(r["tokens"], 1) for r in kept]),
           "seconds_median": statistics.median(r["seconds"] for r in kept),
           "not_finite": sorted({k for r in records for k in r["not_finite"]}),
           "undefined": sorted({k for r in records for k in r.get("undefined", [])})}
    if "spec_steps" in records[0]:
        out["spec_steps"], out["drafter_swaps"] = sum(r["spec_steps"] for r in records), records[-1]["swaps"]
    out["memory_within_bound"] = bool(max(out["rss"]["growth"], out["rss"]["peak_growth"]) < GROWTH_BOUND)
    return out


def _row(s: dict) -> dict:
    d = s["drift"]
    return {"part": s["part"], "n": s["records"], "rss@warm MiB": s["rss"]["base_mib"],
            "rss end MiB": s["rss"]["end_mib"], "growth %": 100 * s["rss"]["growth"],
            "peak %": 100 * s["rss"]["peak_growth"], "MiB/100": s["rss"]["slope_mib_per_100"],
            "late MiB/100": s["rss"]["late_slope_mib_per_100"],
            "less buffer %": 100 * s["rss_less_buffer"]["growth"],
            "malloc %": None if s["malloc_in_use"] is None else 100 * s["malloc_in_use"]["growth"],
            "drift": d["ratio"], "drift 95% CI": f"{d['ci_low']:.2f}-{d['ci_high']:.2f}", "p": d["p"],
            "not finite": ",".join(s["not_finite"]) or "none", "undefined": ",".join(s["undefined"]) or "none"}


def machine() -> dict:
    info = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        info.setdefault(key.strip(), value.strip())
    cpu = f"{info.get('model name', platform.processor())} (family {info.get('cpu family')} model {info.get('model')})"
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "load_avg": [round(x, 2) for x in os.getloadavg()]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tlt bench soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/smoke.yaml")
    p.add_argument("--train-steps", type=int, default=200)
    p.add_argument("--warmup-steps", type=int, default=20, help="memory growth is counted from this step on")
    p.add_argument("--generate-calls", type=int, default=1000)
    p.add_argument("--warmup-calls", type=int, default=100)
    p.add_argument("--batch", type=int, default=8, help="prompts a generate call")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--swap-every", type=int, default=25, help="calls between drafter swaps")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for the train parts, e.g. trainer.retain_freed_memory=false (repeatable)")
    p.add_argument("--control-cache-capacity", type=int, default=16,
                   help="the train part again with ONEDNN_PRIMITIVE_CACHE_CAPACITY and LRU_CACHE_CAPACITY at this "
                        "(oneDNN's and ideep's per-shape kernel caches, 1024 entries each by default); -1: not run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results", default=None, help="directory for soak_<machine>_<date>.txt (e.g. docs/results)")
    p.add_argument("--machine", default="cpu", help="machine name in the results file's name, e.g. cpu-zen5")
    args = p.parse_args(argv)
    args.control_cache_capacity = None if args.control_cache_capacity < 0 else args.control_cache_capacity
    if not Path(args.config).is_file():
        print(f"tlt bench soak: {args.config} not found: run from the repository root or pass --config",
              file=sys.stderr)
        return 2
    if args.train_steps < args.warmup_steps + 8 or args.generate_calls < args.warmup_calls + 8:
        print("tlt bench soak: give at least 8 steps and 8 calls after the warm-up", file=sys.stderr)
        return 2
    before = machine()
    runs: dict[str, list[dict]] = {}
    for name, capacity in (("train", None), ("train_small_caches", args.control_cache_capacity)):
        if name != "train" and capacity is None:
            continue
        with tempfile.TemporaryDirectory(prefix="tlt-soak-") as out_dir:
            runs[name] = _in_fresh_process(train_part, args.config, args.train_steps, args.threads, out_dir, capacity,
                                           tuple(args.override))
    runs["engine"] = _in_fresh_process(engine_part, args.generate_calls, args.batch, args.swap_every, args.threads,
                                       args.max_tokens, args.seed)
    parts = [summarize(name, records, args.warmup_calls if name == "engine" else args.warmup_steps)
             for name, records in runs.items()]
    command = "tlt bench soak " + " ".join(argv if argv is not None else sys.argv[1:])
    by_name = {s["part"]: s for s in parts}
    # the train part's growth is accounted for when the control, which differs only in the caches' size, holds
    explained = "train_small_caches" in by_name and by_name["train_small_caches"]["memory_within_bound"]
    payload = {"command": command.strip(), "machine": before, "load_avg_after": [round(x, 2) for x in os.getloadavg()],
               "parts": parts, "train_growth_is_the_kernel_caches": bool(explained),
               "ok": all((s["memory_within_bound"] or (s["part"] == "train" and explained))
                         and s["drift"]["within_noise"] and not s["not_finite"] for s in parts)}
    table = io.StringIO()
    with contextlib.redirect_stdout(table):
        print_table([_row(s) for s in parts], list(_row(parts[0])))
    print(table.getvalue(), end="")
    print_json_line("soak", payload)
    if args.results:
        path = Path(args.results) / f"soak_{args.machine}_{datetime.date.today().isoformat()}.txt"
        path.write_text(f"# {payload['command']}\n# machine: {json.dumps(before)}\n# load average after: "
                        f"{payload['load_avg_after']}\n{table.getvalue()}"
                        f"# the next line: every record (the train parts' one a step, the engine's one a call)\n"
                        f"{json.dumps({'records': runs})}\n{json.dumps({'benchmark': 'soak', **payload})}\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
