"""Chi-square goodness of fit of sampled first-k-token tuples against exact joint probabilities."""
from __future__ import annotations

from collections import Counter

import numpy as np
import torch
from scipy import stats

from tlt.engine.sampler import transform_logits


def exact_joint(model, prompt: list[int], depth: int, temperature: float, top_k: int = -1, top_p: float = 1.0):
    """Exact probabilities of every `depth`-token continuation under the sampling transform: {tuple: p}."""
    probs = {(): 1.0}
    for _ in range(depth):
        nxt = {}
        prefixes = [k for k, p in probs.items() if p > 0]
        ids = torch.tensor([prompt + list(k) for k in prefixes])
        with torch.no_grad():
            logits = model.logits(model(ids))[:, -1]
        n = len(prefixes)
        p = transform_logits(logits, torch.full((n,), temperature), torch.full((n,), top_k), torch.full((n,), top_p))
        for k, row in zip(prefixes, p):
            for t in torch.nonzero(row).flatten().tolist():
                nxt[k + (t,)] = probs[k] * row[t].item()
        probs = nxt
    return probs


def chi_square_pvalue(samples: list[tuple], exact: dict, min_expected: float = 5.0) -> float:
    """Pool cells with small expected counts; return the goodness-of-fit p-value."""
    n = len(samples)
    counts = Counter(samples)
    assert set(counts) <= set(exact), f"sampled impossible continuations: {set(counts) - set(exact)}"
    obs, exp, pool_o, pool_e = [], [], 0, 0.0
    for k, p in exact.items():
        if n * p >= min_expected:
            obs.append(counts.get(k, 0))
            exp.append(n * p)
        else:
            pool_o += counts.get(k, 0)
            pool_e += n * p
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    exp = np.array(exp) * (sum(obs) / sum(exp))
    return stats.chisquare(obs, exp).pvalue
