"""Checks a run's inputs before any expensive work: the data files (every row), the model directory and its
tokenizer, the reward function, the drafter directory and the output directory.

`tlt train` calls `check_run(cfg)` right after the config loads, before the default model is converted, the
warm-up drafter is built, Ray starts or a rollout runs. Each problem is a `UserError` whose message names the file,
row or key and says what to do; the command line prints it without a traceback and exits with code 2.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from tlt.config import Config
from tlt.rl.tiny_model import TINY_MODEL_NAME
from tlt.schema import UserError



def check_run(cfg: Config) -> None:
    """Raise UserError for the first problem found, cheapest checks first."""
    rows = {split: check_data_files(files, cfg.data.prompt_key, f"data.{split}_files")
            for split, files in (("train", cfg.data.train_files), ("val", cfg.data.val_files)) if files}
    tokenizer = check_model_dir(cfg.model.path) if cfg.model.path not in (None, TINY_MODEL_NAME) else None
    if tokenizer is not None:
        for split, examples in rows.items():
            check_prompt_lengths(examples, tokenizer, cfg, split)
    if cfg.reward.custom_function:
        check_reward_function(cfg.reward.custom_function)
    check_attention_backend(cfg.rollout.attention)
    s = cfg.speculative
    if s.enabled and s.method == "eagle" and s.model is not None:
        check_drafter_dir(s.model)
    check_output_dir(Path(cfg.trainer.default_local_dir) / cfg.trainer.project_name / cfg.trainer.experiment_name,
                     checkpoint_bytes(cfg.model.path))


def check_attention_backend(name: str) -> None:
    """rollout.attention=flex needs FlexAttention in this torch (auto falls back to sdpa by itself)."""
    from tlt.models.flex import flex_available
    if name == "flex" and not flex_available():
        raise UserError("rollout.attention=flex: this torch has no torch.nn.attention.flex_attention (it needs "
                        "torch >= 2.5); set rollout.attention=auto or sdpa")


def check_data_files(paths: list[str], prompt_key: str, key: str) -> list:
    """Every row of every file parsed and checked against the schema (tlt.rl.data's own row parser)."""
    from tlt.rl.data import DataError, load_examples
    for path in paths:
        if not Path(path).is_file():
            raise UserError(f"{key}: data file not found: {path}")
    try:
        examples, _ = load_examples(paths, None, prompt_key)
    except DataError as e:
        raise UserError(f"{key}: {e}. Fix the row, or drop it from the file") from None
    if not examples:
        raise UserError(f"{key}: {', '.join(paths)} holds no rows")
    return examples


def check_model_dir(path: str):
    """An HF model directory tlt can load: config.json of a supported architecture, safetensors weights, and a
    tokenizer. Returns the tokenizer (cheap to load), or None for a directory without tokenizer files."""
    from tlt.models.config import ModelConfig
    from tlt.models.loader import weight_files, load_tokenizer
    where = Path(path)
    fix = "set model.path to an HF model directory (config.json + *.safetensors), or null for the default model"
    if not where.is_dir():
        raise UserError(f"model.path: {path} is not a directory: {fix}")
    try:
        hf = json.loads((where / "config.json").read_text())
        ModelConfig.from_hf(hf)
        weight_files(where)
    except FileNotFoundError as e:
        raise UserError(f"model.path: {e}") from None
    except json.JSONDecodeError as e:
        raise UserError(f"model.path: {where / 'config.json'} is not valid JSON ({e})") from None
    except KeyError as e:
        raise UserError(f"model.path: {where / 'config.json'} has no {e.args[0]!r}: not a complete HF model "
                        "config") from None
    except ValueError as e:
        raise UserError(f"model.path: {path}: {e}") from None
    if not any((where / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise UserError(f"model.path: {path} has no tokenizer files (tokenizer.json / tokenizer_config.json): the "
                        "trainer needs a tokenizer to apply the chat template; copy them from the base model")
    try:
        return load_tokenizer(where)
    except (OSError, ValueError) as e:
        raise UserError(f"model.path: {e}") from None


def check_prompt_lengths(examples: list, tokenizer, cfg: Config, split: str) -> None:
    """Prompts over data.max_prompt_length: dropped and counted when data.filter_overlong_prompts, else an error;
    an error too when nothing would be left."""
    from tlt.rl.data import chat_ids
    d = cfg.data
    too_long = [ex for ex in examples if len(chat_ids(tokenizer, ex.messages)) > d.max_prompt_length]
    if too_long and not d.filter_overlong_prompts:
        raise UserError(f"data.{split}_files: {len(too_long)} of {len(examples)} prompts are longer than "
                        f"data.max_prompt_length={d.max_prompt_length} tokens (the first is row index "
                        f"{too_long[0].index}): raise data.max_prompt_length or set data.filter_overlong_prompts=true")
    if len(too_long) == len(examples):
        raise UserError(f"data.{split}_files: every prompt is longer than data.max_prompt_length="
                        f"{d.max_prompt_length} tokens: raise data.max_prompt_length")


def check_reward_function(spec: str) -> None:
    """reward.custom_function imports and is a function of a shape tlt can call."""
    from tlt.rl.rewards import RewardError, load_custom_function
    try:
        load_custom_function(spec)
    except RewardError as e:
        raise UserError(f"reward.custom_function: {e}") from None
    except Exception as e:  # noqa: BLE001 - the user's module failed to import: say so, whatever it raised
        raise UserError(f"reward.custom_function: importing {spec.rpartition(':')[0]} failed with "
                        f"{type(e).__name__}: {e}") from None


def check_drafter_dir(path: str) -> None:
    where = Path(path)
    if not (where / "drafter.safetensors").is_file() or not (where / "drafter_config.json").is_file():
        raise UserError(f"speculative.model: {path} is not a drafter directory (drafter.safetensors + "
                        "drafter_config.json): build one with `tlt train-drafter --out DIR`, or set "
                        "speculative.model=null for the default model's warm-up drafter")


def checkpoint_bytes(model_path: str | None) -> int:
    """About one checkpoint's size: fp32 weights and AdamW's two moments, from the model's weight files (0 when
    unknown before the default model is converted)."""
    if model_path in (None, TINY_MODEL_NAME) or not Path(model_path).is_dir():
        return 0
    files = list(Path(model_path).glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    dtype = json.loads((Path(model_path) / "config.json").read_text()).get("torch_dtype", "float32")
    per_param = 2 if dtype in ("bfloat16", "float16") else 4
    return size * (4 // per_param) * 3


def check_output_dir(run_dir: Path, need_bytes: int) -> None:
    """The run directory can be created and written, and its disk holds at least one checkpoint."""
    key = "trainer.default_local_dir"
    existing = run_dir
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(f"{key}: {existing} is a file, not a directory: choose another {key}")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=run_dir, prefix=".tlt-write-check-"):
            pass
    except OSError as e:
        raise UserError(f"{key}: cannot write the run directory {run_dir} ({e.strerror or e}): choose a writable "
                        f"{key}") from None
    free = shutil.disk_usage(run_dir).free
    if need_bytes and free < need_bytes:
        raise UserError(f"{key}: {run_dir} has {free / 2**30:.1f} GiB free but one checkpoint needs about "
                        f"{need_bytes / 2**30:.1f} GiB: free space or choose another {key}")
