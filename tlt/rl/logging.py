"""Metric sinks (console progress bar, metrics.jsonl, TensorBoard, wandb) and per-phase timers.

    timer = PhaseTimer()
    with timer("gen"): ...                    # -> timing_s/gen
    logger = MetricsLogger(cfg.trainer, run_dir, total_steps=20)
    logger.log(step, {**metrics, **timer.metrics()})

Only rank 0 builds a MetricsLogger with sinks (see `enabled`). wandb is imported only when trainer.logger asks
for it. Metric names follow verl: actor/*, critic/score/*, response_length/*, timing_s/*, throughput/*, val/*.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterator

import numpy as np
from tqdm import tqdm

from tlt.config import Config, TrainerConfig, config_to_dict

# Live figures shown on the progress bar: (metric, short label)
BAR_FIELDS = (("critic/score/mean", "reward"), ("response_length/mean", "len"), ("timing_s/step", "step_s"),
              ("val/accuracy", "val"), ("rollout/spec_accept_length", "accept"), ("drafter/version", "drafter_v"))


class PhaseTimer:
    """Wall-clock seconds per named phase of one RL step (re-entering a phase adds to it)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"timing_s/{k}": v for k, v in self.seconds.items()}


def _jsonable(value: float) -> float | None:
    return value if math.isfinite(value) else None


def drop_rows_after(path: Path, step: int) -> None:
    """Keep only the rows of a {"step": ...} JSON-lines file up to `step` (atomically; a torn last line goes too)."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a kill
        if isinstance(row, dict) and row.get("step", 0) <= step:
            kept.append(line)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


class MetricsLogger:
    def __init__(self, cfg: TrainerConfig, run_dir: str | Path, total_steps: int, start_step: int = 0,
                 enabled: bool = True, full_config: Config | None = None):
        self.sinks = set(cfg.logger) if enabled else set()
        self.run_dir = Path(run_dir)
        self.bar = None
        self.shown: dict[str, str] = {}  # live figures on the bar; a value stays until a newer one arrives
        self.jsonl = None
        self.lengths = None  # response_lengths.jsonl: {"step", "lengths": [...]} per step (the report's box plot)
        self.tb = None
        self.wandb = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if "console" in self.sinks:
            self.bar = tqdm(total=total_steps, initial=start_step, desc="rl steps", unit="step", dynamic_ncols=True)
        if "jsonl" in self.sinks:
            if cfg.resume != "disable":  # rows past the checkpoint (all, without one) belong to steps run again
                for name in ("metrics.jsonl", "response_lengths.jsonl"):
                    drop_rows_after(self.run_dir / name, start_step if start_step > 0 else -1)
            self.jsonl = open(self.run_dir / "metrics.jsonl", "a")
            self.lengths = open(self.run_dir / "response_lengths.jsonl", "a")
        if "tensorboard" in self.sinks:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))
        if "wandb" in self.sinks:
            try:
                import wandb
            except ImportError:
                raise ImportError("trainer.logger includes 'wandb' but wandb is not installed: `pip install wandb`, "
                                  "or remove 'wandb' from trainer.logger") from None
            self.wandb = wandb.init(project=cfg.project_name, name=cfg.experiment_name, dir=str(self.run_dir),
                                    config=config_to_dict(full_config) if full_config else None, resume="allow")

    def log(self, step: int, metrics: dict[str, float], advance: bool = True) -> None:
        """One step's metrics to every sink; advance=False logs without moving the bar (step 0: before training)."""
        if self.bar is not None:
            self.shown.update({label: f"{metrics[k]:.3g}" if math.isfinite(metrics[k]) else "-"  # nan: no SD step
                               for k, label in BAR_FIELDS if k in metrics})
            self.bar.set_postfix(self.shown, refresh=not advance)
            if advance:
                self.bar.update(1)
        if self.jsonl is not None:
            self.jsonl.write(json.dumps({"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}) + "\n")
            self.jsonl.flush()
        if self.tb is not None:
            for k, v in metrics.items():
                self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)

    def log_lengths(self, step: int, lengths: list[int]) -> None:
        if self.lengths is not None:
            self.lengths.write(json.dumps({"step": step, "lengths": lengths}) + "\n")
            self.lengths.flush()

    def write(self, text: str) -> None:
        """A console line that does not break the progress bar."""
        if self.bar is not None:
            self.bar.write(text)
        elif "console" in self.sinks:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.jsonl is not None:
            self.jsonl.close()
            self.lengths.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def _is_per_rank_count(key: str) -> bool:
    """Counts that each rank makes of its own responses (summed); other num_* values agree on all ranks."""
    return ((key.startswith("reward/") and ("/num_" in key or "/total_" in key))
            or key.startswith("rollout/num_") or key == "data/num_dropped_groups")


def reduce_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Combine ranks' metrics: timings and */max take the max, */min the min, per-rank counts sum, the rest
    average."""
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for m in per_rank for k in m):
        values = [m[key] for m in per_rank if key in m]
        if key.startswith("timing_s/") or key.endswith("/max"):
            out[key] = max(values)
        elif key.endswith("/min"):
            out[key] = min(values)
        elif _is_per_rank_count(key):
            out[key] = sum(values)
        else:
            out[key] = sum(values) / len(values)
    return out


def rollout_metrics(scores: list[float], advantages: list[float], response_lens: list[int], prompt_lens: list[int],
                    clipped: list[bool]) -> dict[str, float]:
    """verl's critic/*, response_length/* and prompt_length/* over all ranks' responses."""
    s, a, r = np.asarray(scores or [0.0]), np.asarray(advantages or [0.0]), np.asarray(response_lens or [0])
    out = {"critic/score/mean": s.mean(), "critic/score/max": s.max(), "critic/score/min": s.min(),
            "critic/advantages/mean": a.mean(), "critic/advantages/max": a.max(), "critic/advantages/min": a.min(),
            "response_length/mean": r.mean(), "response_length/max": r.max(), "response_length/min": r.min(),
            "response_length/p50": np.percentile(r, 50), "response_length/p90": np.percentile(r, 90),
            # the long tail's weight: how much longer the slowest rows are than the typical one
            "response_length/p90_over_p50": np.percentile(r, 90) / max(np.percentile(r, 50), 1.0),
            "response_length/max_over_p50": r.max() / max(np.percentile(r, 50), 1.0),
            "response_length/clip_ratio": float(np.mean(clipped)) if clipped else 0.0,
            "prompt_length/mean": float(np.mean(prompt_lens)) if prompt_lens else 0.0}
    return {k: float(v) for k, v in out.items()}


def flat_numbers(prefix: str, stats: dict[str, Any]) -> dict[str, float]:
    """Numeric leaves of nested dicts (e.g. llm.stats()) as {prefix + "a/b": value}."""
    out: dict[str, float] = {}
    for k, v in stats.items():
        if isinstance(v, dict):
            out.update(flat_numbers(f"{prefix}{k}/", v))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[f"{prefix}{k}"] = float(v)
    return out
