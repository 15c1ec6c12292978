"""`tlt export-drafter`: a drafter as a vLLM EAGLE draft model (tlt.export.vllm) with its test vector.

    tlt export-drafter DIR --out OUT [--target MODEL] [--format auto|eagle|tlt-plugin] [--dtype float32|bfloat16]

DIR is a drafter directory (`tlt train-drafter`'s, the cached warm-up drafter) or a checkpoint (global_step_N/,
whose drafter/ it exports for the checkpoint's own policy). The target is --target, else the checkpoint, else the
model the drafter's provenance.json names. Then serve it with
    vllm serve TARGET --dtype float32 \\
      --speculative-config '{"method": "eagle", "model": "OUT", "num_speculative_tokens": 3}'
(a "tlt-plugin" export needs tlt where vLLM runs: `pip install --no-deps` of tlt's repository registers the plugin).
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from tlt.export.test_vector import FILE as VECTOR_FILE
from tlt.export.test_vector import describe, greedy_continuation, make_test_vector
from tlt.export.vllm import KINDS, choose_kind, export_for_vllm
from tlt.models.loader import load_model, load_tokenizer, read_config
from tlt.schema import UserError
from tlt.speculative.drafter_io import load_drafter

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
VECTOR_TOKENS = 16  # the target's greedy tokens after the prompt in the test vector


def resolve(path: Path, target: str | None) -> tuple[Path, Path]:
    """(drafter directory, target model directory) for DIR and --target, or UserError saying what to pass."""
    if (path / "drafter" / "drafter.safetensors").is_file():
        drafter_dir, checkpoint = path / "drafter", path
    elif (path / "drafter.safetensors").is_file():
        drafter_dir = path
        checkpoint = path.parent if (path.parent / "config.json").is_file() and path.name == "drafter" else None
    else:
        raise UserError(f"{path} is neither a drafter directory (drafter.safetensors + drafter_config.json) nor a "
                        "checkpoint holding one in drafter/: pass one written by `tlt train-drafter` or `tlt train`")
    prov = drafter_dir / "provenance.json"
    named = json.loads(prov.read_text()).get("target_model") if prov.is_file() else None
    model = Path(target) if target else checkpoint or (Path(named) if named else None)
    if model is None:
        raise UserError(f"{drafter_dir} does not say which model it drafts for: pass --target MODEL_DIR")
    if not (model / "config.json").is_file():
        raise UserError(f"target {model} has no config.json: pass --target with the HF model directory the "
                        "drafter was trained for")
    if prov.is_file() and checkpoint is None:
        want = json.loads(prov.read_text()).get("target_config_sha256")
        if want and want != hashlib.sha256((model / "config.json").read_bytes()).hexdigest():
            raise UserError(f"{drafter_dir} was trained for {named}, whose config.json differs from {model}'s: "
                            "pass --target with the model it was trained for")
    return drafter_dir, model


def check_same_shape(drafter_dir: Path, model: Path) -> None:
    """The drafter was built for a model of the target's architecture (its embedding and LM head are the target's)."""
    saved = json.loads((drafter_dir / "drafter_config.json").read_text())["model_config"]
    have = dataclasses.asdict(read_config(model))
    wrong = [k for k, v in saved.items() if k not in ("eos_token_id", "bos_token_id") and have.get(k) != v]
    if wrong:
        raise UserError(f"{drafter_dir} was built for another architecture than {model} ("
                        + ", ".join(f"{k}: {saved[k]} vs {have.get(k)}" for k in wrong) + "): pass --target with "
                        "the model it was trained for")


def vector_prompt(model: Path) -> list[int]:
    """The default task's first held-out prompt in the target's chat template."""
    from tlt.tasks.default_task import make_examples
    try:
        tok = load_tokenizer(model)
    except FileNotFoundError as e:
        raise UserError(f"the test vector needs the target's tokenizer: {e}") from None
    messages = next(make_examples("val", 1, 0))["prompt"]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def export(path: Path, out: Path, target: str | None = None, kind: str = "auto",
           dtype: str = "float32") -> tuple[Path, str]:
    """Check everything, then write the export into a temporary sibling of `out` and rename it into place."""
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out} exists and is not an empty directory: choose a new one")
    drafter_dir, model = resolve(path, target)
    check_same_shape(drafter_dir, model)
    drafter = load_drafter(drafter_dir)
    kind = choose_kind(drafter, kind)
    prompt = vector_prompt(model)
    target_model = load_model(model)  # fp32: the vector is tlt's own drafting, at full precision
    drafter.attach(target_model).eval()
    hf_config = json.loads((model / "config.json").read_text())
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        export_for_vllm(drafter, hf_config, tmp, kind, DTYPES[dtype])
        vector = make_test_vector(drafter, target_model, greedy_continuation(target_model, prompt, VECTOR_TOKENS))
        vector.save(tmp / VECTOR_FILE)
        tmp.chmod(0o755)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"test vector: {describe(vector)}")
    return model, kind


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tlt export-drafter", description=__doc__.split("\n\n")[0])
    p.add_argument("dir", help="drafter directory or checkpoint (global_step_N/)")
    p.add_argument("--out", required=True, help="new directory for the export")
    p.add_argument("--target", default=None, help="the target model directory (default: see above)")
    p.add_argument("--format", default="auto", choices=KINDS,
                   help="auto: plain EAGLE-1 where vLLM's stock class holds the drafter exactly, else tlt-plugin")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES), help="weights' dtype in the export")
    ns = p.parse_args(argv)
    out = Path(ns.out)
    model, kind = export(Path(ns.dir), out, ns.target, ns.format, ns.dtype)
    spec = json.dumps({"method": "eagle", "model": str(out.resolve()), "num_speculative_tokens": 3})
    print(f"wrote {kind} export to {out}; serve it with\n  vllm serve {model} --dtype float32 "
          f"--speculative-config '{spec}'")
    if kind == "tlt-plugin":
        print("  (through tlt's vLLM plugin: `pip install --no-deps` of tlt's repository in vLLM's environment)")
    return 0
