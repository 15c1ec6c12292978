"""Prompt datasets for RL: read parquet/jsonl rows, apply the chat template, batch with a resumable shuffle.

Two row shapes are accepted:
- verl's schema: {data_source, prompt: [{role, content}, ...], ability, reward_model: {style, ground_truth},
  extra_info: {...}} (parquet or jsonl);
- plain jsonl: {prompt: "text", answer: "42"} (the string becomes one user message; `answer` the ground truth).
A malformed row raises `DataError` naming the file and the 1-based row number.
"""

import json
import logging
import os
import random
from dataclasses import dataclass, field
from typing import Any, Iterator, Literal

from tlt.config import DataConfig
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


# ---------------------------------------------------------------- batching


class PromptDataset:
    """Batches of `batch_size` examples, reshuffled each epoch from (seed, epoch); resumable.

    `next_batch()` is the training stream: it never ends, drops an epoch's incomplete last batch (every step
    sees full batches) and moves to the next epoch. `iter_batches()` walks the data once in file order
    (validation), last batch included.
    """

    def __init__(self, examples: list[PromptExample], batch_size: int | None, shuffle: bool = True, seed: int = 0,
                 num_filtered: int = 0):
        if not examples:
            raise DataError("dataset is empty (no rows, or every prompt was filtered as overlong)")
        batch_size = len(examples) if batch_size is None else batch_size  # None: one batch of everything
        if batch_size < 1 or batch_size > len(examples):
            raise DataError(f"batch_size={batch_size} must be in [1, {len(examples)}] (number of examples)")
        self.examples = examples
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.num_filtered = num_filtered  # overlong prompts dropped at load, for the trainer to log
        self.epoch = 0
        self.position = 0  # index into this epoch's order of the next example to serve

    @classmethod
    def from_files(cls, paths: list[str], tokenizer: Any, batch_size: int | None, *, prompt_key: str = "prompt",
                   max_prompt_length: int = 512, filter_overlong_prompts: bool = True, shuffle: bool = True,
                   seed: int = 0) -> "PromptDataset":
        examples, num_filtered = load_examples(paths, tokenizer, prompt_key, max_prompt_length,
                                               filter_overlong_prompts)
        return cls(examples, batch_size, shuffle=shuffle, seed=seed, num_filtered=num_filtered)

    @classmethod
    def from_config(cls, cfg: DataConfig, tokenizer: Any, split: Literal["train", "val"] = "train") -> "PromptDataset":
        """The train (shuffled, train_batch_size) or val (file order, val_batch_size) dataset of a data config."""
        train = split == "train"
        return cls.from_files(cfg.train_files if train else cfg.val_files, tokenizer,
                              cfg.train_batch_size if train else cfg.val_batch_size, prompt_key=cfg.prompt_key,
                              max_prompt_length=cfg.max_prompt_length,
                              filter_overlong_prompts=cfg.filter_overlong_prompts, shuffle=cfg.shuffle and train,
                              seed=cfg.seed)

    def __len__(self) -> int:
        return len(self.examples)

    @property
    def steps_per_epoch(self) -> int:
        return len(self.examples) // self.batch_size

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.examples)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next_batch(self) -> list[PromptExample]:
        self.epoch, self.position = self._next_start()
        batch = self.peek_batch()
        self.position += self.batch_size
        return batch

    def peek_batch(self) -> list[PromptExample]:
        """The batch next_batch() would return, without moving the stream."""
        epoch, position = self._next_start()
        order = self._order(epoch)
        return [self.examples[i] for i in order[position:position + self.batch_size]]

    def _next_start(self) -> tuple[int, int]:
        """(epoch, position) of the next batch: the next epoch's start when this one has no full batch left."""
        if self.position + self.batch_size > len(self.examples):
            return self.epoch + 1, 0
        return self.epoch, self.position

    def iter_batches(self, batch_size: int | None = None) -> Iterator[list[PromptExample]]:
        size = batch_size or self.batch_size
        for start in range(0, len(self.examples), size):
            yield self.examples[start:start + size]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.position, "seed": self.seed, "num_examples": len(self)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("num_examples", len(self)) != len(self):
            logger.warning("dataset size changed since the checkpoint (%s -> %d); resuming position anyway",
                           state.get("num_examples"), len(self))
        self.epoch, self.position = int(state["epoch"]), int(state["index"])
