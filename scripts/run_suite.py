"""The test suite over N processes (scripts/gpu_bench.sh's tests stage): pytest-xdist's `-n N` where it is
installed, else the test files dealt over N pytest processes, largest first to the least loaded, each process's
output printed whole when all are done. Ends with one JSON line of the counts; exit status 0 when every process
passed (or had nothing to run), else 1.

    python scripts/run_suite.py --jobs 16 -rs                      # the whole suite (pytest's testpaths)
    python scripts/run_suite.py --jobs 2 -rs tests/test_bandit.py tests/test_plan.py
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from importlib.util import find_spec
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COUNTS = ("passed", "failed", "error", "skipped", "deselected", "xfailed", "xpassed")


def counts(output: str) -> dict[str, int]:
    """The figures of pytest's final summary line ("2 failed, 40 passed, 3 skipped in 9.1s")."""
    lines = [line for line in output.splitlines() if re.search(r"\d+ (passed|failed|errors?|skipped)", line)
             and " in " in line]
    found = dict.fromkeys(COUNTS, 0)
    for n, what in re.findall(r"(\d+) (\w+)", lines[-1] if lines else ""):
        key = "error" if what.startswith("error") else what
        if key in found:
            found[key] += int(n)
    return found


def deal(targets: list[str], jobs: int) -> list[list[str]]:
    """Test files or node ids in `jobs` groups of about equal size (their files' bytes stand for run time), largest
    first to the lightest."""
    groups: list[list[str]] = [[] for _ in range(jobs)]
    load = [0] * jobs
    for t in sorted(targets, key=lambda t: -(ROOT / t.split("::")[0]).stat().st_size):
        i = load.index(min(load))
        groups[i].append(t)
        load[i] += (ROOT / t.split("::")[0]).stat().st_size
    return [g for g in groups if g]


def split_args(args: list[str]) -> tuple[list[str], list[str]]:
    """(pytest options, test targets: files or node ids) of the command line; no targets: every tests/test_*.py."""
    options, targets = [], []
    for a in args:
        path = ROOT / a.split("::")[0]
        if not a.startswith("-") and path.exists():
            targets += [str(p.relative_to(ROOT)) for p in sorted(path.glob("test_*.py"))] if path.is_dir() else [a]
        else:
            options.append(a)
    return options, targets or [str(p.relative_to(ROOT)) for p in sorted((ROOT / "tests").glob("test_*.py"))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, required=True, help="pytest processes")
    ns, rest = ap.parse_known_args(argv)
    start = time.perf_counter()
    base = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    if find_spec("xdist") is not None:
        r = subprocess.run(base + ["-n", str(ns.jobs)] + rest, cwd=ROOT, capture_output=True, text=True)
        outputs, rcs, how = [r.stdout + r.stderr], [r.returncode], "pytest-xdist"
    else:
        options, targets = split_args(rest)
        procs = [subprocess.Popen(base + options + group, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True) for group in deal(targets, ns.jobs)]
        outputs = [p.communicate()[0] for p in procs]
        rcs, how = [p.returncode for p in procs], "file groups"
    total = dict.fromkeys(COUNTS, 0)
    for i, out in enumerate(outputs):
        print(f"==== pytest process {i + 1} of {len(outputs)} ({how}), exit status {rcs[i]}\n{out}", flush=True)
        for k, v in counts(out).items():
            total[k] += v
    ok = all(rc in (0, 5) for rc in rcs)  # 5: nothing selected in that process
    print(json.dumps({"bench": "tests", "how": how, "jobs": len(outputs), "rc": rcs, **total,
                      "wall_s": round(time.perf_counter() - start, 1)}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
