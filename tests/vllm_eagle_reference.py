"""vLLM 0.32's EAGLE-1 drafting step in plain torch, written from vLLM's data flow (not from tlt's drafter), over
an export directory (config.json + model.safetensors under HF names) and the target's HF checkpoint.

The data flow, as vLLM 0.32 runs it (vllm/v1/spec_decode/llm_base_proposer.py: propose, set_inputs_first_pass;
vllm/model_executor/models/llama_eagle.py: LlamaModel.forward, EagleLlamaForCausalLM):
- first pass over the step's tokens: the input ids are the target's shifted by one (row i gets token i + 1, the last
  row the token the target just sampled), positions are the target's (row i at i), hidden states are the target's
  (its last layer, after the final norm);
- the model: embed the ids with the target's embedding, fc over [embedding; hidden], one decoder layer whose input
  norm is the identity (residual = fc's output; attention; add, RMSNorm; MLP; add), no final norm; the output is both
  the next step's hidden state and what the target's LM head turns into draft logits; greedy drafts are the argmax;
- each later draft: one row, its id the previous draft, its hidden state the previous output, its position one on,
  attending to every row before it (the drafter's KV cache).
The "tlt-plugin" kind adds fc's bias and masks logits outside `draft_vocab_ids` (tlt/vllm_plugin/eagle.py).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """x [N, heads, d], neox style (vLLM's default for Llama: the two halves of each head rotate together)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = pos[:, None].float() * inv                                  # [N, d/2]
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]
    a, b = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)


class VllmEagleReference:
    def __init__(self, export_dir: str | Path, target_dir: str | Path, mask_draft_vocab: bool = True,
                 use_fc_bias: bool = True):
        """mask_draft_vocab / use_fc_bias False: what vLLM's stock class would do with a plugin export (controls)."""
        self.cfg = json.loads((Path(export_dir) / "config.json").read_text())
        self.w = load_file(str(Path(export_dir) / "model.safetensors"))
        target = {}
        for f in sorted(Path(target_dir).glob("*.safetensors")):
            target.update(load_file(str(f)))
        self.embed = target["model.embed_tokens.weight"]
        self.lm_head = self.embed if self.cfg.get("tie_word_embeddings") else target["lm_head.weight"]
        self.fc_bias = self.w.get("fc.bias") if use_fc_bias else None
        ids = self.w.get("draft_vocab_ids")
        self.mask = None
        if ids is not None and mask_draft_vocab:
            self.mask = torch.zeros(self.lm_head.shape[0], dtype=torch.bool)
            self.mask[ids] = True
        rope = self.cfg.get("rope_parameters") or {}
        self.theta = float(self.cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0)

    def forward(self, ids: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows (ids [N], hidden [N, H], positions [N]) attending causally -> (output hidden [N, H], logits [N, V])."""
        c, w, p = self.cfg, self.w, "layers.0."
        nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]
        d = c.get("head_dim") or c["hidden_size"] // nh
        x = F.linear(torch.cat([self.embed[ids], hidden], -1), w["fc.weight"], self.fc_bias)
        n = x.shape[0]
        q = _rope(F.linear(x, w[p + "self_attn.q_proj.weight"]).view(n, nh, d), pos, self.theta)
        k = _rope(F.linear(x, w[p + "self_attn.k_proj.weight"]).view(n, nkv, d), pos, self.theta)
        v = F.linear(x, w[p + "self_attn.v_proj.weight"]).view(n, nkv, d)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)  # query head h reads h // group
        scores = torch.einsum("qhd,khd->hqk", q, k) * d ** -0.5
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, nh * d)
        residual = x + F.linear(attn, w[p + "self_attn.o_proj.weight"])
        h = _rms_norm(residual, w[p + "post_attention_layernorm.weight"], c["rms_norm_eps"])
        mlp = F.linear(F.silu(F.linear(h, w[p + "mlp.gate_proj.weight"])) * F.linear(h, w[p + "mlp.up_proj.weight"]),
                       w[p + "mlp.down_proj.weight"])
        out = residual + mlp
        logits = out @ self.lm_head.T
        if self.mask is not None:
            logits = logits.masked_fill(~self.mask, float("-inf"))
        return out, logits

    def drafts(self, input_ids: torch.Tensor, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, list[int]]:
        """input_ids [T + 1] (x_0..x_T), hidden [T, H] -> (first-pass drafts [T], the k-token chain after x_T)."""
        T = hidden.shape[0]
        ids, h, pos = input_ids[1:], hidden, torch.arange(T)
        out, logits = self.forward(ids, h, pos)
        first = logits.argmax(-1)
        chain = [int(first[-1])]
        for _ in range(k - 1):
            ids, h = torch.cat([ids, torch.tensor([chain[-1]])]), torch.cat([h, out[-1:]])
            pos = torch.arange(len(ids))
            out, logits = self.forward(ids, h, pos)
            chain.append(int(logits[-1].argmax()))
        return first, chain
