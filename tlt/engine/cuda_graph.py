"""Captured CUDA graphs for the few-token forwards: the target's decode and verification, and (through GraphSet) the
speculative step's other parts (tlt.speculative.draft_graph, verify) and SD's K/V commit.

A decode step of a small model on a GPU is launch-bound: it takes about as long at batch 64 as at batch 1 (many layers
of small kernels, each launched from Python; docs/design.md §9). As in vLLM and nano-vllm, a forward is captured
once per key and replayed: one launch a step. The key space is bounded, since every capture costs 10-100 plain
steps: a batch of B rows runs in the smallest of BUCKETS >= B, its tokens per row padded up to the next of WIDTHS
(padding columns attend to themselves only, and their K/V land past the row's end, where nothing reads them).
Shapes are static inside a graph, so:
  - rows B.. of a bucket are padding that writes its K/V into free slots at the last positions of the capacity
    (the cache holds the bucket's slots: running rows are slots 0..B-1);
  - the attention mask spans the cache's whole capacity (`CacheView.static`): a graph computes what the eager
    forward computes; with the flex backend the block mask is built inside the graph from its lens tensor;
  - graphs hold the cache's tensors: they are captured anew when the cache grows (every ROUND positions).
A graph is captured on the step that first needs it, with that step's own inputs: its warm-up forwards write the same
K/V the step writes, so capturing changes nothing. `capture=False` runs the same padded static code eagerly (any
device): the CPU tests check the padding and the static mask with it. Every graph of an engine shares one memory
pool (GraphPool).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from tlt.device import host_tensor
from tlt.engine.kv_cache import KVCache
from tlt.models.decoder import CacheView, Decoder

BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512)
WIDTHS = (1, 5, 9, 17, 33, 49, 65)  # tokens per row of a graphed forward, padded up (the GPU arm table verifies 49)
ROUND = 256  # cache capacity grows in steps of this many positions while graphs are in use


@dataclass
class GraphPool:
    """The memory pool that every graph of an engine shares, the target's and the drafter's: graphs replay one at a
    time and each copies its outputs out at once.

    `anchor` holds the latest captured graph. A grown cache drops every graph that reads it; without a graph left
    in the pool, capturing into its handle again fails PyTorch's allocator check (use_count > 0, seen on an H100
    when a cache grew between captures). The anchor keeps the pool, and the memory the next graphs reuse, alive."""
    handle: Any = None
    num_captured: int = 0
    anchor: Any = None
    capture_s: float = 0.0  # wall time of every capture so far, warm-up included (the device waited for at both ends)

    def capture(self, run: Callable[[], Any]) -> tuple["torch.cuda.CUDAGraph", Any]:
        """Capture `run` (reading and writing only static tensors) -> (graph, its outputs). Warm-up first on a side
        stream (cuBLAS / allocator set-up must not happen inside capture), with the same inputs, so whatever the
        warm-up writes is what a replay writes."""
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.handle):
            out = run()
        self.handle, self.anchor = graph.pool(), graph
        self.num_captured += 1
        torch.cuda.synchronize()
        self.capture_s += time.perf_counter() - t0
        return graph, out


@dataclass
class StaticGraph:
    inputs: dict[str, torch.Tensor]  # static inputs over the bucket's Bp rows, by name
    out: tuple | None = None         # outputs over Bp rows
    graph: "torch.cuda.CUDAGraph | None" = None
    padded_from: int = -1            # rows from here on hold the padding inputs (refilled when B changes)


def bucket(B: int, limit: int) -> int:
    """The smallest of BUCKETS >= B (B itself past them), at most `limit`."""
    return min(next((b for b in BUCKETS if b >= B), B), limit)


def width(T: int) -> int:
    return next(w for w in WIDTHS if w >= T)


class GraphSet:
    """Graphs of one computation of static tensors keyed by (batch bucket, shape): a batch of B rows runs in its
    bucket, its inputs copied into the bucket's static tensors and rows B.. filled by the caller's `pad`; captured on
    first use (or run uncaptured when not capturing, on any device: the same padded static code). static=False:
    no buckets and no padding, the computation run on the B rows as they are (`run(values)`, the eager path, where
    nothing is captured: a CPU's)."""

    def __init__(self, num_slots: int, capture: bool = True, pool: GraphPool | None = None, static: bool = True):
        self.num_slots, self.capture, self.static = num_slots, capture and static, static
        self.pool = pool or GraphPool()
        self.graphs: dict[tuple, StaticGraph] = {}
        self.num_captured = 0

    def bucket(self, B: int) -> int:
        return bucket(B, self.num_slots) if self.static else B

    def replay(self, shape: tuple, B: int, values: dict[str, torch.Tensor],
               pad: Callable[[dict[str, torch.Tensor], int], None],
               run: Callable[[dict[str, torch.Tensor]], tuple], idempotent: bool = True) -> tuple:
        """values: each input's B rows; pad(inputs, B) fills rows B..; run(inputs) -> output tensors (or None) over
        the bucket's rows -> the outputs' first B rows (copies). A run that is not idempotent (it reads what it
        writes) must have no outputs: the step that captures it is done by the capture's warm-up, not replayed."""
        if not self.static:
            return run(values)
        Bp = self.bucket(B)
        g = self.graphs.get((Bp, shape))
        new = g is None
        if new:
            g = self.graphs[(Bp, shape)] = StaticGraph({k: v.new_zeros(Bp, *v.shape[1:]) for k, v in values.items()})
        for k, v in values.items():
            g.inputs[k][:B] = v
        if g.padded_from != B:
            pad(g.inputs, B)
            g.padded_from = B
        if new and self.capture:
            g.graph, g.out = self.pool.capture(lambda: run(g.inputs))
            self.num_captured += 1
            if not idempotent:  # the warm-up has applied it once; a replay would apply it again
                assert not g.out, "a run that is not idempotent cannot return outputs"
                return ()
        if g.graph is not None:
            g.graph.replay()
        else:
            g.out = run(g.inputs)
        return tuple(None if t is None else t[:B].clone() for t in g.out)


class GraphedForward:
    """The target's decode and verification forwards, and SD's K/V commit, through GraphSets over the KV cache."""

    def __init__(self, model: Decoder, kv: KVCache, capture: bool = True, pool: GraphPool | None = None):
        self.model, self.kv = model, kv
        self.set = GraphSet(kv.num_slots, capture, pool)
        # SD's commit (KVCache.move_positions), two launches a layer eagerly: one graph per padded count of moves
        self.moves = GraphSet(2**31, capture, self.set.pool)
        self.cache_key = None
        kv.round_to = max(kv.round_to, ROUND)

    @property
    def pool(self) -> GraphPool:
        return self.set.pool

    @property
    def num_captured(self) -> int:
        return self.set.num_captured + self.moves.num_captured

    def release(self) -> None:
        """Drop the captured graphs and their memory pool (they point into a KV cache that is being freed)."""
        self.set.graphs, self.moves.graphs, self.cache_key = {}, {}, None
        self.pool.handle = self.pool.anchor = None

    def serves(self, B: int, T: int) -> bool:
        return T <= WIDTHS[-1] and B <= self.kv.num_slots

    def bucket(self, B: int) -> int:
        return self.set.bucket(B)

    def _prepare(self, B: int) -> None:
        """The cache holds the bucket's slots (padding rows write into the free ones); graphs read it by address,
        so a grown cache drops them."""
        kv = self.kv
        kv.ensure_capacity(kv.capacity, self.bucket(B))
        self._check_cache()

    def _check_cache(self) -> None:
        kv = self.kv
        key = (kv.k[0].data_ptr(), kv.capacity, kv.slots)
        if key != self.cache_key:
            self.set.graphs.clear()
            self.moves.graphs.clear()
            self.cache_key = key

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, lens: torch.Tensor,
                tree_mask: torch.Tensor | None = None) -> torch.Tensor:
        """ids, positions [B, T], lens [B] (cached tokens before the step), tree_mask [B, T, T] or None (causal)
        -> last hidden state [B, T, H], what `model(ids, positions, kv.view(lens, 0, tree_mask))` returns."""
        B, T = ids.shape
        self._prepare(B)
        W, kv = width(T), self.kv
        values = {"ids": F.pad(ids, (0, W - T)), "lens": lens,
                  "positions": torch.cat([positions, positions[:, -1:] + torch.arange(1, W - T + 1,
                                                                                      device=ids.device)], 1)}
        if tree_mask is not None:  # padding columns see themselves only, and no real token sees them
            values["tree"] = F.pad(tree_mask, (0, W - T, 0, W - T))
            values["tree"][:, T:, T:] |= torch.eye(W - T, dtype=torch.bool, device=ids.device)

        def pad(x: dict, B: int) -> None:  # padding rows: the last W positions of free slots
            x["ids"][B:] = 0
            x["lens"][B:] = kv.capacity - W
            x["positions"][B:] = x["lens"][B:, None] + torch.arange(W, device=ids.device)
            if "tree" in x:
                x["tree"][B:] = torch.ones(W, W, dtype=torch.bool, device=ids.device).tril()

        def run(x: dict) -> tuple:
            view = CacheView(kv.k, kv.v, x["lens"], 0, x.get("tree"), static=True)
            return (self.model(x["ids"], x["positions"], view),)

        return self.set.replay(("forward", W, tree_mask is not None), B, values, pad, run)[0][:, :T]

    def move_positions(self, rows: list[int], src: list[int], dst: list[int]) -> None:
        """KVCache.move_positions through a graph. The moves are padded to a bucket with copies of the first, which
        write the very value it writes to the same place."""
        kv = self.kv
        if len(rows) > BUCKETS[-1]:  # beyond the buckets every count would be a capture of its own
            kv.move_positions(rows, src, dst)
            return
        self._check_cache()
        M = self.moves.bucket(len(rows))
        moves = host_tensor([[r, s, d] for r, s, d in zip(rows, src, dst)] + [[rows[0], src[0], dst[0]]] *
                            (M - len(rows)), kv.device)

        def run(x: dict) -> tuple:
            r, s, d = x["moves"].unbind(1)
            for t in kv.k + kv.v:
                t[r, :, d] = t[r, :, s]
            return ()
        # a move may read what another writes (path [0, 2, 5]: 2 -> 1 and 5 -> 2), so running it twice is wrong
        self.moves.replay(("moves",), M, {"moves": moves}, lambda x, B: None, run, idempotent=False)
