"""FlexAttention backend for cached forwards with a few new tokens a row (decode, chain and tree verification).

The default (sdpa) path attends over the cache's whole capacity under a bias (small_query_attention) or over the
longest row's length under a mask: every row pays for the longest. Here the same mask is a FlexAttention
`mask_mod` read from per-row length tensors; `create_block_mask` turns it into a block-sparse mask, so a compiled
kernel (CUDA) skips the key blocks past each row's own cached length + its S + T speculative / new keys. On CPU
flex_attention runs eagerly (unfused, every key scored then masked): the same numbers, for tests, not speed.
See docs/design.md §17.
"""
from __future__ import annotations

import warnings

import torch

BACKENDS = ("auto", "sdpa", "flex")
FLEX_MAX_QUERY = 64  # new tokens per row up to which a cached forward uses flex (prefill chunks stay on sdpa)

_compiled = None


def flex_available() -> bool:
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def cache_mask_mod(lens: torch.Tensor, tree: torch.Tensor | None, S: int, T: int):
    """mask_mod(b, h, q, kv) of cached attention: keys before lens[b] are visible; the S + T keys from lens[b] on
    (this step's speculative entries, then the new tokens) follow tree [B, T, S + T] (None: causal, S = 0)."""
    def mask_mod(b, h, q, kv):
        off = kv - lens[b]
        if tree is None:
            return off <= q
        inside = (off >= 0) & (off < S + T)
        return (off < 0) | (inside & tree[b, q, off.clamp(0, S + T - 1)])
    return mask_mod


def block_mask(lens: torch.Tensor, tree: torch.Tensor | None, T: int, capacity: int, extra_keys: int = 0):
    """The BlockMask of B rows (lens [B] cached tokens each) with T new tokens over `capacity` keys.
    extra_keys > 0 widens every row's visible prefix by that many keys: a deliberately wrong mask (tests' control)."""
    from torch.nn.attention.flex_attention import create_block_mask
    B = lens.shape[0]
    S = 0 if tree is None else tree.shape[-1] - T
    if tree is not None:
        tree = tree.expand(B, T, S + T)
    seen = lens + extra_keys
    return create_block_mask(cache_mask_mod(seen, tree, S, T), B, None, T, capacity, device=lens.device)


def flex_cache_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
    """q [B, T, nh, D], k / v [B, nkv, capacity, D] (the rows' cache slots), mask from `block_mask`
    -> [B, T, nh, D]."""
    global _compiled
    from torch.nn.attention.flex_attention import flex_attention
    fn = flex_attention
    if q.device.type == "cuda":  # the fused, block-sparse kernel
        if _compiled is None:
            _compiled = torch.compile(flex_attention, dynamic=False)
        fn = _compiled
    with warnings.catch_warnings():  # CPU: the eager (unfused) implementation, on purpose
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        out = fn(q.transpose(1, 2), k, v, block_mask=mask, enable_gqa=k.shape[1] != q.shape[2])
    return out.transpose(1, 2)


def resolve_backend(name: str, device: torch.device) -> str:
    """auto -> flex on CUDA where FlexAttention imports and runs a tiny call, else sdpa; flex -> flex (any
    device: eager on CPU); sdpa -> sdpa. Unknown names raise ValueError."""
    if name not in BACKENDS:
        raise ValueError(f"attention backend {name!r}: choose one of {', '.join(BACKENDS)}")
    if name != "auto":
        if name == "flex" and not flex_available():
            raise ValueError("attention backend 'flex' needs torch.nn.attention.flex_attention (torch >= 2.5)")
        return name
    if device.type != "cuda" or not flex_available():
        return "sdpa"
    try:  # one tiny call: a torch build whose compiled flex kernel fails falls back here, not mid-rollout
        lens = torch.tensor([1, 3], device=device)
        q = torch.zeros(2, 1, 2, 16, device=device)
        kv = torch.zeros(2, 1, 8, 16, device=device)
        flex_cache_attention(q, kv, kv, block_mask(lens, None, 1, 8))
    except Exception as exc:  # noqa: BLE001 - any failure means: keep the current path
        warnings.warn(f"FlexAttention failed on {device} ({type(exc).__name__}: {exc}); attention stays on sdpa")
        return "sdpa"
    return "flex"
