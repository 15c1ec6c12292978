"""The end of `tlt train`: time the next rollout with speculation off and on, say what the online drafter did, write
the run report, print a summary.

`compare_sd` decodes the rollout the next step would sample (`next_rollout`: the next training prompts, that step's
seeds) on the trained policy, on a plain engine built on the same weights (no SD) and on the training engine
(adaptive SD with the current drafter and the policy as it ended the run), interleaved plain, SD, SD, plain
(COMPARE_PAIRS pairs): its speedup is the median of the pairs' ratios, with their range as the noise. Both engines
sample the same tokens (seeded requests; checked). The drafter never trained on these responses, and the n-gram
drafter's history of them is cleared before each SD pass: re-running a rollout it had seen would overstate SD.
`drafter_account` reads the run's metrics: how many rounds ran, what they published, and what the held-out accept
proxy did, or why no round ran.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

from tlt.llm import LLM
from tlt.rl.rollout import rollout_request

COMPARE_PAIRS = 2  # plain/SD pairs of the closing comparison


def compare_sd(trainer) -> dict[str, Any] | None:
    """{with_sd_s, without_sd_s, speedup, accept_length, ...} for the next step's rollout, or None without SD."""
    if trainer.llm.spec is None or trainer.start_step >= trainer.cfg.trainer.total_steps:  # no step ran here
        return None
    if getattr(trainer, "engine_on_host", False) and trainer.device.type == "cuda":
        # a disaggregated trainer rank's engine copy is in host memory (docs/design.md §13): timing it there would
        # not measure the GPU rollout; the replicas' rollout/spec_* metrics cover every step
        print("tlt train: no final SD comparison: the trainer's engine copy is in host memory "
              "(trainer.placement=disaggregated)", flush=True)
        return None
    prompts, params = next_rollout(trainer)
    ids = [ex.prompt_ids for ex in prompts]
    if hasattr(os, "sync"):
        # the checkpoint just saved is dirty in the page cache; flushed 30 s later it slowed a 2-core CPU's decoding
        # about 10% for ~20 s, inside a timed rollout (docs/design.md §11)
        os.sync()
    # plain decoding of the very weights the SD engine decodes (rollout_model: a bf16 copy by default on bf16 CPUs)
    plain = LLM(model=trainer.rollout_model, tokenizer=trainer.tokenizer, **trainer.cfg.engine_args())
    spec = trainer.llm.spec

    def timed(llm) -> tuple[float, list[list[int]]]:
        if llm is trainer.llm:
            spec.ngram.clear_history()  # this rollout's responses are no history of its own
        t0 = time.perf_counter()
        outs = llm.generate(prompt_token_ids=ids, sampling_params=params)
        return time.perf_counter() - t0, [list(c.token_ids) for o in outs for c in o.outputs]

    spec.reset_stats()
    times: dict[str, list[float]] = {"plain": [], "sd": []}
    outputs = {}
    for pair in range(COMPARE_PAIRS):
        for name in (("plain", "sd") if pair % 2 == 0 else ("sd", "plain")):
            seconds, outputs[name] = timed(plain if name == "plain" else trainer.llm)
            times[name].append(seconds)
    ratios = sorted(p / s for p, s in zip(times["plain"], times["sd"]))
    tokens = sum(map(len, outputs["sd"]))
    st = spec.stats()
    return {"speedup": round(statistics.median(ratios), 3), "pair_speedups": [round(r, 3) for r in ratios],
            "with_sd_s": [round(t, 3) for t in times["sd"]], "without_sd_s": [round(t, 3) for t in times["plain"]],
            "tokens_per_s_with_sd": round(tokens / max(statistics.median(times["sd"]), 1e-9), 1),
            "tokens_per_s_without_sd": round(tokens / max(statistics.median(times["plain"]), 1e-9), 1),
            "rl_step": trainer.cfg.trainer.total_steps + 1, "num_prompts": len(ids), "n": params[0].n if params else 0,
            "tokens": tokens,
            "same_tokens": outputs["sd"] == outputs["plain"],  # seeded requests: SD must not change what is sampled
            "accept_length": _finite(st["spec_accept_length"]), "spec_on_fraction": round(st["spec_on_fraction"], 3),
            "accept_length_by_bucket": st["spec_accept_length_by_bucket"], "arm_counts": st["spec_arm_counts"],
            "parked_buckets": spec.policy.parked_buckets(), "drafter_net_saved_s": round(
                st["spec_drafter_net_saved_s"] / COMPARE_PAIRS, 3), "drafter_version": spec.drafter_version}


def drafter_account(run_dir: Path, cfg) -> dict[str, Any] | None:
    """What the online drafter did over the run (from metrics.jsonl, resumed steps included): {rounds,
    drafter_steps, published, refused, reverted, accept_proxy: [first, last], why} or None without online training."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()] \
        if (run_dir / "metrics.jsonl").is_file() else []
    rows = [r for r in rows if "drafter/steps" in r]
    if not rows:
        return None
    ran = [r for r in rows if r["drafter/steps"] > 0]
    published = sum(r.get("drafter/published", 0) for r in ran)
    proxies = [(r["drafter/accept_proxy_old"], r["drafter/accept_proxy"]) for r in ran if "drafter/accept_proxy" in r]
    dt = cfg.drafter_train
    why = None
    if not ran:
        tokens = max((r.get("drafter/buffer_tokens", 0) for r in rows), default=0)
        why = (f"the buffer held {tokens:.0f} tokens, under drafter_train.min_buffer_tokens={dt.min_buffer_tokens}"
               if tokens < dt.min_buffer_tokens else f"no round was due (drafter_train.every_k_steps="
                                                     f"{dt.every_k_steps} over {len(rows)} steps)")
    return {"rounds": len(ran), "drafter_steps": int(sum(r["drafter/steps"] for r in ran)),
            "published": int(published), "refused": len(ran) - int(published),
            "reverted": int(sum(r.get("drafter/reverted", 0) for r in ran)),
            "accept_proxy": [round(proxies[0][0], 3), round(proxies[-1][1], 3)] if proxies else None, "why": why}


def next_rollout(trainer) -> tuple[list, list]:
    """(prompts, sampling params) of this rank's share of the rollout step total_steps + 1 would sample: the next
    training prompts (the data stream does not move) and that step's seeds, without hidden states."""
    return rollout_request(trainer.train_data.peek_batch(), trainer.cfg, trainer.cfg.trainer.total_steps + 1, 0,
                           trainer.dist.rank, trainer.prompts_per_rank)


def _account_line(a: dict) -> str:
    if not a["rounds"]:
        return f"no round ran: {a['why']}"
    line = (f"{a['rounds']} rounds, {a['drafter_steps']} drafter steps; {a['published']} published, {a['refused']} "
            f"refused (held-out accuracy fell), {a['reverted']} undone (worse on the next step's prompts)")
    if a["accept_proxy"]:
        line += f"; held-out accept proxy {a['accept_proxy'][0]:.2f} -> {a['accept_proxy'][1]:.2f}"
    return line


def _finite(x: float) -> float | None:
    """Rounded, or None when undefined (no verify step ran: the policy chose "off" throughout)."""
    return round(x, 3) if math.isfinite(x) else None


def finish_run(trainer, summary: dict[str, Any]) -> dict[str, Any]:
    """sd_compare.json, report.html, and the closing lines on the console; returns the summary with extras added."""
    from tlt.report import make_report
    cfg, run_dir = trainer.cfg, Path(trainer.run_dir)
    cmp = compare_sd(trainer)
    if cmp is not None:
        (run_dir / "sd_compare.json").write_text(json.dumps(cmp, indent=2) + "\n")
        summary |= {"sd_speedup": cmp["speedup"], "sd_speedup_pairs": cmp["pair_speedups"],
                    "sd_accept_length": cmp["accept_length"]}
    account = drafter_account(run_dir, cfg)
    if account is not None:
        summary["drafter"] = account
    recipe = {"model": Path(cfg.model.path).name, "total_steps": cfg.trainer.total_steps,
              "train_batch_size": cfg.data.train_batch_size, "rollout.n": cfg.rollout.n, "actor.lr": cfg.actor.lr,
              "max_response_length": cfg.data.max_response_length, "val_prompts": len(trainer.val_examples),
              "drafter_lr": cfg.drafter_train.lr if summary.get("drafter_version") is not None else None}
    summary |= {"recipe": recipe}
    report = make_report(run_dir, summary)
    summary["report"] = str(report)

    lines = [f"tlt train: {summary['steps']} steps in {summary['wall_s']:.0f} s ({run_dir})"]
    before, after = summary.get("initial_val_accuracy"), summary.get("final_val_accuracy")
    if before is not None and after is not None:
        lines.append(f"  held-out accuracy (greedy, {len(trainer.val_examples)} prompts): {before:.3f} -> {after:.3f}")
    lines.append("  recipe: " + ", ".join(f"{k}={v}" for k, v in recipe.items() if v is not None))
    if account is not None:
        lines.append("  online drafter: " + _account_line(account))
    if cmp is not None:
        accept = (f"accept length {cmp['accept_length']:.2f} on {100 * cmp['spec_on_fraction']:.0f}% of the decode "
                  f"steps" if cmp["accept_length"] is not None else "no SD step: plain decoding chosen in every bucket")
        parked = f"; SD parked (no arm paid) at {', '.join(cmp['parked_buckets'])}" if cmp["parked_buckets"] else ""
        lines.append(f"  next rollout (fresh prompts), {COMPARE_PAIRS} interleaved pairs: adaptive SD "
                     f"{cmp['speedup']:.2f}x plain decoding (pairs {', '.join(f'{r:.2f}' for r in cmp['pair_speedups'])}"
                     f"x: the spread is this machine's noise), {accept}{parked}; the drafter's steps saved "
                     f"{cmp['drafter_net_saved_s']:+.1f} s a rollout")
    lines.append(f"  report: {report}")
    print("\n".join(lines), flush=True)
    return summary
