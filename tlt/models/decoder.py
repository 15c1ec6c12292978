"""One compact decoder for the Llama / Qwen2 / Qwen3 families, used for rollout and training alike.

Shapes: B = batch rows, T = new tokens per row, H = hidden size, D = head dim, L = cache length.
`Decoder.forward` returns the last-layer hidden state (after the final norm: the tensor that enters the LM head);
`Decoder.logits` applies the LM head. With a `CacheView` the forward reads and extends a slot KV cache, which
covers prefill, one-token decode and multi-token tree verification with one code path.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tlt.models.config import ModelConfig
from tlt.models.flex import FLEX_MAX_QUERY, block_mask, flex_cache_attention
from tlt.models.kernels import (LayerInputs, LayerWeights, Linear, attention_bias, decode_layer, decode_layer_ok,
                                layer_inputs, linear, small_query_attention)

SMALL_QUERY = 16  # new tokens per row up to which cached attention uses small_query_attention
SMALL_QUERY_CPU = 32  # on CPU: covers the CPU arm table's largest verify tree (17 tokens), so every SD step runs the
                      # kernels plain decoding runs (bitwise equal logits: drafter-invariant sampling)
FUSED_QUERY_CPU = 128  # where the fused layer serves (CPU fast paths): prompt chunks up to here run it too (prefill)


@dataclass
class CacheView:
    """The KV cache a forward reads and extends. Batch row b uses cache slot `slot_start + b`."""
    k: list[torch.Tensor]        # per layer [S, Hkv, L_cap, D]
    v: list[torch.Tensor]        # per layer [S, Hkv, L_cap, D]
    cache_lens: torch.Tensor     # [B] long: valid cached tokens per row before this forward
    slot_start: int = 0
    # [B, T, S + T] bool (True = may attend) over S speculative entries already written after `cache_lens`
    # in this step plus the T new tokens; None = causal among the new tokens (S = 0).
    tree_mask: torch.Tensor | None = None
    # True: masks span the whole capacity, with no read of cache_lens on the host (a CUDA graph's forward)
    static: bool = False
    # the largest cache_lens when the host knows it: the eager mask's length without reading the device
    max_len: int | None = None


@dataclass
class PackedRows:
    """Training rows that each hold a shared prefix followed by segments that never see one another: a token of
    segment k attends to its row's prefix and, causally, to segment k (tlt.rl.actor packs a group's responses
    behind one copy of their prompt). Positions after a row's last segment are padding.

    On CPU, attention runs per segment over the prefix's and its own keys instead of over the whole T x T square
    under a mask, most of which a group's pack masks out (a 1004-token pack of 8 long-tail responses: 6x fewer
    (query, key) pairs, forward + backward of a SmolLM2 layer's attention 83 -> 30 ms on 2 cores). Elsewhere it
    becomes the equivalent dense mask (one masked kernel launch instead of many small ones)."""
    prefix_lens: list[int]          # [B] prefix tokens per row
    segment_lens: list[list[int]]   # per row, its segments' lengths in order after the prefix

    def dense_mask(self, T: int, device) -> torch.Tensor:
        """The same attention as a [B, T, T] bool mask (True = may attend); padding sees itself only."""
        mask = torch.zeros(len(self.prefix_lens), T, T, dtype=torch.bool, device=device)
        for b, (p, lens) in enumerate(zip(self.prefix_lens, self.segment_lens)):
            mask[b, :p, :p] = torch.ones(p, p, dtype=torch.bool, device=device).tril()
            s = p
            for r in lens:
                mask[b, s:s + r, :p] = True
                mask[b, s:s + r, s:s + r] = torch.ones(r, r, dtype=torch.bool, device=device).tril()
                s += r
            mask[b, s:, s:] = torch.eye(T - s, dtype=torch.bool, device=device)
        return mask


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: PackedRows) -> torch.Tensor:
    """q [B, nh, T, D], k / v [B, nkv, T, D] -> [B, nh, T, D]: each segment's queries against its row's prefix keys
    and its own (zeros at padding, which nothing reads)."""
    _, nh, T, D = q.shape
    gqa = k.shape[1] != nh
    out = []
    for b, (p, lens) in enumerate(zip(rows.prefix_lens, rows.segment_lens)):
        qb, kb, vb = q[b:b + 1], k[b:b + 1], v[b:b + 1]
        parts = [F.scaled_dot_product_attention(qb[:, :, :p], kb[:, :, :p], vb[:, :, :p], is_causal=True,
                                                enable_gqa=gqa)]
        s = p
        for r in lens:
            keys = torch.cat([kb[:, :, :p], kb[:, :, s:s + r]], 2)
            values = torch.cat([vb[:, :, :p], vb[:, :, s:s + r]], 2)
            # [r, p + r] over (prefix, segment) keys: query i sees the whole prefix and segment keys <= i
            mask = torch.ones(r, p + r, dtype=torch.bool, device=q.device).tril(diagonal=p)
            parts.append(F.scaled_dot_product_attention(qb[:, :, s:s + r], keys, values, attn_mask=mask,
                                                        enable_gqa=gqa))
            s += r
        if s < T:
            parts.append(q.new_zeros(1, nh, T - s, D))
        out.append(torch.cat(parts, 2))
    return torch.cat(out, 0)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalised in fp32 and cast back before the scale, like transformers (bit-identical to its formula)
        return self.weight * F.rms_norm(x, (x.shape[-1],), eps=self.eps)


def _inv_freq(cfg: ModelConfig) -> torch.Tensor:
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim))
    rs = cfg.rope_scaling
    if rs is None:
        return inv
    # Llama-3 rope scaling: long wavelengths divided by `factor`, short kept, smooth blend in between.
    factor, lo, hi = rs["factor"], rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
    old_len = rs["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / lo, inv / factor, inv)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
    return torch.where(medium, blended, scaled)


class Rotary(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.register_buffer("inv_freq", _inv_freq(cfg), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] -> (cos, signed sin), each [B, T, 1, D] in `dtype` (see `_rotate`)."""
        freqs = positions[..., None].float() * self.inv_freq  # [B, T, D/2]
        cos, sin = freqs.cos(), freqs.sin()
        return torch.cat([cos, cos], -1).to(dtype)[:, :, None], torch.cat([-sin, sin], -1).to(dtype)[:, :, None]


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """transformers' x * cos + rotate_half(x) * sin, bit for bit: rotate_half(x) * sin = [x2, x1] * [-sin, sin]."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([x[..., half:], x[..., :half]], dim=-1) * signed_sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.nh, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, (self.nh + 2 * self.nkv) * self.hd, bias=cfg.attention_bias)
        self.o_proj = Linear(self.nh * self.hd, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x, cos, sin, mask, cache: CacheView | None, plan: "CachePlan | None"):
        B, T, _ = x.shape
        nh, nkv = self.nh, self.nkv
        qkv = self.qkv_proj(x).view(B, T, nh + 2 * nkv, self.hd)  # heads in [B, T, H, D] until attention
        if self.q_norm is None:
            qk = _rotate(qkv[:, :, :nh + nkv], cos, sin)  # q and k heads rotated together
            q, k = qk[:, :, :nh], qk[:, :, nh:]
        else:
            q = _rotate(self.q_norm(qkv[:, :, :nh]), cos, sin)
            k = _rotate(self.k_norm(qkv[:, :, nh:nh + nkv]), cos, sin)
        v = qkv[:, :, nh + nkv:]
        gqa = nkv != nh
        if cache is None and isinstance(mask, PackedRows):  # checked after `cache`: decode never pays for it
            out = packed_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask).transpose(1, 2)
        elif cache is None:
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 attn_mask=mask, is_causal=mask is None and T > 1, enable_gqa=gqa)
            out = out.transpose(1, 2)
        else:
            kc, vc = cache.k[self.layer_idx], cache.v[self.layer_idx]
            kc[plan.rows, :, plan.cols] = k  # advanced indices first: the value is [B, T, nkv, D]
            vc[plan.rows, :, plan.cols] = v
            s0 = cache.slot_start
            if plan.block_mask is not None:  # flex backend: each row's own keys (docs/design.md §15)
                out = flex_cache_attention(q, kc[s0:s0 + B], vc[s0:s0 + B], plan.block_mask)
            elif plan.bias is not None:  # decode and verification: the whole (contiguous) capacity, biased
                out = small_query_attention(q, kc[s0:s0 + B], vc[s0:s0 + B], plan.bias, plan.n_keys)
            else:
                L = plan.length
                out = F.scaled_dot_product_attention(q.transpose(1, 2), kc[s0:s0 + B, :, :L], vc[s0:s0 + B, :, :L],
                                                     attn_mask=mask, enable_gqa=gqa).transpose(1, 2)
        return self.o_proj(out.reshape(B, T, nh * self.hd))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {cfg.hidden_act!r}: tlt supports 'silu'")
        self.inter = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, input_norm: bool = True):
        super().__init__()
        # The EAGLE drafter's layer has no input norm (its input is already a mix of embedding and hidden state).
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if input_norm else nn.Identity()
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self._weights: LayerWeights | None = None

    def forward(self, x, cos, sin, mask, cache=None, plan=None):
        if plan is not None and plan.bias is not None:  # a few new tokens a row: one fused kernel call if it can
            w, kc = self.weights(), cache.k[self.self_attn.layer_idx]
            if decode_layer_ok(x, w, kc):
                if plan.fused_inputs is None:  # the layers of a forward share cos / sin / plan: convert them once
                    plan.fused_inputs = layer_inputs(cos, sin, plan.cols, plan.n_keys, plan.bias)
                return decode_layer(x, w, kc, cache.v[self.self_attn.layer_idx], cache.slot_start, plan.fused_inputs)
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, plan)
        return x + self.mlp(self.post_attention_layernorm(x))

    def weights(self) -> LayerWeights:
        """The layer's tensors for the fused kernel, gathered once (~70 us of module lookups a call otherwise).
        The parameters are read by pointer at each call, so in-place updates show; the gathering is redone after
        anything that may swap parameter objects (load_state_dict, .to())."""
        if self._weights is None:
            self._weights = self._gather_weights()
        return self._weights

    def _load_from_state_dict(self, *args, **kwargs):
        self._weights = None
        super()._load_from_state_dict(*args, **kwargs)

    def _apply(self, *args, **kwargs):
        self._weights = None
        return super()._apply(*args, **kwargs)

    def _gather_weights(self) -> LayerWeights:
        a, norm = self.self_attn, self.input_layernorm
        return LayerWeights(None if isinstance(norm, nn.Identity) else norm.weight, self.post_attention_layernorm.weight,
                            None if a.q_norm is None else a.q_norm.weight,
                            None if a.k_norm is None else a.k_norm.weight,
                            self.post_attention_layernorm.eps, a.qkv_proj.weight, a.qkv_proj.bias, a.o_proj.weight,
                            self.mlp.gate_up_proj.weight, self.mlp.down_proj.weight, a.nh, a.nkv)


@dataclass
class CachePlan:
    """Where a cached forward writes its new K/V and what its small-query attention adds to the scores."""
    rows: torch.Tensor             # [B, T] cache slots of the new tokens (slot_start included)
    cols: torch.Tensor             # [B, T] cache positions of the new tokens
    length: int                    # keys to attend over: max cached + S + T
    bias: torch.Tensor | None      # [B, 1, 1, T, capacity] 0 / -inf for few new tokens (see cache_mask); else None
    n_keys: torch.Tensor           # [B] keys row b attends over at most: cached + S + T
    fused_inputs: LayerInputs | None = None  # the fused layer's fp32 / int64 copies, made by its first layer
    block_mask: object | None = None  # the flex backend's BlockMask (tlt.models.flex); then bias is None


def cache_mask(cache: CacheView, T: int, device, fused: bool = False) -> tuple[torch.Tensor, CachePlan]:
    """Attention mask [B, 1, T, L] and the write plan for T new tokens per row (with the small-query bias up to
    FUSED_QUERY_CPU new tokens when `fused`: the caller's layers run the fused kernel).

    Keys before `cache_lens` are visible to every new token; the S + T keys after it (speculative entries of this
    step, then the new tokens, written right after them) follow `tree_mask`.
    """
    lens = cache.cache_lens
    B = lens.shape[0]
    tree = cache.tree_mask
    S = 0 if tree is None else tree.shape[-1] - T
    L = cache.k[0].shape[2] if cache.static else (int(lens.max()) if cache.max_len is None else cache.max_len) + S + T
    rows = (torch.arange(B, device=device) + cache.slot_start)[:, None].expand(B, T)
    cols = lens[:, None] + S + torch.arange(T, device=device)  # [B, T] cache positions of the new tokens
    key = torch.arange(L, device=device)
    mask = (key[None, None, :] < lens[:, None, None]).expand(B, T, L).clone()  # committed prefix: always visible
    if tree is None:
        tree = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    tree_cols = lens[:, None] + torch.arange(S + T, device=device)  # [B, S + T]
    # Place the speculative block at each row's own offset (rows have different cache lengths).
    mask.scatter_(2, tree_cols[:, None, :].expand(B, T, S + T), tree.expand(B, T, S + T))
    mask = mask[:, None]
    small = FUSED_QUERY_CPU if fused else SMALL_QUERY_CPU if torch.device(device).type == "cpu" else SMALL_QUERY
    bias = attention_bias(mask, cache.k[0].shape[2], cache.k[0].dtype) if T <= small else None
    return mask, CachePlan(rows, cols, L, bias, lens + S + T)


def flex_plan(cache: CacheView, T: int, device) -> CachePlan:
    """cache_mask's write plan for the flex backend: the BlockMask instead of a dense mask or bias."""
    lens = cache.cache_lens
    B, S = lens.shape[0], 0 if cache.tree_mask is None else cache.tree_mask.shape[-1] - T
    rows = (torch.arange(B, device=device) + cache.slot_start)[:, None].expand(B, T)
    cols = lens[:, None] + S + torch.arange(T, device=device)
    capacity = cache.k[0].shape[2]
    return CachePlan(rows, cols, capacity, None, lens + S + T,
                     block_mask=block_mask(lens, cache.tree_mask, T, capacity))


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # cached forwards of up to FLEX_MAX_QUERY new tokens: "sdpa" (bias / mask over the capacity) or "flex"
        # (tlt.models.flex; set by the engine from rollout.attention); flex_in_graphs: graphed (static) forwards too
        self.attention_backend = "sdpa"
        self.flex_in_graphs = True
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                cache: CacheView | None = None, attn_mask: torch.Tensor | PackedRows | None = None) -> torch.Tensor:
        """input_ids, positions [B, T] -> last hidden state [B, T, H] (post final norm).

        attn_mask (no cache only): [B, T, T] bool, True = may attend, or the PackedRows layout of prompt-sharing
        training rows; None = causal.
        """
        B, T = input_ids.shape
        if positions is None:
            positions = torch.arange(T, device=input_ids.device).expand(B, T)
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        plan = None
        if cache is not None and self._flex(cache, T):
            mask, plan = None, flex_plan(cache, T, input_ids.device)
        elif cache is not None:
            fused = SMALL_QUERY_CPU < T <= FUSED_QUERY_CPU and decode_layer_ok(x, self.layers[0].weights(), cache.k[0])
            mask, plan = cache_mask(cache, T, input_ids.device, fused)
        elif isinstance(attn_mask, PackedRows):
            mask = attn_mask if input_ids.device.type == "cpu" else attn_mask.dense_mask(T, input_ids.device)[:, None]
        else:
            mask = None if attn_mask is None else attn_mask[:, None]
        for layer in self.layers:
            x = layer(x, cos, sin, mask, cache, plan)
        return self.norm(x)

    def forward_nodes(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: CacheView,
                      nodes: torch.Tensor) -> torch.Tensor | None:
        """A cached forward of some of the new tokens only: input_ids, positions [B, T] and cache (with its tree_mask)
        as for `forward`, nodes [B, T] bool, the tokens to compute (every ancestor of one among them: the tree mask
        lets a token see its ancestors, whose K/V must be this step's) -> last hidden state [N, H] of those tokens in
        row-major order, their K/V written as `forward` writes them; the others' cache positions keep what they held
        (finite values, as the zero-filled KVCache's are: the attention kernel skips masked keys by their score) and
        are masked out. None where the fused CPU layer does not serve (then run `forward`). Each token is computed
        alone as one query row at its sequence's cache slot, with the fused layer's kernels, which compute every row
        alone: its bits are those plain decoding's rows get, and `forward`'s wherever that runs the fused layer (up
        to 512 rows). Verification of drafts of unequal length (n-gram rows with shorter or no drafts) then costs the
        N tokens drafted instead of B * T (docs/design.md §9)."""
        B, T = input_ids.shape
        if T > SMALL_QUERY_CPU or self._flex(cache, T):
            return None
        b, t = nodes.nonzero(as_tuple=True)
        x = self.embed_tokens(input_ids[b, t])[:, None]  # [N, 1, H]
        if not all(decode_layer_ok(x, layer.weights(), cache.k[0]) for layer in self.layers):
            return None
        _, full = cache_mask(cache, T, input_ids.device)  # the padded forward's plan, one query row a token
        slots = b + cache.slot_start
        cos, sin = self.rotary(positions[b, t][:, None], x.dtype)
        plan = CachePlan(slots[:, None], full.cols[b, t][:, None], full.length, full.bias[b, :, :, t][:, :, :, None],
                         full.n_keys[b])
        plan.fused_inputs = layer_inputs(cos, sin, plan.cols, plan.n_keys, plan.bias, slots)
        for layer in self.layers:
            x = layer(x, cos, sin, None, cache, plan)
        return self.norm(x)[:, 0]

    def _flex(self, cache: CacheView, T: int) -> bool:
        return self.attention_backend == "flex" and T <= FLEX_MAX_QUERY and (self.flex_in_graphs or not cache.static)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> fp32 logits [..., V] (a bf16 model on the bf16 kernel: its fp32 sums, not rounded to bf16)."""
        return linear(hidden, self.lm_head_weight, out_fp32=True)
