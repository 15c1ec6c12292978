"""Checks an HF model directory's weight files against its config.json before anything loads them: every
safetensors header reads, and every weight the Decoder loads is there with the shape the config implies. Reads
the headers only (a few ms for any model size). A problem is a tlt.integrity.CorruptFileError naming the file.
"""
from __future__ import annotations

from pathlib import Path

import torch

from tlt.integrity import CorruptFileError, check_json, check_safetensors
from tlt.models.config import ModelConfig

OPTIONAL = ("lm_head.weight",)  # an untied model without its own head uses the embedding (tlt.models.loader)


def hf_weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every weight tlt.models.loader.load_model reads for `cfg` (a Decoder on the meta
    device: nothing is allocated)."""
    from tlt.models.decoder import Decoder
    from tlt.models.loader import hf_state_dict
    with torch.device("meta"):
        model = Decoder(cfg)
    return {k: tuple(v.shape) for k, v in hf_state_dict(model).items()}


def read_model_config(path: Path, fix: str) -> ModelConfig:
    config = path / "config.json"
    hf = check_json(config, fix)
    try:
        return ModelConfig.from_hf(hf)
    except KeyError as e:
        raise CorruptFileError(config, f"has no {e.args[0]!r}: not a complete HF model config", fix) from None
    except (ValueError, TypeError, AttributeError) as e:
        raise CorruptFileError(config, f"is not a model config tlt reads ({e})", fix) from None


def check_model_weights(path: str | Path, fix: str) -> ModelConfig:
    """The directory's config, after its weight files passed the checks above."""
    from tlt.models.loader import weight_files
    path = Path(path)
    cfg = read_model_config(path, fix)
    try:
        files = weight_files(path)
    except FileNotFoundError as e:
        raise CorruptFileError(path, f"is not a whole model: {e}", fix) from None
    held: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for f in files:
        held.update({name: (f, shape) for name, shape in check_safetensors(f, fix).items()})
    for name, shape in hf_weight_shapes(cfg).items():
        if name not in held:
            if name in OPTIONAL:
                continue
            where = files[0] if len(files) == 1 else path
            raise CorruptFileError(where, f"has no weight {name!r}, which its config.json needs", fix)
        f, got = held[name]
        if got != shape:
            raise CorruptFileError(f, f"holds {name!r} of shape {list(got)} where its config.json needs "
                                      f"{list(shape)}", fix)
    return cfg
