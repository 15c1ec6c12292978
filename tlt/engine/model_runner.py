"""ModelRunner: turns scheduled sequences into batched forwards over the slot KV cache."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tlt.device import host_tensor
from tlt.engine.clock import WallClock
from tlt.engine.cuda_graph import GraphedForward
from tlt.engine.kv_cache import KVCache
from tlt.engine.sequence import Sequence
from tlt.models.decoder import Decoder


# Prompts per prefill forward on CPU: rows of at most this many (padded) tokens. Activations of 512 tokens stay in
# cache and its matmuls take the small-row kernel; 64 prompts of 64 tokens in one forward ran their matmuls at
# ~125 GFLOP/s against ~155 in forwards of 512 tokens (MKL or the kernel; AVX2 EPYC, two threads).
CPU_PREFILL_TOKENS = 512


class ModelRunner:
    def __init__(self, model: Decoder, kv: KVCache, max_prefill_tokens: int | None = None,
                 cuda_graphs: bool = False, clock=None):
        self.model, self.kv = model, kv
        self.clock = clock if clock is not None else WallClock(next(model.parameters()).device)
        self.device = next(model.parameters()).device
        # decode and verification forwards through captured CUDA graphs (tlt.engine.cuda_graph); None = eager
        self.graphs = GraphedForward(model, kv, capture=self.device.type == "cuda") if cuda_graphs else None
        # None: by device (CPU_PREFILL_TOKENS on CPU; on a GPU all admitted prompts in one forward)
        self.max_prefill_tokens = max_prefill_tokens or (CPU_PREFILL_TOKENS if self.device.type == "cpu" else None)

    def _tensor(self, rows, dtype=torch.long) -> torch.Tensor:
        return torch.tensor(rows, dtype=dtype, device=self.device)

    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Prompts of sequences in consecutive slots -> (logits [B, V] fp32 at each last prompt token, the hidden
        state there [B, H], hidden [B, T, H] of all prompt tokens).

        Prompts run in forwards of at most `max_prefill_tokens` padded tokens (a longer prompt alone), so that the
        activations stay small. Each distinct prompt is computed once: when the first U sequences hold the distinct
        prompts and the rest repeat them (the scheduler's order for a request's n samples), only those U rows run
        and the repeats get copies of their K/V, logits and hidden states. A rollout of n samples a prompt
        prefills 1/n of the tokens.
        """
        first: dict[tuple[int, ...], int] = {}
        src = [first.setdefault(tuple(s.prompt_ids), len(first)) for s in seqs]
        U = len(first)
        if src[:U] != list(range(U)):  # not in distinct-first order: prefill every row
            src, U = list(range(len(seqs))), len(seqs)
        lens = [len(s.prompt_ids) for s in seqs[:U]]
        T, s0 = max(lens), seqs[0].slot
        parts = []
        for a, b in self._prefill_chunks(lens):
            Tc = max(lens[a:b])  # right padding: causal rows never see it
            ids = self._tensor([s.prompt_ids + [0] * (Tc - len(s.prompt_ids)) for s in seqs[a:b]])
            positions = torch.arange(Tc, device=self.device).expand(b - a, Tc)
            zero = torch.zeros(b - a, dtype=torch.long, device=self.device)
            parts.append(self.model(ids, positions, self.kv.view(zero, s0 + a)))
            self.clock.forward("target", b - a, Tc, 0)
        # a group shorter than the longest prompt is padded with zeros (positions past a prompt are never read)
        hidden = torch.cat([F.pad(h, (0, 0, 0, T - h.shape[1])) for h in parts]) if len(parts) > 1 else parts[0]
        last = hidden[torch.arange(U), self._tensor(lens) - 1]
        logits = self.model.logits(last)
        if U < len(seqs):
            dst, from_ = self._tensor([s.slot for s in seqs[U:]]), self._tensor([s0 + j for j in src[U:]])
            for t in self.kv.k + self.kv.v:
                t[dst, :, :T] = t[from_, :, :T]
            rows = self._tensor(src)
            logits, last, hidden = logits[rows], last[rows], hidden[rows]
        for s in seqs:
            s.num_cached = len(s.prompt_ids)
        return logits, last, hidden

    def _prefill_chunks(self, lens: list[int]) -> list[tuple[int, int]]:
        """Consecutive row ranges [a, b) whose padded size (rows x longest prompt) stays within the budget."""
        if not self.max_prefill_tokens:
            return [(0, len(lens))]
        chunks, a, longest = [], 0, 0
        for i, n in enumerate(lens):
            if i > a and (i - a + 1) * max(longest, n) > self.max_prefill_tokens:
                chunks.append((a, i))
                a, longest = i, 0
            longest = max(longest, n)
        return chunks + [(a, len(lens))]

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """One token for each running sequence (rows = slots 0..B-1) -> (logits [B, V] fp32, hidden [B, H])."""
        # one copy, pinned and non-blocking on CUDA: a pageable one would wait for the device
        cached, ids = host_tensor([[s.num_cached for s in seqs], [s.last_token for s in seqs]], self.device)
        hidden = self.cached_forward(ids[:, None], cached[:, None], cached, context=sum(s.num_cached for s in seqs),
                                     max_len=max(s.num_cached for s in seqs))[:, 0]
        for s in seqs:
            s.num_cached += 1
        return self.model.logits(hidden), hidden

    @torch.inference_mode()
    def cached_forward(self, ids: torch.Tensor, positions: torch.Tensor, lens: torch.Tensor,
                       tree_mask: torch.Tensor | None = None, nodes: torch.Tensor | None = None,
                       context: int = 0, max_len: int | None = None) -> torch.Tensor:
        """A few new tokens a row over the cache (decode, SD verification): ids, positions [B, T], lens [B] cached
        tokens before them, tree_mask [B, T, T] or None (causal) -> last hidden state [B, T, H]; through a captured
        graph where one serves. nodes [B, T] bool (eager forwards): the tokens needed; where the model computes them
        alone (Decoder.forward_nodes, the fused CPU layer) only those run, and the others' hidden states are zeros.
        context: the cached tokens the rows read, summed (what the clock charges); max_len: max(lens), where the
        caller knows it on the host (an eager forward then reads nothing of lens)."""
        self.clock.forward("target", *ids.shape, context)
        if self.graphs is not None and self.graphs.serves(*ids.shape):
            return self.graphs.forward(ids, positions, lens, tree_mask)
        view = self.kv.view(lens, tree_mask=tree_mask, max_len=max_len)
        if nodes is not None and (some := self.model.forward_nodes(ids, positions, view, nodes)) is not None:
            hidden = some.new_zeros(*ids.shape, some.shape[-1])
            hidden[nodes] = some
            return hidden
        return self.model(ids, positions, view)

    def move_positions(self, rows: list[int], src: list[int], dst: list[int]) -> None:
        """KVCache.move_positions (SD's commit), through a captured graph where the forwards use them."""
        if self.graphs is not None:
            self.graphs.move_positions(rows, src, dst)
        else:
            self.kv.move_positions(rows, src, dst)

    @property
    def num_graph_captures(self) -> int:
        """CUDA graphs captured so far (a capturing step costs many plain steps, once)."""
        return 0 if self.graphs is None else self.graphs.num_captured
