"""What a `tlt train` checkpoint (global_step_N/) holds, and `verify_checkpoint`: the checks that it is whole,
run before a resume loads anything from it.

A checkpoint of this version lists its files in manifest.json (tlt.integrity: size and CRC-32 of each, written
last); one written before manifests is checked by everything that needs none, so it still loads. Always checked,
from headers and metadata only: the files a resume reads are there; config.json and model.safetensors agree (every
weight, in the shape the config implies); trainer_state.pt is a whole archive whose optimiser state fits the
model's parameters and whose drafter buffer fits its hidden size (loaded with mmap: no tensor is read); config.yaml
parses; actor_shards/ holds every shard its DCP metadata names; drafter/ is a drafter of its config. Checksums are
checked when the checkpoint holds at most CHECKSUM_MAX_BYTES: 8 GiB read at CRC-32's ~5 GB/s is under 2 s, small
next to loading it; a larger one is checked by sizes and headers only, and the caller is told.
"""
from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
import yaml

from tlt.integrity import CorruptFileError, check_json, check_manifest, manifest_bytes
from tlt.models.config import ModelConfig
from tlt.models.weights_check import check_model_weights
from tlt.schema import ConfigError

STATE_FILE = "trainer_state.pt"
CONFIG_FILE = "config.yaml"
REQUIRED_FILES = ("model.safetensors", STATE_FILE, CONFIG_FILE)  # a checkpoint missing any of them is incomplete
SHARDS_DIR = "actor_shards"  # an actor.strategy=fsdp run's DCP shards of the weights and AdamW state
DRAFTER_DIR = "drafter"      # the online drafter in use, in tlt.speculative.drafter_io's layout
CHECKSUM_MAX_BYTES = 8 * 2**30
TRAINER_STATE_KEYS = ("step", "actor", "rng", "data")


def read_trainer_state(path: Path, mmap: bool = False) -> dict[str, Any]:
    """trainer_state.pt's contents, loaded with weights_only (nothing in it can run code); mmap: tensors are mapped,
    not read."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        raise ConfigError(f"{path} holds objects a safe load refuses (a checkpoint of an older tlt, or not tlt's): "
                          f"{str(e).splitlines()[0]}. Start over with trainer.resume=disable, or load its "
                          "model.safetensors as model.path") from None


def verify_checkpoint(path: str | Path, fix: str, checksums: bool | None = None) -> bool:
    """CorruptFileError naming the first bad file of checkpoint `path` (`fix`: what the user can do). checksums:
    None = when the checkpoint is at most CHECKSUM_MAX_BYTES. Returns whether checksums were checked."""
    path = Path(path)
    missing = [name for name in REQUIRED_FILES if not (path / name).is_file()]
    if missing:
        raise CorruptFileError(path, f"is not a complete tlt checkpoint (missing {', '.join(missing)})", fix)
    if checksums is None:
        checksums = manifest_bytes(path) <= CHECKSUM_MAX_BYTES
    has_manifest = check_manifest(path, fix, checksums)
    cfg = check_model_weights(path, fix)
    for side in sorted(path.glob("*.json")):  # tokenizer and generation configs: a resume loads them
        check_json(side, fix)
    try:
        yaml.safe_load((path / CONFIG_FILE).read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise CorruptFileError(path / CONFIG_FILE, f"is not valid YAML ({e})", fix) from None
    check_trainer_state(path / STATE_FILE, cfg, fix)
    if (path / SHARDS_DIR).is_dir():
        check_sharded(path / SHARDS_DIR, fix)
    if (path / DRAFTER_DIR).is_dir():
        from tlt.speculative.drafter_io import check_drafter_dir
        check_drafter_dir(path / DRAFTER_DIR, fix)
    return checksums and has_manifest


def check_trainer_state(path: Path, cfg: ModelConfig, fix: str) -> None:
    """trainer_state.pt is whole, and the optimiser state and drafter buffer in it fit a model of `cfg`."""
    from tlt.drafter_train.buffer import DrafterBuffer
    from tlt.integrity import check_torch_archive
    check_torch_archive(path, fix)
    try:
        state = read_trainer_state(path, mmap=True)
    except ConfigError:  # an older tlt's pickled objects: not loadable, so not resumable (nor rotated away)
        raise CorruptFileError(path, "holds objects a safe load refuses (a checkpoint of an older tlt, or not tlt's)",
                               "Start over with trainer.resume=disable, or load its model.safetensors as model.path"
                               ) from None
    except Exception as e:  # noqa: BLE001 - a damaged archive fails inside torch.load with whatever it hit
        raise CorruptFileError(path, f"does not load ({type(e).__name__}: {str(e).splitlines()[0]})", fix) from None
    lacking = [k for k in TRAINER_STATE_KEYS if not isinstance(state, dict) or k not in state]
    if lacking:
        raise CorruptFileError(path, f"is not a tlt trainer state (no {', '.join(lacking)})", fix)
    problem = _optimizer_problem(state["actor"], cfg)
    buffer = (state.get("drafter_hook") or {}).get("buffer")
    if problem is None and buffer is not None:
        problem = DrafterBuffer.state_problem(buffer, cfg.hidden_size)
    if problem:
        raise CorruptFileError(path, f"does not fit the checkpoint's model: {problem}", fix)


def _optimizer_problem(actor: Any, cfg: ModelConfig) -> str | None:
    """Why the saved AdamW state cannot be this model's (None when it can; a sharded one is DCP's to check)."""
    if not isinstance(actor, dict):
        return "its actor state is not a dict"
    if "sharded" in actor:
        return None
    from tlt.models.decoder import Decoder
    with torch.device("meta"):
        shapes = [tuple(p.shape) for p in Decoder(cfg).parameters()]
    try:
        optim = actor["optimizer"]
        num_params = sum(len(g["params"]) for g in optim["param_groups"])
        if num_params != len(shapes):
            return f"the optimiser state is for {num_params} parameters, the model has {len(shapes)}"
        for index, entry in optim["state"].items():
            for name, value in entry.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and tuple(value.shape) != shapes[index]:
                    return (f"the optimiser's {name} of parameter {index} has shape {list(value.shape)}, the "
                            f"parameter {list(shapes[index])}")
    except (KeyError, TypeError, IndexError, AttributeError) as e:
        return f"its optimiser state is not AdamW's ({type(e).__name__}: {e})"
    return None


def check_sharded(path: Path, fix: str) -> None:
    """A DCP directory (tlt.rl.sharded_checkpoint.save_sharded): its .metadata reads, and every shard file it names
    is there, at least as long as the bytes it places in it. Reads the metadata only."""
    import torch.distributed.checkpoint as dcp
    meta = path / ".metadata"
    if not meta.is_file():
        raise CorruptFileError(meta, "is missing (save_sharded writes it once every shard is written)", fix)
    try:
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # noqa: BLE001 - a damaged pickle raises whatever unpickling hit
        raise CorruptFileError(meta, f"does not read as DCP metadata ({type(e).__name__}: {e})", fix) from None
    needs: dict[str, int] = {}  # shard file -> the bytes the metadata places in it
    for info in (metadata.storage_data or {}).values():
        needs[info.relative_path] = max(needs.get(info.relative_path, 0), info.offset + info.length)
    for name, need in sorted(needs.items()):
        shard = path / name
        if not shard.is_file():
            raise CorruptFileError(shard, "is missing: the shards' .metadata places tensors in it", fix)
        if shard.stat().st_size < need:
            raise CorruptFileError(shard, f"is {shard.stat().st_size} bytes where .metadata places {need} (cut "
                                          "short)", fix)
