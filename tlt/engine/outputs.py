"""Request outputs in vLLM's shape: RequestOutput.outputs[i] is a CompletionOutput."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float]            # target log-prob of each sampled token (softmax(logits / T))
    finish_reason: str               # "stop" | "length"
    cumulative_logprob: float = 0.0
    hidden_states: torch.Tensor | None = None  # [len(token_ids) - hidden_start, H] bf16: state that produced each
                                               # token from hidden_start on
    hidden_start: int = 0            # first token with a kept state (> 0 where the speculator stopped the capture)


@dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    group_id: int | None = None
    finished: bool = True
