"""Device profile: what a forward costs on this machine, for the speculation policy's virtual clock.

    tlt bench profile [--model smollm2-135m|DIR] [--dtype auto] [--threads 0] [--context 256] [--repeats 5]
                      [--name cpu-mine] [--out profile.json]

Times the target's cached forward with its LM head (a decode or verify step) and the drafter's forward with its
draft head, by rows (1..64) and new tokens a row (1..17) over --context cached tokens a row; then a plain engine
step's and an SD step's host time beyond those forwards, and an n-gram proposal's per row. The result is a
"table" device profile (tlt.engine.cost_model): --out writes it as a device_profiles.json file holding it under
--name, for `tlt bench policy --profiles FILE --profile NAME`. Prints a table and a final JSON line.
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time

import torch

import tlt
from tlt.bench.common import print_json_line, print_table
from tlt.device import resolve_device
from tlt.engine.clock import VirtualClock
from tlt.engine.cost_model import CostModel
from tlt.engine.kv_cache import KVCache
from tlt.speculative.drafter import Drafter

ROWS = [1, 2, 4, 8, 16, 32, 64]
TOKENS = [1, 2, 3, 5, 9, 17]
DRAFT_VOCAB = 8192  # the default warm-up drafter's reduced vocabulary (drafter_train.warmup build)


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="tlt bench profile", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="smollm2-135m (the default model) or an HF directory")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads; 0 = torch's default")
    ap.add_argument("--context", type=int, default=256, help="cached tokens a row during the timed forwards")
    ap.add_argument("--repeats", type=int, default=5, help="rounds, each timing every cell once (a cell's median is kept)")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)))
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--name", default=f"cpu-{platform.node() or 'this'}")
    ap.add_argument("--out", default=None, help="write {name: profile} as JSON here")
    args = ap.parse_args(argv)
    args.rows = sorted(int(x) for x in args.rows.split(","))
    args.tokens = sorted(int(x) for x in args.tokens.split(","))
    if len(args.rows) < 2 or len(args.tokens) < 2 or args.rows[0] < 1 or args.tokens[0] < 1 or args.context < 1:
        ap.error("--rows and --tokens need at least two positive values each, --context a positive one")
    return args


def _median_s(fn, repeats: int) -> float:
    fn(); fn()  # warm-up (first calls pack weights)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _interleaved_medians(cells: dict, repeats: int) -> dict:
    """Each cell's median over `repeats` rounds, a round timing every cell once, in an order shuffled each round: a
    slow minute of a shared machine lands in one sample of every cell, not in all of a few cells, and no cell always
    follows the same one (a small forward after a large one finds the caches cold)."""
    for fn in cells.values():
        fn(); fn()  # warm-up (first calls pack weights)
    times = {key: [] for key in cells}
    order = list(cells)
    for r in range(repeats):
        random.Random(r).shuffle(order)
        for key in order:
            fn = cells[key]
            t0 = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t0)
    return {key: statistics.median(ts) for key, ts in times.items()}


def _model_path(name: str):
    if name == "smollm2-135m":
        from tlt.models.smollm import default_model_path
        return default_model_path()
    return name


def measure(args) -> dict:
    device = resolve_device("cpu")
    llm = tlt.LLM(_model_path(args.model), dtype=args.dtype, device=str(device), max_num_seqs=max(args.rows))
    model, engine = llm.model, llm.engine
    g = torch.Generator().manual_seed(0)
    V, H = model.cfg.vocab_size, model.cfg.hidden_size
    # rows holding --context cached tokens each, each reserving a response as long (a rollout's cache, not the context
    # limit: attention off the C kernels reads the whole capacity)
    for _ in range(max(args.rows)):
        engine.add_request(torch.randint(1, V, (args.context,), generator=g).tolist(),
                           tlt.SamplingParams(temperature=0, max_tokens=args.context, ignore_eos=True))
    while len(engine.running) < max(args.rows):  # prefill
        engine.step()
    running = engine.running
    drafter = Drafter(model.cfg).attach(model).to(engine.dtype).eval()
    drafter.d2t = torch.arange(min(DRAFT_VOCAB, V))
    dcache = KVCache(model.cfg, max(args.rows), engine.dtype, device, num_layers=1)
    dcache.ensure_capacity(args.context + max(args.tokens) + 1, max(args.rows))

    def target(B, T):  # the verify forward of T tokens a row over the rows' caches (not committed), its logits
        ids = torch.randint(1, V, (B, T), generator=g)
        depths = torch.arange(T).expand(B, T)
        mask = torch.ones(B, T, T, dtype=torch.bool).tril() if T > 1 else None
        return lambda: model.logits(engine.tree_forward(running[:B], ids, depths, mask).flatten(0, 1))

    def draft(B, T):
        ids, hid = torch.randint(1, V, (B, T), generator=g), torch.randn(B, T, H, dtype=engine.dtype)
        lens = torch.full((B,), args.context)
        mask = torch.ones(B, T, T, dtype=torch.bool).tril() if T > 1 else None
        return lambda: drafter(hid, ids, lens[:, None] + torch.arange(T), dcache.view(lens, tree_mask=mask))

    def head(B, T):
        hid = torch.randn(B, T, H, dtype=engine.dtype)
        return lambda: drafter.logits(hid)

    with torch.inference_mode():
        table = _interleaved_medians({(part, B, T): make(B, T) for part, make in
                                      (("target", target), ("drafter", draft), ("draft_head", head))
                                      for B in args.rows for T in args.tokens}, args.repeats)
    table = {part: [[table[part, B, T] for T in args.tokens] for B in args.rows]
             for part in ("target", "drafter", "draft_head")}
    profile = {"kind": "table", "source": source_line(args, engine), "rows": args.rows, "tokens": args.tokens,
               **{f"{part}_s": t for part, t in table.items()},
               "ngram_row_s": _ngram_row_s(args.context), "overhead_s": {"prefill": 0.0, "plain": 0.0, "sd": 0.0}}
    profile["overhead_s"].update(_overheads(llm, profile, args))
    return profile


def _ngram_row_s(context: int) -> float:
    from tlt.speculative.ngram import NgramDrafter
    g = torch.Generator().manual_seed(1)
    ngram = NgramDrafter()
    seqs = [torch.randint(1, 64, (context,), generator=g).tolist() for _ in range(16)]
    for i, s in enumerate(seqs):
        ngram.register(i, i // 4, i // 4, s)
    return _median_s(lambda: [ngram.propose(i, 4) for i in range(16)], 5) / 16


def _overheads(llm, profile: dict, args) -> dict[str, float]:
    """A plain and an SD (depth-2 chain) engine step's wall time less what the profile charges their forwards."""
    from tlt.speculative.config import SpecConfig
    from tlt.speculative.spec_decoder import SpecDecoder
    costs = CostModel(profile, llm.model.cfg, min(DRAFT_VOCAB, llm.model.cfg.vocab_size))
    out = {}
    for kind, bs in (("plain", 4), ("sd", 4)):
        engine = tlt.LLM(llm.model, dtype=args.dtype, device="cpu", max_num_seqs=bs).engine
        if kind == "sd":
            drafter = Drafter(llm.model.cfg)
            drafter.d2t = torch.arange(min(DRAFT_VOCAB, llm.model.cfg.vocab_size))
            SpecDecoder(engine, SpecConfig(adaptive=False, num_speculative_tokens=2, bs_threshold=None), drafter)
        for _ in range(bs):
            engine.add_request(list(range(1, args.context + 1)), tlt.SamplingParams(temperature=0, max_tokens=args.context,
                                                                                     ignore_eos=True))
        engine.step()  # prefill
        gaps = []
        for i in range(3 + args.repeats):
            engine.use_clock(VirtualClock(costs))
            t0 = time.perf_counter()
            engine.step()
            if i >= 3:  # after warm-up steps
                gaps.append(time.perf_counter() - t0 - engine.clock.now)
        out[kind] = max(statistics.median(gaps), 0.0)
    return out


def source_line(args, engine) -> str:
    cpu = ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"tlt bench profile --model {args.model} --dtype {args.dtype} --context {args.context} --repeats "
            f"{args.repeats} on {cpu or platform.processor() or 'a CPU'}, {torch.get_num_threads()} threads, "
            f"torch {torch.__version__}, {engine.dtype}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(argv or []))
    if args.threads:
        torch.set_num_threads(args.threads)
    profile = measure(args)
    rows = [{"rows": B, **{f"target_T{T}_ms": 1e3 * profile["target_s"][i][j] for j, T in enumerate(args.tokens)},
             **{f"drafter_T{T}_ms": 1e3 * profile["drafter_s"][i][j] for j, T in enumerate(args.tokens)},
             **{f"head_T{T}_ms": 1e3 * profile["draft_head_s"][i][j] for j, T in enumerate(args.tokens)}}
            for i, B in enumerate(args.rows)]
    print(profile["source"])
    print_table(rows, list(rows[0]))
    print("overheads (ms): " + ", ".join(f"{k} {1e3 * v:.2f}" for k, v in profile["overhead_s"].items()) +
          f"; n-gram proposal {1e6 * profile['ngram_row_s']:.1f} us a row")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({args.name: profile}, f, indent=1)
    print_json_line("profile", {"name": args.name, "profile": profile})
    return 0
