"""Sequence: the state of one generated sample as it moves through the scheduler."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from tlt.engine.params import SamplingParams


class Status(enum.Enum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


@dataclass
class Sequence:
    seq_id: int
    request_id: int
    sample_index: int                 # which of the request's n samples
    group_id: int                     # samples of one prompt share it (GRPO group; n-gram siblings)
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator        # this sample's own RNG: seeded requests reproduce in any batch
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    hidden: list[torch.Tensor] = field(default_factory=list)  # [H] per output token from hidden_start on, when kept
    hidden_start: int = 0             # output index of hidden[0]: the speculator may stop and resume the capture
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" | "length"
    slot: int = -1                    # KV-cache slot while running
    num_cached: int = 0               # tokens whose K/V are in the cache
    max_model_len: int | None = None  # the engine's context limit: generation stops there whatever max_tokens
    # kept while running, for a drafter: the target's hidden state at every position [max_total_len + headroom, H]
    # (zeros where none was kept), and how many positions the drafter's cache holds (1..draft_cached)
    hidden_record: torch.Tensor | None = None
    draft_cached: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def max_total_len(self) -> int:
        """Worst-case length: what the scheduler reserves KV cache for (a huge max_tokens means "until EOS")."""
        n = len(self.prompt_ids) + self.params.max_tokens
        return n if self.max_model_len is None else min(n, self.max_model_len)

    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids
