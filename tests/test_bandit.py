"""BEG-MAB: untried arms first, learns the best arm per bucket under noisy rewards by delivered throughput,
prefers "off" on a tie, explores dominated arms rarely, forgets drafter arms on a new drafter, seeded."""
from __future__ import annotations

import math
import random

import pytest

from tlt.speculative.bandit import Arm, StrategyBandit, default_arm_table


def test_untried_arms_first_then_best():
    bandit = StrategyBandit(epsilon=0.0, seed=0)
    arms = bandit.arms[0]
    picked = []
    for i in range(len(arms)):
        arm = bandit.select(1)
        picked.append(arm.name)
        bandit.update(1, arm, float(i), 1.0)
    assert picked == [a.name for a in arms]          # every arm once, in table order
    # then "off" once more: an SD arm wins against a plain step's price, which rests on two "off" steps at a batch size
    assert bandit.select(1).name == "off"
    bandit.update(1, arms[0], 1.0, 1.0)
    assert bandit.select(1).name == arms[-1].name     # then the best throughput


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
            bandit.update(bs, arm, true[b][arm.name] * noise.lognormvariate(0, 0.5), 1.0)
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
            b.update(3, arm, 3 * (1.0 + (arm.depth % 3)), 0.01 + 0.001 * (i % 5))
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
        assert all(any(a.method == "off" for a in bucket) for bucket in arms)
        # SD arms in every bucket, but on a CPU none at bs >= 21 (they took 1.5-4.3x the plain steps they replaced)
        assert [len(bucket) >= 3 for bucket in arms] == ([True] * 4 if device == "gpu" else [True] * 3 + [False])
    _, gpu = default_arm_table("gpu")
    assert [max(a.num_draft_tokens for a in bucket if a.method == "eagle_tree") for bucket in gpu] == [48, 32, 16, 8]
    with pytest.raises(ValueError):
        Arm("x", "medusa")
    with pytest.raises(ValueError):
        StrategyBandit([1, 4], [[Arm("off", "off")], [Arm("off", "off")]])


OFF, CHAIN = Arm("off", "off"), Arm("chain4", "eagle_chain", 4, 1, 4)


def _one_bucket(arms, **kw):
    return StrategyBandit([math.inf], [arms], seed=3, **kw)


def test_counts_that_cannot_be_negative_are_refused():
    for name in ("refresh", "follow", "backoff"):
        with pytest.raises(ValueError, match=f"{name} must be >= 0"):
            _one_bucket([OFF, CHAIN], **{name: -1})


def test_ranks_by_delivered_throughput_not_the_median_step():
    """70% of the chain's steps are a bit faster than plain, 30% pay a drafter catch-up 4x over: its median step
    beats "off" but its tokens per second do not, so the bandit keeps "off" (a median-based one would not)."""
    bandit = _one_bucket([OFF, CHAIN], epsilon=0.0)
    steps = [(1.1, 1.0)] * 7 + [(1.0, 4.0)] * 3           # (tokens, seconds) per step; "off" does 1 token / s
    for i in range(40):
        bandit.update(1, OFF, 1.0, 1.0)
        bandit.update(1, CHAIN, *steps[i % 10])
    import statistics
    assert statistics.median(t / s for t, s in steps) > 1.0  # the median step looks better than plain ...
    assert bandit.estimate(0, "chain4") < 1.0 and bandit.best(1) is OFF  # ... the throughput is not


def test_off_is_kept_on_a_tie():
    bandit = _one_bucket([OFF, CHAIN], epsilon=0.0)
    bandit.update(1, OFF, 100.0, 1.0)
    bandit.update(1, CHAIN, 102.0, 1.0)               # 2% better: within min_gain, not worth SD's variance
    assert bandit.best(1) is OFF
    bandit.update(1, CHAIN, 110.0, 1.0)               # 6% better on average: SD wins
    assert bandit.best(1) is CHAIN


def test_dominated_arms_are_explored_rarely():
    """(Bucket closing off: it would stop all exploration here; tested below.) Once every SD arm is known to lose
    by > margin, exploration mostly re-tries the live arms only; the
    paper's uniform exploration (recheck=1) spends ~epsilon of the steps on losing arms."""
    table = [OFF] + [Arm(f"chain{d}", "eagle_chain", d, 1, d) for d in (2, 3, 4, 5, 6)]

    def non_off_share(recheck):
        bandit = _one_bucket(table, epsilon=0.1, recheck=recheck, window=10**6, close=False)  # no decay; open
        chosen = []
        for _ in range(4000):
            arm = bandit.select(1)
            bandit.update(1, arm, 1.0 if arm is OFF else 0.5, 1.0)
            chosen.append(arm.name)
        return sum(c != "off" for c in chosen[200:]) / len(chosen[200:])

    assert non_off_share(recheck=0.1) < 0.02
    assert non_off_share(recheck=1.0) > 0.07          # control: uniform exploration pays ~epsilon * 5/6


def test_far_behind_arms_are_skipped_after_one_step():
    """A fresh bandit whose SD arms run at a third of plain decoding's speed stops exploring them after their one
    forced try (below `far` x the best), instead of running each min_samples times first. Control: far=0 (only
    the min_samples rule) spends several times more of the first steps on them."""
    table = [OFF] + [Arm(f"chain{d}", "eagle_chain", d, 1, d) for d in (2, 3, 4, 5, 6)]

    def sd_steps(far):
        bandit = _one_bucket(table, epsilon=0.3, far=far, min_samples=5, close=False)
        n = 0
        for _ in range(120):
            arm = bandit.select(1)
            bandit.update(1, arm, 1.0 if arm is OFF else 0.33, 1.0)
            n += arm is not OFF
        return n

    assert sd_steps(0.5) <= 10                      # 5 forced tries, then rechecks only
    assert sd_steps(0.0) >= 18                      # control: each arm explored up to min_samples times


def test_forget_retries_drafter_arms_first_and_keeps_the_rest():
    """forget(keep=0): the drafter arms' rewards are wiped and they are tried again first; other arms keep theirs."""
    ngram = Arm("ngram4", "ngram", 4, 1, 4)
    bandit = _one_bucket([OFF, ngram, CHAIN], epsilon=0.0, refresh=0)
    for arm, tokens in ((OFF, 1.0), (ngram, 2.0), (CHAIN, 0.5)):
        assert bandit.select(1) is arm
        bandit.update(1, arm, tokens, 1.0)
    assert bandit.select(1) is ngram
    bandit.forget(keep=0)
    assert bandit.estimate(0, "chain4") == -math.inf and bandit.estimate(0, "ngram4") == 2.0
    assert bandit.select(1) is CHAIN                  # tried again first
    bandit.update(1, CHAIN, 3.0, 1.0)
    assert bandit.select(1) is CHAIN


def test_forget_keeps_a_short_prior_that_new_steps_outweigh():
    """A published drafter (the default forget) shortens the drafter arms' windows to their last min_samples steps:
    no forced re-try (each RL step publishes one), and the new drafter's steps take over within a few steps where
    the old window of 300 would have held the old estimate. Control: without forget, the same new steps barely
    move it."""
    def run(do_forget):
        bandit = _one_bucket([OFF, CHAIN], epsilon=0.0, min_samples=5, close=False, refresh=0)
        for arm in (OFF, CHAIN):
            assert bandit.select(1) is arm
            bandit.update(1, arm, 1.0, 1.0)
        for _ in range(199):
            bandit.update(1, CHAIN, 0.5, 1.0)         # the old drafter: 0.5x of plain decoding
        if do_forget:
            bandit.forget()
            assert not bandit.untried[0] and bandit.select(1) is OFF  # known, still behind: no forced re-try
            assert len(bandit.steps[0]["chain4"]) == 5 and bandit.estimate(0, "chain4") == pytest.approx(0.5)
        for _ in range(6):
            bandit.update(1, CHAIN, 2.0, 1.0)         # the new drafter: 2x
        return bandit.estimate(0, "chain4"), bandit.select(1)
    est, pick = run(True)
    assert est == pytest.approx((5 * 0.5 + 6 * 2.0) / 11) and pick is CHAIN
    est, pick = run(False)
    assert est < 0.6 and pick is OFF


def test_sd_steps_are_measured_against_plain_decoding_only_once_it_ran():
    """An SD step before any "off" step of its bucket has nothing to be compared with (the old default of 1 s a
    plain step made a 10 ms SD step look 100x faster): it is not recorded and the arm stays untried; an "off" step
    that was left out (a CUDA graph capture) leaves "off" untried, so it runs again next."""
    bandit = _one_bucket([OFF, CHAIN], epsilon=0.0)
    assert bandit.select(1) is OFF                  # selected, but its step is left out: not recorded
    assert bandit.select(1) is OFF and bandit.untried == [["off", "chain4"]]
    bandit.update(1, CHAIN, 3.0, 0.01)              # no plain step measured yet: ignored
    assert bandit.estimate(0, "chain4") == -math.inf
    bandit.update(1, OFF, 1.0, 0.01)
    assert bandit.select(1) is CHAIN                # untried
    bandit.update(1, CHAIN, 2.0, 0.02)              # 2 tokens in 2 plain steps' time: as fast as off
    assert bandit.estimate(0, "chain4") == pytest.approx(1.0) and bandit.select(1) is OFF


def test_window_estimate_follows_evictions():
    """The throughput estimate covers exactly the last `window` steps of an arm."""
    bandit = _one_bucket([OFF, CHAIN], window=4)
    bandit.update(1, OFF, 1.0, 1.0)  # plain decoding's step time at bs 1: 1 s
    for tokens in (100.0, 1.0, 2.0, 3.0, 4.0):  # the first step leaves the window
        bandit.update(1, CHAIN, tokens, 1.0)
    assert bandit.estimate(0, "chain4") == 10.0 / 4


def test_exploration_decays_and_restarts_on_forget():
    """An arm just inside the margin (0.9x of "off") is explored on a share of the steps that falls as the bucket
    gathers steps, and rises again after forget() (a new drafter). Control: without decay (a very long window) the
    share stays at ~epsilon / 2."""
    near = Arm("ngram4", "ngram", 4, 1, 4)

    def shares(window):
        bandit = _one_bucket([OFF, near], epsilon=0.2, window=window, close=False)
        chosen = []
        for step in range(6000):
            if step == 4000:
                bandit.forget(("ngram",))
            arm = bandit.select(1)
            bandit.update(1, arm, 1.0 if arm is OFF else 0.9, 1.0)
            chosen.append(arm is near)
        share = lambda a, b: sum(chosen[a:b]) / (b - a)  # noqa: E731
        return share(10, 1000), share(3000, 4000), share(4001, 5000)

    early, late, after_forget = shares(window=300)
    assert early > 2 * late and after_forget > 2 * late and late < 0.03
    flat = shares(window=10**6)
    assert all(0.06 < x < 0.14 for x in flat)  # control: epsilon 0.2, two live arms -> ~0.1 throughout


def test_arms_compared_at_their_own_batch_size():
    """In bucket 2-4 a plain step costs the same 1.0 s at bs 2 and 4 (memory-bound), and the n-gram arm is truly
    slower (1.3 s a step for 1.1 tokens a row: 0.85x). Off happened to run at bs 2, n-gram at bs 4: by raw tokens/s
    n-gram would look 1.7x faster (4.4 / 1.3 against 2 / 1); measured against plain decoding at its own batch
    size it is 0.85x, and off stays the choice."""
    OFF, NG = Arm("off", "off"), Arm("ngram4", "ngram", depth=4, num_draft_tokens=4)
    bandit = StrategyBandit([4, math.inf], [[OFF, NG], [OFF]], epsilon=0.0)
    for _ in range(20):
        bandit.update(2, OFF, 2.0, 1.0)
        bandit.update(4, NG, 4.4, 1.3)
    assert (4.4 / 1.3) / (2.0 / 1.0) > 1.5  # the confound the raw rate would fall for
    assert bandit.estimate(0, "off") == pytest.approx(1.0)
    assert bandit.estimate(0, "ngram4") == pytest.approx(1.1 / 1.3)
    assert bandit.best(3) is OFF


def test_sd_steps_are_priced_at_the_current_plain_step_time():
    """At bs 2 a plain step took 14 ms while the process warmed up, then 11 ms. A chain's steps (1.575 tokens a row in
    20.5 ms: 0.85x of an 11 ms plain step) recorded in between looked 1.08x against the first "off" steps and were
    chosen. The later "off" steps alone reprice them (at the lower median of the last 8 "off" steps at bs 2): the
    chain falls below "off", the ledger of its steps turns negative and the bucket closes. Priced when recorded (the
    control: the chain's estimate would not move with "off" steps), it kept its 1.08x for its whole window."""
    chain = Arm("chain2", "eagle_chain", 2, 1, 2)
    bandit = _one_bucket([OFF, chain], epsilon=0.0, min_samples=5, reprice_every=1)
    for _ in range(3):
        bandit.update(2, OFF, 2, 0.014)
    for _ in range(50):
        bandit.update(2, chain, 3.15, 0.0205)
    before = bandit.estimate(0, "chain2")
    assert before == pytest.approx(1.575 * 0.014 / 0.0205) and bandit.best(2) is chain
    assert bandit.ledger_seconds(0) > 0 and not bandit.closed_buckets()
    for _ in range(20):
        bandit.update(2, OFF, 2, 0.011)
    t_off = 0.011
    after = bandit.estimate(0, "chain2")
    assert after == pytest.approx(1.575 * t_off / 0.0205) and after < 0.9  # control: before > 1.03
    assert bandit.estimate(0, "off") == 1.0 and bandit.best(2) is OFF
    assert bandit.ledger_seconds(0) == pytest.approx(50 * (1.575 * t_off - 0.0205)) and 1.575 * t_off < 0.0205
    assert bandit.closed_buckets() == ["bs>=1"]
    # by default the prices are read again at each of the first 16 "off" steps, then every 16th, not at every one:
    # an estimate costs O(1) a step, and a window of 300 steps is never priced more than 16 "off" steps late
    default = _one_bucket([OFF, chain], epsilon=0.0, min_samples=5)
    for _ in range(3):
        default.update(2, OFF, 2, 0.014)
    for _ in range(50):
        default.update(2, chain, 3.15, 0.0205)
    for _ in range(13):
        default.update(2, OFF, 2, 0.011)
    priced_at_16 = 1.575 * 0.011 / 0.0205
    assert default.estimate(0, "chain2") == pytest.approx(priced_at_16)  # the 16th "off" step repriced
    for _ in range(15):
        default.update(2, OFF, 2, 0.009)
    assert default.estimate(0, "chain2") == pytest.approx(priced_at_16)  # 15 "off" steps since: not yet
    default.update(2, OFF, 2, 0.009)
    assert default.estimate(0, "chain2") == pytest.approx(1.575 * 0.009 / 0.0205)


def test_a_bucket_with_few_off_steps_is_repriced_at_each_of_them():
    """Where SD pays, a bucket sees "off" only when the bandit explores. In a default-task run the bs-1 bucket ran its
    first "off" step cold (12.9 ms) and 8 more over 12 rollouts at ~10 ms; repriced only at the first and every 16th,
    its price stayed at 12.9 ms and each n-gram step there was valued 30% too high (the ledger's savings with it).
    Each of the first 16 "off" steps reprices, and the price is the lower median of the last 8 at the batch size, so
    the cold step is outvoted by the second. Control: the first step's price, which the old rule kept, is far from
    it."""
    ngram = Arm("ngram6", "ngram", 6, 1, 6)
    bandit = _one_bucket([OFF, ngram], epsilon=0.0)
    bandit.update(1, OFF, 1, 0.0129)
    for k in range(1, 9):
        for _ in range(30):
            bandit.update(1, ngram, 2.1, 0.018, critical=2.1)
        bandit.update(1, OFF, 1, 0.0099, critical=1)
        assert bandit.plain_seconds(1, 1.0, critical=1.0) == pytest.approx(0.0099)  # repriced at each of them
        assert bandit.estimate(0, "ngram6") == pytest.approx(2.1 * 0.0099 / 0.018)
    t_off = 0.0099
    assert bandit.plain_seconds(1, 1.0, critical=1.0) == pytest.approx(t_off)
    assert abs(t_off - 0.0129) / t_off > 0.2  # control: the first step's price
    assert bandit.estimate(0, "ngram6") == pytest.approx(2.1 * t_off / 0.018)
    assert bandit.ledger_seconds(0) == pytest.approx(240 * (2.1 * t_off - 0.018))  # all in its window


def test_a_bucket_without_sd_arms_keeps_states_while_a_bucket_with_them_is_open():
    """The CPU table has no SD arm at bs >= 21. Its steps keep hidden states while a smaller bucket may draft (an
    EAGLE draft's catch-up reads the states of positions decoded at bs >= 21) and stop once every bucket with SD
    arms has closed. Control: a bucket with SD arms keeps them by its own state."""
    bandit = StrategyBandit(*default_arm_table("cpu"), epsilon=0.0, min_samples=1, probe=0.0)
    assert bandit.arms[3] == [OFF] and bandit.capturing(30) and bandit.any_open()
    for bs in (1, 3, 10):
        b = bandit.bucket(bs)
        bandit.update(bs, OFF, bs, 0.010)
        for arm in bandit.arms[b][1:]:
            bandit.update(bs, arm, bs, 0.020)  # every SD arm at half plain decoding's speed: the bucket closes
        assert bandit.closed[b] and not bandit.capturing(bs)
        assert bandit.capturing(30) == (bs != 10)  # control: open while a bucket with SD arms is
    assert bandit.select(30) == OFF and not bandit.any_open() and not bandit.closed[3]


def test_a_cold_plain_step_does_not_price_sd_for_the_run():
    """In a default run the first plain step at bs 22 took 3.1 s (the process starting beside another), the next ones
    about 60 ms. Every SD step at bs 21-32 was then valued at 3.1 s a critical token: the n-gram arm (1.3 tokens a row
    in 100 ms, 0.78x of plain decoding) looked 40x faster, ran on every step and the ledger claimed more seconds saved
    than the rollouts took. Before an SD arm is chosen greedily, "off" runs until its window holds two steps at that
    batch size, whose lower median is the price: the cold step is outvoted, the arm falls below "off" and the bucket
    closes. Control: refresh=0 (no such "off" step) keeps the cold price, and the n-gram arm runs on."""
    ngram = Arm("ngram2", "ngram", 2, 1, 2)

    def run(refresh):
        bandit = _one_bucket([OFF, ngram], epsilon=0.0, min_samples=1, refresh=refresh, probe=0.0)
        chosen = []
        for i in range(60):
            arm = bandit.select(22)
            chosen.append(arm.name)
            cold = i == 0
            bandit.update(22, arm, 22 if arm is OFF else 28.6, 3.1 if cold else (0.06 if arm is OFF else 0.1))
        return bandit, chosen

    bandit, chosen = run(32)
    assert chosen[:3] == ["off", "ngram2", "off"]  # untried first, then a second "off" step before the greedy choice
    assert bandit.plain_seconds(22, 22) == pytest.approx(0.06)
    assert bandit.estimate(0, "ngram2") == pytest.approx(1.3 * 0.06 / 0.1)
    assert bandit.closed_buckets() == ["bs>=1"] and chosen.count("ngram2") == 1
    assert bandit.ledger_seconds(0) == pytest.approx(1.3 * 0.06 - 0.1)
    bandit, chosen = run(0)  # control
    assert bandit.plain_seconds(22, 22) == pytest.approx(3.1) and chosen.count("ngram2") == 59
    assert bandit.estimate(0, "ngram2") > 30 and bandit.ledger_seconds(0) > 200


def test_off_runs_every_refresh_choices_where_sd_pays_so_its_price_stays_current():
    """Where SD pays, "off" runs only when chosen to explore, which decays: its first steps at bs 2 ran at 20 ms (a
    contended start), later plain steps take 10 ms. An n-gram arm at 1.2 tokens a row in 10 ms is chosen throughout;
    "off" runs once every `refresh` (32) choices of the bucket, and the price follows within two of those: the
    estimate and the ledger show 1.2x, not 2.4x. Control: refresh=0 keeps the 20 ms price for the whole run."""
    ngram = Arm("ngram2", "ngram", 2, 1, 2)

    def run(refresh):
        bandit = _one_bucket([OFF, ngram], epsilon=0.0, refresh=refresh)
        chosen, cold = [], 2
        for _ in range(200):
            arm = bandit.select(2)
            chosen.append(arm.name)
            if arm is OFF:
                bandit.update(2, OFF, 2, 0.020 if cold else 0.010)
                cold -= cold > 0
            else:
                bandit.update(2, arm, 2.4, 0.010)
        return bandit, chosen

    bandit, chosen = run(32)
    # untried, then a second step at bs 2, then after every 32 choices without it
    assert [i for i, name in enumerate(chosen) if name == "off"] == [0, 2, 35, 68, 101, 134, 167]
    assert bandit.plain_seconds(2, 2) == pytest.approx(0.010)
    assert bandit.estimate(0, "ngram2") == pytest.approx(1.2) and bandit.best(2) is ngram
    sd_steps = chosen[-300:].count("ngram2")
    assert bandit.ledger_seconds(0) == pytest.approx(sd_steps * (0.012 - 0.010))
    bandit, chosen = run(0)  # control
    assert chosen.count("off") == 1 and bandit.plain_seconds(2, 2) == pytest.approx(0.020)
    assert bandit.estimate(0, "ngram2") == pytest.approx(2.4)


def test_a_refresh_reprices_at_once_so_sd_is_not_priced_at_a_slower_machine(monkeypatch):
    """At bs 1 a 2-core VM's plain step drifts by a fifth from one stretch to the next. Here it first takes 20 ms and
    an n-gram arm pays (1.3 tokens in 22 ms: 1.18x); then the machine runs faster (plain 16 ms) and the text stops
    repeating (1.06 tokens in 17.6 ms: 0.96x). Where the n-gram arm is the greedy choice "off" runs once every
    `refresh` (32) choices, and each such step reprices the bucket at once: the price follows within four of them
    (the lower median of the last 8 "off" steps), the arm falls below "off", and SD runs on few of the next 600
    steps. Control: repriced only at every 16th "off" step past the young window (the rule before), the bucket kept
    the 20 ms price for about 500 more steps of SD at 0.96x."""
    ngram = Arm("ngram6", "ngram", 6, 1, 6)

    def run():
        bandit = _one_bucket([OFF, ngram], epsilon=0.0, probe=0.0)
        for _ in range(400):  # slow machine, repetitive text
            arm = bandit.select(1)
            bandit.update(1, arm, 1 if arm is OFF else 1.3, 0.020 if arm is OFF else 0.022, critical=None)
        assert bandit.best(1) is ngram
        chosen = []
        for _ in range(600):  # faster machine, the text stops repeating
            arm = bandit.select(1)
            chosen.append(arm.name)
            bandit.update(1, arm, 1 if arm is OFF else 1.06, 0.016 if arm is OFF else 0.0176, critical=None)
        return bandit, chosen

    bandit, chosen = run()
    assert chosen[:150].count("ngram6") <= 4 * 32 and chosen[150:].count("ngram6") == 0
    assert bandit.plain_seconds(1, 1) == pytest.approx(0.016) and bandit.best(1) is OFF
    old_rule = lambda self, b, refreshing: (self._off_since_reprice[b] >= self.reprice_every  # noqa: E731
                                            or len(self.steps[b][self.off[b].name]) <= self.reprice_every)
    monkeypatch.setattr(StrategyBandit, "_reprice_due", old_rule)
    bandit, chosen = run()  # control
    assert chosen.count("ngram6") > 400


def test_a_young_bs1_reprice_carries_the_fixed_part_into_every_bucket():
    """The fixed part of a plain step, min(t_off(1), t_off(bs)), prices the critical row's tokens in every bucket, so
    each of the bs-1 bucket's first "off" steps reprices them all: after a cold 12.9 ms step and a 9.9 ms one, a bs-3
    chain step giving the critical row 2 tokens and the others 2.5 is priced with a fixed part of 9.9 ms. Control:
    priced at the first bs-1 step alone, the fixed part would be min(12.9, 12) = 12 ms and the others' tokens worth
    nothing."""
    chain = Arm("chain2", "eagle_chain", 2, 1, 2)
    bandit = StrategyBandit([1, 4, math.inf], [[OFF], [OFF, chain], [OFF]], epsilon=0.0, close=False)
    for _ in range(4):
        bandit.update(3, OFF, 3, 0.012, critical=1)
    bandit.update(1, OFF, 1, 0.0129, critical=1)
    assert bandit.plain_seconds(3, 4.5, critical=2.0) == pytest.approx(2 * 0.012)  # fixed 12 ms, per row 0
    bandit.update(1, OFF, 1, 0.0099, critical=1)
    fixed = 0.0099  # the lower median of the two
    assert bandit.plain_seconds(3, 4.5, critical=2.0) == pytest.approx(2 * fixed + 2.5 * (0.012 - fixed) / 2)


def test_each_batch_size_has_its_own_price_and_off_is_one():
    """A plain step's price is per batch size (the lower median of "off"'s last steps there); an SD arm at a batch
    size "off" never ran is priced at the nearest one. "off" itself is 1.0, the reference, however its steps spread:
    its slow steps (a cold or contended one) do not make an SD arm look faster."""
    chain = Arm("chain2", "eagle_chain", 2, 1, 2)
    bandit = StrategyBandit([4, math.inf], [[OFF, chain], [OFF]], epsilon=0.0, reprice_every=1)
    for bs, s in ((2, 0.010), (3, 0.012), (4, 0.020), (2, 0.011), (3, 0.300)):
        bandit.update(bs, OFF, bs, s)  # bs 2 at 10 ms (lower median of 10, 11), bs 3 at 12 ms (300 outvoted)
    assert bandit.estimate(0, "off") == 1.0
    bandit.update(3, chain, 6, 0.024)  # 2 tokens a row in 24 ms at bs 3, where a plain step takes 12 ms
    bandit.update(1, chain, 1, 0.0105)  # bs 1 never ran "off": priced at bs 2's 10 ms (the nearest)
    assert bandit.estimate(0, "chain2") == pytest.approx((2 * 0.012 + 1 * 0.010) / (0.024 + 0.0105))


def test_with_no_request_waiting_a_step_is_worth_what_it_gives_the_critical_row():
    """bs 2, nothing waiting, a plain step costing 12 ms at bs 1 and 2 (flat): the rollout ends when the row with the
    most left does, so a chain step (17.7 ms) giving the rows 1.57 tokens on average but the critical row 1.28 is
    worth 1.28 plain steps (0.87x), and "off" stays. Control: the same steps where a request waits (a finished row's
    slot is refilled, every token counts) are worth 1.57 plain steps (1.06x), and the chain is chosen."""
    chain = Arm("chain2", "eagle_chain", 2, 1, 2)

    def run(critical):
        bandit = StrategyBandit([1, 4, math.inf], [[OFF], [OFF, chain], [OFF]], epsilon=0.0, close=False)
        bandit.update(1, OFF, 1, 0.012)
        for _ in range(5):
            bandit.update(2, OFF, 2, 0.012, 1 if critical else None)
        for _ in range(20):
            bandit.update(2, chain, 3.14, 0.0177, 1.28 if critical else None)
        return bandit
    by_critical, waiting = run(True), run(False)
    assert by_critical.estimate(1, "chain2") == pytest.approx(1.28 * 0.012 / 0.0177) and by_critical.best(2) is OFF
    assert waiting.estimate(1, "chain2") == pytest.approx(1.57 * 0.012 / 0.0177) and waiting.best(2) is chain
    assert by_critical.estimate(1, "off") == pytest.approx(1.0) == waiting.estimate(1, "off")


def test_a_steps_cost_splits_into_a_fixed_part_and_a_part_per_row():
    """A plain step costs 10 ms at bs 1 and 16 ms at bs 4: 10 ms fixed (the weights read once a step) and 2 ms a row.
    With nothing waiting, a step at bs 4 giving 8 tokens, 2 of them to the critical row, is worth 2 * 10 + 6 * 2 =
    32 ms of plain decoding; with a request waiting 8 / 4 * 16 = 32 ms too, and a step giving the critical row 1
    and the others 7 is worth 24 ms where 32 ms if one waits. A plain step is worth itself either way. Without a
    step at bs 1 measured, the cost is taken as proportional to the batch."""
    bandit = StrategyBandit([1, 4, math.inf], [[OFF], [OFF, CHAIN], [OFF]], epsilon=0.0)
    bandit.update(4, OFF, 4, 0.016, 1)
    assert bandit.plain_seconds(4, 8, critical=1) == pytest.approx(8 / 4 * 0.016)  # no bs-1 step yet
    bandit.update(1, OFF, 1, 0.010)
    assert bandit.plain_seconds(4, 8, critical=2) == pytest.approx(2 * 0.010 + 6 * 0.002)
    assert bandit.plain_seconds(4, 8, critical=1) == pytest.approx(0.010 + 7 * 0.002)
    assert bandit.plain_seconds(4, 8) == pytest.approx(0.032)
    assert bandit.plain_seconds(4, 4, critical=1) == pytest.approx(0.016) == bandit.plain_seconds(4, 4)
    assert bandit.plain_seconds(1, 3, critical=3) == pytest.approx(0.030)


def test_the_fixed_part_is_read_at_bs_1_only_and_follows_it():
    """The fixed part of a step's cost is "off"'s step time at bs 1 exactly: where bs 1 shares a bucket with bs 2-4
    and "off" ran only at bs 2, the cost is taken as proportional to the batch (not bs 2's step as a fixed part,
    which would price the other rows' tokens at nothing). A new bs-1 "off" step reprices the steps of every bucket
    (the estimate cached in bucket bs 2-4 moves with it). A bucket takes one "off" arm."""
    chain = Arm("chain2", "eagle_chain", 2, 1, 2)
    shared = StrategyBandit([4, math.inf], [[OFF, chain], [OFF]], epsilon=0.0)
    shared.update(2, OFF, 2, 0.012, 1)
    assert shared.plain_seconds(2, 4, critical=1) == pytest.approx(4 / 2 * 0.012)
    split = StrategyBandit([1, 4, math.inf], [[OFF], [OFF, chain], [OFF]], epsilon=0.0, close=False,
                           reprice_every=1)
    split.update(1, OFF, 1, 0.010)
    split.update(2, OFF, 2, 0.012, 1)
    split.update(2, chain, 3, 0.020, 1)  # critical row 1 token, the other 2
    assert split.estimate(1, "chain2") == pytest.approx((0.010 + 2 * 0.002) / 0.020)
    split.update(1, OFF, 1, 0.004)  # bs 1 now at 4 ms, the lower median of 10 and 4: fixed 4 ms, per row 8 ms
    assert split.estimate(1, "chain2") == pytest.approx((0.004 + 2 * 0.008) / 0.020)
    with pytest.raises(ValueError, match="one \"off\" arm"):
        StrategyBandit([math.inf], [[OFF, Arm("plain", "off"), chain]])


def test_plain_seconds_prices_sd_tokens_at_plain_decodings_step_time():
    """What plain decoding would take for an SD step's tokens: tokens / bs * t_off(bs), from the measured "off"
    steps of the bucket (the nearest batch size measured); None before any, so no SD step is priced by a guess."""
    b = StrategyBandit([8, math.inf], [[OFF, Arm("chain4", "eagle_chain", depth=4)], [OFF]], epsilon=0.0)
    assert b.plain_seconds(4, 8) is None
    b.update(4, OFF, 4, 0.1)
    assert b.plain_seconds(4, 8) == pytest.approx(8 / 4 * 0.1)
    assert b.plain_seconds(2, 6) == pytest.approx(6 / 2 * 0.1)  # nearest measured batch size in the bucket
    assert b.plain_seconds(20, 20) is None  # another bucket, nothing measured there


def test_a_bucket_where_sd_loses_closes_and_a_new_drafter_reopens_it():
    """SD arms at 0.8x of plain decoding: once each has min_samples steps and the ledger is negative, the bucket
    closes: no SD step at all (no exploration, no rechecks) and no hidden-state capture. forget() (a published
    drafter) reopens it. Control: with close=False the same bandit keeps spending steps on SD."""
    table = [OFF, Arm("chain2", "eagle_chain", 2, 1, 2), Arm("ngram4", "ngram", 4, 1, 4)]

    def run(close):
        bandit = _one_bucket(table, epsilon=0.2, close=close, min_samples=5, probe=0.0)
        late_sd = 0
        for step in range(3000):
            arm = bandit.select(1)
            bandit.update(1, arm, 1.0 if arm is OFF else 0.8, 1.0)
            late_sd += step >= 500 and arm is not OFF
        return bandit, late_sd

    bandit, late_sd = run(close=True)
    assert bandit.closed_buckets() == ["bs>=1"] and late_sd == 0 and not bandit.capturing(7)
    bandit.forget()
    assert bandit.closed_buckets() == [] and bandit.capturing(7)
    _, late_sd_open = run(close=False)
    assert late_sd_open >= 5  # control: exploration and rechecks go on (decayed, never zero)


def test_a_closed_bucket_probes_again_at_a_bounded_cost_and_finds_where_sd_starts_to_pay():
    """A bucket where SD loses (arms at 0.8x of plain decoding) for 3000 steps, then pays (1.5x: the text turned
    repetitive, say), with no new drafter. With probe=0.05 a closed bucket opens again, every SD arm tried afresh,
    once plain decoding there took 20x what SD lost before it closed: over the losing stretch after the first close,
    the probes cost under 5% of the bucket's time, and after the turn SD runs nearly every step. Control: probe=0
    stays closed, plain decoding to the end."""
    table = [OFF, Arm("chain2", "eagle_chain", 2, 1, 2), Arm("ngram4", "ngram", 4, 1, 4)]

    def run(probe):
        bandit = _one_bucket(table, epsilon=0.2, min_samples=5, probe=probe)
        lost = seconds = late_sd = 0.0
        for step in range(6000):
            arm, speed = bandit.select(1), 0.8 if step < 3000 else 1.5
            counted = bandit.probes > 0 or bandit.closed_buckets()  # after the first close
            bandit.update(1, arm, 1.0 if arm is OFF else speed, 1.0)
            if counted and step < 3000:
                seconds += 1.0
                lost += 0.0 if arm is OFF else 1.0 - speed  # plain decoding gives 1 token a second
            late_sd += step >= 4000 and arm is not OFF
        return bandit, lost / seconds, late_sd / 2000

    bandit, cost, late = run(0.05)
    assert bandit.probes >= 5 and 0 < cost < 0.05 and late > 0.95
    bandit, cost, late = run(0.0)
    assert bandit.probes == 0 and cost == 0 and late == 0 and bandit.closed_buckets() == ["bs>=1"]


def test_a_probe_waits_in_proportion_to_what_sd_lost():
    """At probe 0.05 a closed bucket opens again once plain decoding there took 20x what SD lost: 0.1 s lost (one
    chain step at 0.9x) -> 2 s (29 steps of 0.07 s; 28 leave it closed), 0.2 s -> 4 s (58 steps). Its SD arms'
    windows are emptied (tried afresh), "off"'s kept. A bucket closed by a capture charge on a ledger just below zero
    waits the floor, 16 plain steps, not one."""
    chain = Arm("chain2", "eagle_chain", 2, 1, 2)

    def closed_by(tokens, charge=0.0):
        bandit = _one_bucket([OFF, chain], epsilon=0.0, min_samples=1, probe=0.05)
        bandit.update(1, OFF, 1.0, 1.0)
        bandit.update(1, chain, tokens, 1.0)
        if charge:
            bandit.charge(1, charge)
        assert bandit.closed_buckets() == ["bs>=1"]
        return bandit

    for bandit, wait in ((closed_by(0.9), 29), (closed_by(0.8), 58), (closed_by(1.01, charge=0.011), 16)):
        for _ in range(wait - 1):
            bandit.update(1, OFF, 0.07, 0.07)
        assert bandit.closed_buckets() == ["bs>=1"] and bandit.probes == 0, wait
        bandit.update(1, OFF, 0.07, 0.07)
        assert bandit.closed_buckets() == [] and bandit.probes == 1 and bandit.capturing(1), wait
        assert bandit.untried == [["chain2"]] and len(bandit.steps[0]["off"]) == wait + 1
        assert bandit.select(1) is chain


def test_probes_that_find_nothing_back_off_and_news_starts_the_waits_again():
    """A probe that finds SD still losing doubles its bucket's next wait, up to 2 ** backoff times the first: an
    n-gram arm that loses 0.1 s on each probe (plain steps of 0.07 s, probe 0.05) waits 29, 58, 115 plain steps. A new
    drafter that reopens the bucket starts again at 29; so does text the n-gram drafter keeps guessing (hit rate >=
    1/2: the 16-step floor); a publish that reaches the bucket open for its probe leaves the back-off alone. The retired
    drafter arms' own probes back off alike, to 16 times the first wait. Over 20000 steps where SD loses (0.8x), the
    probes cost under a third of what they cost without back-off (control: backoff=0); once the text turns (1.5x) a
    probe finds SD paying, which starts the waits again."""
    ngram, chain = Arm("ngram4", "ngram", 4, 1, 4), Arm("chain2", "eagle_chain", 2, 1, 2)
    bandit = _one_bucket([OFF, ngram], epsilon=0.0, min_samples=1, probe=0.05, backoff=4)
    bandit.update(1, OFF, 1.0, 0.07)

    def lose_and_wait(hits=False):
        assert bandit.select(1) is ngram  # untried: the bucket is new or probes
        bandit.update(1, ngram, 1.0, 0.17)  # 0.1 s slower than plain decoding
        assert bandit.closed_buckets() == ["bs>=1"]
        for n in range(1, 1000):
            bandit.shadow(1, hits)
            bandit.update(1, OFF, 1.0, 0.07)
            if not bandit.closed_buckets():
                return n

    assert [lose_and_wait() for _ in range(3)] == [29, 58, 115] and bandit.probe_misses == [2]
    bandit.forget(methods=("ngram",), keep=0)  # a publish while the bucket is open for its probe: back-off kept
    assert bandit.probe_misses == [2] and bandit.select(1) is ngram
    bandit.update(1, ngram, 1.0, 0.17)  # the probe finds nothing: closed again
    assert bandit.closed_buckets() == ["bs>=1"] and bandit.probe_misses == [3]
    bandit.forget(methods=("ngram",), keep=0)  # a new drafter reopens the closed bucket: the waits start again
    assert bandit.probe_misses == [0] and [lose_and_wait() for _ in range(3)] == [29, 58, 115]
    assert lose_and_wait(hits=True) == 16  # not 8 * 29 * 1/4 = 58 steps

    # the drafter arms retired in an open bucket where the n-gram arm pays: their probes back off, to 16x
    bandit = _one_bucket([OFF, chain, ngram], epsilon=0.0, min_samples=1, probe=0.05, backoff=4, refresh=0)
    waits, n = [], 0
    for _ in range(2000):
        arm = bandit.select(1)
        if arm is chain:
            waits.append(n)
            n = 0
            bandit.update(1, chain, 1.0, 0.17)
        else:
            bandit.update(1, arm, 2.0 if arm is ngram else 1.0, 0.07)
            n += 1
    assert waits == [1, 29, 58, 115, 229, 458, 458, 458] and bandit.closed_buckets() == []

    def run(backoff, turn=20000):
        bandit = _one_bucket([OFF, chain, ngram], epsilon=0.2, min_samples=5, probe=0.05, backoff=backoff)
        lost = seconds = 0.0
        paid_after = None
        for step in range(turn + 5000):
            arm, speed = bandit.select(1), 0.8 if step < turn else 1.5
            counted = bandit.probes > 0 or bandit.closed_buckets()  # after the first close
            bandit.update(1, arm, 1.0 if arm is OFF else speed, 1.0)
            if counted and step < turn:
                seconds += 1.0
                lost += 0.0 if arm is OFF else 1.0 - speed
            if step >= turn and paid_after is None and bandit.best(1) is not OFF:
                paid_after = step - turn
        return lost / seconds, paid_after, bandit.probe_misses[0]

    cost, paid_after, misses = run(4)
    control, control_paid_after, _ = run(0)
    assert cost < control / 3 and paid_after is not None and misses == 0, (cost, control, paid_after)
    assert control_paid_after is not None


def test_n_gram_hits_in_a_closed_bucket_bring_its_probe_nearer():
    """A closed bucket waits 2 s of plain decoding (steps of 0.06 s) for its probe: it lost 0.1 s. Where the n-gram
    drafter, asked at each plain step, would have proposed the drawn token at all of the last 16 (a repetitive
    stretch), the wait is an eighth of that, 0.25 s, but 16 steps must be asked first (lost 0.4 s: 8 s, and 1 s); at
    a hit rate h it is 1 - h of it: at half of them, half; with hits from the 11th step on, it shrinks as they fill
    the 16; none held, or no n-gram arm: all of it. Only a closed bucket with an n-gram arm asks (`shadowing`), and a
    probe starts the count again."""
    chain, ngram = Arm("chain2", "eagle_chain", 2, 1, 2), Arm("ngram4", "ngram", 4, 1, 4)

    def steps_to_probe(hits, arms=(OFF, chain, ngram), lost=0.1):
        bandit = _one_bucket(list(arms), epsilon=0.0, min_samples=1, probe=0.05)
        bandit.update(1, OFF, 1.0, 1.0)
        for arm in arms[1:]:
            bandit.update(1, arm, 1.0 - lost if arm is arms[-1] else 1.0, 1.0)  # (the chain beside n-gram none)
        assert bandit.closed_buckets() == ["bs>=1"] and bandit.shadowing(1) is (ngram in arms)
        for n in range(1, 200):
            if ngram in arms:
                bandit.shadow(1, hits(n))
            bandit.update(1, OFF, 0.06, 0.06)
            if not bandit.closed_buckets():
                assert not bandit.shadowing(1) and not bandit.shadow_hits[0] and bandit.probes == 1
                return n
        return None

    assert steps_to_probe(lambda n: True) == 16
    assert steps_to_probe(lambda n: n % 2 == 0) == 17  # 1.02 s >= 1 s
    assert steps_to_probe(lambda n: n > 10) == 18  # 1.08 s >= 2 s * (1 - 8 / 16)
    assert steps_to_probe(lambda n: False) == 34 and steps_to_probe(lambda n: True, (OFF, chain)) == 34
    # lost 0.4 s -> 8 s; all hits: an eighth, 1 s (17 steps; a quarter would be 34)
    assert steps_to_probe(lambda n: True, lost=0.4) == 17 and steps_to_probe(lambda n: False, lost=0.4) == 134


def test_a_row_that_loops_in_a_closed_bucket_brings_its_probe_to_the_floor():
    """At bs 3 one row of three loops. The closed bucket asks about one row a step, in turn, so the shadow's hit rate
    stays near a third and, after two probes that found nothing, its wait is backed off: 2 s (0.1 s lost at probe
    0.05) x about 2/3 x 4, 72 plain steps of 0.07 s. With `follow` on (4), the looping row's fourth hit in a row (the
    10th step) brings the wait to its floor, an eighth with no back-off: the bucket probes at the 16 steps it must ask
    first. A miss of that row (the 15th step) ends its loop until four more hits (the 27th); control: follow=0 waits
    the 72 steps."""
    ngram = Arm("ngram4", "ngram", 4, 1, 4)

    def steps_to_probe(follow, miss_at=None):
        bandit = _one_bucket([OFF, ngram], epsilon=0.0, min_samples=1, probe=0.05, backoff=4, follow=follow)
        bandit.update(3, OFF, 3.0, 0.07)
        for probe in range(3):  # the first close, then two probes that find n-gram drafts still losing
            assert bandit.select(3) is ngram
            bandit.update(3, ngram, 3.0, 0.17)
            assert bandit.closed_buckets() == ["bs>=1"]
            for n in range(1, 1000):
                row = n % 3  # rows in turn, as SpecDecoder._ask_ngram asks them
                bandit.shadow(3, row == 0 and n != miss_at if probe == 2 else False, row)
                bandit.update(3, OFF, 3.0, 0.07)
                if not bandit.closed_buckets():
                    break
        return n

    assert steps_to_probe(follow=4) == 16
    assert steps_to_probe(follow=0) == 72
    assert steps_to_probe(follow=4, miss_at=15) == 27


def test_a_probe_at_repeating_text_that_found_nothing_backs_the_next_one_off():
    """A row loops in a closed bucket (its every n-gram guess holds: the shadow's hit rate is 1 too) where SD lost
    0.3 s at probe 0.05: the wait is its floor, 6 s / 8, and the first probe comes at the 16 steps it must ask. That
    probe finds n-gram drafts still losing (as past EOS, where rows repeat a few tokens that 3-token drafts do not
    follow), so the repetition is no longer news: the next probes wait 2x, 4x and 8x the floor (22, 43 and 86 plain
    steps of 0.07 s). Control: a probe that found nothing where the text did not repeat leaves a loop news (the test above);
    the old rule, no back-off while the text repeats, probed at every 16th step, each probe losing what the last
    did. A probe where SD pays starts the waits again."""
    ngram = Arm("ngram3", "ngram", 3, 1, 3)
    bandit = _one_bucket([OFF, ngram], epsilon=0.0, min_samples=1, probe=0.05, backoff=4, follow=4)
    bandit.update(3, OFF, 3.0, 0.07)
    waits = []
    for probe in range(4):  # the first close, then three probes at the loop that find n-gram drafts still losing
        assert bandit.select(3) is ngram
        bandit.update(3, ngram, 3.0, 0.37)
        assert bandit.closed_buckets() == ["bs>=1"]
        for n in range(1, 1000):
            bandit.shadow(3, True, 0)  # row 0 asked, its guess held
            bandit.update(3, OFF, 3.0, 0.07)
            if not bandit.closed_buckets():
                break
        waits.append(n)
    assert waits == [16, 22, 43, 86]
    assert bandit.select(3) is ngram
    bandit.update(3, ngram, 9.0, 0.1)           # this probe pays: 9 tokens at 1.4 plain steps' time
    assert not bandit.closed_buckets() and bandit.probe_misses[0] == 0 and not bandit.repeat_missed[0]


def test_a_new_drafter_reopens_only_the_closed_buckets_where_its_gain_could_pay():
    """forget(gain=g): a closed bucket whose best drafter arm ran at 0.6x of "off" stays closed for a 10% better
    drafter (0.66x), its arms' windows untouched; one at 0.95x reopens (1.045x beats off by min_gain 3%). Gains
    published while a bucket stays closed add up: at 0.98x, +3% alone stays closed (1.009x), a second +3% reopens
    (1.040x), and a drafter 10% worse in between undoes it (0.936x). Controls: a gain of 80% reopens the 0.6x bucket, and
    forget() without a gain reopens every bucket."""
    chain, ngram = Arm("chain1", "eagle_chain", 1, 1, 1), Arm("ngram2", "ngram", 2, 1, 2)

    def closed_at(speed):
        bandit = _one_bucket([OFF, ngram, chain], epsilon=0.0, min_samples=2)
        for arm, tokens in ((OFF, 1.0), (ngram, 0.5), (chain, speed), (ngram, 0.5), (chain, speed), (chain, speed)):
            bandit.update(1, arm, tokens, 1.0)
        assert bandit.closed_buckets() == ["bs>=1"]
        return bandit

    slow, near = closed_at(0.6), closed_at(0.95)
    slow.forget(gain=0.1)
    near.forget(gain=0.1)
    assert slow.closed_buckets() == ["bs>=1"] and len(slow.steps[0]["chain1"]) == 3  # forget() would keep 2
    assert near.closed_buckets() == [] and near.capturing(1)
    for gains, closed in (([0.03], True), ([0.03, 0.03], False), ([0.03, -0.1, 0.03], True)):
        bandit = closed_at(0.98)
        for g in gains:
            bandit.forget(gain=g)
        assert bool(bandit.closed_buckets()) is closed, gains
    for control in (dict(gain=0.8), {}):
        bandit = closed_at(0.6)
        bandit.forget(**control)
        assert bandit.closed_buckets() == [], control


def test_a_bucket_where_sd_pays_never_closes_and_charges_can_close_one():
    """A chain at 1.3x stays the choice and its bucket stays open. The same chain at 1.02x (a tie: "off" is kept)
    with SD steps that saved time is not closed while the ledger is positive; charging the capture's seconds to the
    bucket turns the ledger negative, and then it closes."""
    chain = Arm("chain2", "eagle_chain", 2, 1, 2)
    bandit = _one_bucket([OFF, chain], epsilon=0.1, min_samples=5)
    for _ in range(500):
        arm = bandit.select(1)
        bandit.update(1, arm, 1.0 if arm is OFF else 1.3, 1.0)
    assert bandit.best(1) is chain and not bandit.closed_buckets()

    tie = _one_bucket([OFF, chain], epsilon=0.0, min_samples=5)
    tie.update(1, OFF, 1.0, 1.0)
    for _ in range(5):
        tie.update(1, chain, 1.02, 1.0)
    assert tie.best(1) is OFF and tie.ledger_seconds(0) > 0 and not tie.closed_buckets()
    tie.charge(1, 0.2)
    assert tie.ledger_seconds(0) < 0 and tie.closed_buckets() == ["bs>=1"]


def test_a_closed_bucket_runs_off_even_if_an_sd_arm_looks_best_later():
    """Closed means plain decoding: "off" is returned even when its estimate drifts below a (frozen) SD arm's."""
    chain = Arm("chain2", "eagle_chain", 2, 1, 2)
    bandit = _one_bucket([OFF, chain], epsilon=0.0, min_samples=1, probe=0.0)
    bandit.update(1, OFF, 1.0, 1.0)
    bandit.update(1, chain, 0.9, 1.0)
    assert bandit.closed_buckets() == ["bs>=1"]
    for _ in range(50):
        bandit.update(1, OFF, 0.5, 1.0)  # plain decoding slows: the chain's steps now price above "off"
    bandit.retired[0] = False  # (it retired with the bucket: it lost; here it may run but for the closing)
    assert bandit.best(1) is chain and bandit.select(1) is OFF  # the greedy choice moved; closed still runs off


def test_drafter_arms_that_do_not_pay_retire_where_the_n_gram_arm_does():
    """Chains at 0.7x of plain decoding beside an n-gram arm at 1.5x (a looping tail): the bucket stays open, but once
    each chain has min_samples steps and they lost time, the chains retire: not chosen, not explored, and the bucket's
    steps keep no hidden states (the drafter's capture, data and rounds stop; n-gram drafts read none). Control:
    with close=False the chains are still explored (decayed, never zero) and the bucket keeps capturing."""
    ngram, chain1, chain2 = Arm("ngram4", "ngram", 4, 1, 4), Arm("chain1", "eagle_chain", 1, 1, 1), \
        Arm("chain2", "eagle_chain", 2, 1, 2)

    def run(close):
        bandit = _one_bucket([OFF, ngram, chain1, chain2], epsilon=0.2, close=close, min_samples=5, probe=0.0)
        late_chain = 0
        for step in range(3000):
            arm = bandit.select(1)
            bandit.update(1, arm, {OFF: 1.0, ngram: 1.5}.get(arm, 0.7), 1.0)
            late_chain += step >= 500 and arm.method == "eagle_chain"
        return bandit, late_chain

    bandit, late_chain = run(close=True)
    assert bandit.retired_buckets() == ["bs>=1"] and bandit.closed_buckets() == [] and late_chain == 0
    assert bandit.best(1) is ngram and bandit.counts[0]["ngram4"] > 2500
    assert not bandit.capturing(1) and not bandit.any_open()
    control, late_chain = run(close=False)
    assert control.retired_buckets() == [] and late_chain >= 5 and control.capturing(1)
    # the CPU table: where every bucket's chains retired, the bucket without SD arms stops capturing too
    cpu = StrategyBandit(*default_arm_table("cpu"), epsilon=0.0, min_samples=1, probe=0.0)
    for bs in (1, 3, 10):
        b = cpu.bucket(bs)
        cpu.update(bs, OFF, bs, 0.010)
        for arm in cpu.arms[b][1:]:  # n-gram at 1.5x, chains at 0.5x
            cpu.update(bs, arm, bs * (3 if arm.method == "ngram" else 1), 0.020)
        assert cpu.retired[b] and not cpu.closed[b] and not cpu.capturing(bs)
        assert cpu.capturing(30) == (bs != 10)  # control: while a bucket's chains may run


def test_retired_drafter_arms_return_for_a_drafter_that_could_pay_and_by_probe():
    """Retired chains (0.6x, the n-gram arm paying) stay retired for a drafter 10% better (0.66x), and return, capture
    with them, for one 80% better (1.19x beats "off") or one of unknown gain. And by themselves: chains at 0.7x for
    3000 steps, then 2.0x (the drafter's text came back); with probe=0.05 they are tried again once the bucket has
    decoded 20x what they lost, and after the turn they run most steps. Control: probe=0, retired to the end."""
    ngram, chain = Arm("ngram4", "ngram", 4, 1, 4), Arm("chain1", "eagle_chain", 1, 1, 1)

    def retired():
        bandit = _one_bucket([OFF, ngram, chain], epsilon=0.0, min_samples=2, probe=0.0)
        for arm, tokens in ((OFF, 1.0), (ngram, 1.5), (chain, 0.6), (chain, 0.6)):
            bandit.update(1, arm, tokens, 1.0)
        assert bandit.retired_buckets() == ["bs>=1"] and not bandit.capturing(1)
        return bandit

    bandit = retired()
    bandit.forget(gain=0.1)
    assert bandit.retired_buckets() == ["bs>=1"] and not bandit.capturing(1)
    for control in (dict(gain=0.8), {}):
        bandit = retired()
        bandit.forget(**control)
        assert bandit.retired_buckets() == [] and bandit.capturing(1), control
        assert bandit.untried == [["chain1"]] and bandit.select(1) is chain  # a fresh trial, not the old window

    def run(probe):
        bandit = _one_bucket([OFF, ngram, chain], epsilon=0.2, min_samples=5, probe=probe)
        mid_chain = late_chain = 0
        for step in range(6000):
            arm = bandit.select(1)
            bandit.update(1, arm, {OFF: 1.0, ngram: 1.2}.get(arm, 0.7 if step < 3000 else 2.0), 1.0)
            mid_chain += 1000 <= step < 3000 and arm is chain
            late_chain += step >= 4000 and arm is chain
        return bandit, mid_chain / 2000, late_chain / 2000

    bandit, mid, late = run(0.05)
    assert bandit.probes >= 5 and mid < 0.1 and late > 0.8, (bandit.probes, mid, late)
    bandit, mid, late = run(0.0)
    assert bandit.probes == 0 and late == 0 and bandit.retired_buckets() == ["bs>=1"]


def test_a_closed_bucket_probes_the_n_gram_arm_while_the_drafter_arms_that_lost_wait():
    """An n-gram arm (0.8x) and a chain (0.5x) both lose: the bucket closes and the chain, which lost, retires with it.
    The bucket's probe, brought near by n-gram hits (a looping stretch), tries the n-gram arm afresh but not the chain,
    which waits for its own probe (1 / probe times the 0.5 s it lost: 10 s of decoding). Control: with the chain not
    retired, the same probe tries it first."""
    chain, ngram = Arm("chain1", "eagle_chain", 1, 1, 1), Arm("ngram4", "ngram", 4, 1, 4)

    def probed(retired):
        bandit = _one_bucket([OFF, chain, ngram], epsilon=0.0, min_samples=1, probe=0.05)
        for arm, tokens in ((OFF, 1.0), (ngram, 0.8), (chain, 0.5)):
            bandit.update(1, arm, tokens, 1.0)
        assert bandit.closed_buckets() == ["bs>=1"] and bandit.retired == [True]
        bandit.retired[0] = retired
        while bandit.closed[0]:
            bandit.shadow(1, True)
            bandit.update(1, OFF, 0.06, 0.06)
        return bandit

    bandit = probed(retired=True)
    assert bandit.probes == 1 and bandit.untried == [["ngram4"]] and bandit.select(1) is ngram
    assert bandit.retired == [True] and not bandit.capturing(1)
    decoded = bandit.retired_s[0]  # since the chain retired (the closed stretch counts)
    for _ in range(300):  # the n-gram arm loses again; the chain's own probe comes after 10 s
        arm = bandit.select(1)
        if arm is chain:
            break
        bandit.update(1, arm, {OFF: 0.06, ngram: 0.048}[arm], 0.06)
        decoded += 0.06
    assert arm is chain and 10.0 <= decoded < 10.5, decoded
    control = probed(retired=False)
    assert control.untried == [["chain1", "ngram4"]] and control.select(1) is chain


def test_a_bucket_whose_retired_drafter_arms_have_few_steps_still_closes():
    """A chain retired after one step (dominated by an n-gram arm at 1.5x) is judged: when the n-gram arm then loses
    (0.7x) the bucket closes on the arms that may run, though the chain never got min_samples steps."""
    ngram, chain = Arm("ngram4", "ngram", 4, 1, 4), Arm("chain1", "eagle_chain", 1, 1, 1)
    bandit = _one_bucket([OFF, ngram, chain], epsilon=0.2, min_samples=5, probe=0.0)
    for step in range(3000):
        arm = bandit.select(1)
        bandit.update(1, arm, {OFF: 1.0, ngram: 1.5 if step < 500 else 0.7}.get(arm, 0.6), 1.0)
        if step == 499:
            assert bandit.retired == [True] and len(bandit.steps[0]["chain1"]) < 5 and not bandit.closed[0]
    assert bandit.closed_buckets() == ["bs>=1"]


def test_an_open_bucket_runs_its_n_gram_arm_while_a_row_loops():
    """The n-gram arm lost on average here (0.62 of a plain step's worth), so "off" is the greedy choice. When the
    n-gram drafter, asked before plain steps, guessed a row's next token `follow` (4) times in a row, the row loops,
    and while a row of the batch loops the bucket runs the n-gram arm for the looping rows (`following`: the rows it
    drafts for); a step where that row gains no drafted token ends its loop, and so does its finishing, while a step
    with a request waiting (rows=None) does not follow, nor one where a row that does not loop has as many tokens left
    as the looping row or more (`left`: drafting for it brings the batch's end no nearer).
    Controls: 3 hits, or 3 hits, a miss and 3 more, keep "off"; another row's hits do not count; a looping row outside
    the batch does not count; follow=0 never follows; a closed bucket does not watch (its shadow asks instead: the
    next test)."""
    ngram = Arm("ngram3", "ngram", 3, 1, 3)

    def fresh(follow=4, close=False):
        bandit = _one_bucket([OFF, ngram], epsilon=0.0, follow=follow, close=close)
        for _ in range(5):
            bandit.update(1, OFF, 1.0, 1.0, 1.0)
            bandit.update(1, ngram, 1.0, 1.6, 1.0)    # 0.62x of plain decoding: lost
        assert bandit.select(1, [10, 11]) is OFF and bandit.watching(1) is (bool(follow) and not close)
        return bandit

    bandit = fresh()
    for _ in range(3):
        bandit.loop_shadow(10, True)
    bandit.loop_shadow(11, True)
    assert bandit.select(1, [10, 11]) is OFF          # 3 hits for row 10, 1 for row 11: not yet
    bandit.loop_shadow(10, True)
    assert bandit.select(1, [10, 11]) is ngram        # the 4th: row 10 loops
    assert bandit.following == {10}                  # the step drafts for row 10 only
    assert bandit.select(1, None) is OFF and bandit.following is None  # a request waits: no following
    assert bandit.select(1, [11, 12]) is OFF         # row 10 is not in this batch
    bandit.loop_drafted({10: 4, 11: 1})              # row 10 gained 3 drafted tokens: it goes on looping
    assert bandit.select(1, [10, 11]) is ngram
    bandit.loop_drafted({10: 2})                     # one drafted token: still
    assert bandit.select(1, [10, 11]) is ngram
    bandit.loop_drafted({10: 1, 11: 4})              # none for row 10: its loop ended; row 11's gain starts none
    assert bandit.select(1, [10, 11]) is OFF
    for _ in range(4):
        bandit.loop_shadow(11, True)
    assert bandit.select(1, [10, 11]) is ngram and bandit.following == {11}
    assert bandit.select(1, [11, 12], left=[9, 5]) is ngram and bandit.following == {11}  # it leads: followed
    assert bandit.select(1, [11, 12], left=[9, 9]) is OFF   # row 12, not looping, ends with it: no nearer end
    assert bandit.select(1, [11, 12], left=[5, 9]) is OFF and bandit.following is None  # row 12 outlasts it
    bandit.loop_end([11])                            # it finished
    assert bandit.select(1, [10, 11]) is OFF and bandit.loop_steps == 5 and bandit.streak == {}

    bandit = fresh()
    for hit in [True] * 3 + [False] + [True] * 3:
        bandit.loop_shadow(10, hit)
    assert bandit.select(1, [10]) is OFF             # a miss starts the count again

    bandit = fresh(follow=0)
    for _ in range(10):
        bandit.loop_shadow(10, True)
    assert bandit.select(1, [10]) is OFF

    bandit = fresh(close=True)                       # the n-gram arm lost: the bucket closes
    assert bandit.closed_buckets() == ["bs>=1"] and not bandit.watching(1) and bandit.shadowing(1)


def test_a_new_batch_cuts_the_n_gram_arms_record_to_its_last_steps():
    """The n-gram arm ran 30 steps at 1.25x of plain decoding's worth on one batch's text. On the next batch it is
    worth 0.875x: after `new_batch` its window keeps its last `min_samples` (5) steps, so greedy choice goes back to
    "off" after 6 of them; the drafter's arm keeps its record (a drafter's worth does not depend on the batch).
    Control: without `new_batch`, the old record holds the n-gram arm for 36 of the next 50 steps."""
    ngram = Arm("ngram3", "ngram", 3, 1, 3)

    def losing_steps(new_batch):
        bandit = _one_bucket([OFF, ngram, CHAIN], epsilon=0.0, close=False)
        for _ in range(30):
            bandit.update(10, OFF, 10.0, 1.0)
            bandit.update(10, ngram, 12.5, 1.0)        # 1.25x
            bandit.update(10, CHAIN, 10.0, 1.2)        # 0.83x
        if new_batch:
            bandit.new_batch()
            assert (len(bandit.steps[0]["ngram3"]), len(bandit.steps[0][CHAIN.name])) == (5, 30)
        chosen = []
        for _ in range(50):
            arm = bandit.select(10)
            chosen.append(arm.name)
            bandit.update(10, arm, 10.5 if arm is ngram else 10.0, 1.0 if arm is OFF else 1.2)  # n-gram 0.875x
        return chosen

    assert losing_steps(new_batch=True) == ["ngram3"] * 6 + ["off"] * 44
    chosen = losing_steps(new_batch=False)
    assert chosen.count("ngram3") == 36 and chosen[32] == "off"  # "off" once to refresh its price (`refresh`)


def test_steps_run_for_a_loop_do_not_make_the_arm_the_greedy_choice_after_it():
    """The n-gram arm's own steps ran at 0.89x of plain decoding's worth, so "off" is the greedy choice. A row
    then loops, and ten steps run for it pay 3x. Once the loop ends, "off" is still the greedy choice: the followed
    steps are recorded neither in the arm's window nor in the ledger (they say what the arm is worth in a loop, which
    following acts on, not what choosing it on its record brings). Control: the same ten steps recorded as the arm's
    own make it the greedy choice, and it keeps being chosen with no row looping."""
    ngram = Arm("ngram3", "ngram", 3, 1, 3)

    def after_loop(followed):
        bandit = _one_bucket([OFF, ngram], epsilon=0.0, close=False)
        for _ in range(10):
            bandit.update(2, OFF, 2.0, 1.0, 1.0)
            bandit.update(2, ngram, 2.5, 1.4, 1.0)  # 1.25 plain steps' worth in 1.4 steps' time: 0.89x
        assert bandit.select(2, [10, 11]) is OFF
        for _ in range(4):
            bandit.loop_shadow(10, True)
        ledger = bandit.ledger_seconds(0)
        for _ in range(10):
            assert bandit.select(2, [10, 11]) is ngram and bandit.following == {10}
            bandit.update(2, ngram, 6.0, 1.0, 5.0, followed=followed)  # 3 plain steps' worth in one step's time
            bandit.loop_drafted({10: 5})
        bandit.loop_end([10])
        return bandit, bandit.ledger_seconds(0) - ledger

    bandit, gained = after_loop(followed=True)
    assert bandit.select(2, [11, 12]) is OFF and bandit.following is None
    assert bandit.estimate(0, "ngram3") < 1.0 and gained == 0.0
    bandit, gained = after_loop(followed=False)           # control: recorded as the arm's own steps
    assert bandit.estimate(0, "ngram3") > 1.03 and gained > 0
    assert [bandit.select(2, [11, 12]) for _ in range(5)] == [ngram] * 5 and bandit.following is None


def test_steps_run_for_a_loop_count_towards_the_retired_drafter_arms_probe():
    """A followed step is recorded nowhere (not in the n-gram arm's window), but it is decoding time in its bucket all
    the same: it counts towards the retired drafter arms' own probe (1 / probe times the seconds they lost)."""
    ngram = Arm("ngram3", "ngram", 3, 1, 3)
    bandit = _one_bucket([OFF, ngram, CHAIN], epsilon=0.0, min_samples=1, probe=0.01)
    bandit.update(1, OFF, 1.0, 1.0)
    bandit.update(1, ngram, 3.0, 1.0)  # 3x
    bandit.update(1, CHAIN, 1.0, 2.0)  # 0.5x: the drafter's arm retires where the n-gram arm pays
    assert bandit.retired == [True] and not bandit.closed[0]
    steps, seconds, window = bandit.retired_steps[0], bandit.retired_s[0], len(bandit.steps[0]["ngram3"])
    for _ in range(3):
        bandit.update(1, ngram, 4.0, 0.5, followed=True)
    assert (bandit.retired_steps[0], bandit.retired_s[0]) == (steps + 3, seconds + 1.5)
    assert len(bandit.steps[0]["ngram3"]) == window


def test_a_closed_bucket_follows_a_row_that_loops_and_stays_closed():
    """The n-gram arm lost here (0.62 of a plain step's worth) while no row looped, and the bucket closed. A row that
    loops later is followed there too: the closed bucket's shadow guesses (`shadow`, with the row's key) count its
    hits in a row, and at `follow` (4) the bucket runs its n-gram arm for that row, whatever its window says. It stays
    closed: the step is recorded neither in the arm's window nor in the ledger, only plain steps count towards its
    probe, and a step where the row gains no drafted token ends the loop. Controls: three hits keep "off"; follow=0
    never follows; a looping row that a row which does not loop outlasts (`left`) is not followed."""
    ngram = Arm("ngram3", "ngram", 3, 1, 3)

    def closed(follow=4):
        bandit = _one_bucket([OFF, ngram], epsilon=0.0, follow=follow, probe=0.01)
        for _ in range(5):
            bandit.update(2, OFF, 2.0, 1.0, 1.0)
            bandit.update(2, ngram, 2.0, 1.6, 1.0)   # 0.62x of plain decoding: lost
        assert bandit.closed_buckets() == ["bs>=1"] and bandit.shadowing(2) and not bandit.watching(2)
        return bandit

    bandit = closed()
    for hit in [True] * 3:
        bandit.shadow(2, hit, 10)
    bandit.shadow(2, True, 11)
    assert bandit.select(2, [10, 11]) is OFF          # 3 hits for row 10, 1 for row 11: not yet
    bandit.update(2, OFF, 2.0, 1.0, 1.0)
    bandit.shadow(2, True, 10)
    assert bandit.select(2, [10, 11]) is ngram and bandit.following == {10}  # the 4th: row 10 loops
    steps, ledger, plain = len(bandit.steps[0]["ngram3"]), len(bandit.ledger[0]), bandit.closed_steps[0]
    bandit.update(2, ngram, 5.0, 1.2, 4.0, followed=True)  # the step drafted 3 tokens for row 10
    bandit.loop_drafted({10: 4})
    assert bandit.closed_buckets() == ["bs>=1"] and bandit.closed_steps[0] == plain
    assert (len(bandit.steps[0]["ngram3"]), len(bandit.ledger[0])) == (steps, ledger)
    assert bandit.select(2, [10, 11]) is ngram and bandit.loop_steps == 2
    assert bandit.select(2, [10, 11], left=[5, 9]) is OFF   # row 11, not looping, outlasts it
    bandit.loop_drafted({10: 1})                      # no drafted token for row 10: its loop ended
    assert bandit.select(2, [10, 11]) is OFF and bandit.closed_buckets() == ["bs>=1"]

    bandit = closed(follow=0)
    for _ in range(10):
        bandit.shadow(2, True, 10)
    assert bandit.select(2, [10, 11]) is OFF and bandit.following is None


def test_loop_following_is_on_with_the_cpu_profile_and_off_with_the_gpu_one_unless_set():
    """speculative.follow_loops null: 4 where the arm table is the CPU's (by the engine's device, or device_profile),
    off where it is the GPU's; a value set is used as it is."""
    from tlt.speculative.config import SpecConfig
    assert SpecConfig().follow("cpu") == 4 and SpecConfig().follow("cuda") == 0
    assert SpecConfig.from_dict(dict(device_profile="cpu")).follow("cuda") == 4
    assert SpecConfig.from_dict(dict(device_profile="gpu")).follow("cpu") == 0
    assert SpecConfig.from_dict(dict(follow_loops=2)).follow("cuda") == 2
    assert SpecConfig.from_dict(dict(follow_loops=0)).follow("cpu") == 0


def test_only_guesses_start_a_loop_which_follows_its_row_across_buckets_and_keeps_off_priced():
    """A row's loop starts from plain steps' guesses alone: n-gram steps that gained it drafted tokens while not
    following (greedy or explored) start none. Following, "off" still runs where its price would go stale (every
    `refresh` choices), and a hit there keeps the loop. The loop is the row's: it goes on where the batch moves to
    another bucket with an n-gram arm, open or closed, and after a published drafter (`forget`)."""
    ngram = Arm("ngram3", "ngram", 3, 1, 3)
    arms = [OFF, ngram]

    def fresh(**kw):
        bandit = StrategyBandit([2, math.inf], [arms, arms], seed=3, epsilon=0.0, close=False, **kw)
        for bs in (1, 3):
            for _ in range(5):
                bandit.update(bs, OFF, float(bs), 1.0, 1.0)
                bandit.update(bs, ngram, 1.0, 1.6, 1.0)
        return bandit

    bandit = fresh()
    for _ in range(6):
        bandit.update(1, ngram, 1.0, 1.6, 3.0)       # n-gram steps not chosen by following, drafts held
        bandit.loop_drafted({7: 3})
    bandit.select(1, [7])                            # (its window may make it greedy now: not a loop's step)
    assert bandit.streak == {} and bandit.loop_steps == 0

    bandit = fresh(refresh=8)
    for _ in range(4):
        bandit.loop_shadow(7, True)
    chosen = []
    for _ in range(20):
        arm = bandit.select(1, [7])
        chosen.append(arm.name)
        if arm is OFF:
            bandit.loop_shadow(7, True)              # its guess held: the loop goes on
        else:
            bandit.update(1, ngram, 1.0, 1.6, 3.0)
            bandit.loop_drafted({7: 3})
    assert chosen[:8] == ["ngram3"] * 8 and chosen[8] == "off" and chosen[9:17] == ["ngram3"] * 8
    assert bandit.loop_steps == 18

    bandit = fresh()
    for _ in range(4):
        bandit.loop_shadow(7, True)
    bandit.forget(gain=0.01)                         # a publish: still following
    assert bandit.select(3, [6, 7, 8]) is ngram and bandit.select(1, [7]) is ngram  # in either bucket
    bandit.closed[1] = True
    assert bandit.select(3, [6, 7, 8]) is ngram and bandit.select(1, [7]) is ngram
