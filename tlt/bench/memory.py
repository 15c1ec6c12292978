"""Memory: the per-device plan of `tlt plan` beside the measured peak of real GRPO steps, per phase.

    tlt bench memory [CONFIG.yaml] [--steps 2] [key=value ...]
    tlt bench memory configs/smoke.yaml actor.gradient_checkpointing=true
    torchrun --nproc_per_node 2 -m tlt bench memory configs/smoke.yaml actor.strategy=fsdp

Runs --steps GRPO steps of the config (a GRPOTrainer, as `tlt train` builds it) and measures the peak live tensor
bytes of each phase on every rank (tlt.bench.memory_meter: CUDA's allocator counters on a GPU, the CPU allocator's
running total through the profiler on CPU) with the process's peak RSS beside it on CPU. The plan of each phase
(tlt.plan.memory_plan, docs/design.md §16) is printed next to it with the ratio measured / plan; the overall row
is the largest phase. A phase's figure is its largest over the steps (the first step has no gradients or AdamW
state before its update). Forced for the measurement: no validation or checkpoint before the last step, and
drafter_train.spot=false (the spot trainer's thread is not the trainer's, which the CPU meter follows). Prints a
table, then one JSON line. A benchmark, not a test: it asserts nothing about the numbers.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist

from tlt.bench.common import print_json_line, print_table

# trainer phase -> reported name (the RL step's order)
PHASES = {"gen": "rollout", "old_log_prob": "old_log_prob", "ref": "ref_log_prob", "update_actor": "update",
          "weight_sync": "weight_sync", "drafter": "drafter"}
MiB = 2**20


def measurement_overrides(steps: int, out_dir: str) -> list[str]:
    return [f"trainer.total_steps={steps}", "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.resume=disable",
            f"trainer.default_local_dir={out_dir}", "trainer.logger=[jsonl]", "drafter_train.spot=false"]


def measure(config_path: str | None, overrides: list[str], steps: int, out_dir: str) -> dict:
    """Build the trainer and run `steps` steps under the meter -> this rank's figures and the plan's."""
    from tlt.bench.memory_meter import PhaseMemory
    from tlt.config import load_config
    from tlt.models.loader import read_config
    from tlt.plan import memory_plan
    from tlt.rl.trainer import GRPOTrainer, config_device

    cfg = load_config(config_path, overrides + measurement_overrides(steps, out_dir))
    device = config_device(cfg)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    memory = PhaseMemory(device)
    memory.start()
    trainer = GRPOTrainer(cfg)             # cfg resolved in place: model path, data files, drafter
    trainer.phase_timer = memory.timer
    trainer.fit()
    peaks = memory.finish()
    longest_prompt = max(len(e.prompt_ids) for e in trainer.train_data.examples)
    plan = memory_plan(trainer.cfg, read_config(trainer.cfg.model.path), trainer.dist.world_size,
                       prompts_per_rank=trainer.prompts_per_rank, prompt_len=longest_prompt)
    phases = {}
    for phase, name in PHASES.items():
        if phase in peaks.tensor:
            planned = plan.phase_bytes(name)
            phases[name] = {"plan": planned, "measured": peaks.tensor[phase], "rss": peaks.rss.get(phase),
                            "ratio": round(peaks.tensor[phase] / planned, 4) if planned else None}
    overall = max(plan.phase_bytes(name) for name in phases)
    phases["overall"] = {"plan": overall, "measured": peaks.overall, "rss": peaks.overall_rss,
                         "ratio": round(peaks.overall / overall, 4) if overall else None}
    # building the trainer (loading, the engine's copy): the plan's load phase beside the meter's first segment,
    # which also holds the engine, tokenizer and data set-up the plan does not count
    load = plan.phase_bytes("load")
    phases["load"] = {"plan": load, "measured": peaks.init, "rss": None,
                      "ratio": round(peaks.init / load, 4) if load else None}
    return {"rank": trainer.dist.rank, "device": str(device), "init": peaks.init,
            "step_s": [round(t, 3) for t in memory.step_seconds], "longest_prompt": longest_prompt, "phases": phases,
            "plan_rows": [{"component": r.name, "bytes": r.bytes, "phases": sorted(r.phases), "where": r.where}
                          for r in plan.rows],
            "world_size": trainer.dist.world_size, "strategy": trainer.cfg.actor.strategy}


def _mib(x: int | None) -> float | None:
    return None if x is None else x / MiB


def report(ranks: list[dict], config: str | None, overrides: list[str], steps: int) -> dict:
    rows = []
    for r in ranks:
        for name, v in r["phases"].items():
            rows.append({"rank": r["rank"], "phase": name, "plan_MiB": _mib(v["plan"]),
                         "measured_MiB": _mib(v["measured"]), "ratio": v["ratio"], "rss_MiB": _mib(v["rss"])})
    first = ranks[0]
    print(f"{first['strategy']} on {first['world_size']} rank(s), {first['device']}, {steps} step(s); the plan's "
          "components (MiB): " + ", ".join(f"{p['component']} {p['bytes'] / MiB:.2f}"
                                            + (" (host)" if p["where"] == "host" else "")
                                            for p in first["plan_rows"]))
    print_table(rows, ["rank", "phase", "plan_MiB", "measured_MiB", "ratio", "rss_MiB"])
    ratios = [v["ratio"] for r in ranks for name, v in r["phases"].items() if v["ratio"] is not None and name != "load"]
    worst = max(ratios, key=lambda x: abs(x - 1.0)) if ratios else None
    return {"config": config, "overrides": overrides, "steps": steps, "device": first["device"],
            "strategy": first["strategy"], "world_size": first["world_size"], "worst_ratio": worst, "ranks": ranks}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tlt bench memory", description=__doc__.split("\n\n")[0])
    ap.add_argument("args", nargs="*", help="[CONFIG.yaml] then key=value overrides")
    ap.add_argument("--steps", type=int, default=2, help="GRPO steps to run (default 2: the second has AdamW state)")
    ap.add_argument("--out", default=None, help="run directory root (default: a temporary directory, removed)")
    ns = ap.parse_intermixed_args(argv)
    config = ns.args[0] if ns.args and "=" not in ns.args[0] else None
    overrides = ns.args[1:] if config else ns.args
    if ns.steps < 1:
        print("tlt bench memory: --steps must be >= 1", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="tlt_bench_memory_") as tmp:
        mine = measure(config, overrides, ns.steps, ns.out or tmp)
        ranks = [mine]
        if dist.is_initialized():
            ranks = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, mine)
            dist.destroy_process_group()
    if mine["rank"] == 0:
        print_json_line("memory", report(ranks, config, overrides, ns.steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
