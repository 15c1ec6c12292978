"""A disk too small for the run's checkpoints: `tlt train` says so before any expensive work, a checkpoint that will
not fit is refused before anything of it is written, and a save that fails part-way says what survives; the newest
complete checkpoint stays intact and the run resumes from it."""
from __future__ import annotations

import errno
import io
import shutil
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from tlt.config import load_config
from tlt.rl.preflight import check_output_dir, check_run, checkpoint_bytes, checkpoints_held, model_size
from tlt.rl.checkpoint import LATEST_FILE, CheckpointManager, CheckpointSpaceError, tensor_bytes
from tlt.rl.trainer import GRPOTrainer
from tlt.schema import UserError

from tests.test_trainer import make_overrides, tiny_dir  # noqa: F401 (tiny_dir: the trainer tests' fixture)

GiB = 2**30
Usage = namedtuple("Usage", "total used free")


def fake_free(monkeypatch, free):
    """shutil.disk_usage reports `free` bytes (a number, or a function of the queried path)."""
    real = shutil.disk_usage

    def usage(path):
        u = real(path)
        return Usage(u.total, u.used, free(Path(path)) if callable(free) else free)
    monkeypatch.setattr(shutil, "disk_usage", usage)


def test_tensor_bytes_counts_each_storage_once_as_torch_save_writes_it():
    a, b = torch.zeros(10, dtype=torch.float32), torch.zeros(3, dtype=torch.bfloat16)
    obj = {"a": a, "nested": [a[:5], (b, 7, "text")], "empty": {}}
    assert tensor_bytes(obj) == 40 + 6
    assert tensor_bytes({"a": a, "copy": a.clone()}) == 80
    buf = io.BytesIO()
    torch.save(obj, buf)
    assert 46 < len(buf.getvalue()) < 46 + 4096


@pytest.mark.parametrize("total,freq,keep,held", [(6, -1, None, 1), (100, 10, None, 10), (105, 10, None, 11),
                                                 (100, 10, 2, 3), (100, 10, 20, 10), (5, 10, None, 1)])
def test_checkpoints_held_at_once(total, freq, keep, held):
    cfg = load_config(None, [f"trainer.total_steps={total}", f"trainer.save_freq={freq}",
                             f"trainer.max_ckpt_to_keep={'null' if keep is None else keep}"])
    assert checkpoints_held(cfg.trainer) == held


def test_output_dir_without_room_for_one_checkpoint_is_an_error(tmp_path, monkeypatch, capsys):
    fake_free(monkeypatch, 5 * GiB)
    with pytest.raises(UserError, match=r"has 5.0 GiB free but one checkpoint needs about 10.0 GiB"):
        check_output_dir(tmp_path / "run", 10 * GiB)
    check_output_dir(tmp_path / "run", 4 * GiB, held=1)
    assert capsys.readouterr().err == ""
    check_output_dir(tmp_path / "run", 2 * GiB, held=3)  # 2 fit, keeping 1 needs 2 at once
    assert "keeps up to 3 checkpoints" in capsys.readouterr().err
    fake_free(monkeypatch, 5 * GiB)
    check_output_dir(tmp_path / "run", 2 * GiB, held=4)
    assert "set trainer.max_ckpt_to_keep=1" in capsys.readouterr().err
    check_output_dir(tmp_path / "run", 3 * GiB, held=4)
    assert "set trainer.save_freq=-1" in capsys.readouterr().err


def test_model_size_from_the_weight_files_and_for_the_default_model(tiny_dir, tmp_path, monkeypatch):
    from tlt.models import load_model, smollm
    params, hidden = model_size(tiny_dir)
    real = sum(p.numel() for p in load_model(tiny_dir).state_dict().values())
    assert hidden == 64 and real <= params <= real + 4096  # the safetensors header on top
    monkeypatch.setenv("TLT_CACHE", str(tmp_path / "empty_cache"))  # not converted yet: the packaged model's size
    assert model_size(None) == (smollm.NUM_PARAMETERS, smollm.HIDDEN_SIZE)


def test_checkpoint_estimate_counts_the_drafter_buffer_the_run_can_fill(tiny_dir):
    base = ["trainer.total_steps=3", "data.train_batch_size=2", "rollout.n=4", "data.max_prompt_length=64",
            "data.max_response_length=16", f"model.path={tiny_dir}", "speculative.method=eagle"]
    params, hidden = model_size(tiny_dir)
    no_sd = checkpoint_bytes(load_config(None, [*base, "speculative.enabled=false"]))
    assert no_sd == 12 * params
    with_buffer = checkpoint_bytes(load_config(None, [*base, "speculative.enabled=true"]))
    assert with_buffer == no_sd + 3 * 2 * 4 * 80 * (2 * hidden + 8)
    capped = checkpoint_bytes(load_config(None, [*base, "speculative.enabled=true",
                                                 "drafter_train.buffer_max_tokens=100"]))
    assert capped == no_sd + 100 * (2 * hidden + 8)
    assert checkpoint_bytes(load_config(None, [*base, "speculative.enabled=true",
                                               "trainer.save_drafter_buffer=false"])) == no_sd


def test_train_refuses_a_disk_without_room_before_any_work(tmp_path, tiny_dir, monkeypatch):
    cfg = load_config(None, make_overrides(tmp_path, tiny_dir))
    fake_free(monkeypatch, 1000)
    with pytest.raises(UserError, match="trainer.default_local_dir: .* one checkpoint needs about"):
        check_run(cfg)


def test_a_checkpoint_that_does_not_fit_is_refused_and_the_run_resumes_from_the_last(tmp_path, tiny_dir,
                                                                                     monkeypatch):
    """Step 1's checkpoint is written; then the disk fills: step 2's is refused before a byte is written, step 1's
    stays the newest, and a resumed run goes on from it."""
    overrides = make_overrides(tmp_path, tiny_dir, **{"trainer.save_freq": 1, "trainer.resume": "auto"})
    run_dir = tmp_path / "runs"
    fake_free(monkeypatch, lambda path: 10**6 if any(run_dir.rglob("global_step_1")) else 10**12)
    with pytest.raises(CheckpointSpaceError) as caught:
        GRPOTrainer(load_config(None, overrides)).fit()
    message = str(caught.value)
    assert "checkpoint step 2 does not fit" in message and "Nothing of it was written" in message
    assert "global_step_1, is intact" in message and "trainer.max_ckpt_to_keep" in message
    exp = next(p.parent for p in run_dir.rglob("global_step_1"))
    assert sorted(p.name for p in exp.iterdir() if "step" in p.name) == ["global_step_1"]
    assert (exp / LATEST_FILE).read_text().strip() == "1"
    monkeypatch.undo()
    resumed = GRPOTrainer(load_config(None, overrides))
    assert resumed.start_step == 1
    resumed.fit()
    assert (exp / LATEST_FILE).read_text().strip() == "2"


def test_a_save_that_fails_part_way_says_what_survives(tmp_path, tiny_dir):
    from tests.conftest import checkpoint_parts
    ckpt = CheckpointManager(tmp_path / "run")
    cfg = load_config(None, [])
    write_model, state = checkpoint_parts(tiny_dir, 1)
    ckpt.save(1, write_model, state, cfg)

    def disk_full(path: Path) -> None:
        (path / "model.safetensors").write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(OSError, match="No space left") as caught:
        ckpt.save(2, disk_full, state, cfg)
    assert any("checkpoint step 2 was not written" in n and "global_step_1, is intact" in n
               for n in caught.value.__notes__)
    assert sorted(p.name for p in ckpt.run_dir.iterdir()) == ["global_step_1", LATEST_FILE]
    assert ckpt.latest_step() == 1

    empty = CheckpointManager(tmp_path / "other")
    with pytest.raises(OSError) as caught:
        empty.save(1, disk_full, state, cfg)
    assert any("no earlier checkpoint exists" in n for n in caught.value.__notes__)
