"""`tlt bench soak` (tlt.bench.soak), the short version CI runs: both parts run and record what the long soak
judges (resident memory, pace, finite metrics, SD steps and drafter swaps), and its figures tell a rise or a
slowdown from noise. The bounds themselves are the long soak's to judge (docs/results/soak_*): a short run on a
shared machine would only time the machine."""
from __future__ import annotations

import json
import math
import random
from pathlib import Path

from tlt.bench import soak

ROOT = Path(__file__).resolve().parent.parent


def _numbers(obj):
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _numbers(v)
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        yield obj


def test_a_short_soak_records_memory_pace_and_finite_metrics(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("TLT_CACHE", str(tmp_path / "cache"))
    assert soak.main(["--train-steps", "10", "--warmup-steps", "2", "--generate-calls", "24", "--warmup-calls", "8",
                      "--swap-every", "5", "--control-cache-capacity", "-1", "--results", str(tmp_path),
                      "--machine", "test"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    payload = json.loads(next(x for x in lines if x.startswith('{"benchmark": "soak"')))
    parts = {p["part"]: p for p in payload["parts"]}
    assert sorted(parts) == ["engine", "train"]
    assert parts["train"]["records"] == 10 and parts["engine"]["records"] == 24
    assert parts["engine"]["spec_steps"] > 0 and parts["engine"]["drafter_swaps"] == 4
    for part in parts.values():
        assert part["not_finite"] == [], part["not_finite"]
        assert part["rss"]["base_mib"] > 0 and all(math.isfinite(x) for x in _numbers(part))
    written = next(tmp_path.glob("soak_test_*.txt")).read_text().splitlines()
    assert json.loads(written[-1]) == payload
    records = json.loads(next(x for x in written if x.startswith('{"records": ')))["records"]
    assert [r["i"] for r in records["train"]] == list(range(1, 11))


def test_growth_and_drift_tell_a_rise_and_a_slowdown_from_noise():
    rng = random.Random(0)
    flat = [1000 + rng.randint(-5, 5) for _ in range(100)]
    rising = [1000 + 3 * i for i in range(100)]
    assert abs(soak.growth(flat, 20)["growth"]) < 0.02
    assert soak.growth(rising, 20)["growth"] > 0.2 and soak.growth(rising, 20)["slope_mib_per_100"] > 0
    steady = [1.0 + 0.1 * rng.random() for _ in range(80)]
    slowing = [x * (1 + i / 40) for i, x in enumerate(steady)]
    assert soak.drift(steady)["within_noise"]
    slow = soak.drift(slowing)
    assert not slow["within_noise"] and slow["ratio"] > 1.5 and slow["p"] < 0.01
