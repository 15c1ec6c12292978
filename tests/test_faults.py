"""Runs that survive SIGKILL: the real `tlt train` killed at named points of a step (tlt.faults, TLT_FAULT_AT)
and resumed with trainer.resume=auto ends with bitwise the same policy, drafter and per-step metrics as a run
that was never interrupted, with the drafter's default settings (spot training where a core is idle, as with one
thread on two cores). The fast test (CI) kills a few times; the slow one 24 times, in every phase."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tlt.device import usable_cpus
from tlt.faults import PHASES, fault_point, parse_fault_spec

ROOT = Path(__file__).resolve().parent.parent
# per-step metrics that must replay exactly (not timings, nor the adaptive SD's arm choices, which follow timings)
DETERMINISTIC = ("actor/", "critic/", "response_length/", "prompt_length/", "reward/", "val/", "data/",
                 "drafter/loss", "drafter/acc", "drafter/version", "drafter/steps", "drafter/published",
                 "drafter/buffer_tokens", "drafter/eval_acc", "drafter/accept_proxy")


def train(run_root: Path, cache: Path, steps: int, fault: str | None = None) -> subprocess.CompletedProcess:
    """`tlt train configs/smoke.yaml` (eagle SD, online drafter) in a subprocess; fault = TLT_FAULT_AT."""
    overrides = [f"trainer.total_steps={steps}", "trainer.save_freq=1", "trainer.test_freq=2",
                 "trainer.logger=[jsonl]", "trainer.resume=auto", f"trainer.default_local_dir={run_root}",
                 "trainer.experiment_name=faults", "trainer.max_ckpt_to_keep=2",
                 "rollout.dtype=float32",              # the same weights whatever this CPU's bf16
                 "drafter_train.holdout_fraction=0"]   # every session publishes: the publish point is reached
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TLT_CACHE": str(cache), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1"}
    env.pop("TLT_FAULT_AT", None)
    if fault:
        env["TLT_FAULT_AT"] = fault
    return subprocess.run([sys.executable, "-m", "tlt", "train", "configs/smoke.yaml", *overrides], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)


def outcome(run_root: Path, steps: int) -> dict:
    run_dir = run_root / "tlt" / "faults"
    rows: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        # a step re-run after a kill replaces its row: the resumed run drops rows past its checkpoint
        assert row["step"] not in rows, f"step {row['step']} logged twice"
        rows[row["step"]] = {k: v for k, v in row.items() if k.startswith(DETERMINISTIC)}
    final = run_dir / f"global_step_{steps}"
    return {"metrics": rows, "policy": load_file(str(final / "model.safetensors")),
            "drafter": load_file(str(final / "drafter" / "drafter.safetensors"))}


def assert_same(ref: dict, got: dict, steps: int) -> None:
    assert sorted(got["metrics"]) == list(range(steps + 1)), f"lost steps: logged {sorted(got['metrics'])}"
    for step, row in ref["metrics"].items():
        assert got["metrics"][step] == row, f"step {step}'s metrics differ after the kills"
    for part in ("policy", "drafter"):
        assert ref[part].keys() == got[part].keys()
        for k, v in ref[part].items():
            assert torch.equal(v, got[part][k]), f"{part} weight {k} differs after the kills"


def kill_and_resume(tmp_path: Path, steps: int, faults: list[str]) -> None:
    cache = tmp_path / "cache"
    ref = train(tmp_path / "ref", cache, steps)
    assert ref.returncode == 0, ref.stderr[-3000:]
    if len(usable_cpus()) > 1:  # one torch thread, a core idle: the default trains the drafter beside the rollout
        rows = (tmp_path / "ref" / "tlt" / "faults" / "metrics.jsonl").read_text().splitlines()
        assert any("drafter/spot_wait_s" in json.loads(row) for row in rows), "no spot round ran"
    for fault in faults:
        killed = train(tmp_path / "faulty", cache, steps, fault)
        assert killed.returncode == -signal.SIGKILL, f"{fault} was not reached: rc={killed.returncode}\n" \
                                                     f"{killed.stderr[-3000:]}"
    done = train(tmp_path / "faulty", cache, steps)
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = tmp_path / "faulty" / "tlt" / "faults"
    assert sorted(p.name for p in run_dir.glob("global_step_*")) == [f"global_step_{steps - 1}",
                                                                      f"global_step_{steps}"]  # max_ckpt_to_keep
    assert_same(outcome(tmp_path / "ref", steps), outcome(tmp_path / "faulty", steps), steps)


def test_killed_runs_resume_to_the_same_result(tmp_path):
    """Killed while writing a checkpoint, during an update, while publishing a drafter: nothing lost or altered."""
    kill_and_resume(tmp_path, steps=3, faults=["checkpoint:2", "update:3", "publish:3"])


@pytest.mark.slow
def test_twenty_four_kills_in_every_phase(tmp_path):
    steps = 5  # every phase of every step, but the last commit (that run would leave nothing to resume)
    faults = [f"{phase}:{step}" for step in range(1, steps + 1) for phase in PHASES]
    kill_and_resume(tmp_path, steps, faults[:-1])


def test_fault_spec_is_checked_and_inert_without_the_variable(monkeypatch):
    assert parse_fault_spec("rollout:2, commit:10") == {("rollout", 2), ("commit", 10)}
    with pytest.raises(ValueError, match="phase:step"):
        parse_fault_spec("rolout:2")
    kills = []  # os.kill stands in for the real thing: a wrong match must fail this test, not kill pytest
    monkeypatch.setattr("tlt.faults.os.kill", lambda pid, sig: kills.append((phase, sig)))
    monkeypatch.delenv("TLT_FAULT_AT", raising=False)
    phase = "no variable"
    fault_point("rollout", 2)
    monkeypatch.setenv("TLT_FAULT_AT", "update:3")
    phase = "another phase"
    fault_point("rollout", 3)
    phase = "another step"
    fault_point("update", 2)
    assert kills == []
    phase = "named"
    fault_point("update", 3)
    assert kills == [("named", signal.SIGKILL)]


# ---------------------------------------------------------------- checkpoints, in process


def save_fake(manager, step: int, cfg, model_dir: str) -> Path:
    from tests.conftest import checkpoint_parts
    return manager.save(step, *checkpoint_parts(model_dir, step), cfg)


@pytest.fixture
def cfg():
    from tlt.config import load_config
    return load_config(None, [])


def test_resume_auto_skips_an_incomplete_newest_checkpoint(tmp_path, cfg, tiny_llama_dir, caplog):
    from tlt.rl.checkpoint import STATE_FILE, CheckpointManager
    manager = CheckpointManager(tmp_path)
    for step in (1, 2, 3):
        save_fake(manager, step, cfg, tiny_llama_dir)
    (manager.step_dir(3) / STATE_FILE).unlink()  # e.g. a copy cut short; the latest-step file still says 3
    with caplog.at_level("WARNING"):
        assert manager.resolve_resume("auto") == manager.step_dir(2)
    assert "global_step_3" in caplog.text and STATE_FILE in caplog.text and "global_step_2" in caplog.text
    with pytest.raises(ValueError, match="not a complete tlt checkpoint"):
        manager.resolve_resume(str(manager.step_dir(3)))
    # a complete newer directory the latest-step file does not name yet (killed before it was updated) is used
    save_fake(manager, 4, cfg, tiny_llama_dir)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("2\n")
    assert manager.resolve_resume("auto") == manager.step_dir(4)


def test_rotation_keeps_the_newest_complete_checkpoints(tmp_path, cfg, tiny_llama_dir):
    from tlt.rl.checkpoint import CheckpointManager
    keep_all = CheckpointManager(tmp_path / "all")
    rotated = CheckpointManager(tmp_path / "two", max_to_keep=2)
    for step in (1, 2, 3, 4):
        save_fake(keep_all, step, cfg, tiny_llama_dir)
        save_fake(rotated, step, cfg, tiny_llama_dir)
    assert keep_all.complete_steps() == [1, 2, 3, 4]
    assert rotated.complete_steps() == [3, 4]
    one = CheckpointManager(tmp_path / "one", max_to_keep=1)
    save_fake(one, 5, cfg, tiny_llama_dir)
    save_fake(one, 6, cfg, tiny_llama_dir)  # the one resumed from (5) goes only once 6 is complete
    assert one.complete_steps() == [6]


def test_resave_never_points_at_a_missing_directory(tmp_path, cfg, tiny_llama_dir):
    from tlt.rl.checkpoint import LATEST_FILE, CheckpointManager
    manager = CheckpointManager(tmp_path)
    save_fake(manager, 1, cfg, tiny_llama_dir)
    save_fake(manager, 2, cfg, tiny_llama_dir)
    manager._point_away_from(2)  # what save() does before swapping global_step_2 out
    assert (tmp_path / LATEST_FILE).read_text().strip() == "1"
    save_fake(manager, 2, cfg, tiny_llama_dir)
    assert (tmp_path / LATEST_FILE).read_text().strip() == "2"
    only = CheckpointManager(tmp_path / "only")
    save_fake(only, 1, cfg, tiny_llama_dir)
    only._point_away_from(1)  # no other complete checkpoint: no pointer at all rather than a dangling one
    assert not (tmp_path / "only" / LATEST_FILE).exists()
    (tmp_path / ".global_step_3.tmp-123").mkdir()  # a save a crash interrupted
    save_fake(manager, 3, cfg, tiny_llama_dir)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".global_step")]


def test_trainer_state_loads_with_weights_only_and_restores_every_rng(tmp_path, cfg, tiny_llama_dir):
    import pickle
    import random

    import numpy as np

    from tlt.rl.checkpoint import CheckpointManager, load_trainer_state, restore_rng_state
    path = save_fake(CheckpointManager(tmp_path), 1, cfg, tiny_llama_dir)
    draws = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    restore_rng_state(load_trainer_state(path).rng)  # torch.load(weights_only=True) inside
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == draws
    torch.save({"numpy": np.random.get_state()}, tmp_path / "raw.pt")  # numpy's own state: refused by weights_only
    with pytest.raises(pickle.UnpicklingError):
        torch.load(tmp_path / "raw.pt", weights_only=True)


def test_drafter_checkpoint_thread_surfaces_any_failure(tmp_path):
    from tlt.drafter_train.trainer import AsyncCheckpointer
    ckpt = AsyncCheckpointer()
    ckpt.save({"w": torch.zeros(2)}, tmp_path / "d.safetensors", metadata={"steps": 3})  # not str: TypeError
    ckpt._thread.join()
    with pytest.raises(RuntimeError, match="drafter checkpoint write failed"):
        ckpt.check()
    ckpt.save({"w": torch.zeros(2)}, tmp_path / "d.safetensors")
    ckpt.wait()  # the error was raised once; a good write then succeeds
    assert load_file(str(tmp_path / "d.safetensors"))["w"].shape == (2,)
    assert not list(tmp_path.glob("*.tmp*"))


def test_resuming_from_an_older_step_sets_the_newer_checkpoints_aside(tmp_path, cfg, tiny_llama_dir):
    """After an explicit resume from step 2 of a run that reached step 5, a later resume=auto must continue the
    resumed branch, not jump back to the abandoned step 5: the newer checkpoints are renamed (kept)."""
    from tlt.rl.checkpoint import CheckpointManager
    mgr = CheckpointManager(tmp_path)
    for step in (2, 5):
        save_fake(mgr, step, cfg, tiny_llama_dir)
    assert mgr.resolve_resume(str(tmp_path / "global_step_2")) == tmp_path / "global_step_2"
    assert mgr.latest_step() == 2 and (tmp_path / "abandoned_global_step_5" / "model.safetensors").is_file()
