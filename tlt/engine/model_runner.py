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
        state there [B, H], hidden [B, T, H] of all prompt tokens)."""
        lens = [len(s.prompt_ids) for s in seqs]
        T = max(lens)
        ids = self._tensor([s.prompt_ids + [0] * (T - len(s.prompt_ids)) for s in seqs])  # right padding: causal
        B = len(seqs)                                                                       # rows never see it
        positions = torch.arange(T, device=self.device).expand(B, T)
        view = self.kv.view(torch.zeros(B, dtype=torch.long, device=self.device), slot_start=seqs[0].slot)
        hidden = self.model(ids, positions, view)
        last = hidden[torch.arange(B), self._tensor(lens) - 1]
        for s, n in zip(seqs, lens):
            s.num_cached = n
        return self.model.logits(last), last, hidden

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """One token for each running sequence (rows = slots 0..B-1) -> (logits [B, V] fp32, hidden [B, H])."""
        cached = self._tensor([s.num_cached for s in seqs])
        ids = self._tensor([[s.last_token] for s in seqs])
        hidden = self.model(ids, cached[:, None], self.kv.view(cached))[:, 0]
        for s in seqs:
            s.num_cached += 1
        return self.model.logits(hidden), hidden
