"""BEG-MAB: untried arms first, learns the best arm per bucket under noisy rewards, seeded, counts choices."""
from __future__ import annotations

import math
import random

import pytest

from tlt.spec.bandit import Arm, StrategyBandit, default_arm_table, reward


def test_untried_arms_first_then_best():
    bandit = StrategyBandit(epsilon=0.0, seed=0)
    arms = bandit.arms[0]
    picked = []
    for i in range(len(arms)):
        arm = bandit.select(1)
        picked.append(arm.name)
        bandit.update(1, arm, float(i))
    assert picked == [a.name for a in arms]          # every arm once, in table order
    assert bandit.select(1).name == arms[-1].name     # then the best median


def test_learns_best_arm_per_bucket_with_noise():
    bounds = [1, 4, 20, math.inf]
    table = [[Arm("off", "off"), Arm("chain2", "eagle_chain", 2, 1, 2), Arm("chain6", "eagle_chain", 6, 1, 6)]] * 4
    true = {0: {"off": 100, "chain2": 180, "chain6": 240},   # small batch: deep drafting pays
            3: {"off": 900, "chain2": 700, "chain6": 400}}   # large batch: SD loses
    bandit = StrategyBandit(bounds, table, epsilon=0.1, window=300, seed=1)
    noise = random.Random(2)
    for _ in range(1500):
        for bs, b in ((1, 0), (32, 3)):
            arm = bandit.select(bs)
            bandit.update(bs, arm, true[b][arm.name] * noise.lognormvariate(0, 0.5))
    assert bandit.best(1).name == "chain6" and bandit.best(32).name == "off"
    stats = bandit.stats()
    assert stats["bs1"]["chain6"]["count"] > 1200     # ~ (1 - eps) of choices once learned
    assert stats["bs>=21"]["off"]["count"] > 1200
    assert sum(a["count"] for a in stats["bs1"].values()) == 1500


def test_seeded_and_buckets():
    def run(seed):
        b = StrategyBandit(seed=seed)
        out = []
        for i in range(300):
            arm = b.select(3)
            b.update(3, arm, reward(1.0 + (arm.depth % 3), 3, 0.01 + 0.001 * (i % 5)))
            out.append(arm.name)
        return out
    assert run(5) == run(5)
    b = StrategyBandit()
    assert [b.bucket(s) for s in (1, 2, 4, 5, 20, 21, 500)] == [0, 1, 1, 2, 2, 3, 3]
    assert [b.bucket_name(i) for i in range(4)] == ["bs1", "bs2-4", "bs5-20", "bs>=21"]


def test_default_tables_have_off_and_fastrl_budgets():
    for device in ("cpu", "gpu"):
        bounds, arms = default_arm_table(device)
        assert bounds[-1] == math.inf and len(arms) == len(bounds)
        assert all(any(a.method == "off" for a in bucket) and len(bucket) >= 3 for bucket in arms)
    _, gpu = default_arm_table("gpu")
    assert [max(a.num_draft_tokens for a in bucket if a.method == "eagle_tree") for bucket in gpu] == [48, 32, 16, 8]
    with pytest.raises(ValueError):
        Arm("x", "medusa")
    with pytest.raises(ValueError):
        StrategyBandit([1, 4], [[Arm("off", "off")], [Arm("off", "off")]])
