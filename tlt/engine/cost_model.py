"""What a forward costs on a device: the cost model behind tlt.engine.clock.VirtualClock.

A device profile (one entry of device_profiles.json, the one file holding every constant) is either
  - "roofline", for GPUs: a forward of R rows x T tokens over C cached tokens reads the weights once and the K/V of
    its context, and computes 2 flops a weight a token plus attention; it takes the longer of bytes / bandwidth
    and flops / matrix rate, plus a floor of `kernel_s` per kernel it launches (a small model's decode step is
    that floor, even replayed from a CUDA graph); or
  - "table", for CPUs: seconds measured by `tlt bench profile` on the machine, by rows and tokens per row, for the
    target's forward (LM head included), the drafter's layer and its draft head, interpolated between the grid's
    points.
Both add a host overhead per step by kind (prefill, plain, sd) and an n-gram proposal's cost per row.
"""
from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from pathlib import Path

from tlt.models.config import ModelConfig

PROFILES_FILE = Path(__file__).with_name("device_profiles.json")


def load_profiles(path: str | Path | None = None) -> dict[str, dict]:
    return json.loads(Path(path or PROFILES_FILE).read_text())


@dataclass
class CostModel:
    profile: dict                  # one entry of device_profiles.json
    shape: ModelConfig             # the target's architecture (the roofline's bytes and flops)
    draft_vocab: int | None = None  # the drafter's vocabulary (None: the target's)

    @classmethod
    def named(cls, name: str, shape: ModelConfig, draft_vocab: int | None = None,
              path: str | Path | None = None) -> "CostModel":
        profiles = load_profiles(path)
        if name not in profiles:
            raise ValueError(f"unknown device profile {name!r}: choose one of {', '.join(sorted(profiles))}")
        return cls(profiles[name], shape, draft_vocab)

    def forward(self, part: str, rows: int, tokens: int, context: int) -> float:
        """Seconds of one forward: part "target" (its LM head included), "drafter" (its layer) or "draft_head" (logits
        over the draft vocabulary): rows x tokens new tokens over `context` cached tokens summed over rows; or
        "ngram" (a proposal for each of `rows` rows, on the host)."""
        p = self.profile
        if part == "ngram":
            return rows * p["ngram_row_s"]
        if p["kind"] == "table":
            return _interpolate(p["rows"], p["tokens"], p[f"{part}_s"], rows, tokens)
        return self._roofline(part, rows, tokens, context)

    def step_overhead(self, kind: str) -> float:
        """The host's seconds per engine step of this kind ("prefill", "plain" or "sd") beyond its forwards."""
        return self.profile["overhead_s"][kind]

    def _roofline(self, part: str, rows: int, tokens: int, context: int) -> float:
        p, c = self.profile, self.shape
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        layer = 2 * c.hidden_size * (q + kv) + 3 * c.hidden_size * c.intermediate_size
        if part == "target":
            layers, weights = c.num_layers, c.num_layers * layer + c.vocab_size * c.hidden_size
        elif part == "drafter":  # one layer and its fc over [embedding; hidden]
            layers, weights = 1, layer + 2 * c.hidden_size ** 2
        else:  # the draft vocabulary's rows of the LM head
            layers, weights, q = 0, (self.draft_vocab or c.vocab_size) * c.hidden_size, 0
        new = rows * tokens
        read = context + new  # keys each new token's row attends to, summed over rows
        kv_bytes = layers * 2 * kv * read * p["dtype_bytes"]
        flops = 2 * new * weights + layers * 4 * q * tokens * read
        seconds = max((weights * p["dtype_bytes"] + kv_bytes) / p["mem_bw_bytes_s"], flops / p["matmul_flop_s"])
        return seconds + (layers * p["kernels_per_layer"] + p["head_kernels"]) * p["kernel_s"]


def _interpolate(xs: list[float], ys: list[float], table: list[list[float]], x: float, y: float) -> float:
    """table[i][j] at (xs[i], ys[j]), bilinear between grid points and linear beyond its edges (never below 0)."""
    def bracket(grid, v):
        i = min(max(bisect.bisect_left(grid, v), 1), len(grid) - 1)
        lo, hi = grid[i - 1], grid[i]
        return i - 1, i, (v - lo) / (hi - lo)
    if len(xs) == 1 or len(ys) == 1:
        raise ValueError("a table profile needs at least two rows and two token counts")
    i0, i1, u = bracket(xs, x)
    j0, j1, v = bracket(ys, y)
    at = lambda i: table[i][j0] + v * (table[i][j1] - table[i][j0])  # noqa: E731
    return max(at(i0) + u * (at(i1) - at(i0)), 0.0)
