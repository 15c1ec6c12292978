"""`tlt bench decode --quick` runs on a tiny random model and ends with a parseable JSON line (numbers unchecked:
benchmarks are not tests); `tlt bench` names the available benchmarks when given an unknown one."""
from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import make_tiny_checkpoint
from tlt import bench
from tlt.bench import decode


def test_decode_quick_prints_table_and_json(tmp_path, capsys):
    model_dir = make_tiny_checkpoint(tmp_path / "tiny", "llama")
    assert decode.main(["--quick", "--models", model_dir]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert any("ours_tok_s" in line for line in out)  # the table header
    result = json.loads(out[-1])
    assert result["benchmark"] == "decode"
    assert [(r["bs"], r["dtype"]) for r in result["rows"]] == [(1, "float32"), (2, "float32")]
    assert all(r["ours_tok_s"] > 0 and r["hf_tok_s"] > 0 for r in result["rows"])


def test_bench_dispatch_lists_available(capsys):
    assert "decode" in bench.available() and "common" not in bench.available()
    assert bench.main(["no-such-bench"]) == 2
    assert "available: " in capsys.readouterr().err


class _UniformModel(torch.nn.Module):
    """Every position predicts a uniform distribution over V tokens: top-k mass k / V exactly."""

    def __init__(self, V: int):
        super().__init__()
        self.V = V
        self.dummy = torch.nn.Parameter(torch.zeros(1))

    def forward(self, ids):
        return torch.zeros(*ids.shape, 1)

    def logits(self, hidden):
        return torch.zeros(*hidden.shape[:-1], self.V)


def test_oracle_accept_bound_exact_on_a_uniform_model():
    from tlt.bench.spec import oracle_accept_bound
    n, depth = 10, 2
    got = oracle_accept_bound(_UniformModel(4), [([1, 2], list(range(n)))], depth, topks=(1, 2))
    for k in (1, 2):
        m = k / 4
        # positions 0..n-2 see 1 + m + m^2, the last one only 1 + m (nothing after it to draft)
        want = ((n - 1) * (1 + m + m * m) + (1 + m)) / n
        assert abs(got[k] - want) < 1e-9, (k, got[k], want)


def test_oracle_accept_bound_on_a_real_model_is_ordered(tiny_llama_dir):
    from tlt.bench.spec import oracle_accept_bound
    from tlt.models import load_model
    model = load_model(tiny_llama_dir)
    pairs = [([3, 4, 5], [7, 8, 9, 10, 11, 12]), ([9], [1, 2, 3])]
    b4, b8 = oracle_accept_bound(model, pairs, 4), oracle_accept_bound(model, pairs, 8)
    assert 1.0 < b4[1] < b4[2] < b4[4] <= 5.0  # more children, more mass; at most 1 + depth
    assert all(b8[k] >= b4[k] for k in b4)
    # at a lower temperature the target's top-k mass can only grow: the bound rises (a uniform model stays put)
    cold = oracle_accept_bound(model, pairs, 4, temperature=0.5)
    assert all(cold[k] > b4[k] for k in b4), (cold, b4)
    flat = [oracle_accept_bound(_UniformModel(4), pairs, 4, temperature=t)[1] for t in (0.5, 1.0)]
    assert flat[0] == flat[1]


def test_trl_bench_per_token_time():
    """Step time per 1000 sampled response tokens: the length-normalised figure next to the per-step ratio."""
    from tlt.bench.trl_grpo import seconds_per_ktok
    # 16 responses a step: 40 s for 1000 tokens (62.5 each), 30 s for 500, 60 s for 2000 -> 40, 60, 30 s/ktok
    assert seconds_per_ktok([40.0, 30.0, 60.0], [62.5, 31.25, 125.0], 16) == 40.0
    assert seconds_per_ktok([40.0, 30.0], [None, 62.5], 16) == 30.0  # a step without a length is left out
    assert seconds_per_ktok([40.0], [None], 16) is None


def test_rollout_on_the_longtail_task_prints_the_oracle_bound_beside_accept_length(tmp_path, capsys, monkeypatch):
    from tlt.bench import rollout
    from tlt.bench.random_model import build_random_model
    from tlt.rl import rollout as rl_rollout
    model_dir = str(build_random_model("tiny", tmp_path / "tiny", dtype="float32"))
    seen, real = [], rl_rollout.sampling_params_for
    monkeypatch.setattr(rl_rollout, "sampling_params_for", lambda *a, **k: seen.append(a[2]) or real(*a, **k))
    assert rollout.main(["--quick", "--model", model_dir, "--task", "longtail", "--device", "cpu",
                         "--modes", "off,ngram", "--depth", "3", "--temperature", "0.6"]) == 0
    assert seen and set(seen) == {0.6}  # every rollout sampled at the temperature asked for
    out = capsys.readouterr().out.strip().splitlines()
    assert json.loads(out[-1])["temperature"] == 0.6
    assert any("oracle_chain" in line and "accept_max" in line for line in out)
    modes = json.loads(out[-1])["modes"]
    assert "accept_max" not in modes["off"]                            # no SD, no bound to show
    ngram = modes["ngram"]
    assert ngram["accept_max"] == 4
    assert 1.0 <= ngram["oracle_chain"] <= ngram["oracle_tree4"] <= 4.0
    assert ngram["accept_len"] <= ngram["accept_max"]


def test_bench_temperature_must_be_positive(capsys):
    from tlt.bench import rollout, spec
    for main in (rollout.main, spec.main):
        with pytest.raises(SystemExit) as e:
            main(["--quick", "--temperature", "0"])
        assert e.value.code == 2 and "--temperature 0.0: must be > 0" in capsys.readouterr().err


def test_bench_spec_times_only_the_strategies_asked_for(tmp_path, capsys):
    """--strategies picks what is timed against plain decoding (always timed), plain_control (a second plain engine,
    the machine's noise) only when named; a name it does not know, plain itself, an EAGLE strategy without a
    drafter, or an empty prompt pool is refused before any model loads."""
    from tlt.bench import spec
    for bad, why in ((["--strategies", "plain"], "plain is always timed"), (["--strategies", "medusa"], "choose from"),
                     (["--no-drafter", "--strategies", "adaptive"], "only ngram runs without a drafter"),
                     (["--prompts", "0"], "--prompts 0: must be >= 1")):
        with pytest.raises(SystemExit) as e:
            spec.main(["--quick", "--model", str(tmp_path / "absent"), *bad])
        assert e.value.code == 2 and why in capsys.readouterr().err
    assert list(spec.strategies("d", 4, wanted=["adaptive"])) == ["plain", "adaptive"]
    assert list(spec.strategies("d", 4, sd_eager=True, wanted=["ngram"])) == ["plain", "ngram", "ngram/sd_eager"]
    assert list(spec.strategies("d", 4)) == ["plain", "ngram", "eagle_chain", "eagle_tree", "adaptive"]  # control
    assert list(spec.strategies(None, 4, wanted=["plain_control", "ngram"])) == ["plain", "plain_control", "ngram"]


def test_bench_spec_rows_say_where_the_time_went(tiny_llama_dir, monkeypatch):
    """Each row carries the CUDA graphs captured in the timed rounds (0 on CPU); an adaptive strategy's row also
    its last round's seconds in SD steps and what they saved, which a fixed strategy (nothing plain to price its
    steps against) and plain do not have."""
    import itertools
    import math

    from tlt.bench.spec import run_ours, strategies
    from tlt.speculative.policy import AdaptivePolicy
    # an adaptive engine that alternates plain and n-gram steps, whatever they cost here
    turns = itertools.cycle([0, 1])
    monkeypatch.setattr(AdaptivePolicy, "choose",
                        lambda self, bs: (arms := self.bucket(bs).arms)[next(turns) % len(arms)].arm)
    specs = {**strategies(None, 3, wanted=["ngram"]),
             "ngram_adaptive": dict(method="ngram", bs_threshold=None)}
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    rows, _ = run_ours(str(tiny_llama_dir), None, prompts, 2, specs, 40, 1, 0)
    by = {r["strategy"]: r for r in rows}
    assert set(by) == {"plain", "ngram", "ngram_adaptive"} and all(r["captures"] == r["capture_s"] == 0 for r in rows)
    assert all(by[k]["sd_s"] is None and by[k]["sd_saved_s"] is None for k in ("plain", "ngram"))
    assert by["ngram_adaptive"]["sd_on"] > 0 and by["ngram_adaptive"]["sd_s"] > 0
    assert math.isfinite(by["ngram_adaptive"]["sd_saved_s"])
    assert by["ngram"]["ci_low"] <= by["ngram"]["speedup"] <= by["ngram"]["ci_high"]


def test_bench_spec_rounds_walk_the_prompt_pool(tiny_llama_dir, monkeypatch):
    """Round j (0: the warm-up) decodes the pool's next bs prompts, wrapping, and every strategy decodes the same
    batch in a round (its ratios pair like with like); the pairs returned are the last round's. Decoding
    prompts[:bs] every round would give a bs-1 verdict on one prompt."""
    import tlt
    from tlt.bench.spec import run_ours, strategies
    seen: list[tuple[str, list[list[int]]]] = []
    generate = tlt.LLM.generate

    def spy(self, prompts, params):
        seen.append(("plain" if self.spec is None else "ngram", [list(p) for p in prompts]))
        return generate(self, prompts, params)
    monkeypatch.setattr(tlt.LLM, "generate", spy)
    pool = [[5, 6, 7, 8], [9, 10, 11], [12, 13], [14, 15, 16]]
    _, pairs = run_ours(str(tiny_llama_dir), None, pool, 1, strategies(None, 3, wanted=["ngram"]), 8, 4, 0)
    by = {k: [b for name, b in seen if name == k] for k in ("plain", "ngram")}
    assert by["plain"] == by["ngram"] == [[pool[j % 4]] for j in range(5)]  # warm-up + 4 rounds, wrapping
    assert [p for p, _ in pairs] == [pool[0]]
    seen.clear()
    run_ours(str(tiny_llama_dir), None, pool, 3, strategies(None, 3, wanted=["ngram"]), 8, 1, 0)
    assert [b for name, b in seen if name == "plain"] == [pool[:3], [pool[3], pool[0], pool[1]]]


def test_interleaved_times_rotates_the_order():
    """Every configuration runs in every slot of a round equally often (a fixed order would always time the first
    one right after the previous round's last), and each gets one untimed warm-up call."""
    from tlt.bench.common import interleaved_times
    log: list[str] = []
    timed = interleaved_times({k: (lambda k=k: log.append(k) or k) for k in "ABC"}, 6)
    assert log[:3] == list("ABC")  # warm-up
    rounds = [log[3 + 3 * r: 6 + 3 * r] for r in range(6)]
    assert all(sorted(r) == list("ABC") for r in rounds)
    assert {k: [r[0] for r in rounds].count(k) for k in "ABC"} == {"A": 2, "B": 2, "C": 2}
    assert all(len(t["times"]) == 6 and t["result"] == k for k, t in timed.items())


def test_median_ci_is_the_sign_test_interval():
    """The interval's ends are order statistics whose binomial coverage is the smallest >= 95%: 9 values give the
    2nd and 8th (96%), 5 values only their range (94%); shuffling the values does not change it."""
    import random

    from tlt.bench.common import median_ci
    vals = [1.0 + 0.01 * i for i in range(9)]
    random.Random(0).shuffle(vals)
    lo, hi, cover = median_ci(vals)
    assert (lo, hi) == (1.01, 1.07) and cover == pytest.approx(1 - 2 * 10 / 512)
    assert median_ci([3.0, 1.0, 2.0, 5.0, 4.0]) == (1.0, 5.0, pytest.approx(1 - 2 / 32))
    with pytest.raises(ValueError):
        median_ci([])


def test_adaptive_verdict_names_the_batch_sizes_that_miss():
    """The verdict judges the adaptive rows' medians against 0.98 and says where the interval lies wholly below it
    (slower beyond the noise) apart from where only the median does; no adaptive row, no verdict."""
    from tlt.bench.spec import _ci, adaptive_verdict
    rows = [{"strategy": s, "bs": bs, "speedup": x, **_ci([lo, x, hi])}
            for s, bs, lo, x, hi in (("adaptive", 1, 0.90, 0.95, 1.02), ("adaptive", 2, 1.05, 1.10, 1.15),
                                     ("adaptive", 8, 0.91, 0.93, 0.96), ("adaptive", 16, 0.95, 0.9751, 1.0),
                                     ("plain", 8, 0.5, 0.5, 0.5))]
    v = adaptive_verdict(rows)
    assert "not met at bs 1, 8" in v and "lowest 0.93x at bs 8" in v and "wholly below 0.98 at bs 8" in v
    ok = adaptive_verdict(rows[1:2] + rows[3:4])  # 0.9751 prints as 0.98: met
    assert ok.startswith("goal: adaptive >= 0.98x plain at every batch size; met") and "no interval" in ok
    assert adaptive_verdict(rows[4:]) is None


def test_bench_spec_decodes_past_eos_unless_asked_to_stop(tmp_path, tiny_llama_dir):
    """By default every row decodes max_tokens, past its EOS (a batch size's cost holds through a round); with
    stop_at_eos a row ends at its EOS, as in a rollout, with the tokens it had up to there."""
    import json
    import shutil

    from tlt.bench.spec import run_ours, strategies
    specs = strategies(None, 3, wanted=["ngram"])
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    _, free = run_ours(str(tiny_llama_dir), None, prompts, 2, specs, 40, 1, 0)
    eos = free[0][1][5]  # the tiny model has no EOS: make row 0's sixth token one
    model = tmp_path / "with_eos"
    shutil.copytree(tiny_llama_dir, model)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    _, past = run_ours(str(model), None, prompts, 2, specs, 40, 1, 0)
    assert [r for _, r in past] == [r for _, r in free] and all(len(r) == 40 for _, r in past)
    rows, stopped = run_ours(str(model), None, prompts, 2, specs, 40, 1, 0, stop_at_eos=True)
    end = free[0][1].index(eos) + 1
    assert stopped[0][1] == free[0][1][:end] and end <= 6
    assert {r["strategy"] for r in rows} == {"plain", "ngram"}


def test_profile_measures_a_table_the_cost_model_loads(tiny_llama_dir, tmp_path, capsys):
    """`tlt bench profile` on a tiny model: a table of positive costs by rows and tokens, written where --out says,
    that tlt.engine.cost_model prices forwards from (an unknown rows/tokens pair interpolated between them)."""
    from tlt.bench import profile
    from tlt.engine.cost_model import CostModel, load_profiles
    from tlt.models import load_model
    out = tmp_path / "p.json"
    assert profile.main(["--model", tiny_llama_dir, "--dtype", "float32", "--rows", "1,2,4", "--tokens", "1,3",
                         "--context", "16", "--repeats", "1", "--name", "tiny", "--out", str(out)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    table = result["profile"]
    assert table["rows"] == [1, 2, 4] and table["tokens"] == [1, 3]
    assert all(t > 0 for part in ("target_s", "drafter_s", "draft_head_s") for row in table[part] for t in row)
    costs = CostModel(load_profiles(str(out))["tiny"], load_model(tiny_llama_dir).cfg, 64)
    assert costs.forward("target", 3, 2, 0) > 0
