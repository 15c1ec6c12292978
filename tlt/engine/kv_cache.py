"""Slot KV cache: running sequences occupy slots 0..B-1 contiguously, so a decode step reads one slice.

Each layer holds K and V as [num_slots, num_kv_heads, capacity, head_dim]. When a sequence finishes, the last
running slot moves into its place (one copy per layer), keeping the running rows contiguous. Capacity along the
length grows on demand (rounded up), and so do the slots (up to num_slots, rounded up to slot_round): memory
follows the longest running sequence and the number running, not the context limit times max_num_seqs.

A growth allocates every layer's K and V afresh and copies the old ones in: on a 2-core CPU 0.4-0.8 s for
SmolLM2-135M at 48 slots x 512 positions, mostly page faults. So the length grows by at least a quarter of what
it had (`growth`), and straight to `limit` (the longest a sequence can get, or the positions a KV budget leaves a
row, when the caller knows it; not past it but for the rounding) once the length asked is over half of that:
memory stays within twice the longest sequence, and an RL run, whose prompts differ by a few tokens a step,
allocates once instead of at every step that brings a longer prompt (docs/design.md §10).
"""
from __future__ import annotations

import torch

from tlt.device import host_tensor
from tlt.models.config import ModelConfig
from tlt.models.decoder import CacheView


class KVCache:
    def __init__(self, cfg: ModelConfig, num_slots: int, dtype: torch.dtype, device: torch.device | str,
                 num_layers: int | None = None, round_to: int = 32, slot_round: int = 8, growth: float = 0.25):
        self.cfg, self.num_slots, self.dtype, self.device = cfg, num_slots, dtype, device
        self.num_layers = num_layers or cfg.num_layers
        self.round_to, self.slot_round = round_to, slot_round
        self.growth = growth  # the least a growth adds, as a fraction of the length held (0: what is asked)
        self.capacity = 0
        self.slots = 0  # allocated slots (<= num_slots)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []

    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.cfg.num_kv_heads * self.cfg.head_dim * torch.finfo(self.dtype).bits // 8

    def ensure_capacity(self, length: int, slots: int | None = None, limit: int | None = None) -> None:
        """At least `length` positions for at least `slots` slots (default: those allocated, at least one);
        `limit`: the most positions any sequence can need, where the caller knows it (see the module's doc)."""
        slots = max(slots or 0, self.slots, 1)
        if slots > self.num_slots:
            raise ValueError(f"{slots} slots requested, the cache has {self.num_slots}")
        if length <= self.capacity and slots <= self.slots:
            return
        new_cap = self.capacity
        if length > self.capacity:
            want = max(length, self.capacity + int(self.capacity * self.growth))
            if limit is not None:  # a row past the limit (one a KV budget cannot hold) gets what it asks
                cap = max(length, limit)
                want = cap if 2 * length > limit else min(want, cap)
            new_cap = -(-want // self.round_to) * self.round_to
        new_slots = self.slots if slots <= self.slots else min(-(-slots // self.slot_round) * self.slot_round,
                                                               self.num_slots)
        shape = (new_slots, self.cfg.num_kv_heads, new_cap, self.cfg.head_dim)
        new_k = [torch.empty(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        new_v = [torch.empty(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        # each byte written once: the old entries, zeros elsewhere (attention reads masked positions too, which
        # must hold finite values)
        old = self.k + self.v
        for i, new in enumerate(new_k + new_v):
            if old:
                new[:self.slots, :, :self.capacity] = old[i]
            new[:self.slots, :, self.capacity:].zero_()
            new[self.slots:].zero_()
        self.k, self.v, self.capacity, self.slots = new_k, new_v, new_cap, new_slots

    def release(self) -> None:
        """Free every K/V tensor (the engine's sleep); ensure_capacity allocates afresh at the next request."""
        self.k, self.v, self.capacity, self.slots = [], [], 0, 0

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy slot src's first `length` positions into slot dst (compaction after a sequence finishes)."""
        for t in self.k + self.v:
            t[dst, :, :length] = t[src, :, :length]

    def move_positions(self, rows: list[int], src: list[int], dst: list[int]) -> None:
        """Within each listed row, copy the K/V at position src[i] to dst[i] (SD's accepted nodes into place)."""
        dev = self.k[0].device
        r, s_, d_ = host_tensor([rows, src, dst], dev)  # one copy, not waited for
        for t in self.k + self.v:
            t[r, :, d_] = t[r, :, s_]

    def view(self, cache_lens: torch.Tensor, slot_start: int = 0, tree_mask: torch.Tensor | None = None,
             static: bool = False, max_len: int | None = None) -> CacheView:
        """static: masks over the whole capacity, no host read of cache_lens (a CUDA graph's forward); max_len: the
        largest of cache_lens, known on the host (an eager forward's mask then reads nothing either)."""
        return CacheView(self.k, self.v, cache_lens, slot_start, tree_mask, static, max_len)
