"""Prompt datasets for RL: batches of prompt rows (tlt.prompts) with a shuffle that resumes from a checkpoint."""

import logging
import random
from typing import Any, Iterator, Literal

from tlt.config import DataConfig
from tlt.prompts import DataError, PromptExample, load_examples

logger = logging.getLogger(__name__)


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
