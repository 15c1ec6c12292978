"""The adaptive policy on synthetic observations: what it values, when it parks and probes, what a new drafter does.
Each test has a control that a wrong rule fails. The policy on the real engine under device cost models:
tests/test_policy_harness.py."""
from __future__ import annotations

import math

import pytest

from tlt.speculative.config import SpecConfig, default_arm_table
from tlt.speculative.policy import OFF, AdaptivePolicy, Arm, PlainCosts

CHAIN = Arm("chain2", "eagle_chain", depth=2, num_draft_tokens=2)
NGRAM = Arm("ngram4", "ngram", depth=4, num_draft_tokens=4)
ONE = [1, math.inf]  # a bucket at bs 1, one above


def _policy(arms=(OFF, CHAIN, NGRAM), **kw) -> AdaptivePolicy:
    return AdaptivePolicy([4, math.inf], [list(arms), [OFF]], **kw)


def _drive(policy, steps, cost, bs=2):
    """Run `steps` choices at bs; cost(arm) -> (tokens, seconds). Returns the arms chosen."""
    chosen = []
    for _ in range(steps):
        arm = policy.choose(bs)
        tokens, seconds = cost(arm)
        policy.observe(bs, arm, tokens, seconds)
        chosen.append(arm.name)
    return chosen


def test_trials_first_in_table_order_then_the_fastest_arm():
    p = _policy()
    cost = {"off": (2, 1.0), "chain2": (4, 1.6), "ngram4": (3, 1.1)}  # speeds 1, 1.25, 1.36 of plain
    chosen = _drive(p, 90, lambda a: cost[a.name])
    assert chosen[:12] == ["off"] * 4 + ["chain2"] * 4 + ["ngram4"] * 4  # min_steps each
    assert chosen[12:].count("off") == 1  # once in `refresh` (64) SD choices: its price follows the machine
    assert chosen[12:].count("ngram4") > 60  # the chain, 8% slower, explored a few times
    assert p.explain()["bs1-4"]["ngram4"]["state"] == "best"


def test_nested_arms_are_judged_on_the_same_text():
    """A deep tree's trial falls on hard text and the budget cut nested in it tries on easy text; then the text is
    alike for both and the tree is 6% faster. Told what the cut would have emitted on the tree's steps (observe's
    nested), and so the tree's tokens on the cut's steps by their ratio, the policy is back on the tree within the
    rollout. Control: without it (each arm's record its own steps) it stays on the cut."""
    big = Arm("tree8x4n16", "eagle_tree", depth=8, topk=4, num_draft_tokens=16)
    cut = Arm("tree8x4n8", "eagle_tree", depth=8, topk=4, num_draft_tokens=8)

    def run(told: bool) -> list[str]:
        p = _policy((OFF, big, cut))
        chosen = []
        for i in range(300):
            arm = p.choose(2)
            tokens = 3.2 if i < 8 else 8.0 if i < 12 else 6.0  # the tree's tokens: hard, easy, then alike text
            nested = {cut: 0.8 * tokens} if told and arm is big else None
            if arm is OFF:
                p.observe(2, arm, 2, 1.0)
            else:
                p.observe(2, arm, tokens if arm is big else 0.8 * tokens, 1.3 if arm is big else 1.1, nested)
            chosen.append(arm.name)
        return chosen
    assert run(told=True)[4:12] == ["tree8x4n16"] * 4 + ["tree8x4n8"] * 4  # the trials, in table order
    assert run(told=True)[-100:].count("tree8x4n16") > 90
    assert run(told=False)[-100:].count("tree8x4n16") < 10


def test_a_trial_at_a_large_batch_takes_one_step():
    """min_rows: one step at bs 16 holds the 16 rows a trial needs, so each arm's trial is one step there (control:
    without the row rule, min_steps steps each)."""
    def trials(**kw):
        p = AdaptivePolicy([32, math.inf], [[OFF, CHAIN, NGRAM], [OFF]], **kw)
        return _drive(p, 12, lambda a: (16 * (1 + (a is not OFF)), 1.0), bs=16)[:3]
    assert trials() == ["off", "chain2", "ngram4"]
    assert trials(min_rows=10**9) == ["off"] * 3


def test_plain_decoding_runs_first_at_a_batch_size_it_has_not_priced():
    """The best arm is an SD arm, yet at a batch size with no plain step yet "off" runs once, so the SD steps there
    are priced by a plain step there; at a priced batch size (the control) the SD arm runs."""
    p = _policy()
    cost = {"off": (2, 1.0), "chain2": (4, 1.6), "ngram4": (3, 1.1)}
    _drive(p, 40, lambda a: cost[a.name], bs=2)
    arm = p.choose(2)
    assert arm is not OFF
    p.observe(2, arm, *cost[arm.name])
    assert p.choose(3) == OFF


def test_the_price_follows_plain_decoding_getting_faster():
    """Plain steps become twice as fast (the machine freed up, or the batch's rows got shorter): the chain, 1.25x
    plain before, now loses, and the refreshes (one plain step every `refresh` SD choices) bring the new price in,
    so the chain is dropped. Control: with no refresh the old price keeps it chosen."""
    def tail(**kw):
        p = _policy(arms=(OFF, CHAIN), **kw)
        _drive(p, 40, lambda a: (2, 1.0) if a is OFF else (4, 1.6))
        return _drive(p, 700, lambda a: (2, 0.5) if a is OFF else (4, 1.6))[-100:]
    assert tail().count("chain2") < 10
    assert tail(refresh=10**9).count("chain2") == 100


def test_speed_is_measured_against_plain_decoding_at_the_same_batch_size():
    """Plain steps cost 1 s at bs 2 (2 tokens/s) and 1.2 s at bs 4 (3.3 tokens/s). The chain ran at bs 4, 1.2x plain
    there (4 tokens/s); the n-gram arm at bs 2, 1.5x plain (3 tokens/s). Valued against plain at their own batch
    sizes the n-gram arm is the better one; by raw tokens per second (the control) the chain would be."""
    p = _policy()
    for bs, s in ((2, 1.0), (4, 1.2)) * 8:
        p.observe(bs, OFF, bs, s)
    for _ in range(4):
        p.observe(4, CHAIN, 4.8, 1.2)  # (4.8 / 4 * 1.2) / 1.2 = 1.2x
        p.observe(2, NGRAM, 3.0, 1.0)  # (3.0 / 2 * 1.0) / 1.0 = 1.5x
    b = p.bucket(2)
    chain, ngram = (next(r for r in b.arms if r.arm is a) for a in (CHAIN, NGRAM))
    assert p.value(chain) == pytest.approx(1.2) and p.value(ngram) == pytest.approx(1.5)
    assert p.explain()[b.name][NGRAM.name]["state"] == "best"
    raw = {r.arm: sum(t for _, t, _ in r.steps) / sum(s for *_, s in r.steps) for r in (chain, ngram)}
    assert raw[CHAIN] > raw[NGRAM]  # the control's ranking is the other one


def test_plain_costs_interpolate_and_extrapolate_along_the_upper_slope():
    c = PlainCosts()
    for bs, s in ((1, 10.0), (2, 10.0), (4, 12.0), (8, 20.0), (16, 36.0)):
        c.add(bs, s)
    assert [c(n) for n in (1, 3, 6, 16)] == [10.0, 11.0, 16.0, 36.0]
    assert c(32) == pytest.approx(36.0 + 2.0 * 16)  # the slope of bs 8..16
    c.add(15, 900.0)  # one slow step beside the step at bs 16 (a first at a batch size) sets no price
    c.add(17, 37.0)
    assert c(16) == 37.0
    flat = PlainCosts()
    for bs in (1, 8, 16):
        flat.add(bs, 3.0)
    assert flat(64) == 3.0  # a GPU's flat cost stays flat past the largest batch measured


def test_a_losing_arm_is_parked_and_its_probes_cost_a_bounded_share_that_backs_off():
    """A chain at 0.8x of plain: after its trial it is parked; it comes back for a trial once the bucket decoded
    1 / probe times what it lost, then twice that, ... (misses counted). Over a long run its probes take about
    probe of the time, halving with each miss. Control: probe=0.2 spends far more."""
    def run(probe):
        p = _policy(arms=(OFF, CHAIN), probe=probe, backoff=3)
        chosen = _drive(p, 4000, lambda a: (2, 1.0) if a is OFF else (2, 1.25))
        return chosen, p
    chosen, p = run(0.01)
    trials = [i for i, (a, b) in enumerate(zip(chosen, chosen[1:] + ["off"])) if a != "chain2" and b == "chain2"]
    gaps = [b - a for a, b in zip(trials, trials[1:])]
    assert len(gaps) >= 5 and all(1.8 * g1 <= g2 <= 2.2 * g1 for g1, g2 in zip(gaps[:3], gaps[1:4]))  # it doubles
    assert all(g == gaps[3] for g in gaps[4:])  # ... up to 2 ** backoff
    share = chosen.count("chain2") / len(chosen)
    assert 0 < share < 0.03
    assert p.bucket(2).arms[1].misses == len(trials) - 1
    assert run(0.2)[0].count("chain2") / 4000 > 2 * share


def test_a_probe_that_finds_the_arm_paying_keeps_it():
    p = _policy(arms=(OFF, CHAIN), probe=0.05)
    speed = {"chain": 1.25}
    chosen = _drive(p, 400, lambda a: (2, 1.0) if a is OFF else (2, speed["chain"]))
    assert chosen[-50:].count("chain2") == 0
    speed["chain"] = 0.5  # the text turned repetitive: the chain now accepts 4 tokens for 2 s' worth... 2x plain
    chosen = _drive(p, 1500, lambda a: (2, 1.0) if a is OFF else (2, speed["chain"]))
    assert chosen[-100:].count("chain2") > 80
    assert p.bucket(2).arms[1].misses == 0


def test_a_new_drafter_reopens_a_parked_drafter_arm_only_where_its_gain_could_pay():
    """A chain parked at 0.8x: a drafter 10% better cannot make it pay (it stays parked); two more such publishes
    (1.33x growth) can, and it is tried at once. Unknown gain (None): tried at once. The n-gram arm needs no
    drafter and is not reopened."""
    def parked():
        p = _policy()
        _drive(p, 20, lambda a: (2, 1.0) if a is OFF else (2, 1.25))
        assert all(r.parked_for is not None for r in p.bucket(2).arms[1:])
        return p
    p = parked()
    p.drafter_changed(gain=0.1)
    assert p.bucket(2).arms[1].parked_for is not None
    p.drafter_changed(gain=0.1)
    p.drafter_changed(gain=0.1)
    assert p.bucket(2).arms[1].parked_for is None and p.choose(2) is CHAIN
    assert p.bucket(2).arms[2].parked_for is not None
    p = parked()
    p.drafter_changed(gain=None)
    assert p.choose(2) is CHAIN


def test_exploration_decays_and_a_new_drafter_is_explored_again():
    """Two arms that pay, the n-gram arm more: the chain, with few steps on record, is chosen often at first and
    seldom later (its bonus shrinks as its steps accrue); a new drafter cuts the chain's record, and it is explored
    again. Control: explore=0 never returns to the chain after the trials."""
    cost = {"off": (2, 1.0), "chain2": (2, 0.85), "ngram4": (4, 1.3)}  # 1.18x and 1.54x of plain
    p = _policy(explore=1.0)
    chosen = _drive(p, 3000, lambda a: cost[a.name])
    early, late = chosen[12:312], chosen[-300:]
    assert early.count("chain2") > 2 * max(late.count("chain2"), 1) and late.count("ngram4") > 280
    p.drafter_changed(gain=0.0)
    again = _drive(p, 300, lambda a: cost[a.name])
    assert again.count("chain2") > 2 * max(late.count("chain2"), 1)
    greedy = _policy(explore=0.0)
    assert _drive(greedy, 600, lambda a: cost[a.name])[12:].count("chain2") == 0


def test_above_the_threshold_plain_decoding_and_the_prices_still_learned():
    p = AdaptivePolicy([4, math.inf], [[OFF, CHAIN], [OFF, CHAIN]], bs_threshold=8)
    assert p.choose(9) is OFF
    p.observe(9, OFF, 9, 3.0)
    assert p.price(9) == 3.0 and p.bucket(9).arms[0].chosen == 0


def test_a_fixed_arm_table_runs_its_arm_everywhere():
    cfg = SpecConfig(method="ngram", adaptive=False, bs_threshold=None, num_speculative_tokens=3)
    p = cfg.policy(has_drafter=False, device_type="cpu")
    for bs in (1, 7, 300):
        arm = p.choose(bs)
        p.observe(bs, arm, bs, 100.0)  # however slow: nothing to park it against
        assert arm.name == "ngram3" and p.choose(bs).name == "ngram3"


def test_deterministic():
    def run():
        return _drive(_policy(), 300, lambda a: {"off": (2, 1.0), "chain2": (4, 1.6), "ngram4": (3, 1.1)}[a.name])
    assert run() == run()


def test_default_tables_have_off_in_every_bucket_and_drafter_arms_only_with_a_drafter():
    for table in ("cpu", "gpu"):
        bounds, arms = default_arm_table(table)
        assert bounds[-1] == math.inf and all(any(a.method == "off" for a in bucket) for bucket in arms)
    cfg = SpecConfig(method="ngram")
    _, arms = cfg.arms(has_drafter=False, device_type="cuda")
    assert all(a.method in ("off", "ngram") for bucket in arms for a in bucket)
    with pytest.raises(ValueError, match="bounds must increase"):
        AdaptivePolicy([4, 2], [[OFF], [OFF]])
