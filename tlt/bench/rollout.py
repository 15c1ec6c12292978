"""Rollout-only benchmark over the long tail: one RL rollout of the default task, SD off / always / adaptive / n-gram.

    tlt bench rollout [--prompts 8] [--n 4] [--max-tokens 256] [--repeats 1] [--threads 1] [--quick]
                      [--temperature 1.0] [--device auto|cpu|cuda] [--dtype float32|bfloat16|auto]

One rollout = `--prompts` default-task chat prompts, `--n` samples each (GRPO groups), --temperature, stopping at
EOS or --max-tokens: the batch starts full and shrinks as responses finish, so its tail runs at small batch.
Modes, all with the same seeds: the drafter-invariant verification makes SD sample the very tokens plain decoding
samples, so every mode does the same work (`same_as_off`: the fraction of responses equal to off's, token for
token; a float rounding difference between the verify and decode forwards can, rarely, move a draw across a token
boundary). tok_x = tok_s / tok_s of off.
    off       plain decoding
    always    EAGLE, one fixed chain of --depth at every batch size (bs_threshold=None)
    adaptive  EAGLE, SD gated on the running batch (--bs-threshold) with the adaptive policy over the arm table
    ngram     n-gram drafts only, at every batch size
Drafter: --drafter, else the model's cached warm-up drafter; without one the EAGLE modes are skipped (said so).
Repeats run the modes interleaved (A B C D A B C D ...), each repeat with new seeds (the same in every mode);
speedup is the median over repeats of off's wall time over the mode's. Reports wall time, tokens/s, accept length
overall and per batch-size bucket, SD-on fraction and decode time split into bulk (SD gated off) and tail. Prints
a table, then one JSON line.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import tlt
from tlt.bench.common import TASKS, default_task_prompt_ids, print_json_line, print_table
from tlt.device import resolve_device, resolve_dtype

MODES = ("off", "always", "adaptive", "ngram")  # the default set; also always_rej, adaptive_rej (acceptance=rejection)


def spec_configs(drafter: str | None, depth: int, bs_threshold: int | None) -> dict[str, dict | None]:
    s: dict[str, dict | None] = {"off": None}
    if drafter:
        s["always"] = dict(method="eagle", model=drafter, bs_threshold=None, adaptive=False,
                           num_speculative_tokens=depth)
        s["adaptive"] = dict(method="eagle", model=drafter, **({} if bs_threshold is None else
                                                               {"bs_threshold": bs_threshold}))
        # sampled chain drafts with rejection sampling: the same law as SD off, not its very samples
        s["always_rej"] = dict(s["always"], acceptance="rejection")
        s["adaptive_rej"] = dict(s["adaptive"], acceptance="rejection")
    s["ngram"] = dict(method="ngram", bs_threshold=None, adaptive=False, num_speculative_tokens=depth)
    return s


def rollout_once(llm, prompts: list[list[int]], n: int, max_tokens: int, seed: int, temperature: float = 1.0) -> dict:
    from tlt.rl.rollout import sampling_params_for
    params = sampling_params_for(len(prompts), n, temperature, 1.0, -1, max_tokens, seed, first_prompt=0)
    if llm.spec is not None:
        llm.spec.reset_stats()
    before = llm.stats()
    t0 = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, group_ids=list(range(len(prompts))))
    wall = time.perf_counter() - t0
    after = llm.stats()
    ids = [tuple(c.token_ids) for o in outs for c in o.outputs]
    lengths = list(map(len, ids))
    return {"wall_s": wall, "tokens": sum(lengths), "lengths": lengths, "ids": ids,
            "decode_steps": after["num_decode_steps"] - before["num_decode_steps"], "stats": after}


def summarize(runs: list[dict]) -> dict:
    walls = [r["wall_s"] for r in runs]
    last = runs[-1]
    st, lengths = last["stats"], sorted(last["lengths"])
    return {"wall_s": statistics.median(walls), "spread": f"{min(walls):.2f}-{max(walls):.2f}",
            "tokens": statistics.median(r["tokens"] for r in runs),
            "tok_s": sum(r["tokens"] for r in runs) / sum(walls), "decode_steps": last["decode_steps"],
            "len_p50": lengths[len(lengths) // 2], "len_max": lengths[-1],
            "accept_len": st.get("spec_accept_length"), "sd_on": st.get("spec_on_fraction"),
            "bulk_s": st.get("decode_time_bulk_s"), "tail_s": st.get("decode_time_tail_s"),
            "accept_by_bucket": st.get("spec_accept_length_by_bucket"), "arm_counts": st.get("spec_arm_counts")}


ORACLE_SAMPLE = 16  # responses the oracle bound is estimated on (one target forward each)


def oracle_bound(model, prompts: list[list[int]], runs: dict[str, list[dict]], a) -> dict[int, float]:
    """oracle_accept_bound of tlt bench spec on the first mode's first run (plain decoding's, when timed)."""
    from tlt.bench.spec import oracle_accept_bound
    first = runs.get("off") or next(iter(runs.values()))
    pairs = [(prompts[i // a.n], list(ids)) for i, ids in enumerate(first[0]["ids"][:ORACLE_SAMPLE])]
    return oracle_accept_bound(model, pairs, a.depth, topks=(1, 4), temperature=a.temperature)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tlt bench rollout", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="HF model dir (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--drafter", default=None, help="drafter dir (default: the model's cached warm-up drafter)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4, help="samples per prompt (group size)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (> 0)")
    ap.add_argument("--bs-threshold", type=int, default=None, help="adaptive gate (default: SpecConfig's)")
    ap.add_argument("--modes", default=",".join(MODES),
                    help="comma-separated: off, always, adaptive, ngram, always_rej, adaptive_rej (the _rej modes "
                         "sample chain drafts and verify by rejection sampling)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--device", default="auto", help="auto (cuda if available), cpu or cuda")
    ap.add_argument("--dtype", default="float32", help="float32, bfloat16 or auto (bf16 where fast)")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (tlt.LLM(enforce_eager=True))")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--task", default="default", choices=TASKS,
                    help="prompt set: default (the default task) or longtail (tlt.tasks.longtail_sort)")
    ap.add_argument("--quick", action="store_true", help="tiny settings for a smoke run")
    a = ap.parse_args(argv)
    if a.quick:
        a.prompts, a.n, a.max_tokens, a.repeats = 2, 2, 16, 1
    if not a.temperature > 0:
        ap.error(f"--temperature {a.temperature}: must be > 0 (the benchmark samples, and the oracle "
                 "bound divides the logits by it)")
    torch.set_num_threads(a.threads)
    from tlt.models import load_model, load_tokenizer
    from tlt.models.smollm import default_model_path
    model_dir = a.model or str(default_model_path())
    device = resolve_device(a.device)
    model = load_model(model_dir, dtype=resolve_dtype(a.dtype, device), device=str(device))
    tok = load_tokenizer(model_dir)
    drafter, note = a.drafter, f"drafter {a.drafter}"
    if drafter is None:
        from tlt.drafter_train.offline import drafter_cache_dir
        cached = drafter_cache_dir(model_dir)
        if (cached / "provenance.json").is_file():
            drafter, note = str(cached), f"cached warm-up drafter {cached}"
        else:
            note = f"no warm-up drafter at {cached}: EAGLE modes skipped, n-gram only"
    prompts = default_task_prompt_ids(tok, a.prompts, seed=a.seed, task=a.task)
    wanted = a.modes.split(",")
    configs = {m: c for m, c in spec_configs(drafter, a.depth, a.bs_threshold).items() if m in wanted}
    max_len = max(map(len, prompts)) + a.max_tokens
    llms = {m: tlt.LLM(model, tokenizer=tok, max_num_seqs=a.prompts * a.n, max_model_len=max_len, seed=a.seed,
                       speculative_config=c, enforce_eager=a.enforce_eager) for m, c in configs.items()}
    runs: dict[str, list[dict]] = {m: [] for m in configs}
    for rep in range(a.repeats):  # a new seed each repeat (the same for every mode): the n-gram drafter's history
        for m, llm in llms.items():  # of earlier responses must not hold this very rollout
            runs[m].append(rollout_once(llm, prompts, a.n, a.max_tokens, a.seed + 1000 * rep,
                                          a.temperature))
    res = {m: summarize(r) for m, r in runs.items()}
    base_tok_s = res.get("off", {}).get("tok_s")
    for m, v in res.items():
        if "off" in runs:  # seeded requests: every mode but the _rej ones samples SD off's very tokens (invariant)
            pairs = [(x, y) for r, o in zip(runs[m], runs["off"]) for x, y in zip(r["ids"], o["ids"])]
            v["same_as_off"] = sum(x == y for x, y in pairs) / len(pairs)
            v["speedup"] = statistics.median(o["wall_s"] / r["wall_s"] for r, o in zip(runs[m], runs["off"]))
        v["tok_x"] = v["tok_s"] / base_tok_s if base_tok_s else None
    bound = oracle_bound(model, prompts, runs, a)
    for m, v in res.items():
        if v["accept_len"] is not None:
            v["accept_max"], v["oracle_chain"], v["oracle_tree4"] = a.depth + 1, bound.get(1), bound.get(4)
    print(f"model={model_dir} device={device} dtype={a.dtype} prompts={a.prompts} n={a.n} "
          f"max_tokens={a.max_tokens} temperature={a.temperature} threads={a.threads} repeats={a.repeats} "
          f"(median wall, new seeds each repeat; speedup: median paired ratio; tokens: median) | {note}")
    print_table([{"mode": m, **v} for m, v in res.items()],
                ["mode", "wall_s", "spread", "speedup", "tokens", "same_as_off", "tok_s", "tok_x", "decode_steps",
                 "len_p50", "len_max", "accept_len", "oracle_chain", "oracle_tree4", "accept_max", "sd_on", "bulk_s",
                 "tail_s"])
    print(f"accept_max: depth + 1; oracle_chain / oracle_tree4: the accept length an oracle drafter could reach at "
          f"depth {a.depth} with 1 / 4 children per node, estimated on {ORACLE_SAMPLE} of the first run's responses "
          f"(tlt bench spec's oracle_accept_bound)")
    buckets = sorted({b for v in res.values() for b in (v["accept_by_bucket"] or {})}, key=str)
    if buckets:
        print("\naccept length per batch-size bucket:")
        print_table([{"mode": m, **{str(b): (v["accept_by_bucket"] or {}).get(b) for b in buckets}}
                     for m, v in res.items() if v["accept_by_bucket"]], ["mode", *map(str, buckets)])
    print_json_line("rollout", {"model": model_dir, "device": str(device), "dtype": a.dtype, "prompts": a.prompts,
                                "n": a.n, "max_tokens": a.max_tokens, "temperature": a.temperature,
                                "threads": a.threads, "repeats": a.repeats, "drafter": drafter, "drafter_note": note,
                                "modes": res})
    return 0
