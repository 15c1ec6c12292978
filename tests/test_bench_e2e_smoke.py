"""`tlt bench e2e --quick` and `tlt bench rollout --quick` run on the tiny random model and end with a parseable
JSON line naming every requested mode (numbers unchecked: benchmarks are not tests)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tlt.bench import e2e, rollout
from tlt.models import kernels

REPO = Path(__file__).resolve().parents[1]


def last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_e2e_quick_on_smoke_config(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)  # smoke.yaml's data paths are relative to the repository root
    assert e2e.main(["configs/smoke.yaml", "--quick", "--modes", "off,adaptive", "--out", str(tmp_path)]) == 0
    result = last_json(capsys)
    assert result["benchmark"] == "e2e" and set(result["modes"]) == {"off", "adaptive"}
    assert len(result["modes"]["adaptive"]["per_step"]) == result["steps"] == 2
    assert "reward_diff_ci" in result["modes"]["adaptive"] and "step_speedup" in result["modes"]["adaptive"]
    off, ad = ([s["step_s"] for s in result["modes"][m]["per_step"]] for m in ("off", "adaptive"))
    assert result["modes"]["adaptive"]["run_speedup"] == pytest.approx(sum(off) / sum(ad))  # the whole run's
    assert result["modes"]["adaptive"]["step1_speedup"] == pytest.approx(off[0] / ad[0])
    assert result["modes"]["adaptive"]["later_step_speedup"] == pytest.approx(off[1] / ad[1])  # 2 steps: step 2
    # off's step with the mode's rollout and drafter round in place of off's
    sd = [o["step_s"] / (o["step_s"] - o["gen_s"] - o["drafter_s"] + a["gen_s"] + a["drafter_s"])
          for o, a in zip(result["modes"]["off"]["per_step"], result["modes"]["adaptive"]["per_step"])]
    assert result["modes"]["adaptive"]["sd_step_speedup"] == pytest.approx(sum(sd) / 2)  # 2 steps: their median
    tail = result["modes"]["off"]["tail_decode_s"]  # decode time at a running batch <= 1, 2, 4, 8
    assert list(tail) == ["1", "2", "4", "8"] and tail["1"] <= tail["2"] <= tail["4"] <= tail["8"]
    costs = result["costs"]  # where the time goes, per mode: the trainer's phases and SD's own costs
    assert set(costs["off"]) == set(costs["adaptive"]) == set(e2e.COSTS)
    assert costs["off"]["rollout"] > 0 and costs["off"]["verify"] is None and costs["adaptive"]["rollout"] > 0
    assert (tmp_path / "e2e_curves.png").is_file()


def test_e2e_off_control_is_a_second_sd_off_process(tmp_path, capsys, monkeypatch):
    """--modes off,off_control: two SD-off trainers, the control compared with off like any mode (the machine's
    noise), sampling off's very responses; its config differs from off's only in the run's name."""
    from tlt.config import load_config
    cfg = load_config(None, [])
    off, control = (e2e.mode_config(cfg, m, "eagle", None, tmp_path) for m in ("off", "off_control"))
    assert not control.speculative.enabled and control.trainer.experiment_name == "off_control"
    control.trainer.experiment_name = "off"
    assert control == off
    monkeypatch.chdir(REPO)
    assert e2e.main(["configs/smoke.yaml", "--quick", "--modes", "off,off_control", "--out", str(tmp_path)]) == 0
    result = last_json(capsys)
    assert result["modes"]["off_control"]["same_responses"] == 1.0 and "step_speedup" in result["modes"]["off_control"]
    assert result["costs"]["off_control"]["verify"] is None  # no SD step ran


@pytest.mark.needs("reasoning_gym")
def test_rollout_quick_all_modes(tmp_path, capsys):
    from tlt.models import load_model
    from tlt.rl.tiny_model import tiny_random_model_path
    from tlt.speculative.drafter import Drafter
    from tlt.speculative.drafter_io import save_drafter
    model_dir = str(tiny_random_model_path())
    torch.manual_seed(0)
    drafter = save_drafter(Drafter(load_model(model_dir).cfg), tmp_path / "drafter")  # random: accepts little
    modes = [*rollout.MODES, "always_rej", "adaptive_rej"]
    assert rollout.main(["--quick", "--model", model_dir, "--drafter", str(drafter), "--modes", ",".join(modes)]) == 0
    result = last_json(capsys)
    assert result["benchmark"] == "rollout" and set(result["modes"]) == set(modes)
    # seeded rollouts: every mode samples SD off's responses (drafter-invariant verification; bitwise forwards on
    # the fp32 path this machine's kernels serve, else a rounding-sized boundary could part a response)
    with torch.no_grad():
        bitwise = kernels.matmul_path(torch.ones(2, 8), torch.ones(8, 8)) == "small_gemm"
    if not bitwise:  # a visible skip, and only where the kernels cannot be built (test_kernels checks that)
        pytest.skip("no fp32 small-row kernel on this CPU: verify forwards need not round as plain ones")
    # the _rej modes sample SD off's law, not its very samples
    assert all(v["same_as_off"] == 1.0 for m, v in result["modes"].items() if not m.endswith("_rej")), \
        result["modes"]


def test_e2e_modes_differ_only_in_the_speculative_section():
    from tlt.config import load_config
    cfg = load_config(None, [])
    rej = e2e.mode_config(cfg, "adaptive_rej", "eagle", "d", Path("o"))
    ada = e2e.mode_config(cfg, "adaptive", "eagle", "d", Path("o"))
    assert rej.speculative.acceptance == "rejection" and ada.speculative.acceptance == "invariant"
    rej.speculative.acceptance = "invariant"
    rej.trainer.experiment_name = ada.trainer.experiment_name
    assert rej == ada


def test_median_metric_skips_steps_without_the_metric():
    recs = [{"metrics": {"rollout/spec_accept_length": x}} for x in (1.9, float("nan"), None, 1.5, 2.1)]
    recs.append({"metrics": {}})
    assert e2e._median_metric(recs, "rollout/spec_accept_length") == 1.9  # NaN: a step where SD never ran
    assert e2e._median_metric(recs[1:3], "rollout/spec_accept_length") is None


def test_compare_learning_checks_the_first_step_on_its_own():
    """step1_* compares only the first step (same weights in every mode): equal laws there pass, a shifted length
    law fails (negative control) even when the pooled steps hide it."""
    from tlt.bench.e2e import compare_learning
    rng = np.random.default_rng(0)

    def rec(lengths):
        return {"scores": [float(x % 2) for x in lengths], "lengths": list(lengths)}

    same = rng.integers(10, 200, 400)
    off = [rec(same), rec(rng.integers(10, 400, 400))]
    sd = [rec(rng.permutation(same)), rec(rng.integers(10, 200, 400))]
    assert compare_learning(off, sd)["step1_lengths_ks_p"] > 0.5
    shifted = [rec(same + 40), off[1]]
    res = compare_learning(off, shifted)
    assert res["step1_lengths_ks_p"] < 1e-6 and res["step1_lengths_mwu_p"] < 1e-6


def test_summary_reports_the_free_rollout_ceiling():
    """gen_share and free_rollout_bound are per-step medians of gen/step and step/(step - gen): a rollout of 3 s in
    a 12 s step bounds any rollout speedup at 12/9 = 1.33x; a wrong reading (gen/step or step/gen) fails."""
    def rec(gen, step):
        return {"metrics": {"timing_s/gen": gen, "timing_s/step": step + 5.0, "timing_s/testing": 5.0},
                "scores": [1.0, 0.0], "lengths": [10, 20]}
    res = e2e.summarize({"off": [rec(3.0, 12.0), rec(2.0, 10.0), rec(4.0, 12.0)]})["off"]
    assert abs(res["gen_share"] - 0.25) < 1e-9  # median of 0.25, 0.2, 0.333
    assert abs(res["free_rollout_bound"] - 12 / 9) < 1e-9  # median of 1.333, 1.25, 1.5


def test_without_a_config_the_benches_run_what_tlt_train_runs(monkeypatch, tmp_path):
    """`tlt bench e2e` and `tlt bench trl` with no CONFIG read the config `tlt train` runs, shipped in the package, from
    any directory; they read the repository's configs/ copy before, so an installed package fell back to the built-in
    defaults (20 steps instead of 6). Control: the built-in default differs from the file's."""
    from tlt.config import load_config
    from tlt.rl.trainer import DEFAULT_CONFIG
    monkeypatch.chdir(tmp_path)
    assert e2e.DEFAULT_CONFIG == DEFAULT_CONFIG and DEFAULT_CONFIG.is_file()
    assert DEFAULT_CONFIG.parent.parent == Path(e2e.__file__).resolve().parents[1]  # inside the package
    builtin = load_config(None, []).trainer.total_steps
    assert load_config(str(e2e.DEFAULT_CONFIG), []).trainer.total_steps == 6 != builtin
