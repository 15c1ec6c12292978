"""`tlt bench e2e --quick` and `tlt bench rollout --quick` run on the tiny random model and end with a parseable
JSON line naming every requested mode (numbers unchecked: benchmarks are not tests)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from tlt.bench import e2e, rollout

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
    assert (tmp_path / "e2e_curves.png").is_file()


def test_rollout_quick_all_modes(tmp_path, capsys):
    from tlt.models import load_model
    from tlt.rl.tiny_model import tiny_random_model_path
    from tlt.spec.drafter import Drafter
    from tlt.spec.drafter_io import save_drafter
    model_dir = str(tiny_random_model_path())
    torch.manual_seed(0)
    drafter = save_drafter(Drafter(load_model(model_dir).cfg), tmp_path / "drafter")  # random: accepts little
    assert rollout.main(["--quick", "--model", model_dir, "--drafter", str(drafter)]) == 0
    result = last_json(capsys)
    assert result["benchmark"] == "rollout" and set(result["modes"]) == set(rollout.MODES)
