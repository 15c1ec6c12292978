"""Step clocks: what one engine step cost, on the device's own clock or on a cost model's.

The engine times every decode step with a clock and hands the seconds to the speculator's policy. The clock is
injected (`LLMEngine(clock=...)`, `tlt.LLM(clock=...)`), so the policy never reads time itself:
  - WallClock: host time on a CPU; on CUDA, events recorded in the step's stream at its start, at each phase's end
    and after the last op it queued (the commit's K/V moves and hidden-state copies included), read once that op has
    run. A host timer stopped at the step's last host read would bill that trailing work to the next step.
  - VirtualClock: every forward a step runs is charged by a CostModel (tlt.engine.cost_model) for its rows, tokens
    per row and context, so the CPU's real engine and drafter decode as they would on another device's costs,
    deterministically (the policy's behavioural tests, `tlt bench policy`).
Callers report each forward with `forward(part, rows, tokens, context)` (part "target", "drafter", "draft_head" or
"ngram"; context: the cached tokens the rows read, summed over rows) and end a step's phases with `mark(name)`;
after `stop`, `phases` holds the last step's seconds by phase. WallClock ignores the forwards.
"""
from __future__ import annotations

import time

import torch


class WallClock:
    def __init__(self, device: torch.device | str = "cpu"):
        self.cuda = torch.device(device).type == "cuda"
        self._marks: list[tuple[str, object]] = []
        self.phases: dict[str, float] = {}

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        self._marks = [("", self._now())]

    def forward(self, part: str, rows: int, tokens: int, context: int) -> None:
        """A forward ran (the device's clock measures it)."""

    def mark(self, phase: str) -> None:
        """The step's phase `phase` ends here."""
        self._marks.append((phase, self._now()))

    def stop(self, kind: str = "plain") -> float:
        """Seconds since `start`, every op queued until now included (waits for them on CUDA); `phases` gets each
        marked phase's share. kind: "prefill", "plain" or "sd" (a virtual clock adds that kind's host overhead)."""
        end = self._now()
        if self.cuda:
            end.synchronize()
            between = lambda a, b: a.elapsed_time(b) / 1000.0  # noqa: E731
        else:
            between = lambda a, b: b - a  # noqa: E731
        self.phases = {name: between(t0, t1) for (_, t0), (name, t1) in zip(self._marks, self._marks[1:])}
        return between(self._marks[0][1], end)


class VirtualClock:
    """Charges each reported forward from `costs` (a CostModel): a step's seconds are its forwards' cost plus the
    model's per-step overhead (billed to the phase "host"); `now` is the virtual time since the clock was made."""

    def __init__(self, costs):
        self.costs = costs
        self.now = 0.0
        self._pending = 0.0
        self.phases: dict[str, float] = {}

    def start(self) -> None:
        self._pending, self.phases = 0.0, {}

    def forward(self, part: str, rows: int, tokens: int, context: int) -> None:
        self._pending += self.costs.forward(part, rows, tokens, context)

    def mark(self, phase: str) -> None:
        self.phases[phase] = self._pending
        self._pending = 0.0

    def stop(self, kind: str = "plain") -> float:
        self.phases["host"] = self.costs.step_overhead(kind)
        seconds = sum(self.phases.values()) + self._pending
        self.now += seconds
        return seconds
