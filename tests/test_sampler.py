"""The logit transform every sampled token goes through (tlt.engine.sampler.transform_logits), against
transformers' own logits processors and against itself row by row in mixed batches."""
from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from tlt.engine.sampler import transform_logits

V = 257


def _hf_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """One row set through transformers' warpers in generate()'s order (temperature, top-k, top-p), then softmax."""
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k > 0:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores.softmax(-1)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 20, 1.0), (0.6, 0, 0.9),
                                                     (1.3, 50, 0.8), (1.0, 5, 0.5), (0.9, 0, 0.3)])
def test_transform_matches_transformers_warpers(temperature, top_k, top_p):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(16, V, generator=g) * 3
    ours = transform_logits(logits, torch.full((16,), temperature), torch.full((16,), top_k),
                            torch.full((16,), top_p))
    theirs = _hf_probs(logits, temperature, top_k, top_p)
    assert torch.equal(ours > 0, theirs > 0)  # the same support: the same tokens kept by top-k and top-p
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)


def test_each_row_is_transformed_as_if_alone_in_a_mixed_batch():
    """Rows with top_p = 1 (or top_k off) keep their distribution bit for bit when another row in the batch uses
    top-p or top-k: a seeded request then samples the same token whatever shares its batch, with SD on or off."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(6, V, generator=g) * 2
    temperature = torch.tensor([1.0, 0.7, 1.0, 0.0, 1.2, 1.0])
    top_k = torch.tensor([0, 0, 40, 0, 0, 10])
    top_p = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.85, 0.6])
    batch = transform_logits(logits, temperature, top_k, top_p)
    for i in range(6):
        alone = transform_logits(logits[i:i + 1], temperature[i:i + 1], top_k[i:i + 1], top_p[i:i + 1])
        assert torch.equal(batch[i:i + 1], alone), f"row {i} depends on the rest of its batch"


def test_nucleus_keeps_the_smallest_prefix_reaching_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = transform_logits(logits, torch.ones(1), torch.zeros(1, dtype=torch.long), torch.tensor([0.8]))
    torch.testing.assert_close(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
