"""Save/load the drafter's trainable weights and build a reduced draft vocabulary.

tlt format (`save_drafter`): drafter.safetensors with our own keys (fc.*, layer.*; fused qkv_proj / gate_up_proj)
+ drafter_config.json (the ModelConfig) + draft_vocab.safetensors when the drafter has a reduced vocabulary.
`check_drafter_dir` checks such a directory from its headers (every weight there, in the shape its config implies)
before anything loads it. Other engines' layouts: tlt.export.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file

from tlt.integrity import CorruptFileError, check_json, check_manifest, check_safetensors
from tlt.models.config import ModelConfig
from tlt.models.loader import write_safetensors
from tlt.speculative.drafter import Drafter


def save_drafter(drafter: Drafter, out_dir: str | Path, extra: dict | None = None) -> Path:
    """Write the trainable weights (fc + layer) and the config; `extra` (e.g. RL step) goes into the json."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in drafter.trainable_state_dict().items()}
    write_safetensors(state, out / "drafter.safetensors", metadata={"format": "pt"})
    meta = {"format": "tlt-drafter-v1", "model_config": dataclasses.asdict(drafter.cfg), "extra": extra or {}}
    if not drafter.fc_bias:  # written only when off: directories saved before the option read as fc with bias
        meta["fc_bias"] = False
    (out / "drafter_config.json").write_text(json.dumps(meta, indent=2))
    if drafter.d2t is not None:
        save_draft_vocab(drafter.d2t, out / "draft_vocab.safetensors")
    return out


def load_drafter(path: str | Path, drafter: Drafter | None = None, device: str = "cpu",
                 dtype: torch.dtype = torch.float32) -> Drafter:
    """Load weights saved by `save_drafter` into `drafter` (built from the saved config when None). Attach the
    target afterwards with drafter.attach(target) if it is new."""
    path = Path(path)
    if not (path / "drafter.safetensors").is_file():
        raise FileNotFoundError(f"{path} has no drafter.safetensors: pass a directory written by save_drafter")
    meta = json.loads((path / "drafter_config.json").read_text())
    if drafter is None:
        drafter = Drafter(ModelConfig(**meta["model_config"]), fc_bias=meta.get("fc_bias", True)).to(
            device=device, dtype=dtype)
    state = load_file(str(path / "drafter.safetensors"), device=str(next(drafter.parameters()).device))
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    missing = [k for k in missing if k.startswith(("fc.", "layer."))]
    if missing or unexpected:
        raise ValueError(f"{path}: drafter weights do not match the model (missing {missing}, "
                         f"unexpected {unexpected}): was it saved for a different target config?")
    if (path / "draft_vocab.safetensors").is_file():
        drafter.d2t = load_draft_vocab(path / "draft_vocab.safetensors").to(next(drafter.parameters()).device)
    return drafter


def check_drafter_dir(path: str | Path, fix: str) -> ModelConfig:
    """The drafter's config, after its files passed the header checks (tlt.integrity); a CorruptFileError names
    the first bad file. Reads no weights."""
    path = Path(path)
    check_manifest(path, fix)
    config = path / "drafter_config.json"
    meta = check_json(config, fix)
    try:
        cfg = ModelConfig(**meta["model_config"])
    except (KeyError, TypeError) as e:
        raise CorruptFileError(config, f"is not a tlt drafter config ({type(e).__name__}: {e})", fix) from None
    with torch.device("meta"):  # the shapes a drafter of this config has, without allocating it
        shapes = {k: tuple(v.shape) for k, v in Drafter(cfg).trainable_state_dict().items()}
    weights = path / "drafter.safetensors"
    unexpected = sorted(set(check_safetensors(weights, fix, shapes)) - set(shapes))
    if unexpected:
        raise CorruptFileError(weights, f"holds weights a drafter of its config has not ({unexpected[:3]})", fix)
    vocab = path / "draft_vocab.safetensors"
    if vocab.is_file() and len(check_safetensors(vocab, fix).get("d2t", ())) != 1:
        raise CorruptFileError(vocab, "has no one-dimensional 'd2t' tensor", fix)
    return cfg


def build_draft_vocab(token_counts: torch.Tensor | Mapping[int, int], size: int,
                      vocab_size: int | None = None) -> torch.Tensor:
    """d2t [size] long: the `size` most frequent target ids (ties -> lower id), sorted ascending.
    token_counts: counts [V] indexed by target id, or {target_id: count} (then give vocab_size)."""
    if isinstance(token_counts, Mapping):
        if vocab_size is None:
            raise ValueError("token_counts given as a mapping: pass vocab_size too")
        counts = torch.zeros(vocab_size, dtype=torch.float64)
        for t, c in token_counts.items():
            counts[int(t)] += c
    else:
        counts = token_counts.double().flatten()
    if not 0 < size <= counts.numel():
        raise ValueError(f"draft vocab size {size} must be in 1..{counts.numel()} (the target vocabulary)")
    order = torch.argsort(-counts, stable=True)  # stable: equal counts keep ascending id order
    return order[:size].sort().values


def save_draft_vocab(d2t: torch.Tensor, path: str | Path) -> None:
    write_safetensors({"d2t": d2t.detach().to(torch.long).contiguous().cpu()}, path)


def load_draft_vocab(path: str | Path) -> torch.Tensor:
    return load_file(str(path))["d2t"]
