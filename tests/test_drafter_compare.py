"""The per-step drafter comparison (tlt.drafter_train.compare): its accept-length proxy and the n-gram simulation."""
import torch

from tlt.drafter_train.compare import accept_from_hits, ngram_hits


def test_accept_from_hits_counts_runs_and_caps_at_depth():
    hits = torch.tensor([1, 1, 0, 1, 1, 1, 1, 0], dtype=torch.bool)
    assert accept_from_hits(hits, depth=8).tolist() == [3, 2, 1, 5, 4, 3, 2, 1]
    assert accept_from_hits(hits, depth=2).tolist() == [3, 2, 1, 3, 3, 3, 2, 1]
    assert accept_from_hits(torch.zeros(0, dtype=torch.bool)).numel() == 0
    # packed rows: a run stops where the segment (window) changes
    seg = torch.tensor([[0, 0, 0, 1, 1, 1, 1, -1]])
    assert accept_from_hits(hits[None], seg_ids=seg).tolist() == [[3, 2, 1, 5, 4, 3, 2, 1]]
    assert accept_from_hits(torch.ones(1, 6, dtype=torch.bool), seg_ids=torch.tensor([[0, 0, 1, 1, 1, 2]])).tolist() \
        == [[3, 2, 4, 3, 2, 2]]


def test_ngram_hits_copy_a_sibling_in_lockstep_but_not_the_future():
    prompt = [1, 2, 3]
    response = [10, 11, 12, 13, 14, 15, 16, 17]
    top1 = torch.tensor(response)  # the target agrees with the sampled tokens
    # alone, a response with no repeats gives the n-gram drafter nothing to copy
    assert not ngram_hits(prompt, [response], 0, top1, max_n=2, min_n=1).any()
    # a sibling that is one token AHEAD is copied from: after one shared token every later one is predicted
    ahead = [10, 11, 12, 13, 14, 15, 16, 17, 18]
    hits = ngram_hits(prompt, [response, ahead[1:]], 0, top1, max_n=2, min_n=1)
    assert hits.shape == (len(response) - 1,)
    assert not hits[0] and hits[1:].all()  # position 1 has no shared n-gram yet; from 2 on the sibling leads
    # lockstep: at position t the sibling holds only t tokens, so an identical sibling never shows the next one
    same = ngram_hits(prompt, [response, list(response)], 0, top1, max_n=2, min_n=1)
    assert not same.any()
    # a target that disagrees with the copied continuation scores no hit (the proxy checks the target's top-1)
    prefix_twice = [7, 8, 9, 7, 8, 9, 7, 8]
    assert ngram_hits(prompt, [prefix_twice], 0, torch.tensor(prefix_twice), max_n=2, min_n=1)[3:].all()
    assert not ngram_hits(prompt, [prefix_twice], 0, torch.full((8,), 99), max_n=2, min_n=1).any()
