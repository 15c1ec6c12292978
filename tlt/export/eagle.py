"""The drafter in the EAGLE layout serving engines load: HF names (`eagle_state_dict`) and SGLang's EAGLE-1 draft
model (`export_eagle`, `load_eagle`); vLLM's is tlt.export.vllm (`tlt export-drafter`).

SGLang (python/sglang/srt/models/llama_eagle.py, qwen2_eagle.py): entry class `LlamaForCausalLMEagle` or
`Qwen2ForCausalLMEagle`, picked by config `architectures`; load_weights prefixes "model." to every non-lm_head key,
so checkpoint keys are `fc.weight`, `fc.bias` (nn.Linear(2H, H) with bias) and `layers.0.<HF names>`; layer 0
replaces input_layernorm with identity (EAGLE-1), so no input_layernorm key is written. embed_tokens / lm_head are
taken from the target. A reduced vocabulary goes to `--speculative-token-map`, a torch.load-able list of hot token
ids (SGLang's load_token_map), written here as hot_token_ids.pt.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from tlt.models.loader import write_safetensors
from tlt.speculative.drafter import Drafter

_SGLANG_ARCH = {"llama": "LlamaForCausalLMEagle", "qwen2": "Qwen2ForCausalLMEagle"}  # the EAGLE-1 classes it has


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
