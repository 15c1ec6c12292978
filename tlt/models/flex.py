"""FlexAttention backend for cached forwards with a few new tokens a row (decode, chain and tree verification).

The default (sdpa) path attends over the cache's whole capacity under a bias (small_query_attention) or over the
longest row's length under a mask: every row pays for the longest. Here the same mask is a FlexAttention
`mask_mod` read from per-row length tensors, and its block-sparse layout is computed from those lengths directly
(`block_mask`, once a forward, shared by every layer), so a compiled kernel (CUDA) skips the key blocks past each
row's own cached length + its S + T speculative / new keys. On CPU flex_attention runs eagerly (unfused, every key
scored then masked by mask_mod, the block layout unused): the same numbers, for tests, not speed.
See docs/design.md §15.
"""
from __future__ import annotations

import warnings

import torch

BACKENDS = ("auto", "sdpa", "flex")
FLEX_MAX_QUERY = 64  # new tokens per row up to which a cached forward uses flex (prefill chunks stay on sdpa)
BLOCK = 128  # keys (and queries) a block of the block mask: FlexAttention's default sparse block

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
    """The BlockMask of B rows (lens [B] cached tokens each) with T new tokens over `capacity` keys, computed from
    the lengths by a few [B, capacity / 128] tensor ops: no mask_mod evaluated over B x T x capacity, no host read,
    static shapes (built inside a captured graph). Per row, the key blocks wholly before lens[b] are full (every
    query sees all their keys: the kernel skips mask_mod there); the blocks holding keys lens[b] .. lens[b] + S + T - 1
    are partial (mask_mod decides each key); the rest are skipped. Every query block lists the same blocks (a
    superset where T spans several). extra_keys > 0 widens every row's visible prefix by that many keys: a
    deliberately wrong mask (tests' control)."""
    from torch.nn.attention.flex_attention import BlockMask
    B, dev = lens.shape[0], lens.device
    S = 0 if tree is None else tree.shape[-1] - T
    if tree is not None:
        tree = tree.expand(B, T, S + T)
    seen = lens + extra_keys
    num_kv, num_q = -(-capacity // BLOCK), -(-T // BLOCK)
    blocks = torch.arange(num_kv, dtype=torch.int32, device=dev)
    full = (seen // BLOCK).to(torch.int32)                                       # [B] blocks before lens[b]
    last = ((seen + S + T - 1) // BLOCK).to(torch.int32).clamp(max=num_kv - 1)  # [B] the last block with a new key
    partial = (full[:, None] + blocks).clamp(max=num_kv - 1)  # [B, num_kv]: the first last - full + 1 are listed

    def per_query_block(x: torch.Tensor) -> torch.Tensor:  # [B, ...] -> [B, 1, num_q, ...]
        return x.view(B, 1, 1, *x.shape[1:]).expand(B, 1, num_q, *x.shape[1:]).contiguous()
    return BlockMask.from_kv_blocks(per_query_block(last - full + 1), per_query_block(partial),
                                    per_query_block(full), per_query_block(blocks.expand(B, num_kv)),
                                    BLOCK_SIZE=BLOCK, mask_mod=cache_mask_mod(seen, tree, S, T),
                                    seq_lengths=(T, capacity), compute_q_blocks=False)


def flex_cache_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
    """q [B, T, nh, D], k / v [B, nkv, capacity, D] (the rows' cache slots), mask from `block_mask`
    -> [B, T, nh, D]."""
    global _compiled
    from torch.nn.attention.flex_attention import flex_attention
    fn = flex_attention
    if q.device.type == "cuda":  # the fused, block-sparse kernel
        if _compiled is None:
            # dynamic shapes: one kernel for every batch bucket, query length and cache capacity. Compiled per
            # shape, a rollout's shapes pass dynamo's recompile limit (8) and flex falls back to its eager
            # implementation, which cannot run inside CUDA graph capture (docs/design.md §15)
            _compiled = torch.compile(flex_attention, dynamic=True)
        fn = _compiled
    with warnings.catch_warnings():  # CPU: the eager (unfused) implementation, on purpose
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        out = fn(q.transpose(1, 2), k, v, block_mask=mask, enable_gqa=k.shape[1] != q.shape[2])
    return out.transpose(1, 2)


def resolve_backend(name: str, device: torch.device) -> tuple[str, bool]:
    """(backend, whether graphed forwards may use it).

    auto -> sdpa; flex -> flex (any device: eager on CPU); sdpa -> sdpa. flex is opt-in: on an H100 its compiled
    kernel, compiled per shape, fell back to the eager implementation mid-rollout, which breaks CUDA graph capture
    (docs/design.md §15). On CUDA, flex first runs a probe over several shapes; graphed forwards use it only where
    the probe also captures into a CUDA graph and replays right, else they stay on sdpa. Unknown names raise
    ValueError."""
    if name not in BACKENDS:
        raise ValueError(f"attention backend {name!r}: choose one of {', '.join(BACKENDS)}")
    if name == "flex" and not flex_available():
        raise ValueError("attention backend 'flex' needs torch.nn.attention.flex_attention (torch >= 2.5)")
    if name != "flex":
        return "sdpa", True
    if device.type != "cuda":
        return "flex", True  # nothing is captured off CUDA
    _probe(device, capture=False)  # a torch build whose compiled flex kernel fails raises here, not mid-rollout
    try:
        _probe(device, capture=True)
    except Exception as exc:  # noqa: BLE001 - any failure means: graphed forwards keep sdpa
        warnings.warn(f"FlexAttention does not capture into a CUDA graph here ({type(exc).__name__}: {exc}); "
                      f"graphed decode / verify forwards stay on sdpa")
        return "flex", False
    return "flex", True


PROBE_SHAPES = ((2, 1, 256), (5, 1, 512), (3, 4, 768), (12, 9, 1024))  # (rows, new tokens a row, capacity)


def _probe(device: torch.device, capture: bool) -> None:
    """Flex calls at several shapes (rows, new tokens, capacity), as a rollout's buckets and cache growth make
    them, each against the eager implementation; with `capture`, each built and run inside a CUDA graph whose
    replay after new lengths must match an eager call."""
    from torch.nn.attention.flex_attention import flex_attention
    g = torch.Generator(device="cpu").manual_seed(0)
    for B, T, cap in PROBE_SHAPES:
        q = torch.randn(B, T, 2, 16, generator=g).to(device)
        k, v = (torch.randn(B, 1, cap, 16, generator=g).to(device) for _ in range(2))
        lens = torch.randint(1, cap - T, (B,), generator=g).to(device)

        def run():
            return flex_cache_attention(q, k, v, block_mask(lens, None, T, cap))

        def reference():  # the eager (unfused) implementation
            mask = block_mask(lens, None, T, cap)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
                return flex_attention(q.transpose(1, 2), k, v, block_mask=mask, enable_gqa=True).transpose(1, 2)
        out = run()
        if not capture:
            if not torch.allclose(out, reference(), atol=1e-4):
                raise RuntimeError(f"compiled flex attention differs from eager at shape {(B, T, cap)}")
            continue
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run()
        lens.copy_(torch.randint(1, cap - T, (B,), generator=g))
        graph.replay()
        torch.cuda.synchronize()
        if not torch.allclose(out, reference(), atol=1e-4):
            raise RuntimeError(f"a replayed block mask did not follow the new lengths at shape {(B, T, cap)}")
