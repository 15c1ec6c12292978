"""Atomic, resumable RL checkpoints.

Layout (verl's): <default_local_dir>/<project_name>/<experiment_name>/
    latest_checkpointed_iteration.txt      the last complete step, e.g. "20"
    global_step_N/
        config.json, model.safetensors, generation_config.json, tokenizer files   HF format: transformers'
                                             AutoModelForCausalLM.from_pretrained and `tlt eval` load it
        trainer_state.pt                     optimizer, LR scheduler, RNG states, data position, drafter hook state
        config.yaml                          the resolved training config
        manifest.json                        every other file's size and CRC-32 (tlt.integrity), written last

A checkpoint is written into a temporary directory next to its final place, every file fsynced, then renamed
into place (a crash leaves either the old state or the new one, never half a checkpoint); the latest-step file
is replaced atomically after that, and never names a directory that is not there (re-saving a step points it at
another complete checkpoint during the swap). Before a run trusts a checkpoint it verifies it
(tlt.rl.checkpoint_verify): trainer.resume=auto takes the newest that verifies, warning which it skipped; a
trainer.resume=DIR that does not verify is an error naming the bad file. Nothing is deleted for failing: rotation
(trainer.max_ckpt_to_keep) removes only checkpoints that verify, and a step re-saved over a damaged directory sets
it aside as corrupt_global_step_N. trainer_state.pt (tensors and plain containers) loads with weights_only=True.

Before writing, the trainer checks that its disk holds the tensors it is about to write (`check_space`, every rank
its own part): a checkpoint that will not fit is refused with nothing of it written (CheckpointSpaceError), and a
save that fails part-way anyway is removed and its error says which complete checkpoint survives.
"""
from __future__ import annotations

import logging
import os
import random
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from tlt.config import Config, ConfigError, save_config
from tlt.faults import fault_point
from tlt.integrity import CorruptFileError, write_manifest
from tlt.rl.checkpoint_verify import CONFIG_FILE, REQUIRED_FILES, STATE_FILE, read_trainer_state, verify_checkpoint
from tlt.schema import UserError

logger = logging.getLogger(__name__)

LATEST_FILE = "latest_checkpointed_iteration.txt"
HF_SIDE_FILES = ("config.json", "generation_config.json")
STEP_DIR = re.compile(r"global_step_(\d+)")


@dataclass
class TrainerState:
    """Everything besides the policy weights that a resumed run needs to continue exactly."""
    step: int  # last completed RL step
    actor: dict[str, Any]  # Actor.state_dict(): optimizer + LR scheduler
    rng: dict[str, Any]  # capture_rng_state()
    data: dict[str, int]  # PromptDataset.state_dict()
    drafter_hook: dict[str, Any] = field(default_factory=dict)
    rollout_seed: int = 0  # trainer.seed: rollout sampling seeds are rollout_seed(seed, step, attempt)


class CheckpointSpaceError(UserError):
    """A checkpoint does not fit on its disk; raised before anything of it is written."""


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors in nested dicts, lists and tuples, each storage once (what torch.save writes for them;
    a DTensor counts this rank's shard)."""
    storages: dict[int, int] = {}

    def walk(o: Any) -> None:
        if isinstance(o, torch.Tensor):
            storage = (o.to_local() if hasattr(o, "to_local") else o).untyped_storage()
            storages[storage.data_ptr() or id(storage)] = storage.nbytes()
        elif isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)
    walk(obj)
    return sum(storages.values())


SPACE_SLACK = 64 * 2**20  # config, tokenizer and pickle overhead beside the tensors


def space_shortfall(directory: Path, need_bytes: int) -> str | None:
    """Why `need_bytes` more do not fit in `directory`'s file system, or None when they do."""
    free = shutil.disk_usage(directory).free
    if free >= need_bytes + SPACE_SLACK:
        return None
    return (f"it needs about {(need_bytes + SPACE_SLACK) / 2**30:.2f} GiB in {directory}, which has "
            f"{free / 2**30:.2f} GiB free")


def capture_rng_state() -> dict[str, Any]:
    """Every RNG the run draws from, as tensors and plain containers (torch.load(weights_only=True) reads them)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
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


def is_complete(path: Path) -> bool:
    return all((path / name).is_file() for name in REQUIRED_FILES)


DAMAGED = ("Resume from a checkpoint that verifies (trainer.resume=auto takes the newest one, skipping damaged "
           "ones; nothing is deleted), or copy this one again from where it came")


class CheckpointManager:
    def __init__(self, run_dir: str | os.PathLike, max_to_keep: int | None = None):
        self.run_dir = Path(run_dir)
        self.max_to_keep = max_to_keep  # trainer.max_ckpt_to_keep: None = keep all
        self._whole: set[Path] = set()  # checkpoints this process wrote or verified in full: not read again

    def step_dir(self, step: int) -> Path:
        return self.run_dir / f"global_step_{step}"

    def step_dirs(self) -> dict[int, Path]:
        """Every global_step_N directory, complete or not, by step."""
        if not self.run_dir.is_dir():
            return {}
        found = (STEP_DIR.fullmatch(p.name) for p in self.run_dir.iterdir() if p.is_dir())
        return {int(m.group(1)): self.run_dir / m.group(0) for m in found if m}

    def complete_steps(self) -> list[int]:
        return sorted(step for step, path in self.step_dirs().items() if is_complete(path))

    def problem(self, step: int, checksums: bool | None = None, trust_own: bool = False) -> CorruptFileError | None:
        """Why global_step_<step> does not verify (tlt.rl.checkpoint_verify), or None when it does; trust_own: a
        checkpoint this process wrote or verified in full is not read again (rotation at every save)."""
        path = self.step_dir(step)
        if trust_own and path in self._whole:
            return None
        try:
            if verify_checkpoint(path, DAMAGED, checksums):
                self._whole.add(path)
        except CorruptFileError as e:
            return e
        return None

    def newest_verified(self, checksums: bool | None = None) -> tuple[int | None, dict[int, CorruptFileError]]:
        """The newest checkpoint that verifies (None if none does), and the newer ones that do not, with why."""
        skipped: dict[int, CorruptFileError] = {}
        for step in sorted(self.step_dirs(), reverse=True):
            problem = self.problem(step, checksums)
            if problem is None:
                return step, skipped
            skipped[step] = problem
        return None, skipped

    def latest_step(self) -> int | None:
        """The newest checkpoint that verifies by sizes and headers (None if there is none)."""
        return self.newest_verified(checksums=False)[0]

    def save(self, step: int, write_model: Callable[[Path], None], state: TrainerState, cfg: Config) -> Path:
        """Write global_step_<step>/ atomically; write_model(dir) writes the HF files (weights, config, tokenizer)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._remove_leftovers()
        final = self.step_dir(step)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=self.run_dir))
        try:
            write_model(tmp)
            fault_point("checkpoint", step)  # the fault tests kill here: weights written, state not yet
            torch.save(dict(state.__dict__), tmp / STATE_FILE)
            save_config(cfg, str(tmp / CONFIG_FILE))
            write_manifest(tmp)  # last: what the checkpoint holds, read back before it is trusted
            tmp.chmod(0o755)
            _fsync_tree(tmp)
            if final.exists():  # re-saving a step (e.g. after resuming from an earlier one): swap the copies
                self._point_away_from(step)
                self._replace(final, tmp)
            else:
                os.rename(tmp, final)
            _fsync_dir(self.run_dir)
        except Exception as e:  # a full disk, an I/O error: say what survives
            e.add_note(f"tlt: checkpoint step {step} was not written; {self.survivor()}")
            raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        self._whole.add(final)
        fault_point("commit", step)  # complete but not yet named by the latest-step file
        write_text_atomic(self.run_dir / LATEST_FILE, f"{step}\n")
        self.rotate(keep=step)
        return final

    def _replace(self, final: Path, tmp: Path) -> None:
        """Put the new copy `tmp` at `final`. The old copy is removed when it verifies (a checkpoint of an
        abandoned run), set aside as corrupt_<name> when it does not: a damaged checkpoint is the user's to look
        at, never deleted."""
        self._whole.discard(final)
        problem = self.problem(int(STEP_DIR.fullmatch(final.name).group(1)), checksums=None)
        if problem is not None:
            aside = self._aside_name(final, "corrupt_")
            logger.warning("tlt: warning: %s does not verify (%s %s): kept as %s; this step is written anew", final,
                           problem.path, problem.problem, aside.name)
            os.rename(final, aside)
            os.rename(tmp, final)
            return
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old)

    @staticmethod
    def _aside_name(path: Path, prefix: str) -> Path:
        aside = path.with_name(f"{prefix}{path.name}")
        while aside.exists():
            aside = aside.with_name(aside.name + "_")
        return aside

    def survivor(self) -> str:
        """What a run that stops now resumes from."""
        latest = self.latest_step()
        return ("no earlier checkpoint exists" if latest is None else
                f"the newest complete checkpoint, {self.step_dir(latest)}, is intact (trainer.resume=auto resumes "
                f"from it)")

    def check_space(self, step: int, need_bytes: int, tidy: bool = True) -> None:
        """CheckpointSpaceError, before anything is written, when global_step_<step>/ (or this rank's `need_bytes`
        of it) will not fit; tidy: first remove what crashed saves left (the writing rank only)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if tidy:
            self._remove_leftovers()
        short = space_shortfall(self.run_dir, need_bytes)
        if short:
            raise CheckpointSpaceError(f"checkpoint step {step} does not fit: {short}. Nothing of it was written; "
                                       f"{self.survivor()}. Free space, or set trainer.max_ckpt_to_keep")

    def _point_away_from(self, step: int) -> None:
        """Before global_step_<step> is swapped out: the latest-step file must not name it meanwhile."""
        latest = self.run_dir / LATEST_FILE
        if latest.is_file() and latest.read_text().strip() == str(step):
            others = [s for s in self.complete_steps() if s != step]
            if others:
                write_text_atomic(latest, f"{others[-1]}\n")
            else:
                latest.unlink()
                _fsync_dir(self.run_dir)

    def rotate(self, keep: int) -> None:
        """Delete the oldest checkpoints beyond max_to_keep; `keep` (the one just completed) stays. Only
        checkpoints that verify count and go: a damaged one neither takes a good one's place nor is deleted."""
        if self.max_to_keep is None:
            return
        old = [s for s in self.complete_steps() if s != keep and self.problem(s, trust_own=True) is None]
        for step in old[:max(len(old) - (self.max_to_keep - 1), 0)]:
            shutil.rmtree(self.step_dir(step))
            self._whole.discard(self.step_dir(step))

    def _remove_leftovers(self) -> None:
        """Temporary directories of saves a crash interrupted (never renamed into place)."""
        for path in self.run_dir.glob(".global_step_*"):
            if path.is_dir() and (".tmp-" in path.name or ".old-" in path.name):
                shutil.rmtree(path, ignore_errors=True)

    def resolve_resume(self, resume: str, set_aside: bool = True) -> Path | None:
        """trainer.resume -> the checkpoint to resume from, verified, or None (start fresh). auto: the newest that
        verifies, with a warning for each newer one skipped; a directory that does not verify is a ConfigError
        naming the bad file. set_aside: the process that owns the run directory (see _set_aside_newer_than)."""
        if resume == "disable":
            return None
        if resume == "auto":
            step, skipped = self.newest_verified()
            start = "the start" if step is None else str(self.step_dir(step))
            for bad, problem in sorted(skipped.items(), reverse=True):
                logger.warning("tlt: warning: skipping checkpoint %s: %s %s; resuming from %s (the skipped one is "
                               "kept)", self.step_dir(bad), problem.path, problem.problem, start)
            return None if step is None else self.step_dir(step)
        path = Path(resume)
        try:
            verify_checkpoint(path, DAMAGED)
        except CorruptFileError as e:
            raise ConfigError(f"trainer.resume={resume!r}: {e}") from None
        if set_aside:
            self._set_aside_newer_than(path)
        return path

    def _set_aside_newer_than(self, path: Path) -> None:
        """Resuming this run from an older step: its newer checkpoints belong to the abandoned branch. They are
        renamed (abandoned_global_step_N, kept), so that a later resume=auto cannot pick them up."""
        m = STEP_DIR.fullmatch(path.name)
        if m is None or not self.run_dir.is_dir() or path.resolve().parent != self.run_dir.resolve():
            return
        for step, newer in sorted(self.step_dirs().items()):
            if step > int(m.group(1)):
                aside = self._aside_name(newer, "abandoned_")
                logger.warning("resuming from %s: setting the newer %s aside as %s", path, newer, aside.name)
                os.rename(newer, aside)


def load_trainer_state(path: str | os.PathLike) -> TrainerState:
    return TrainerState(**read_trainer_state(Path(path) / STATE_FILE))


def copy_hf_side_files(src: str | os.PathLike | None, dst: Path) -> None:
    """config.json / generation_config.json of the original model, so the checkpoint loads like it."""
    if src is None:
        return
    for name in HF_SIDE_FILES:
        if (Path(src) / name).is_file():
            shutil.copy2(Path(src) / name, dst / name)
