"""EAGLE-style one-layer drafter (docs/design.md §2).

Input at position t: concat(embed(x_{t+1}), h_t) -> fc (2H -> H) -> one decoder layer (no input norm, no final
norm) -> predicted h_{t+1}; the target's LM head turns it into logits for x_{t+2}. Embedding and LM head are the
target's, shared and frozen (held by reference, never saved with the drafter). Only `fc` and `layer` train.
Optional reduced draft vocabulary: `d2t` maps draft ids -> target ids; drafting then uses only those rows of
the LM head (the head dominates draft cost for a small target with a large vocabulary). `fc_bias=False` builds fc
without its bias: with the full vocabulary that is vLLM's stock EAGLE-1 drafter (tlt.export.vllm).
"""
from __future__ import annotations

import torch
from torch import nn

from tlt.models.config import ModelConfig
from tlt.models.decoder import CacheView, Decoder, DecoderLayer, Rotary, cache_mask
from tlt.models.kernels import Linear, linear


class Drafter(nn.Module):
    def __init__(self, cfg: ModelConfig, fc_bias: bool = True):
        super().__init__()
        self.cfg = cfg
        self.fc_bias = fc_bias
        self.fc = Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=fc_bias)
        self.layer = DecoderLayer(cfg, 0, input_norm=False)
        self.rotary = Rotary(cfg)
        self.register_buffer("d2t", None, persistent=False)  # [V_draft] target ids of the draft vocabulary
        self._target: list[Decoder] = []  # held in a list so the frozen target is not a submodule

    def attach(self, target: Decoder) -> "Drafter":
        """Share the target's embedding and LM head (frozen, by reference)."""
        self._target[:] = [target]
        self._head_key = None  # another target's head may sit at the address the cached slice was keyed by
        return self

    @property
    def target(self) -> Decoder:
        if not self._target:
            raise RuntimeError("drafter is not attached to a target model: call drafter.attach(target)")
        return self._target[0]

    def forward(self, hidden: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor,
                cache: CacheView | None = None, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [B, T, H] (target's h_t), next_ids [B, T] (x_{t+1}), positions [B, T] (t+1) -> pred h_{t+1}."""
        with torch.no_grad():
            emb = self.target.embed_tokens(next_ids)
        x = self.fc(torch.cat([emb.to(hidden.dtype), hidden], dim=-1))
        cos, sin = self.rotary(positions, x.dtype)
        plan = None
        if cache is not None:
            mask, plan = cache_mask(cache, next_ids.shape[1], next_ids.device)
        else:
            mask = None if attn_mask is None else attn_mask[:, None]
        return self.layer(x, cos, sin, mask, cache, plan)

    def draft_head(self) -> torch.Tensor:
        """The LM-head rows of the draft vocabulary [V_draft, H]. Slicing copies, so the slice is cached and taken
        again only when the target's head changes (an optimizer step bumps its version) or d2t changes. Taken
        again into the same tensor where its shape allows: captured drafting graphs read it by address
        (tlt.speculative.draft_graph), so a policy update then leaves them valid instead of dropping them all."""
        w = self.target.lm_head_weight
        if self.d2t is None:
            return w
        key = (w.data_ptr(), w._version, self.d2t.data_ptr(), w.dtype)
        if getattr(self, "_head_key", None) != key:
            with torch.inference_mode(False), torch.no_grad():  # a normal tensor, so `linear` may prepack it
                head = getattr(self, "_head", None)
                if (head is not None and head.shape == (self.d2t.numel(), w.shape[1]) and head.dtype == w.dtype
                        and head.device == w.device):
                    torch.index_select(w, 0, self.d2t, out=head)  # bumps its version: `linear` packs it again
                else:
                    self._head = w[self.d2t].detach()
            self._head_key = key
        return self._head

    def logits(self, pred_hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits over the draft vocabulary ([..., V_draft], fp32); map ids back with `to_target_ids`."""
        w = self.draft_head()
        return linear(pred_hidden.to(w.dtype), w, out_fp32=True)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.d2t is None else self.d2t[draft_ids]

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.state_dict().items() if k.startswith(("fc.", "layer."))}
