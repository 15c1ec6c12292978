"""Model configuration: one dataclass for the Llama / Qwen2 / Qwen3 families, read from an HF config.json."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# HF `architectures` / `model_type` names we implement -> family name.
SUPPORTED_FAMILIES = {
    "llama": "llama", "LlamaForCausalLM": "llama",
    "qwen2": "qwen2", "Qwen2ForCausalLM": "qwen2",
    "qwen3": "qwen3", "Qwen3ForCausalLM": "qwen3",
}


@dataclass
class ModelConfig:
    family: str                      # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # Llama-3 style {"rope_type": "llama3", "factor", ...} or None
    tie_word_embeddings: bool = False
    attention_bias: bool = False      # Qwen2: bias on q/k/v projections
    qk_norm: bool = False             # Qwen3: RMSNorm on q and k per head
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        arch = (cfg.get("architectures") or [None])[0]
        family = SUPPORTED_FAMILIES.get(arch) or SUPPORTED_FAMILIES.get(cfg.get("model_type", ""))
        if family is None:
            raise ValueError(
                f"unsupported architecture {arch or cfg.get('model_type')!r}: tlt implements "
                f"LlamaForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM. Convert the model to one of these "
                f"families or add a family in tlt/models/config.py.")
        num_heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        rope_params = cfg.get("rope_parameters")  # transformers 5.x moves rope settings here
        if isinstance(rope_params, dict):
            rope_theta = rope_theta or rope_params.get("rope_theta")
            if rope_params.get("rope_type", "default") != "default":
                rope_scaling = rope_params
        if rope_scaling is not None:
            kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            if kind == "default":
                rope_scaling = None
            elif kind != "llama3":
                raise ValueError(f"unsupported rope_scaling type {kind!r}: tlt supports none and 'llama3'")
        return cls(
            family=family,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", family == "qwen2")),
            qk_norm=family == "qwen3",
            hidden_act=cfg.get("hidden_act", "silu"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos,
        )
