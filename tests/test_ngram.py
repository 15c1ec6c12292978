"""N-gram drafter: own-context, sibling and history matches, longest n first, incremental updates, trees."""
from __future__ import annotations


import pytest

from tlt.speculative.ngram import NgramDrafter


def test_own_context_match_and_incremental_update():
    d = NgramDrafter(max_n=3, min_n=2, num_draft_tokens=3)
    d.register("a", group_id=0, prompt_key="p", token_ids=[1, 2, 3, 4, 5, 9, 1, 2])
    assert d.propose("a") == [3, 4, 5]      # suffix (1, 2) occurred before, followed by 3 4 5
    d.update("a", [3])
    assert d.propose("a", k=2) == [4, 5]    # now (1, 2, 3) matches: longest n
    d.update("a", [7])                      # (2, 3, 7) / (3, 7) never seen
    assert d.propose("a") == []


def test_index_is_built_only_for_proposals_and_matches_eager_indexing():
    import random
    rng = random.Random(0)
    d = NgramDrafter(max_n=4, min_n=2, num_draft_tokens=3)
    d.register("a", 0, "p", [rng.randrange(6) for _ in range(30)])
    d.register("b", 0, "p", [rng.randrange(6) for _ in range(30)])
    for _ in range(50):
        d.update("a", [rng.randrange(6)])
        d.update("b", [rng.randrange(6)])
    assert d.seqs["a"].index == {} and d.seqs["b"].index == {}  # decoding without n-gram drafts indexes nothing

    def eager(toks):  # every n-gram ending before position e -> the latest such e
        return {tuple(toks[e - n:e]): e for e in range(1, len(toks)) for n in range(2, min(4, e) + 1)}
    for step in range(40):
        d.propose("a")  # indexes a's own tokens and its sibling b's, as far as each has grown
        assert d.seqs["a"].index == eager(d.seqs["a"].tokens)
        assert d.seqs["b"].index == eager(d.seqs["b"].tokens)
        d.update("a", [rng.randrange(6)] * (step % 3))
        d.update("b", [rng.randrange(6)])


def test_lazy_index_proposes_what_eager_indexing_does():
    """Random groups over three prompts, epochs with history, finished siblings, chains and trees: the lazy index
    proposes exactly what one brought up to date on every token does."""
    import random

    class Eager(NgramDrafter):
        def register(self, seq_id, group_id, prompt_key, token_ids):
            super().register(seq_id, group_id, prompt_key, token_ids)
            for s in [self.seqs[seq_id], *self.group_history[group_id]]:
                self._indexed(s)

        def update(self, seq_id, new_tokens):
            super().update(seq_id, new_tokens)
            self._indexed(self.seqs[seq_id])

    rng = random.Random(1)
    lazy, eager = NgramDrafter(max_n=3, min_n=1, num_draft_tokens=4), Eager(max_n=3, min_n=1, num_draft_tokens=4)
    prompts = {p: [rng.randrange(5) for _ in range(rng.randrange(3, 12))] for p in range(3)}
    for epoch in range(4):
        for g, p in enumerate(prompts):
            gid, members = (epoch, g), [(epoch, g, i) for i in range(3)]
            for d in (lazy, eager):
                for m in members:
                    d.register(m, gid, p, prompts[p])
            running = list(members)
            while running:
                m = rng.choice(running)
                assert lazy.propose(m) == eager.propose(m)
                toks = [rng.randrange(5) for _ in range(rng.randrange(1, 4))]
                done = rng.random() < 0.15
                for d in (lazy, eager):
                    d.update(m, toks)
                    if done:
                        d.finish(m)
                if done:
                    running.remove(m)


def test_longest_n_wins_over_recency():
    d = NgramDrafter(max_n=3, min_n=1, num_draft_tokens=1)
    d.register("a", 0, "p", [5, 1, 2, 8, 0, 2, 6, 1, 2])
    # (1, 2) was followed by 8; the 1-gram (2,) was last followed by 6: the longer match wins
    assert d.propose("a") == [8]


def test_siblings_and_history():
    d = NgramDrafter(max_n=4, min_n=2, num_draft_tokens=4)
    prompt = [100, 101]
    d.register("a", "g1", "p", prompt + [1, 2, 3, 4, 5, 6])
    d.register("b", "g1", "p", prompt + [7, 1, 2])
    assert d.propose("b") == [3, 4, 5, 6]   # copied from sibling a
    d.finish("a")
    assert d.propose("b") == [3, 4, 5, 6]   # finished siblings stay visible to the group
    d.update("b", [3, 9, 9])
    d.finish("b")
    assert d.stats() == {"running": 0, "groups": 0, "history_prompts": 1}
    # next epoch: a new group for the same prompt sees both earlier responses (newest first)
    d.register("c", "g2", "p", prompt + [2, 3])
    assert d.propose("c") == [4, 5, 6]      # b (newest) offers 9 9, a offers 4 5 6: no full k, longest wins
    assert d.propose("c", k=2) == [9, 9]    # both full: newest first
    d.register("x", "g3", "other", [1, 2])
    assert d.propose("x") == []             # history is keyed by prompt
    with pytest.raises(KeyError):
        d.update("a", [1])
    with pytest.raises(ValueError):
        d.register("c", "g2", "p", [1])


def test_clear_history_forgets_earlier_responses():
    """A re-run of the same request must not draft from its own earlier response. Control: without clearing, it
    does (the whole response comes back as a draft)."""
    for clear in (False, True):
        d = NgramDrafter(max_n=2, min_n=2, num_draft_tokens=4)
        d.register("a", "g1", "p", [100, 101, 1, 2, 3, 4, 5])
        d.finish("a")
        if clear:
            d.clear_history()
        d.register("b", "g2", "p", [100, 101])
        assert d.propose("b") == ([] if clear else [1, 2, 3, 4])
        assert d.stats()["history_prompts"] == (0 if clear else 1)


def test_history_is_bounded():
    d = NgramDrafter(max_history=2, max_history_prompts=3)
    for i in range(10):
        d.register(i, i, i % 5, [1, 2, 3, i])
        d.finish(i)
    assert len(d.history) == 3 and all(len(h) <= 2 for h in d.history.values())
