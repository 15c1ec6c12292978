"""tlt's vLLM plugin: registers the draft model class of `tlt export-drafter`'s "tlt-plugin" exports.

vLLM calls `register` in each of its processes through the entry point group `vllm.general_plugins` (pyproject.toml),
so `vllm serve TARGET --speculative-config '{"method": "eagle", "model": EXPORT, ...}'` needs no code of the user's.
Only vLLM imports this package; the class itself (tlt.vllm_plugin.eagle) is imported lazily, when a config names it.
"""
from __future__ import annotations

ARCHITECTURE = "EagleTltLlamaForCausalLM"  # tlt.export.vllm.PLUGIN_ARCH["llama"] writes it into config.json


def register() -> None:
    from vllm import ModelRegistry

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, "tlt.vllm_plugin.eagle:TltEagleLlamaForCausalLM")
