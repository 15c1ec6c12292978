"""What tlt reads back, damaged the way a disk or a copy damages it, through the console entry point (`tlt.cli.main`,
in a subprocess `python -m tlt` where the process matters): trainer.resume=auto falls back to the newest checkpoint
that verifies, warning which one it skipped, and deletes nothing; a damaged checkpoint or drafter directory named
by the user is one message naming the file, exit code 2, no traceback, before any expensive work (the model cache
stays empty); a second run into a live run's directory is refused, and a killed run's lock blocks nobody. Rotation
never trades a good checkpoint for a damaged one, and damaged cache entries are rebuilt. The checkpoints come from
one smoke run per module."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parent.parent
STEPS = ["trainer.total_steps=2", "trainer.test_freq=0", "trainer.logger=[jsonl]"]


def tlt(args: list[str], cache: Path, timeout: int = 300, **popen) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TLT_CACHE": str(cache), "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1"}
    env.pop("TLT_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "tlt", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout, **popen)


@dataclass
class Run:
    dir: Path    # <root>/runs/tlt/smoke: global_step_1/ and global_step_2/, each with its manifest
    cache: Path  # TLT_CACHE holding the tiny model


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Run:
    """Two steps of configs/smoke.yaml (eagle SD, online drafter with its buffer), a checkpoint after each."""
    from tlt.config import load_config
    from tlt.rl.trainer import GRPOTrainer
    root = tmp_path_factory.mktemp("readback")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TLT_CACHE", str(root / "cache"))
        mp.chdir(ROOT)
        GRPOTrainer(load_config("configs/smoke.yaml", [*STEPS, "trainer.save_freq=1",
                                                       f"trainer.default_local_dir={root}"])).fit()
    return Run(root / "tlt" / "smoke", root / "cache")


@pytest.fixture
def tlt_main(monkeypatch, capsys):
    """`tlt ARGS` in this process with TLT_CACHE=cache: (exit code, stdout, stderr). An exception other than a
    user error propagates (on the command line: a traceback)."""
    from tlt.cli import main

    def call(args: list[str], cache: Path) -> tuple[int, str, str]:
        monkeypatch.setenv("TLT_CACHE", str(cache))
        monkeypatch.chdir(ROOT)
        capsys.readouterr()
        rc = main([*args, "trainer.retain_freed_memory=false"])  # leave this process's malloc as it is
        out, err = capsys.readouterr()
        return rc, out, err
    return call


def copy_run(run: Run, tmp_path: Path) -> Path:
    """A copy of the module's run directory under tmp_path/runs (its default_local_dir)."""
    out = tmp_path / "runs" / "tlt" / "smoke"
    shutil.copytree(run.dir, out, ignore=shutil.ignore_patterns("run.lock"))
    return out


def assert_one_error(rc: int, stderr: str, cache: Path, *fragments: str) -> None:
    assert rc == 2, (rc, stderr[-3000:])
    assert "Traceback" not in stderr, stderr[-3000:]
    message = stderr.strip().splitlines()[-1]
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    assert not cache.exists() or not any(cache.iterdir()), f"work was done before the error: {list(cache.iterdir())}"


# ---------------------------------------------------------------- damage, as a disk or a copy does it


def truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)])


def flip_last_byte(path: Path) -> None:
    """Same size, same header: only a checksum tells."""
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def narrow_norm(ckpt: Path) -> None:
    """model.safetensors of another shape (a copy from another model), in a checkpoint of an earlier version (no
    manifest to disagree with): only the shapes against config.json tell."""
    weights = load_file(str(ckpt / "model.safetensors"))
    weights["model.norm.weight"] = weights["model.norm.weight"][:32].clone()
    save_file(weights, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    (ckpt / "manifest.json").unlink(missing_ok=True)


def drop_shard(ckpt: Path) -> None:
    """The checkpoint in an actor.strategy=fsdp run's layout (the weights and AdamW state as DCP shards, which a
    one-process ddp run resumes too), written by an earlier version (no manifest to list the shard): DCP's own
    metadata tells that its shard file is gone."""
    from tlt.config import load_config
    from tlt.models.loader import load_model
    from tlt.rl.actor import Actor
    from tlt.rl.sharded_checkpoint import SHARDS_DIR, save_sharded
    state = torch.load(ckpt / "trainer_state.pt", weights_only=True)
    actor = Actor(load_model(ckpt), load_config(str(ckpt / "config.yaml"), []).actor, 2)
    actor.load_state_dict(state["actor"])
    save_sharded(actor, ckpt / SHARDS_DIR)
    state["actor"] = {"sharded": SHARDS_DIR}
    torch.save(state, ckpt / "trainer_state.pt")
    (ckpt / "manifest.json").unlink(missing_ok=True)
    (ckpt / SHARDS_DIR / "__0_0.distcp").unlink()


DAMAGE = {
    "truncated": (lambda c: truncate(c / "model.safetensors"), ("model.safetensors is", "bytes where manifest.json")),
    "zero-length": (lambda c: truncate(c / "trainer_state.pt", 0.0), ("trainer_state.pt is 0 bytes",)),
    "wrong-shapes": (narrow_norm, ("model.safetensors holds 'model.norm.weight' of shape [32]", "[64]")),
    "missing-shard": (drop_shard, ("actor_shards/__0_0.distcp is missing: the shards' .metadata",)),
    "manifest-disagrees": (lambda c: flip_last_byte(c / "model.safetensors"),
                           ("model.safetensors does not match its checksum in manifest.json",)),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_checkpoint_named_by_trainer_resume_is_one_error(run, tmp_path, tlt_main, damage):
    """trainer.resume=DIR of the newest step (so that on a version without these checks a run that did not fail
    would have nothing left to train): one message naming the file and the way out, before the model is built."""
    damage_fn, fragments = DAMAGE[damage]
    ckpt = copy_run(run, tmp_path) / "global_step_2"
    damage_fn(ckpt)
    empty = tmp_path / "empty_cache"
    rc, out, err = tlt_main(["train", "configs/smoke.yaml", *STEPS, f"trainer.resume={ckpt}",
                             f"trainer.default_local_dir={tmp_path / 'other'}"], empty)
    assert_one_error(rc, err, empty, f"trainer.resume='{ckpt}'", *fragments, "trainer.resume=auto")
    assert "resume:" not in out  # the resolved config is printed once the model is resolved: never here


def test_resume_auto_falls_back_to_the_newest_checkpoint_that_verifies(run, tmp_path):
    """`tlt train trainer.resume=auto` with the newest checkpoint's weights cut short: a warning naming it, and the
    run resumes from the one before; the damaged one is left as it was."""
    run_dir = copy_run(run, tmp_path)
    truncate(run_dir / "global_step_2" / "model.safetensors")
    damaged = {p.name: p.read_bytes() for p in (run_dir / "global_step_2").iterdir() if p.is_file()}
    proc = tlt(["train", "configs/smoke.yaml", *STEPS, "trainer.total_steps=1", "trainer.resume=auto",
                f"trainer.default_local_dir={tmp_path / 'runs'}"], run.cache)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert f"skipping checkpoint {run_dir / 'global_step_2'}: {run_dir / 'global_step_2' / 'model.safetensors'}" \
        in proc.stderr
    assert f"resumed from {run_dir / 'global_step_1'} (step 1)" in proc.stdout
    assert {p.name: p.read_bytes() for p in (run_dir / "global_step_2").iterdir() if p.is_file()} == damaged


def test_a_step_written_again_over_a_damaged_checkpoint_keeps_it_aside(run, tmp_path):
    """After such a fallback the run reaches the damaged step again: the new checkpoint takes its place, the damaged
    one is kept as corrupt_global_step_N (a good one would be replaced, as before)."""
    from tlt.rl.checkpoint import CheckpointManager
    manager = CheckpointManager(copy_run(run, tmp_path))
    truncate(manager.step_dir(2) / "model.safetensors")
    size = (manager.step_dir(2) / "model.safetensors").stat().st_size
    save_copy(manager, 2, run.dir / "global_step_2")
    assert (manager.step_dir(2) / "model.safetensors").read_bytes() == \
        (run.dir / "global_step_2" / "model.safetensors").read_bytes()
    assert (manager.run_dir / "corrupt_global_step_2" / "model.safetensors").stat().st_size == size
    save_copy(manager, 2, run.dir / "global_step_2")  # control: an intact one is replaced, nothing set aside
    assert sorted(p.name for p in manager.run_dir.glob("*global_step_2*")) == ["corrupt_global_step_2",
                                                                               "global_step_2"]


def test_a_checkpoint_of_an_earlier_version_resumes_without_a_warning(run, tmp_path, monkeypatch, caplog, capsys):
    """No manifest (written before them): checked by headers and shapes, and loaded with no false alarm."""
    from tlt.config import load_config
    from tlt.rl.trainer import GRPOTrainer
    run_dir = copy_run(run, tmp_path)
    for step in (1, 2):
        (run_dir / f"global_step_{step}" / "manifest.json").unlink(missing_ok=True)
    monkeypatch.setenv("TLT_CACHE", str(run.cache))
    monkeypatch.chdir(ROOT)
    with caplog.at_level("WARNING"):
        trainer = GRPOTrainer(load_config("configs/smoke.yaml", [
            *STEPS, "trainer.resume=auto", f"trainer.default_local_dir={tmp_path / 'runs'}"]))
    assert trainer.start_step == 2
    assert not caplog.records and "warning" not in capsys.readouterr().err


@pytest.mark.parametrize("damage", ["truncated", "wrong-shapes"])
def test_a_damaged_drafter_directory_is_one_error(run, tmp_path, tlt_main, damage):
    drafter = tmp_path / "drafter"
    shutil.copytree(run.dir / "global_step_2" / "drafter", drafter)
    if damage == "truncated":
        truncate(drafter / "drafter.safetensors")
        fragments = ("drafter.safetensors is not a readable safetensors file",)
    else:  # a drafter saved for another config: fc's input width differs
        weights = load_file(str(drafter / "drafter.safetensors"))
        weights["fc.weight"] = weights["fc.weight"][:, :96].clone()
        save_file(weights, str(drafter / "drafter.safetensors"))
        fragments = ("drafter.safetensors holds 'fc.weight' of shape [64, 96] where [64, 128] is expected",)
    empty = tmp_path / "empty_cache"
    args = ["train", "configs/smoke.yaml", *STEPS, f"speculative.model={drafter}",
            f"trainer.default_local_dir={tmp_path / 'runs'}"]
    if damage == "truncated":  # the report, as a user runs it
        proc = tlt(args, empty)
        rc, err = proc.returncode, proc.stderr
    else:
        rc, _, err = tlt_main(args, empty)
    assert_one_error(rc, err, empty, "speculative.model:", *fragments, "tlt train-drafter")


def test_eval_of_a_damaged_checkpoint_is_one_error(run, tmp_path, tlt_main):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(run.dir / "global_step_2", ckpt)
    truncate(ckpt / "model.safetensors", 0.9)
    empty = tmp_path / "empty_cache"
    rc, _, err = tlt_main(["eval", str(ckpt), "data.val_files=configs/smoke_data/val.jsonl"], empty)
    assert_one_error(rc, err, empty, "model.safetensors is not a readable safetensors file")


# ---------------------------------------------------------------- one run directory, one run


def test_a_live_run_holds_its_directory_and_a_killed_one_does_not(run, tmp_path, tlt_main):
    runs = tmp_path / "runs"
    args = ["train", "configs/smoke.yaml", "trainer.logger=[jsonl]", f"trainer.default_local_dir={runs}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TLT_CACHE": str(run.cache), "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1"}
    live = subprocess.Popen([sys.executable, "-m", "tlt", *args, "trainer.total_steps=10000"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    lock = runs / "tlt" / "smoke" / "run.lock"
    try:
        deadline = time.monotonic() + 120
        while not (lock.is_file() and f'"pid": {live.pid}' in lock.read_text()):
            assert live.poll() is None and time.monotonic() < deadline, "the live run never locked its directory"
            time.sleep(0.2)
        rc, _, err = tlt_main([*args, "trainer.total_steps=1"], run.cache)
        assert rc == 2 and f"is in use by a live run (pid {live.pid} on" in err.splitlines()[-1], err[-3000:]
    finally:
        os.killpg(live.pid, signal.SIGKILL)  # the trainer and its reward workers: what a crash leaves
        live.wait()
    # the killed run's lock blocks nothing: the next run gets past it, to its next check
    rc, _, err = tlt_main([*args, f"trainer.resume={runs / 'nowhere'}"], run.cache)
    assert rc == 2 and "is not a complete tlt checkpoint" in err, err[-3000:]


# ---------------------------------------------------------------- in process: rotation and the cache


def save_copy(manager, step: int, source: Path) -> Path:
    """Checkpoint `step` holding `source`'s weights and trainer state (tlt.rl.checkpoint's own save)."""
    from tlt.config import load_config
    from tlt.rl.checkpoint import TrainerState

    def write_model(path: Path) -> None:
        for name in ("config.json", "model.safetensors"):
            shutil.copy(source / name, path / name)
    raw = torch.load(source / "trainer_state.pt", weights_only=True)
    return manager.save(step, write_model, TrainerState(**(raw | {"step": step})),
                        load_config(str(source / "config.yaml"), []))


def test_rotation_never_trades_a_good_checkpoint_for_a_damaged_one(run, tmp_path):
    """max_ckpt_to_keep=2 with a damaged step 3 between good ones: saving step 4 removes step 1 only; step 2 (good)
    and step 3 (damaged, the user's to look at) stay. Counting every complete checkpoint would remove step 2."""
    from tlt.rl.checkpoint import CheckpointManager
    manager = CheckpointManager(tmp_path / "run", max_to_keep=2)
    for step in (1, 2, 3):
        save_copy(manager, step, run.dir / "global_step_1")
    flip_last_byte(manager.step_dir(3) / "model.safetensors")
    fresh = CheckpointManager(tmp_path / "run", max_to_keep=2)  # a resumed process: nothing trusted yet
    save_copy(fresh, 4, run.dir / "global_step_1")
    assert sorted(fresh.step_dirs()) == [2, 3, 4]


def test_a_damaged_cached_model_is_rebuilt_and_kept_aside(tmp_path, monkeypatch, capsys):
    """The tiny model's cache entry cut short is rebuilt, with a message, and the bad copy kept; an intact entry
    (one with a manifest, and one of an earlier version without) is reused as it is."""
    from tlt.rl.tiny_model import tiny_random_model_path
    monkeypatch.setenv("TLT_CACHE", str(tmp_path))
    path = tiny_random_model_path()
    weights = path / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert tiny_random_model_path() == path and weights.stat().st_mtime_ns == stamp
    (path / "manifest.json").unlink(missing_ok=True)
    assert tiny_random_model_path() == path and weights.stat().st_mtime_ns == stamp
    assert "fails verification" not in capsys.readouterr().err
    truncate(weights)
    assert tiny_random_model_path() == path
    err = capsys.readouterr().err
    assert f"the cached {path} fails verification ({weights} is not a readable safetensors file" in err
    assert "rebuilding it" in err
    from tlt.models.weights_check import check_model_weights
    check_model_weights(path, "")
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("tiny-random-llama.corrupt-")]
    assert len(aside) == 1 and (aside[0] / "model.safetensors").stat().st_size < weights.stat().st_size


def test_a_damaged_cached_warm_up_drafter_is_rebuilt(tmp_path, monkeypatch, capsys):
    from tests.conftest import make_tiny_checkpoint
    from tlt.drafter_train import offline
    model_dir = make_tiny_checkpoint(tmp_path / "tiny", "llama", vocab_size=128, hidden_size=64)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt_token_ids": list(range(1, 6 + i))}) + "\n" for i in range(8)))
    monkeypatch.setenv("TLT_CACHE", str(tmp_path / "cache"))
    build = dict(data=str(data), num_prompts=4, max_tokens=4, steps=1, draft_vocab=0, batch_tokens=32,
                 window_len=8, holdout_every=4, amp="none", dtype="float32", temperatures="1.0", threads=1)
    path = offline.default_drafter_path(model_dir, build)
    (path / "manifest.json").unlink(missing_ok=True)  # an entry of an earlier version: its shapes tell
    weights = load_file(str(path / "drafter.safetensors"))
    weights["layer.mlp.down_proj.weight"] = weights["layer.mlp.down_proj.weight"][:, :64].clone()
    save_file(weights, str(path / "drafter.safetensors"))
    capsys.readouterr()
    assert offline.default_drafter_path(model_dir, build) == path
    err = capsys.readouterr().err
    assert "fails verification" in err and "'layer.mlp.down_proj.weight' of shape [64, 64]" in err
    assert load_file(str(path / "drafter.safetensors"))["layer.mlp.down_proj.weight"].shape == (64, 128)


def test_each_check_names_what_is_wrong(run, tmp_path):
    """tlt.integrity's checks one by one on a copy of a checkpoint: the manifest's (a listed file gone, cut short,
    changed in place), a header's (empty, cut short), an archive's; the intact copy passes them all."""
    from tlt.integrity import (CorruptFileError, check_directory, check_manifest, check_safetensors,
                               check_torch_archive)
    ckpt = tmp_path / "ckpt"
    shutil.copytree(run.dir / "global_step_2", ckpt)
    check_directory(ckpt, "")
    check_torch_archive(ckpt / "trainer_state.pt", "")
    cases = [(lambda: (ckpt / "drafter" / "drafter.safetensors").unlink(), check_manifest,
              "drafter.safetensors is missing: "),
             (lambda: truncate(ckpt / "tokenizer.json"), check_manifest, "tokenizer.json is "),
             (lambda: flip_last_byte(ckpt / "config.yaml"), check_manifest, "config.yaml does not match its checksum")]
    for damage, check, fragment in cases:
        shutil.rmtree(ckpt)
        shutil.copytree(run.dir / "global_step_2", ckpt)
        damage()
        with pytest.raises(CorruptFileError, match=fragment):
            check(ckpt, "")
    for keep, fragment in ((0.5, "is not a readable safetensors file"), (0.0, "is empty")):
        truncate(ckpt / "model.safetensors", keep)
        with pytest.raises(CorruptFileError, match=fragment):
            check_safetensors(ckpt / "model.safetensors", "")
    truncate(ckpt / "trainer_state.pt", 0.99)
    with pytest.raises(CorruptFileError, match="is not a complete torch.save archive"):
        check_torch_archive(ckpt / "trainer_state.pt", "")
