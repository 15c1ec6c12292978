"""Prompt rows from data files: read parquet/jsonl/json rows, parse them, apply the chat template.

Two row shapes are accepted:
- verl's schema: {data_source, prompt: [{role, content}, ...], ability, reward_model: {style, ground_truth},
  extra_info: {...}} (parquet or jsonl);
- plain jsonl: {prompt: "text", answer: "42"} (the string becomes one user message; `answer` the ground truth).
A malformed row raises `DataError` naming the file and the 1-based row number. RL batches them with
tlt.rl.data.PromptDataset; `tlt train-drafter` and tlt.rl.preflight read the same rows.
"""

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from tlt.schema import UserError

logger = logging.getLogger(__name__)

DEFAULT_DATA_SOURCE = "default"


class DataError(UserError, ValueError):
    """A data file is missing or one of its rows is malformed; the message names the file and row."""


@dataclass
class PromptExample:
    index: int  # position of the row among all rows of the files, before filtering
    data_source: str  # selects the reward function
    messages: list[dict[str, str]]  # chat messages [{role, content}, ...]
    ground_truth: str | list[str] | None  # None = no reference answer (reward decides what to do)
    extra_info: dict[str, Any] = field(default_factory=dict)
    prompt_ids: list[int] = field(default_factory=list)  # [prompt_len] tokens after the chat template
    ability: str = ""


# ---------------------------------------------------------------- reading rows


def _read_rows(path: str) -> list[tuple[int, Any]]:
    """(1-based row number, raw row) pairs; for jsonl the row number is the line number."""
    if not os.path.exists(path):
        raise DataError(f"data file not found: {path}")
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        return list(enumerate(pq.read_table(path).to_pylist(), start=1))
    if path.endswith(".json"):
        with open(path) as fh:
            try:
                rows = json.load(fh)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}: invalid JSON ({e}); use .jsonl for one object per line") from None
        if not isinstance(rows, list):
            raise DataError(f"{path}: a .json data file must hold a list of rows")
        return list(enumerate(rows, start=1))
    if path.endswith(".jsonl"):
        rows = []
        with open(path) as fh:
            for row_num, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    rows.append((row_num, json.loads(line)))
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}, row {row_num}: invalid JSON ({e})") from None
        return rows
    raise DataError(f"{path}: unsupported file type (expected .parquet, .jsonl or .json)")


def _ground_truth(value: Any) -> str | list[str] | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, (list, tuple)) and all(isinstance(v, (str, int, float)) for v in value):
        return [str(v) for v in value]
    raise TypeError(f"ground truth must be a string, number or list of them, got {type(value).__name__}")


def _parse_row(row: Any, index: int, prompt_key: str) -> PromptExample:
    """Turn one raw row into a PromptExample (without tokens); raises TypeError/KeyError on bad rows."""
    if not isinstance(row, dict):
        raise TypeError(f"row must be an object, got {type(row).__name__}")
    if row.get(prompt_key) is None:
        raise KeyError(f"missing '{prompt_key}' (columns present: {', '.join(map(str, row)) or 'none'})")
    prompt = row[prompt_key]
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, (list, tuple)) and prompt:
        messages = []
        for m in prompt:
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise TypeError(f"'{prompt_key}' must be a list of {{role: str, content: str}} messages, got {m!r}")
            messages.append({"role": m["role"], "content": m["content"]})
    else:
        raise TypeError(f"'{prompt_key}' must be a string or a non-empty list of chat messages, "
                        f"got {type(prompt).__name__}")
    reward_model = row.get("reward_model") or {}
    extra_info = row.get("extra_info") or {}
    if not isinstance(reward_model, dict):
        raise TypeError(f"'reward_model' must be an object {{style, ground_truth}}, got {type(reward_model).__name__}")
    if not isinstance(extra_info, dict):
        raise TypeError(f"'extra_info' must be an object, got {type(extra_info).__name__}")
    truth = reward_model.get("ground_truth", row.get("answer", row.get("ground_truth")))
    data_source = row.get("data_source") or DEFAULT_DATA_SOURCE
    if not isinstance(data_source, str):
        raise TypeError(f"'data_source' must be a string, got {type(data_source).__name__}")
    return PromptExample(index=index, data_source=data_source, messages=messages, ground_truth=_ground_truth(truth),
                         extra_info=dict(extra_info), ability=str(row.get("ability") or ""))


# ---------------------------------------------------------------- tokenising


def chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Prompt token ids via the chat template; plain text when the tokenizer has no template (base models)."""
    if getattr(tokenizer, "chat_template", None) is None:
        text = "\n".join(m["content"] for m in messages)
        return list(tokenizer(text, add_special_tokens=True)["input_ids"])
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(out, "keys"):  # transformers 5 returns a BatchEncoding; 4.x a list of ids
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    if out and isinstance(out[0], list):  # a batch of one
        out = out[0]
    return [int(t) for t in out]


def load_examples(paths: list[str], tokenizer: Any, prompt_key: str = "prompt", max_prompt_length: int = 512,
                  filter_overlong_prompts: bool = True) -> tuple[list[PromptExample], int]:
    """Read and tokenise every row of `paths`; returns (examples, number of overlong prompts dropped).

    With tokenizer=None rows are parsed but not tokenised (prompt_ids stay empty, nothing is filtered).
    """
    if isinstance(paths, str):
        paths = [paths]
    if tokenizer is not None and getattr(tokenizer, "chat_template", None) is None:
        logger.warning("tokenizer has no chat template: prompts are tokenised as plain text")
    examples, num_filtered, index = [], 0, 0
    for path in paths:
        for row_num, row in _read_rows(path):
            try:
                ex = _parse_row(row, index, prompt_key)
            except (TypeError, KeyError) as e:
                msg = e.args[0] if e.args else repr(e)
                raise DataError(f"{path}, row {row_num}: {msg}") from None
            index += 1
            if tokenizer is not None:
                ex.prompt_ids = chat_ids(tokenizer, ex.messages)
                if filter_overlong_prompts and len(ex.prompt_ids) > max_prompt_length:
                    num_filtered += 1
                    continue
            examples.append(ex)
    if num_filtered:
        logger.info("dropped %d prompts longer than max_prompt_length=%d", num_filtered, max_prompt_length)
    return examples, num_filtered
