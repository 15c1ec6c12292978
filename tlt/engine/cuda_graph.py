"""Captured CUDA graphs for the target's few-token forwards (decode, and speculative verification).

A decode step of a small model on a GPU is launch-bound: SmolLM2-135M took ~18 ms a step on an H100 at batch 1 and
at batch 64 alike (30 layers of small kernels and their Python). As in vLLM and nano-vllm, the forward is captured
once per (batch bucket, new tokens per row, tree mask or not) and replayed: one launch a step.

Shapes are static inside a graph, so:
  - a batch of B rows runs in the smallest bucket >= B; rows B.. are padding that writes its K/V into free slots
    (slots B.. hold no running sequence: running rows are slots 0..B-1), at the last positions of the capacity;
  - the attention mask spans the cache's whole capacity (`CacheView.static`); up to SMALL_QUERY new tokens it is
    the small-query attention's bias over the capacity, as in the eager path, beyond that SDPA's mask over the
    whole capacity instead of the longest row's length: a graph computes what the eager forward computes; with
    the flex backend (rollout.attention) the block mask is rebuilt inside the graph from its lens tensor, so
    each row still reads only its own keys (docs/design.md §15);
  - the graphs hold the cache's tensors: they are captured anew when the cache grows (every `ROUND` positions;
    all slots are allocated at the first graphed step).
A graph is captured on the step that first needs it, with that step's own inputs: its warm-up forwards write the
same K/V the step writes, so capturing changes nothing. `capture=False` runs the same padded static forward
eagerly (any device): the tests check the padding and the static mask on CPU with it.

GraphSet applies the same conventions to any function of static tensors: the speculative step's other graphs
(the drafter's, the acceptance walk's: tlt.speculative.draft_graph and verify_static) and SD's K/V commit
(`GraphedForward.move_positions`). Every graph of an engine shares one memory pool (GraphPool).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from tlt.device import host_tensor
from tlt.engine.kv_cache import KVCache
from tlt.models.decoder import CacheView, Decoder

BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
ROUND = 256  # cache capacity grows in steps of this many positions while graphs are in use
MAX_TOKENS = 64  # new tokens per row up to which forwards are graphed (the GPU arm table verifies at most 49)


@dataclass
class GraphPool:
    """The memory pool that every graph of an engine shares, the target's and the drafter's
    (tlt.speculative.draft_graph): graphs replay one at a time and each copies its outputs out at once.

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
class _Graph:
    ids: torch.Tensor                 # [Bp, T] static inputs ...
    positions: torch.Tensor           # [Bp, T]
    lens: torch.Tensor                # [Bp]
    tree: torch.Tensor | None         # [Bp, T, T] or None (causal)
    out: torch.Tensor | None = None   # [Bp, T, H] ... and output
    graph: "torch.cuda.CUDAGraph | None" = None
    padded_from: int = -1             # rows from here on hold the padding inputs (refilled when B changes)


class GraphedForward:
    def __init__(self, model: Decoder, kv: KVCache, capture: bool = True, pool: GraphPool | None = None):
        self.model, self.kv, self.capture = model, kv, capture
        self.graphs: dict[tuple[int, int, bool], _Graph] = {}
        self.cache_key = None
        self.pool = pool or GraphPool()
        self.num_captured = 0
        kv.round_to = max(kv.round_to, ROUND)
        # SD's commit (KVCache.move_positions), two launches a layer eagerly: one graph per padded count of moves
        self.moves = GraphSet(2**31, capture, self.pool)
        self.moves_key = None

    def release(self) -> None:
        """Drop the captured graphs and their memory pool (they point into a KV cache that is being freed)."""
        self.graphs, self.cache_key, self.pool.handle, self.pool.anchor = {}, None, None, None
        self.moves.graphs, self.moves_key = {}, None

    def move_positions(self, rows: list[int], src: list[int], dst: list[int]) -> None:
        """KVCache.move_positions through a graph. The moves are padded to a bucket with copies of the first, which
        write the very value it writes to the same place."""
        kv = self.kv
        if len(rows) > BUCKETS[-1]:  # beyond the buckets every count would be a capture of its own
            kv.move_positions(rows, src, dst)
            return
        if (kv.k[0].data_ptr(), kv.capacity) != self.moves_key:
            self.moves.graphs.clear()
            self.moves_key = (kv.k[0].data_ptr(), kv.capacity)
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

    def serves(self, B: int, T: int) -> bool:
        return T <= MAX_TOKENS and B <= self.kv.num_slots

    def bucket(self, B: int) -> int:
        return min(next((b for b in BUCKETS if b >= B), B), self.kv.num_slots)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, lens: torch.Tensor,
                tree_mask: torch.Tensor | None = None) -> torch.Tensor:
        """ids, positions [B, T], lens [B] (cached tokens before the step), tree_mask [B, T, T] or None (causal)
        -> last hidden state [B, T, H], what `model(ids, positions, kv.view(lens, 0, tree_mask))` returns."""
        kv = self.kv
        B, T = ids.shape
        kv.ensure_capacity(kv.capacity, kv.num_slots)  # every slot: padding rows write into free ones
        key = (kv.k[0].data_ptr(), kv.capacity)
        if key != self.cache_key:  # graphs read the cache by address: a grown cache needs new ones
            self.graphs.clear()
            self.cache_key = key
        shape = (self.bucket(B), T, tree_mask is not None)
        g = self.graphs.get(shape)
        new = g is None
        if new:
            g = self.graphs[shape] = self._buffers(*shape)
        g.ids[:B] = ids
        g.lens[:B] = lens
        g.positions[:B] = positions
        if g.tree is not None:
            g.tree[:B] = tree_mask
        if g.padded_from != B:  # padding rows: the last T positions of free slots (a graph's capacity is fixed)
            g.ids[B:] = 0
            g.lens[B:] = kv.capacity - T
            g.positions[B:] = g.lens[B:, None] + torch.arange(T, device=ids.device)
            if g.tree is not None:
                g.tree[B:] = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()
            g.padded_from = B
        if new and self.capture:
            self._capture(g)
        if g.graph is not None:
            g.graph.replay()
        else:
            g.out = self._run(g)
        return g.out[:B].clone()

    def _buffers(self, Bp: int, T: int, tree: bool) -> _Graph:
        dev = self.kv.device
        return _Graph(torch.zeros(Bp, T, dtype=torch.long, device=dev),
                      torch.zeros(Bp, T, dtype=torch.long, device=dev), torch.zeros(Bp, dtype=torch.long, device=dev),
                      torch.ones(Bp, T, T, dtype=torch.bool, device=dev).tril() if tree else None)

    def _run(self, g: _Graph) -> torch.Tensor:
        view = CacheView(self.kv.k, self.kv.v, g.lens, 0, g.tree, static=True)
        return self.model(g.ids, g.positions, view)

    def _capture(self, g: _Graph) -> None:
        g.graph, g.out = self.pool.capture(lambda: self._run(g))
        self.num_captured += 1


@dataclass
class StaticGraph:
    inputs: dict[str, torch.Tensor]  # static inputs over the bucket's Bp rows, by name
    out: tuple | None = None         # outputs over Bp rows
    graph: "torch.cuda.CUDAGraph | None" = None
    padded_from: int = -1            # rows from here on hold the padding inputs (refilled when B changes)


class GraphSet:
    """Graphs of one computation keyed by (batch bucket, shape), GraphedForward's conventions for any function of
    static tensors: a batch of B rows runs in the smallest bucket >= B, its inputs copied into the bucket's static
    tensors and rows B.. filled by the caller's `pad`; captured on first use (or run eagerly when not capturing,
    on any device: the same padded static code)."""

    def __init__(self, num_slots: int, capture: bool = True, pool: GraphPool | None = None):
        self.num_slots, self.capture = num_slots, capture
        self.pool = pool or GraphPool()
        self.graphs: dict[tuple, StaticGraph] = {}
        self.num_captured = 0

    def bucket(self, B: int) -> int:
        return min(next((b for b in BUCKETS if b >= B), B), self.num_slots)

    def replay(self, shape: tuple, B: int, values: dict[str, torch.Tensor],
               pad: Callable[[dict[str, torch.Tensor], int], None],
               run: Callable[[dict[str, torch.Tensor]], tuple], idempotent: bool = True) -> tuple:
        """values: each input's B rows; pad(inputs, B) fills rows B..; run(inputs) -> output tensors (or None) over
        the bucket's rows -> the outputs' first B rows (copies). A run that is not idempotent (it reads what it
        writes) must have no outputs: the step that captures it is done by the capture's warm-up, not replayed."""
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
