"""SamplingParams in vLLM's shape, validated at construction."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SamplingParams:
    n: int = 1                              # samples per prompt (they share a group id: GRPO's G)
    temperature: float = 1.0                # 0 = greedy
    top_p: float = 1.0                      # 1 = off
    top_k: int = -1                         # -1 or 0 = off
    max_tokens: int = 16
    stop_token_ids: list[int] | None = None  # besides the tokenizer's EOS
    ignore_eos: bool = False
    seed: int | None = None                 # per-request seed: output independent of batch composition
    logprobs: int | None = None             # vLLM compatibility; the sampled token's logprob is always returned
    return_hidden_states: bool = False      # keep the last-layer hidden state that produced each output token

    def __post_init__(self):
        def bad(name, value, allowed):
            raise ValueError(f"SamplingParams.{name}={value!r} is invalid: {allowed}")
        if not isinstance(self.n, int) or self.n < 1:
            bad("n", self.n, "use an integer >= 1")
        if self.temperature < 0:
            bad("temperature", self.temperature, "use 0 for greedy or a value > 0")
        if not 0 < self.top_p <= 1:
            bad("top_p", self.top_p, "use a value in (0, 1]; 1 disables it")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", self.top_k, "use -1 (or 0) to disable, or an integer >= 1")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", self.max_tokens, "use an integer >= 1")
        if self.stop_token_ids is not None and not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", self.stop_token_ids, "use a list of non-negative token ids")
        if self.top_k == 0:
            self.top_k = -1
