"""Checks a run's inputs before any expensive work: the data files (every row), the model directory (its weights
against its config) and tokenizer, the reward function, the drafter directory and the output directory; then
claims the run directory and verifies the checkpoint it resumes from.

`tlt train` calls `check_run(cfg)` right after the config loads, and `claim_run_dir(cfg, owner)` once it knows its
rank, both before the default model is converted, the warm-up drafter is built, Ray starts or a rollout runs. Each
problem is a `UserError` whose message names the file, row or key and says what to do; the command line prints it
without a traceback and exits with code 2.
"""
from __future__ import annotations

import json
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tlt.config import Config, TrainerConfig
from tlt.integrity import CorruptFileError
from tlt.models import flex, smollm
from tlt.models.config import ModelConfig
from tlt.models.loader import load_tokenizer, weight_files
from tlt.models.weights_check import check_model_weights
from tlt.prompts import DataError, chat_ids, load_examples
from tlt.rl.rewards import RewardError, load_custom_function
from tlt.rl.run_lock import RunLock
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
    t = cfg.trainer
    check_output_dir(run_dir_of(cfg), checkpoint_bytes(cfg), checkpoints_held(t))


def run_dir_of(cfg: Config) -> Path:
    t = cfg.trainer
    return Path(t.default_local_dir) / t.project_name / t.experiment_name


@dataclass
class RunDir:
    lock: RunLock | None     # held while the run lives (the owner's; None on the other ranks)
    resume_dir: Path | None  # the verified checkpoint trainer.resume names, or None: start fresh


def claim_run_dir(cfg: Config, owner: bool) -> RunDir:
    """The owner (the process `tlt train` started: rank 0, or the launcher of placed ranks) locks the run directory
    (tlt.rl.run_lock), then every rank finds the checkpoint it resumes from, verified (tlt.rl.checkpoint): the
    newest one that verifies for trainer.resume=auto, an error naming the bad file for a directory."""
    from tlt.rl.checkpoint import CheckpointManager
    run_dir = run_dir_of(cfg)
    lock = RunLock(run_dir).acquire() if owner else None
    try:
        resume_dir = CheckpointManager(run_dir).resolve_resume(cfg.trainer.resume, set_aside=owner)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return RunDir(lock, resume_dir)


def check_attention_backend(name: str) -> None:
    """rollout.attention=flex needs FlexAttention in this torch (auto falls back to sdpa by itself)."""
    if name == "flex" and not flex.flex_available():
        raise UserError("rollout.attention=flex: this torch has no torch.nn.attention.flex_attention (it needs "
                        "torch >= 2.5); set rollout.attention=auto or sdpa")


def check_data_files(paths: list[str], prompt_key: str, key: str) -> list:
    """Every row of every file parsed and checked against the schema (tlt.prompts' own row parser)."""
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
    where = Path(path)
    fix = "set model.path to an HF model directory (config.json + *.safetensors), or null for the default model"
    if not where.is_dir():
        raise UserError(f"model.path: {path} is not a directory: {fix}")
    try:
        hf = json.loads((where / "config.json").read_text())
        ModelConfig.from_hf(hf)
        weight_files(where)
        check_model_weights(where, "Copy the model again, or set model.path to a whole HF model directory")
    except CorruptFileError as e:
        raise UserError(f"model.path: {e}") from None
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
    try:
        load_custom_function(spec)
    except RewardError as e:
        raise UserError(f"reward.custom_function: {e}") from None
    except Exception as e:  # noqa: BLE001 - the user's module failed to import: say so, whatever it raised
        raise UserError(f"reward.custom_function: importing {spec.rpartition(':')[0]} failed with "
                        f"{type(e).__name__}: {e}") from None


def check_drafter_dir(path: str) -> None:
    """A drafter directory whose files are whole and whose weights have the shapes its config implies."""
    from tlt.speculative.drafter_io import check_drafter_dir as check_files
    where = Path(path)
    if not (where / "drafter.safetensors").is_file() or not (where / "drafter_config.json").is_file():
        raise UserError(f"speculative.model: {path} is not a drafter directory (drafter.safetensors + "
                        "drafter_config.json): build one with `tlt train-drafter --out DIR`, or set "
                        "speculative.model=null for the default model's warm-up drafter")
    try:
        check_files(where, "Copy the drafter again, build one with `tlt train-drafter --out DIR`, or set "
                           "speculative.model=null for the default model's warm-up drafter")
    except CorruptFileError as e:
        raise UserError(f"speculative.model: {e}") from None


def model_size(model_path: str | None) -> tuple[int, int]:
    """(parameters, hidden size) from the model directory's weight files and config.json without loading them; the
    default model's (null) from its known size until it is converted; (0, 0) when unknown."""
    if model_path is None:
        if not smollm.is_converted(smollm.cache_dir()):
            return smollm.NUM_PARAMETERS, smollm.HIDDEN_SIZE
        model_path = str(smollm.cache_dir())
    if model_path == TINY_MODEL_NAME or not Path(model_path).is_dir():
        return 0, 0
    hf = json.loads((Path(model_path) / "config.json").read_text())
    per_param = 2 if hf.get("torch_dtype", hf.get("dtype", "float32")) in ("bfloat16", "float16") else 4
    size = sum(f.stat().st_size for f in Path(model_path).glob("*.safetensors"))
    return size // per_param, int(hf.get("hidden_size", 0))


def checkpoint_bytes(cfg: Config) -> int:
    """About one checkpoint's size: fp32 weights and AdamW's two moments, and the online drafter's hidden-state
    buffer (trainer.save_drafter_buffer) as full as the run can fill it. 0 when unknown."""
    params, hidden = model_size(cfg.model.path)
    size = 3 * 4 * params
    s, d = cfg.speculative, cfg.data
    if cfg.trainer.save_drafter_buffer and cfg.drafter_train.enabled and s.enabled and s.method == "eagle":
        run_tokens = cfg.trainer.total_steps * d.train_batch_size * cfg.rollout.n * (
            d.max_prompt_length + d.max_response_length)
        size += min(cfg.drafter_train.buffer_max_tokens, run_tokens) * (2 * hidden + 8)  # bf16 rows + token ids
    return size


def checkpoints_held(t: TrainerConfig) -> int:
    """The most checkpoints a run's disk holds at once: every save (trainer.save_freq and the last step), or
    trainer.max_ckpt_to_keep plus the one being written before the oldest is rotated out."""
    saves = t.total_steps // t.save_freq + (t.total_steps % t.save_freq != 0) if t.save_freq > 0 else 1
    return saves if t.max_ckpt_to_keep is None else min(saves, t.max_ckpt_to_keep + 1)


def check_output_dir(run_dir: Path, need_bytes: int, held: int = 1) -> None:
    """The run directory can be created and written, and its disk holds one checkpoint (else an error) and the
    `held` checkpoints the run keeps at once (else a warning: checkpoints already there may be rotated out)."""
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
        raise UserError(f"{key}: {run_dir} has {gib(free)} free but one checkpoint needs about {gib(need_bytes)}: "
                        f"free space or choose another {key}")
    if need_bytes and free < held * need_bytes:
        fits = free // need_bytes  # keeping k needs room for k + 1 while the newest is written
        fix = f"trainer.max_ckpt_to_keep={fits - 1}" if fits > 1 else "trainer.save_freq=-1 (one checkpoint, the last)"
        print(f"tlt: warning: {run_dir} has {gib(free)} free; the run keeps up to {held} checkpoints of about "
              f"{gib(need_bytes)}: set {fix}, or free space", file=sys.stderr, flush=True)


def gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.1f} GiB"
