"""Scheduler: admission under a KV-cache budget, slot assignment and compaction.

A sequence is admitted only if, with it, every running sequence still fits in the budget at its worst-case
length (prompt + max_tokens) plus the speculator's headroom: generation can never run out of KV memory
mid-sequence, so there is no OOM and no preemption. Running sequences hold slots 0..B-1 in slot order. Within
one admission, sequences whose prompt is already in the block (the n samples of a request, GRPO's group) take the
slots after all first occurrences, so the runner prefills each distinct prompt once, in consecutive slots, and
copies its K/V to the others.
"""
from __future__ import annotations

from collections import deque

from tlt.engine.kv_cache import KVCache
from tlt.engine.sequence import Sequence, Status


class Scheduler:
    def __init__(self, kv: KVCache, max_num_seqs: int, max_cache_tokens: int | None = None,
                 max_len: int | None = None):
        self.kv = kv
        self.max_len = max_len  # the engine's context limit: no sequence gets longer (plus the headroom)
        self.max_num_seqs = min(max_num_seqs, kv.num_slots)
        self.max_cache_tokens = max_cache_tokens  # positions over all slots; None: only max_num_seqs bounds
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.slot_caches: list[KVCache] = []  # slot-indexed caches that move with their rows (drafter's)
        # positions past a sequence's worst-case length that a step may write (a speculator's drafts and padding):
        # reserved at admission, so no cache grows mid-rollout, which would drop every CUDA graph reading it
        self.headroom = 0

    def add_slot_cache(self, cache: KVCache) -> None:
        """Another slot-indexed cache whose rows move with the target's when the batch is compacted."""
        self.slot_caches.append(cache)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def admit(self) -> list[Sequence]:
        """Move waiting sequences into free slots while the worst-case cache footprint fits the budget."""
        admitted = []
        longest = max((s.max_total_len for s in self.running), default=0)
        while self.waiting and len(self.running) + len(admitted) < self.max_num_seqs:
            seq = self.waiting[0]
            new_longest = max(longest, seq.max_total_len)
            n = len(self.running) + len(admitted)
            if (self.max_cache_tokens is not None and n
                    and (n + 1) * (new_longest + self.headroom) > self.max_cache_tokens):
                break  # the worst case of the rows admitted together: each at the longest length plus headroom
            self.waiting.popleft()
            longest = new_longest
            admitted.append(seq)
        admitted = distinct_prompts_first(admitted)
        for seq in admitted:
            seq.status, seq.slot = Status.RUNNING, len(self.running)
            self.running.append(seq)
        if admitted:
            # the most positions a row can need, and no more than the budget leaves each of the rows that may run
            # (capacity never shrinks, and later admissions add slots)
            limits = [self.max_len + self.headroom] if self.max_len is not None else []
            if self.max_cache_tokens is not None:
                limits.append(self.max_cache_tokens // self.max_num_seqs)
            for cache in [self.kv, *self.slot_caches]:  # the slot caches are slot-indexed like the target's
                cache.ensure_capacity(longest + self.headroom, len(self.running), limit=min(limits, default=None))
        return admitted

    def finish(self, done: list[Sequence]) -> None:
        """Drop finished sequences and move the highest live slots into the holes they leave."""
        if not done:
            return
        for seq in done:
            seq.status = Status.FINISHED
        self.running = [s for s in self.running if s.status is Status.RUNNING]
        n = len(self.running)
        holes = sorted({s.slot for s in done if s.slot < n})
        movers = [s for s in self.running if s.slot >= n]
        for hole, seq in zip(holes, movers):
            for cache in [self.kv, *self.slot_caches]:
                cache.move(seq.slot, hole, min(seq.num_cached + 1, cache.capacity))
            seq.slot = hole
        for seq in done:
            seq.slot = -1
        self.running.sort(key=lambda s: s.slot)


def distinct_prompts_first(seqs: list[Sequence]) -> list[Sequence]:
    """seqs reordered (stably) so that each prompt's first occurrence comes before every repeat of a prompt."""
    seen: set[tuple[int, ...]] = set()
    first, repeats = [], []
    for s in seqs:
        key = tuple(s.prompt_ids)
        (repeats if key in seen else first).append(s)
        seen.add(key)
    return first + repeats
