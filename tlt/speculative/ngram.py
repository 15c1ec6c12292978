"""Model-free drafter: n-gram / suffix matching over the sequence itself, its GRPO siblings and past responses.

A proposal copies what followed the latest earlier occurrence of the sequence's last n tokens (n from max_n down
to min_n; the longest match wins), searched in three pools, in this order:
  1. the sequence's own prompt + output (reasoning traces repeat themselves),
  2. the sibling responses of the same group (GRPO samples G responses per prompt; they share phrasing),
  3. earlier responses to the same prompt (previous epochs), a history keyed by `prompt_key`.
Drafts are deterministic (no q): verified by the invariant rule (tlt.speculative.verify), and cheap to make.

Cost: each sequence keeps a dict n-gram -> latest position whose token followed it, built lazily: `update` only
appends, and a proposal first indexes the positions its pool members added since their last one (max_n - min_n + 1
dict writes per token), then does one dict lookup per (n, pool member). A sequence no n-gram draft is asked for
costs an append per token (the adaptive policy seldom picks n-gram arms in many buckets).
Memory: finished responses are kept as compact token arrays (at most max_history per prompt, max_history_prompts
prompts, least recently used dropped); a new group for that prompt indexes them again, once, when its proposals
first read them.
"""
from __future__ import annotations

from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Hashable


@dataclass
class _Seq:
    tokens: list[int]                                   # prompt + output so far
    group_id: Hashable
    prompt_key: Hashable
    index: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> position of its continuation
    indexed: int = 1                                    # positions e < indexed have their n-grams in `index`
    done: bool = False


class NgramDrafter:
    def __init__(self, max_n: int = 4, min_n: int = 2, num_draft_tokens: int = 4, max_history: int = 4,
                 max_history_prompts: int = 4096):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n, self.min_n, self.num_draft_tokens = max_n, min_n, num_draft_tokens
        self.max_history, self.max_history_prompts = max_history, max_history_prompts
        self.seqs: dict[Hashable, _Seq] = {}
        self.groups: dict[Hashable, list[Hashable]] = {}
        self.history: OrderedDict[Hashable, deque] = OrderedDict()  # prompt_key -> finished token arrays, newest last
        self.group_history: dict[Hashable, list[_Seq]] = {}  # group_id -> indexed history of its prompt (read-only)

    # ---- bookkeeping ----
    def register(self, seq_id: Hashable, group_id: Hashable, prompt_key: Hashable, token_ids: list[int]) -> None:
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id!r} is already registered")
        seq = _Seq(list(token_ids), group_id, prompt_key)
        self.seqs[seq_id] = seq
        if group_id not in self.groups:  # first member: the prompt's earlier responses, indexed once for the group
            self.groups[group_id] = []
            past = [_Seq(list(toks), None, prompt_key) for toks in self.history.get(prompt_key, ())]
            self.group_history[group_id] = past[::-1]  # newest first
        self.groups[group_id].append(seq_id)

    def update(self, seq_id: Hashable, new_tokens: list[int]) -> None:
        self._get(seq_id).tokens.extend(new_tokens)

    def finish(self, seq_id: Hashable) -> None:
        """Move a finished sequence to the prompt's history; siblings still see it until the group ends."""
        seq = self._get(seq_id)
        seq.done = True
        if self.max_history > 0:
            hist = self.history.setdefault(seq.prompt_key, deque(maxlen=self.max_history))
            hist.append(array("l", seq.tokens))
            self.history.move_to_end(seq.prompt_key)
            while len(self.history) > self.max_history_prompts:
                self.history.popitem(last=False)
        members = self.groups[seq.group_id]
        if all(self.seqs[m].done for m in members):
            for m in members:
                del self.seqs[m]
            del self.groups[seq.group_id], self.group_history[seq.group_id]

    def clear_history(self) -> None:
        """Forget the earlier responses to each prompt (pool 3); running groups keep what they indexed at start.
        A benchmark that decodes the same seeded requests again calls it: the history would hold the very
        responses being decoded."""
        self.history.clear()

    def _get(self, seq_id: Hashable) -> _Seq:
        if seq_id not in self.seqs or self.seqs[seq_id].done:
            raise KeyError(f"sequence {seq_id!r} is not running: register() it first (finished ones are history)")
        return self.seqs[seq_id]

    def _indexed(self, seq: _Seq) -> dict[tuple[int, ...], int]:
        """seq's index, brought up to date: every n-gram that ends right before a position e (so each has a
        continuation), the latest e for each; positions are indexed in order, once."""
        toks, index = seq.tokens, seq.index
        for e in range(seq.indexed, len(toks)):
            for n in range(self.min_n, min(self.max_n, e) + 1):
                index[tuple(toks[e - n:e])] = e
        seq.indexed = len(toks)
        return index

    # ---- proposals ----
    def _pools(self, seq: _Seq, seq_id: Hashable):
        """(tokens, index) of each pool member in priority order: own, siblings, history (newest first)."""
        yield seq.tokens, self._indexed(seq)
        for m in self.groups[seq.group_id]:
            if m != seq_id:
                yield self.seqs[m].tokens, self._indexed(self.seqs[m])
        for h in self.group_history[seq.group_id]:
            yield h.tokens, self._indexed(h)

    def _matches(self, seq_id: Hashable, k: int):
        """Continuations (up to k tokens) at the longest n with any match, in pool priority order."""
        seq = self._get(seq_id)
        toks = seq.tokens
        for n in range(min(self.max_n, len(toks)), self.min_n - 1, -1):
            key = tuple(toks[-n:])
            found = [src[e:e + k] for src, index in self._pools(seq, seq_id) if (e := index.get(key)) is not None]
            if found:
                return found
        return []

    def propose(self, seq_id: Hashable, k: int | None = None) -> list[int]:
        """Up to k draft tokens (possibly none): among the longest-n matches, the first (in pool priority) that
        gives all k tokens, else the longest."""
        k = self.num_draft_tokens if k is None else k
        found = self._matches(seq_id, k)
        full = [c for c in found if len(c) == k]
        return full[0] if full else max(found, key=len, default=[])

    def stats(self) -> dict[str, int]:
        """What the drafter holds: running sequences, their groups, prompts with a history (bounded: max_history*)."""
        return {"running": sum(not s.done for s in self.seqs.values()), "groups": len(self.groups),
                "history_prompts": len(self.history)}
