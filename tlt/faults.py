"""Deterministic fault injection for the fault-tolerance tests (tests/test_faults.py).

    TLT_FAULT_AT=update:3 tlt train configs/smoke.yaml      # SIGKILLs itself during step 3's policy update

The trainer calls `fault_point(phase, step)` at named points of a step; it does nothing unless TLT_FAULT_AT names
that phase and step ("phase:step", several comma-separated). Then the process SIGKILLs itself: no cleanup, no
flushing, exactly what a preempted node or an OOM kill leaves behind.
"""
from __future__ import annotations

import os
import signal

ENV = "TLT_FAULT_AT"
# rollout: after the step's generation; update: after the policy update, before the drafter's turn;
# publish: while publishing a trained drafter into the engine; checkpoint: between a checkpoint's files;
# commit: after a checkpoint's directory is in place, before the latest-step file names it
PHASES = ("rollout", "update", "publish", "checkpoint", "commit")


def parse_fault_spec(spec: str) -> set[tuple[str, int]]:
    """'rollout:2,commit:4' -> {('rollout', 2), ('commit', 4)}; a clear error for anything else."""
    points = set()
    for item in filter(None, (s.strip() for s in spec.split(","))):
        phase, _, step = item.partition(":")
        if phase not in PHASES or not step.isdigit():
            raise ValueError(f"{ENV}={spec!r}: expected phase:step items with phase in {PHASES}, got {item!r}")
        points.add((phase, int(step)))
    return points


def fault_point(phase: str, step: int) -> None:
    """SIGKILL this process if TLT_FAULT_AT names (phase, step); inert otherwise."""
    spec = os.environ.get(ENV)
    if spec and (phase, step) in parse_fault_spec(spec):
        os.kill(os.getpid(), signal.SIGKILL)
