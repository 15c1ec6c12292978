"""A drafter as a vLLM 0.32 EAGLE draft model that drafts exactly what tlt's does, or a refusal that says why not.

Two kinds, chosen by what the drafter is (`stock_misfits`):
- "eagle": a drafter without fc bias (or with an all-zero one) over the full vocabulary is vLLM's stock EAGLE-1
  drafter. config.json keeps the target's architectures ("LlamaForCausalLM"; vLLM's EAGLEConfig renames it to
  "EagleLlamaForCausalLM", vllm/model_executor/models/llama_eagle.py), model.safetensors holds fc.weight and
  layers.0.<HF names> without input_layernorm (EAGLE-1's layer 0 has none); embedding and LM head are the target's.
- "tlt-plugin": anything else (tlt's default drafter has an fc bias and an 8192-token draft vocabulary). The stock
  class would load it and draft something else without a word (its loader skips unexpected `*.bias` tensors, and it
  drafts over the whole vocabulary), so config.json names PLUGIN_ARCH, which only tlt's vLLM plugin
  (tlt/vllm_plugin, entry point group `vllm.general_plugins`) registers: the same tensors plus fc.bias, and
  `draft_vocab_ids` (absolute target ids, int64) to which it masks the draft logits. A vLLM without the plugin fails
  to load it instead of drafting differently.
Both copy the target's config (max_position_embeddings included) with num_hidden_layers=1 and a `tlt_drafter`
block (TLT_BLOCK_KEYS) that the plugin reads. Only the llama family: vLLM 0.32 has no EAGLE-1 class for qwen2/qwen3.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from tlt.models.loader import write_safetensors
from tlt.schema import UserError
from tlt.speculative.drafter import Drafter
from tlt.export.eagle import eagle_state_dict

FORMAT = "tlt-vllm-eagle-v1"
KINDS = ("auto", "eagle", "tlt-plugin")
STOCK_ARCH = {"llama": "LlamaForCausalLM"}          # vLLM's EAGLEConfig makes it EagleLlamaForCausalLM
PLUGIN_ARCH = {"llama": "EagleTltLlamaForCausalLM"}  # the "Eagle" prefix keeps EAGLEConfig from renaming it
DRAFT_VOCAB_KEY = "draft_vocab_ids"
TLT_BLOCK_KEYS = ("format", "kind", "fc_bias", "draft_vocab_size")


def stock_misfits(drafter: Drafter) -> list[str]:
    """What vLLM's stock EagleLlamaForCausalLM cannot hold of this drafter (empty: it holds all of it)."""
    out = []
    if drafter.fc_bias and bool(drafter.fc.bias.detach().abs().max() > 0):
        out.append("its fc has a nonzero bias, which vLLM's EagleLlamaForCausalLM lacks (its loader skips fc.bias "
                   "without a word)")
    if not full_vocabulary(drafter):
        out.append(f"it drafts over a reduced vocabulary of {drafter.d2t.numel()} of {drafter.cfg.vocab_size} "
                   "token ids, which vLLM's EAGLE-1 lacks (it drafts over all of them)")
    return out


def full_vocabulary(drafter: Drafter) -> bool:
    d2t, V = drafter.d2t, drafter.cfg.vocab_size
    return d2t is None or (d2t.numel() == V and torch.equal(d2t.cpu(), torch.arange(V)))


def choose_kind(drafter: Drafter, requested: str = "auto") -> str:
    """The export kind for `requested` ("auto": "eagle" where the stock class holds the drafter, else
    "tlt-plugin"); UserError where it cannot hold the drafter exactly."""
    if requested not in KINDS:
        raise UserError(f"--format {requested!r}: expected one of {', '.join(KINDS)}")
    family = drafter.cfg.family
    if family not in STOCK_ARCH:
        raise UserError(f"the drafter is for a {family} target: vLLM 0.32 has an EAGLE-1 draft class for the llama "
                        f"family only (EagleLlamaForCausalLM), so there is no export of it that vLLM drafts with "
                        f"exactly; serve it with tlt (tlt.LLM speculative_config)")
    misfits = stock_misfits(drafter)
    if requested == "eagle" and misfits:
        raise UserError("--format eagle: vLLM's stock EAGLE-1 class would load this drafter and draft differently: "
                        + "; ".join(misfits) + ". Export with --format tlt-plugin (vLLM then needs tlt installed: "
                        "`pip install --no-deps` of tlt's repository in its environment), or train a drafter that fits "
                        "with `tlt train-drafter fc_bias=false draft_vocab=0`")
    if requested == "auto":
        return "tlt-plugin" if misfits else "eagle"
    return requested


def vllm_config(drafter: Drafter, target_hf_config: dict, kind: str, dtype: torch.dtype) -> dict:
    """config.json of the export: the target's, as a one-layer draft model of `kind`."""
    cfg = {k: v for k, v in target_hf_config.items() if k not in ("layer_types", "quantization_config")}
    family = drafter.cfg.family
    cfg["architectures"] = [STOCK_ARCH[family] if kind == "eagle" else PLUGIN_ARCH[family]]
    cfg["num_hidden_layers"] = 1
    # EAGLE drafts at the target's positions: a shorter rotary table would end them early (vLLM raises it too)
    cfg["max_position_embeddings"] = target_hf_config.get("max_position_embeddings",
                                                          drafter.cfg.max_position_embeddings)
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    cfg.pop("dtype", None)
    cfg["tlt_drafter"] = {"format": FORMAT, "kind": kind, "fc_bias": drafter.fc_bias and kind == "tlt-plugin",
                          "draft_vocab_size": None if full_vocabulary(drafter) else int(drafter.d2t.numel())}
    return cfg


def export_for_vllm(drafter: Drafter, target_hf_config: dict, out_dir: str | Path, kind: str,
                    dtype: torch.dtype = torch.float32) -> Path:
    """Write config.json and model.safetensors of `kind` ("eagle" or "tlt-plugin", from `choose_kind`)."""
    if kind not in ("eagle", "tlt-plugin"):
        raise ValueError(f"kind must be 'eagle' or 'tlt-plugin' (see choose_kind), got {kind!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = vllm_config(drafter, target_hf_config, kind, dtype)
    state = {k: v.to(dtype) for k, v in eagle_state_dict(drafter).items()}
    if not cfg["tlt_drafter"]["fc_bias"]:
        state.pop("fc.bias", None)  # all zeros (stock_misfits said so), or no bias at all
    if cfg["tlt_drafter"]["draft_vocab_size"] is not None:
        state[DRAFT_VOCAB_KEY] = drafter.d2t.detach().to(torch.int64).cpu().contiguous()
    write_safetensors(state, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out
