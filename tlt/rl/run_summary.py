"""The end of `tlt train`: time the next rollout with speculation off and on, write the run report, print a summary.

`compare_sd` runs the rollout the next step would sample (`next_rollout`: the next training prompts, that step's
seeds) twice, on the trained policy: once on a plain engine built on the same weights (no SD) and once on the
training engine (adaptive SD with the current drafter and the bandit as it ended the run). Both are exact samplers
of the same policy: seeded requests give the same tokens. The drafter has never trained on these responses.
Re-running the final step's rollout instead would decode responses the online drafter had just trained on and the
n-gram drafter's history holds, and overstate what SD gives a run (docs/design.md §11).
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from tlt.llm import LLM
from tlt.rl.rollout import rollout_request


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
        # about 10% for ~20 s, inside the second timed rollout (docs/design.md §11)
        os.sync()
    # plain decoding of the very weights the SD engine decodes (rollout_model: a bf16 copy by default on bf16 CPUs)
    plain = LLM(model=trainer.rollout_model, tokenizer=trainer.tokenizer, **trainer.cfg.engine_args())

    def timed(llm) -> tuple[float, list[list[int]]]:
        t0 = time.perf_counter()
        outs = llm.generate(prompt_token_ids=ids, sampling_params=params)
        return time.perf_counter() - t0, [list(c.token_ids) for o in outs for c in o.outputs]

    without_s, without = timed(plain)
    trainer.llm.spec.reset_stats()
    with_s, with_sd = timed(trainer.llm)
    with_tokens, without_tokens = sum(map(len, with_sd)), sum(map(len, without))
    spec = trainer.llm.spec.stats()
    return {"with_sd_s": round(with_s, 3), "without_sd_s": round(without_s, 3),
            "speedup": round(without_s / max(with_s, 1e-9), 3),
            "tokens_per_s_with_sd": round(with_tokens / max(with_s, 1e-9), 1),
            "tokens_per_s_without_sd": round(without_tokens / max(without_s, 1e-9), 1),
            "rl_step": trainer.cfg.trainer.total_steps + 1,
            "num_prompts": len(ids), "n": params[0].n if params else 0,
            "tokens_with_sd": with_tokens, "tokens_without_sd": without_tokens,
            "same_tokens": with_sd == without,  # seeded requests: SD must not change what is sampled
            "accept_length": _finite(spec["spec_accept_length"]), "spec_on_fraction": round(spec["spec_on_fraction"], 3),
            "accept_length_by_bucket": spec["spec_accept_length_by_bucket"], "arm_counts": spec["spec_arm_counts"],
            "drafter_version": trainer.llm.spec.drafter_version}


def next_rollout(trainer) -> tuple[list, list]:
    """(prompts, sampling params) of this rank's share of the rollout step total_steps + 1 would sample: the next
    training prompts (the data stream does not move) and that step's seeds, without hidden states."""
    return rollout_request(trainer.train_data.peek_batch(), trainer.cfg, trainer.cfg.trainer.total_steps + 1, 0,
                           trainer.dist.rank, trainer.prompts_per_rank)


def _finite(x: float) -> float | None:
    """Rounded, or None when undefined (no verify step ran: the bandit chose "off" throughout)."""
    return round(x, 3) if math.isfinite(x) else None


def finish_run(trainer, summary: dict[str, Any]) -> dict[str, Any]:
    """sd_compare.json, report.html, and the closing lines on the console; returns the summary with extras added."""
    from tlt.report import make_report
    cfg, run_dir = trainer.cfg, Path(trainer.run_dir)
    cmp = compare_sd(trainer)
    if cmp is not None:
        (run_dir / "sd_compare.json").write_text(json.dumps(cmp, indent=2) + "\n")
        summary |= {"sd_speedup": cmp["speedup"], "sd_accept_length": cmp["accept_length"]}
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
    if summary.get("drafter_version") is not None:
        lines.append(f"  drafter: {summary['drafter_version']:.0f} versions published online")
    if cmp is not None:
        accept = (f"accept length {cmp['accept_length']:.2f}" if cmp["accept_length"] is not None else
                  "no SD step: plain decoding chosen in every bucket")
        lines.append(f"  next rollout (fresh prompts) without SD {cmp['without_sd_s']:.1f} s, "
                     f"with adaptive SD {cmp['with_sd_s']:.1f} s ({cmp['speedup']:.2f}x), {accept}")
    lines.append(f"  report: {report}")
    print("\n".join(lines), flush=True)
    return summary
