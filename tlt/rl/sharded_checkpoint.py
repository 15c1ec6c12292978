"""Sharded checkpoints of the actor with torch.distributed.checkpoint (DCP), and export to one HF safetensors model.

`save_sharded` writes each rank's shards of the policy weights and AdamW state (plus the LR schedule) into one
DCP directory, under the model's own parameter names; `load_sharded` reads them back into an Actor with any
strategy and rank count (DCP reshards: save with 2 FSDP ranks, resume with 1 process, or the reverse).
`export_hf` gathers the full weights and writes config.json + model.safetensors under HF names
(tlt.models.loader.hf_state_dict), which transformers and tlt both load. A resume checks the directory first
(tlt.rl.checkpoint_verify.check_sharded: every shard its metadata names, whole).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)

from tlt.models.decoder import Decoder
from tlt.models.loader import save_model
from tlt.rl.actor import Actor
from tlt.rl.checkpoint import tensor_bytes
from tlt.rl.checkpoint_verify import SHARDS_DIR  # noqa: F401 - in global_step_N/ of an actor.strategy=fsdp run


def _state(actor: Actor) -> dict:
    model_sd, optim_sd = get_state_dict(actor.model, actor.optimizer)
    return {"model": model_sd, "optimizer": optim_sd, "scheduler": actor.scheduler.state_dict()}


def shard_bytes(actor: Actor) -> int:
    """What save_sharded writes on this rank: its shards of the weights and AdamW state."""
    return tensor_bytes(_state(actor))


def save_sharded(actor: Actor, path: str | os.PathLike) -> None:
    """Every rank calls this (collective under FSDP); each writes its own shards."""
    dcp.save(_state(actor), checkpoint_id=str(path))


def load_sharded(actor: Actor, path: str | os.PathLike) -> None:
    """Load a save_sharded checkpoint into `actor`, whatever strategy and rank count saved it."""
    if not (Path(path) / ".metadata").is_file():
        raise FileNotFoundError(f"{path} is not a sharded checkpoint (no .metadata written by save_sharded)")
    state = _state(actor)
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(actor.model, actor.optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])
    actor.scheduler.load_state_dict(state["scheduler"])


def full_state_dict(model: Decoder) -> dict[str, torch.Tensor]:
    """The whole model's weights on the CPU (gathered from the shards under FSDP; every rank calls this)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def consolidated(model: Decoder) -> Decoder | None:
    """`model`'s full weights as a plain Decoder on the CPU, on rank 0 (collective; None on the other ranks).
    Its rotary buffers stay on the meta device: it is for saving, not for running."""
    full = full_state_dict(model)
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    with torch.device("meta"):
        plain = Decoder(model.cfg)
    plain.load_state_dict(full, strict=False, assign=True)  # buffers (rotary) are not weights: not exported
    return plain


def export_hf(model: Decoder, out_dir: str | os.PathLike, hf_config_path: str | os.PathLike) -> None:
    """Write `model` (sharded or not) as an HF checkpoint: config.json copied from `hf_config_path` (the
    checkpoint the run started from) and model.safetensors under HF names. Rank 0 writes."""
    plain = consolidated(model)
    if plain is None:
        return
    hf_config = json.loads((Path(hf_config_path) / "config.json").read_text())
    save_model(plain, out_dir, hf_config)
