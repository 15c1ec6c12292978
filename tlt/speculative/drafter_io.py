"""Save/load the drafter's trainable weights, export them in the EAGLE layout SGLang loads, and build a reduced
draft vocabulary.

tlt format (`save_drafter`): drafter.safetensors with our own keys (fc.*, layer.*; fused qkv_proj / gate_up_proj)
+ drafter_config.json (the ModelConfig) + draft_vocab.safetensors when the drafter has a reduced vocabulary.
`check_drafter_dir` checks such a directory from its headers (every weight there, in the shape its config implies)
before anything loads it.

EAGLE format (`export_eagle`), checked against the serving code (read via the code search, 2026):
- SGLang python/sglang/srt/models/llama_eagle.py: entry class `LlamaForCausalLMEagle` (and qwen2_eagle.py:
  `Qwen2ForCausalLMEagle`), picked by config `architectures`; load_weights prefixes "model." to every non-lm_head
  key, so checkpoint keys are `fc.weight`, `fc.bias` (nn.Linear(2H, H) with bias) and `layers.0.<HF names>`; layer 0
  replaces input_layernorm with identity (EAGLE-1), so no input_layernorm key is written. embed_tokens / lm_head
  are taken from the target. A reduced vocabulary goes to `--speculative-token-map`, a torch.load-able list of hot
  token ids (SGLang's load_token_map), written here as hot_token_ids.pt.
- vLLM: `tlt export-drafter` (tlt.export.vllm), which refuses what vLLM's stock EAGLE-1 class would load and draft
  differently with (it drops fc.bias without a word and has no draft vocabulary).
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

_SGLANG_ARCH = {"llama": "LlamaForCausalLMEagle", "qwen2": "Qwen2ForCausalLMEagle"}  # the EAGLE-1 classes it has


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


def eagle_state_dict(drafter: Drafter) -> dict[str, torch.Tensor]:
    """Trainable weights under EAGLE/HF names: fc.*, layers.0.self_attn.{q,k,v,o}_proj, layers.0.mlp.*."""
    cfg, sd = drafter.cfg, drafter.trainable_state_dict()
    nq, nkv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    out = {k: sd[k] for k in ("fc.weight", "fc.bias") if k in sd}
    a, p = "layer.self_attn.", "layers.0.self_attn."
    for kind in ("weight", "bias") if cfg.attention_bias else ("weight",):
        for name, w in zip("qkv", sd[a + f"qkv_proj.{kind}"].split([nq, nkv, nkv])):
            out[p + f"{name}_proj.{kind}"] = w
    out[p + "o_proj.weight"] = sd[a + "o_proj.weight"]
    if cfg.qk_norm:
        out[p + "q_norm.weight"], out[p + "k_norm.weight"] = sd[a + "q_norm.weight"], sd[a + "k_norm.weight"]
    out["layers.0.mlp.gate_proj.weight"], out["layers.0.mlp.up_proj.weight"] = \
        sd["layer.mlp.gate_up_proj.weight"].chunk(2)
    out["layers.0.mlp.down_proj.weight"] = sd["layer.mlp.down_proj.weight"]
    out["layers.0.post_attention_layernorm.weight"] = sd["layer.post_attention_layernorm.weight"]
    return {k: v.detach().contiguous().cpu() for k, v in out.items()}


def export_eagle(drafter: Drafter, target_hf_config: dict, out_dir: str | Path, flavour: str = "sglang",
                 dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write config.json + model.safetensors (+ hot_token_ids.pt) that SGLang loads as an EAGLE-1/2 draft model for
    the target whose HF config is `target_hf_config`. For vLLM use `tlt export-drafter` (tlt.export.vllm)."""
    if flavour == "vllm":
        raise ValueError("export for vLLM with `tlt export-drafter DIR --out OUT` (tlt.export.vllm): vLLM's stock "
                         "EAGLE-1 class drops fc.bias and has no draft vocabulary, which that export checks")
    if flavour != "sglang":
        raise ValueError(f"flavour must be 'sglang', got {flavour!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(target_hf_config)
    if drafter.cfg.family not in _SGLANG_ARCH:
        raise ValueError(f"SGLang has no EAGLE-1 draft class for family {drafter.cfg.family!r} (it has "
                         f"{sorted(_SGLANG_ARCH.values())}); serve with tlt")
    cfg["architectures"] = [_SGLANG_ARCH[drafter.cfg.family]]
    cfg["num_hidden_layers"] = 1
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    cfg.pop("layer_types", None)  # per-layer lists of the target would not match one layer
    state = {k: v.to(dtype) for k, v in eagle_state_dict(drafter).items()}
    state.setdefault("fc.bias", torch.zeros(drafter.cfg.hidden_size, dtype=dtype))  # SGLang's fc has one
    write_safetensors(state, out / "model.safetensors", metadata={"format": "pt"})
    if drafter.d2t is not None:
        torch.save(drafter.d2t.cpu().tolist(), out / "hot_token_ids.pt")
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def load_eagle(path: str | Path, drafter: Drafter) -> Drafter:
    """Inverse of `export_eagle` (also reads EAGLE-1 checkpoints of the same layout) into `drafter`."""
    hf = load_file(str(Path(path) / "model.safetensors"))
    cfg = drafter.cfg
    dtype = next(drafter.parameters()).dtype
    p = "layers.0."
    state = {"fc.weight": hf["fc.weight"],
             "layer.self_attn.qkv_proj.weight": torch.cat([hf[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]),
             "layer.self_attn.o_proj.weight": hf[p + "self_attn.o_proj.weight"],
             "layer.mlp.gate_up_proj.weight": torch.cat([hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]]),
             "layer.mlp.down_proj.weight": hf[p + "mlp.down_proj.weight"],
             "layer.post_attention_layernorm.weight": hf[p + "post_attention_layernorm.weight"]}
    if drafter.fc_bias:  # an EAGLE-1 checkpoint without one: zeros, the same function
        state["fc.bias"] = hf.get("fc.bias", torch.zeros(cfg.hidden_size))
    if cfg.attention_bias:
        state["layer.self_attn.qkv_proj.bias"] = torch.cat([hf[p + f"self_attn.{n}_proj.bias"] for n in "qkv"])
    if cfg.qk_norm:
        state["layer.self_attn.q_norm.weight"] = hf[p + "self_attn.q_norm.weight"]
        state["layer.self_attn.k_norm.weight"] = hf[p + "self_attn.k_norm.weight"]
    drafter.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False)
    return drafter


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
