"""Load and save HF-format checkpoints (config.json + *.safetensors) into the fused-projection Decoder: whole
(`load_model`), or row ranges of each parameter (`CheckpointRows`, for a sharded load that reads each rank's rows)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tlt.models.config import ModelConfig
from tlt.models.decoder import Decoder


def write_safetensors(tensors: dict[str, torch.Tensor], path: str | os.PathLike,
                      metadata: dict[str, str] | None = None) -> None:
    """safetensors' save_file, leaving the file readable as any new file is under the umask (save_file itself
    creates it owner-only, mode 0600: other users of a shared checkpoint directory could not load the weights)."""
    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, 0o666 & ~umask())


def umask() -> int:
    """This process's umask, read without changing it (Linux); else set and restored at once."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _fail(msg: str):
    raise FileNotFoundError(msg)


def read_config(path: str | os.PathLike) -> ModelConfig:
    path = Path(path)
    if not path.exists():
        _fail(f"model path {str(path)!r} does not exist: pass a local directory holding an HF checkpoint "
              f"(config.json + *.safetensors); tlt never downloads models")
    if not (path / "config.json").is_file():
        _fail(f"{path} has no config.json: expected an HF model directory (config.json + *.safetensors)")
    return ModelConfig.from_hf(json.loads((path / "config.json").read_text()))


def weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        for n in names:
            if not (path / n).is_file():
                _fail(f"{path} is missing weight file {n} listed in model.safetensors.index.json")
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        _fail(f"{path} has no *.safetensors weights (found: {sorted(p.name for p in path.iterdir())}); "
              f"convert .bin checkpoints with transformers' save_pretrained(safe_serialization=True)")
    return files


def _sources(cfg: ModelConfig, available: set[str]) -> dict[str, list[str]]:
    """Our parameter name -> the HF tensors whose rows it is, in order: the fused q/k/v and gate/up projections
    concatenate theirs along dim 0; an untied LM head missing from the checkpoint is the embedding."""
    out = {"embed_tokens.weight": ["model.embed_tokens.weight"], "norm.weight": ["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = ["lm_head.weight" if "lm_head.weight" in available else "model.embed_tokens.weight"]
    for i in range(cfg.num_layers):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        a = p + "self_attn."
        out[q + "self_attn.qkv_proj.weight"] = [a + f"{n}_proj.weight" for n in "qkv"]
        if cfg.attention_bias:
            out[q + "self_attn.qkv_proj.bias"] = [a + f"{n}_proj.bias" for n in "qkv"]
        out[q + "self_attn.o_proj.weight"] = [a + "o_proj.weight"]
        if cfg.qk_norm:
            out[q + "self_attn.q_norm.weight"] = [a + "q_norm.weight"]
            out[q + "self_attn.k_norm.weight"] = [a + "k_norm.weight"]
        out[q + "mlp.gate_up_proj.weight"] = [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
        out[q + "mlp.down_proj.weight"] = [p + "mlp.down_proj.weight"]
        out[q + "input_layernorm.weight"] = [p + "input_layernorm.weight"]
        out[q + "post_attention_layernorm.weight"] = [p + "post_attention_layernorm.weight"]
    return out


def _hf_to_ours(cfg: ModelConfig, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename HF keys and fuse q/k/v and gate/up projections."""
    return {name: torch.cat([hf[k] for k in keys]) if len(keys) > 1 else hf[keys[0]]
            for name, keys in _sources(cfg, set(hf)).items()}


class CheckpointRows:
    """Rows of our parameters read straight from an HF checkpoint's safetensors files (safe_open's get_slice): a
    sharded load reads each rank's rows only, never a whole tensor it does not hold. Each read maps its file and
    unmaps it when done, so the pages read do not stay in the process's resident set.

        ckpt = CheckpointRows(path)
        ckpt.read_rows("layers.0.self_attn.qkv_proj.weight", start, stop, out)   # out: [stop - start, ...]
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.cfg = read_config(self.path)
        self.files: dict[str, Path] = {}  # HF key -> its file
        self.shapes: dict[str, tuple[int, ...]] = {}  # HF key -> its shape
        for f in weight_files(self.path):
            with safe_open(str(f), framework="pt") as fh:
                for k in fh.keys():
                    self.files[k], self.shapes[k] = f, tuple(fh.get_slice(k).get_shape())
        self.sources = _sources(self.cfg, set(self.files))
        missing = sorted(k for keys in self.sources.values() for k in keys if k not in self.files)
        if missing:
            raise ValueError(f"{self.path}: weight {missing[0]!r} is missing from the safetensors files")

    def shape(self, name: str) -> tuple[int, ...]:
        """The full shape of our parameter `name` (its sources' rows together)."""
        shapes = [self.shapes[k] for k in self.sources[name]]
        return (sum(s[0] for s in shapes), *shapes[0][1:])

    def read_rows(self, name: str, start: int, stop: int, out: torch.Tensor) -> None:
        """Copy rows [start, stop) of our parameter `name` into `out` (any dtype and device; cast as a whole load
        casts), reading from the files only the rows that land there."""
        offset = 0
        for key in self.sources[name]:
            rows = self.shapes[key][0]
            lo, hi = max(start, offset), min(stop, offset + rows)
            if lo < hi:
                with safe_open(str(self.files[key]), framework="pt") as fh:
                    out[lo - start:hi - start].copy_(fh.get_slice(key)[lo - offset:hi - offset])
            offset += rows


def hf_state_dict(model: Decoder) -> dict[str, torch.Tensor]:
    """Our weights under HF names (projections split again), for save_pretrained-compatible checkpoints."""
    cfg, sd = model.cfg, model.state_dict()
    nq, nkv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    out = {"model.embed_tokens.weight": sd["embed_tokens.weight"], "model.norm.weight": sd["norm.weight"]}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = sd["lm_head.weight"]
    for i in range(cfg.num_layers):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        for kind in ("weight", "bias") if cfg.attention_bias else ("weight",):
            qw, kw, vw = sd[q + f"self_attn.qkv_proj.{kind}"].split([nq, nkv, nkv])
            out[p + f"self_attn.q_proj.{kind}"], out[p + f"self_attn.k_proj.{kind}"] = qw, kw
            out[p + f"self_attn.v_proj.{kind}"] = vw
        out[p + "self_attn.o_proj.weight"] = sd[q + "self_attn.o_proj.weight"]
        if cfg.qk_norm:
            out[p + "self_attn.q_norm.weight"] = sd[q + "self_attn.q_norm.weight"]
            out[p + "self_attn.k_norm.weight"] = sd[q + "self_attn.k_norm.weight"]
        gate, up = sd[q + "mlp.gate_up_proj.weight"].chunk(2)
        out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = gate, up
        out[p + "mlp.down_proj.weight"] = sd[q + "mlp.down_proj.weight"]
        out[p + "input_layernorm.weight"] = sd[q + "input_layernorm.weight"]
        out[p + "post_attention_layernorm.weight"] = sd[q + "post_attention_layernorm.weight"]
    return {k: v.detach().contiguous() for k, v in out.items()}


def load_model(path: str | os.PathLike, dtype: torch.dtype = torch.float32, device: str = "cpu") -> Decoder:
    path = Path(path)
    cfg = read_config(path)
    hf: dict[str, torch.Tensor] = {}
    for f in weight_files(path):
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                hf[k] = fh.get_tensor(k)
    try:
        sd = _hf_to_ours(cfg, hf)
    except KeyError as e:
        raise ValueError(f"{path}: weight {e.args[0]!r} is missing from the safetensors files") from None
    with torch.device("meta"):
        model = Decoder(cfg)
    model.load_state_dict(sd, strict=True, assign=True)
    model.rotary = type(model.rotary)(cfg)  # buffers are not in the checkpoint: rebuild off the meta device
    return model.to(device=device, dtype=dtype).eval()


def save_model(model: Decoder, path: str | os.PathLike, hf_config: dict | None = None) -> None:
    """Write config.json + model.safetensors that transformers and tlt both load."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    write_safetensors(hf_state_dict(model), path / "model.safetensors", metadata={"format": "pt"})
    if hf_config is not None:
        (path / "config.json").write_text(json.dumps(hf_config, indent=2))


def load_tokenizer(path: str | os.PathLike):
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise FileNotFoundError(f"could not load a tokenizer from {path}: {e}. The model directory needs "
                                f"tokenizer.json or tokenizer_config.json with its vocabulary files") from None
