"""vLLM's EAGLE-1 Llama drafter with what tlt's drafter has and it lacks: fc's bias, and a draft vocabulary.

The layout is `tlt export-drafter`'s (tlt.export.vllm): config.json's `tlt_drafter` block says whether fc has a bias
and how many draft ids there are; model.safetensors holds vLLM's EAGLE-1 names plus `fc.bias` and `draft_vocab_ids`
(absolute target ids). Drafts are the argmax of the target's LM head over the draft ids only, as tlt's are: logits of
the other ids are -inf, so greedy and sampled drafting (compute_logits) and the local-argmax path (get_top_tokens)
all see the draft vocabulary. Loading checks that every tensor it needs came from the checkpoint.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from vllm.config import VllmConfig
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.models.llama_eagle import EagleLlamaForCausalLM
from vllm.model_executor.models.utils import AutoWeightsLoader, maybe_prefix

FORMAT = "tlt-vllm-eagle-v1"  # tlt.export.vllm.FORMAT
DRAFT_VOCAB_KEY = "draft_vocab_ids"


class TltEagleLlamaForCausalLM(EagleLlamaForCausalLM):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        spec = getattr(self.config, "tlt_drafter", None)
        if not isinstance(spec, dict) or spec.get("format") != FORMAT:
            raise ValueError(f"{type(self).__name__} serves `tlt export-drafter` exports (config.json's tlt_drafter "
                             f"block, format {FORMAT!r}); this config has {spec!r}: export the drafter again")
        H = self.config.hidden_size
        if spec["fc_bias"]:  # the stock fc has none; same name, so the checkpoint's fc.bias now has a place
            self.model.fc = ReplicatedLinear(2 * H, H, bias=True, params_dtype=vllm_config.model_config.dtype,
                                             quant_config=self.model.quant_config,
                                             prefix=maybe_prefix(prefix, "model.fc"), return_bias=False)
        n = spec["draft_vocab_size"]
        # [V_draft] target ids; filled by load_weights, then the [V] mask of ids the drafter may propose
        self.register_buffer("draft_vocab_ids", None if n is None else torch.zeros(n, dtype=torch.long),
                             persistent=False)
        self.register_buffer("draft_vocab_mask", None, persistent=False)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden_states)
        if logits is None or self.draft_vocab_mask is None:
            return logits
        return logits.masked_fill(~self.draft_vocab_mask, float("-inf"))

    def get_top_tokens(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # the stock local-argmax path would take the argmax over the whole vocabulary
        return self.compute_logits(hidden_states).argmax(dim=-1)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        got_vocab = False

        def layer_weights():
            nonlocal got_vocab
            for name, tensor in weights:
                if name == DRAFT_VOCAB_KEY:
                    if self.draft_vocab_ids is None or tensor.shape != self.draft_vocab_ids.shape:
                        raise ValueError(f"{DRAFT_VOCAB_KEY} {tuple(tensor.shape)} does not match config.json's "
                                         f"tlt_drafter.draft_vocab_size: export the drafter again")
                    self.draft_vocab_ids.copy_(tensor)
                    got_vocab = True
                else:  # checkpoint names are the draft model's (fc.*, layers.0.*); the module's sit under model.
                    yield "model." + name, tensor

        loaded = AutoWeightsLoader(self).load_weights(layer_weights())
        # the embedding is the target's (shared after loading): everything else must have come from the checkpoint
        need = {n for n, _ in self.named_parameters() if not n.startswith("model.embed_tokens.")}
        missing = sorted(need - set(loaded))
        if missing or (self.draft_vocab_ids is not None and not got_vocab):
            raise ValueError(f"tlt drafter checkpoint lacks {missing or [DRAFT_VOCAB_KEY]}: export it again with "
                             "`tlt export-drafter`")
        if self.draft_vocab_ids is not None:
            mask = torch.zeros(self.config.vocab_size, dtype=torch.bool, device=self.draft_vocab_ids.device)
            mask[self.draft_vocab_ids] = True
            self.draft_vocab_mask = mask
        # None, as the stock class returns: vLLM's own check would count the target's shared embedding as missing
