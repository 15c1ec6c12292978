"""Atomic, resumable RL checkpoints.

Layout (verl's): <default_local_dir>/<project_name>/<experiment_name>/
    latest_checkpointed_iteration.txt      the last complete step, e.g. "20"
    global_step_N/
        config.json, model.safetensors, generation_config.json, tokenizer files   HF format: transformers'
                                             AutoModelForCausalLM.from_pretrained and `tlt eval` load it
        trainer_state.pt                     optimizer, LR scheduler, RNG states, data position, drafter hook state
        config.yaml                          the resolved training config

A checkpoint is written into a temporary directory next to its final place, every file fsynced, then renamed
into place (a crash leaves either the old state or the new one, never half a checkpoint); the latest-step file
is replaced atomically after that. trainer_state.pt is our own pickle (torch.load with weights_only=False):
load only checkpoints you wrote.
"""
from __future__ import annotations

import os
import random
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from tlt.config import Config, ConfigError, save_config

LATEST_FILE = "latest_checkpointed_iteration.txt"
STATE_FILE = "trainer_state.pt"
CONFIG_FILE = "config.yaml"
HF_SIDE_FILES = ("config.json", "generation_config.json")


@dataclass
class TrainerState:
    """Everything besides the policy weights that a resumed run needs to continue exactly."""
    step: int  # last completed RL step
    actor: dict[str, Any]  # Actor.state_dict(): optimizer + LR scheduler
    rng: dict[str, Any]  # capture_rng_state()
    data: dict[str, int]  # PromptDataset.state_dict()
    drafter_hook: dict[str, Any] = field(default_factory=dict)
    rollout_seed: int = 0  # trainer.seed: rollout sampling seeds are rollout_seed(seed, step, attempt)


def capture_rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_tree(path: Path) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as fh:
                os.fsync(fh.fileno())
        _fsync_dir(Path(root))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


class CheckpointManager:
    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = Path(run_dir)

    def step_dir(self, step: int) -> Path:
        return self.run_dir / f"global_step_{step}"

    def latest_step(self) -> int | None:
        latest = self.run_dir / LATEST_FILE
        if not latest.is_file():
            return None
        step = int(latest.read_text().strip())
        return step if (self.step_dir(step) / STATE_FILE).is_file() else None

    def save(self, step: int, write_model: Callable[[Path], None], state: TrainerState, cfg: Config) -> Path:
        """Write global_step_<step>/ atomically; write_model(dir) writes the HF files (weights, config, tokenizer)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        final = self.step_dir(step)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=self.run_dir))
        try:
            write_model(tmp)
            torch.save(state.__dict__, tmp / STATE_FILE)
            save_config(cfg, str(tmp / CONFIG_FILE))
            tmp.chmod(0o755)
            _fsync_tree(tmp)
            if final.exists():  # re-saving a step (e.g. after a resume): move the old copy out of the way first
                old = final.with_name(f".{final.name}.old-{os.getpid()}")
                os.rename(final, old)
                os.rename(tmp, final)
                shutil.rmtree(old)
            else:
                os.rename(tmp, final)
            _fsync_dir(self.run_dir)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        write_text_atomic(self.run_dir / LATEST_FILE, f"{step}\n")
        return final

    def resolve_resume(self, resume: str) -> Path | None:
        """trainer.resume -> checkpoint dir to resume from, or None (start fresh)."""
        if resume == "disable":
            return None
        if resume == "auto":
            step = self.latest_step()
            return None if step is None else self.step_dir(step)
        path = Path(resume)
        if not (path / STATE_FILE).is_file():
            raise ConfigError(f"trainer.resume={resume!r}: {path} is not a tlt checkpoint (no {STATE_FILE}); "
                              f"use 'auto', 'disable' or a global_step_N directory")
        return path


def load_trainer_state(path: str | os.PathLike) -> TrainerState:
    raw = torch.load(Path(path) / STATE_FILE, map_location="cpu", weights_only=False)
    return TrainerState(**raw)


def copy_hf_side_files(src: str | os.PathLike | None, dst: Path) -> None:
    """config.json / generation_config.json of the original model, so the checkpoint loads like it."""
    if src is None:
        return
    for name in HF_SIDE_FILES:
        if (Path(src) / name).is_file():
            shutil.copy2(Path(src) / name, dst / name)
