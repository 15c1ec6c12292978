"""ModelRunner: turns scheduled sequences into batched forwards over the slot KV cache."""
from __future__ import annotations

import torch

from tlt.engine.kv_cache import KVCache
from tlt.engine.sequence import Sequence
from tlt.models.decoder import Decoder


class ModelRunner:
    def __init__(self, model: Decoder, kv: KVCache):
        self.model, self.kv = model, kv
        self.device = next(model.parameters()).device

    def _tensor(self, rows, dtype=torch.long) -> torch.Tensor:
        return torch.tensor(rows, dtype=dtype, device=self.device)

    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Prompts of sequences in consecutive slots -> (logits [B, V] fp32 at each last prompt token, the hidden
        state there [B, H], hidden [B, T, H] of all prompt tokens).

        Each distinct prompt is computed once: when the first U sequences hold the distinct prompts and the rest
        repeat them (the scheduler's order for a request's n samples), only those U rows run and the repeats get
        copies of their K/V, logits and hidden states. A rollout of n samples a prompt prefills 1/n of the tokens.
        """
        first: dict[tuple[int, ...], int] = {}
        src = [first.setdefault(tuple(s.prompt_ids), len(first)) for s in seqs]
        U = len(first)
        if src[:U] != list(range(U)):  # not in distinct-first order: prefill every row
            src, U = list(range(len(seqs))), len(seqs)
        lens = [len(s.prompt_ids) for s in seqs[:U]]
        T = max(lens)
        ids = self._tensor([s.prompt_ids + [0] * (T - len(s.prompt_ids)) for s in seqs[:U]])  # right padding:
        positions = torch.arange(T, device=self.device).expand(U, T)                          # causal rows never
        s0 = seqs[0].slot                                                                     # see it
        hidden = self.model(ids, positions, self.kv.view(torch.zeros(U, dtype=torch.long, device=self.device), s0))
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

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """One token for each running sequence (rows = slots 0..B-1) -> (logits [B, V] fp32, hidden [B, H])."""
        cached = self._tensor([s.num_cached for s in seqs])
        ids = self._tensor([[s.last_token] for s in seqs])
        hidden = self.model(ids, cached[:, None], self.kv.view(cached))[:, 0]
        for s in seqs:
            s.num_cached += 1
        return self.model.logits(hidden), hidden
