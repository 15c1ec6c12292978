"""Shared benchmark helpers: prompts from the default task, timing, the table and the final JSON line."""
from __future__ import annotations

import json
import statistics
import time
from typing import Callable


TASKS = ("default", "longtail")  # the benchmarks' prompt sets: tlt.tasks.default_task, tlt.tasks.longtail_sort


def default_task_prompt_ids(tokenizer, n: int, seed: int = 0, task: str = "default") -> list[list[int]]:
    """Chat-templated prompts of a built-in task (what rollouts see): the default task (needs reasoning-gym) or
    the long-tail sorting task (tlt's own generator)."""
    if task == "longtail":
        from tlt.tasks.longtail_sort import make_examples
    elif task == "default":
        from tlt.tasks.default_task import make_examples
    else:
        raise ValueError(f"unknown task {task!r}: use one of {TASKS}")
    rows = list(make_examples("train", n, seed))
    out = []
    for r in rows:
        text = tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


def median_time(fn: Callable[[], object], repeats: int) -> tuple[float, float, float, object]:
    """(median, min, max) seconds over `repeats` runs after one untimed warm-up, plus the last result."""
    t = interleaved_times({"fn": fn}, repeats)["fn"]
    return t["median"], t["min"], t["max"], t["result"]


def interleaved_times(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, dict]:
    """Time several configurations round-robin with the order rotated every round (A B C, B C A, C A B, ...), so
    neither machine drift nor the slot a configuration runs in favours one: one untimed warm-up round, then
    `repeats` timed rounds. Per name: median/min/max seconds, the per-round times and the last result;
    `paired_ratios` compares two names round by round."""
    for fn in fns.values():
        fn()
    names = list(fns)
    times: dict[str, list[float]] = {k: [] for k in fns}
    results: dict[str, object] = {}
    for r in range(repeats):
        shift = r % len(names)
        for k in names[shift:] + names[:shift]:
            t0 = time.perf_counter()
            results[k] = fns[k]()
            times[k].append(time.perf_counter() - t0)
    return {k: {"median": statistics.median(v), "min": min(v), "max": max(v), "times": v, "result": results[k]}
            for k, v in times.items()}


def paired_ratios(base: list[float], other: list[float]) -> list[float]:
    """base_time / other_time round by round (rounds paired: drift between rounds cancels; their median is a
    speedup)."""
    return [b / o for b, o in zip(base, other)]


def median_ci(values: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """(low, high, coverage): a distribution-free confidence interval for the median of `values` from their order
    statistics (the sign test's interval, `sign_test_rank`)."""
    xs = sorted(values)
    if not xs:
        raise ValueError("median_ci needs at least one value")
    k, coverage = sign_test_rank(len(xs), level)
    return xs[k - 1], xs[len(xs) - k], coverage


def sign_test_rank(n: int, level: float = 0.95) -> tuple[int, float]:
    """(k, coverage) of the narrowest interval [x_(k), x_(n+1-k)] of n sorted values whose coverage of their median,
    from the binomial law of how many fall below it, is at least `level`; with too few values for that, the full
    range (k = 1) and its smaller coverage (5 values: 0.94; 9 values give k = 2 at 0.96)."""
    from scipy.stats import binom
    k = 1  # move the lower end inwards while the coverage stays >= level
    while k + 1 <= n - k and 1 - 2 * binom.cdf(k, n, 0.5) >= level:
        k += 1
    return k, float(1 - 2 * binom.cdf(k - 1, n, 0.5))


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns}
    print("  ".join(c.rjust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).rjust(widths[c]) for c in columns))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.2f}"
    return "-" if v is None else str(v)


def print_json_line(name: str, payload: dict) -> None:
    print(json.dumps({"benchmark": name, **payload}))
