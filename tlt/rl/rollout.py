"""Rollouts: sample G responses per prompt with tlt.LLM and hold them in typed batches.

`generate_rollouts` turns engine outputs into a `RolloutBatch` (python lists, one entry per response);
`RolloutBatch.to_actor_batch` pads them into the tensors the actor trains on (`ActorBatch`).

Sampling seeds are a deterministic function of (trainer seed, RL step, attempt, prompt position in the global
step batch): a resumed run samples exactly the tokens the uninterrupted run would have, and the tokens do not
depend on how the prompts are split over data-parallel ranks.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Sequence

import torch

from tlt.config import Config
from tlt.engine.outputs import RequestOutput
from tlt.engine.params import SamplingParams
from tlt.prompts import PromptExample


def rollout_seed(seed: int, step: int, attempt: int = 0) -> int:
    """Base seed of one rollout call: a hash of (seed, step, attempt), stable across runs and platforms."""
    digest = hashlib.sha256(f"tlt-rollout:{seed}:{step}:{attempt}".encode()).digest()
    return int.from_bytes(digest[:6], "little")  # < 2**48, leaves room for + prompt * n + sample


@dataclass
class RolloutBatch:
    """N = num_prompts * n responses; responses of one prompt are consecutive and share a group id."""
    examples: list[PromptExample]  # [N] the prompt (and ground truth) each response answers
    group_ids: list[int]  # [N] GRPO group = global index of the prompt within the step
    prompt_ids: list[list[int]]  # [N][prompt_len]
    response_ids: list[list[int]]  # [N][response_len]
    engine_log_probs: list[list[float]]  # [N][response_len] log softmax(logits / T) of each sampled token
    finish_reasons: list[str]  # [N] "stop" | "length"
    texts: list[str]  # [N] decoded responses (special tokens skipped)
    scores: list[float | None] = field(default_factory=list)  # [N] rewards, filled after scoring

    def __len__(self) -> int:
        return len(self.response_ids)

    @property
    def response_lengths(self) -> list[int]:
        return [len(r) for r in self.response_ids]

    @property
    def prompt_lengths(self) -> list[int]:
        return [len(p) for p in self.prompt_ids]

    def select(self, keep: Sequence[bool]) -> "RolloutBatch":
        """The responses where keep[i] is True (e.g. the groups DAPO dynamic sampling keeps)."""
        idx = [i for i, k in enumerate(keep) if k]
        pick = lambda xs: [xs[i] for i in idx]  # noqa: E731
        return RolloutBatch(pick(self.examples), pick(self.group_ids), pick(self.prompt_ids),
                            pick(self.response_ids), pick(self.engine_log_probs), pick(self.finish_reasons),
                            pick(self.texts), pick(self.scores) if self.scores else [])

    def first_groups(self, num_groups: int) -> "RolloutBatch":
        """The responses of the first `num_groups` distinct groups."""
        kept = set(list(dict.fromkeys(self.group_ids))[:num_groups])
        return self.select([g in kept for g in self.group_ids])

    @staticmethod
    def concat(batches: Sequence["RolloutBatch"]) -> "RolloutBatch":
        out = RolloutBatch([], [], [], [], [], [], [], [])
        for b in batches:
            for name in ("examples", "group_ids", "prompt_ids", "response_ids", "engine_log_probs",
                         "finish_reasons", "texts", "scores"):
                getattr(out, name).extend(getattr(b, name))
        return out

    def to_actor_batch(self, advantages: torch.Tensor, loss_mask: torch.Tensor, temperature: float,
                       device: torch.device | str = "cpu") -> "ActorBatch":
        """Right-padded prompt+response rows plus response-aligned [N, R] tensors (R = longest response)."""
        n = len(self)
        seq_lens = [len(p) + len(r) for p, r in zip(self.prompt_ids, self.response_ids)]
        max_seq, max_resp = max(seq_lens, default=1), max(self.response_lengths, default=1)
        input_ids = torch.zeros(n, max_seq, dtype=torch.long)
        response_mask = torch.zeros(n, max_resp)
        old_log_probs = torch.zeros(n, max_resp)
        for i, (p, r, lp) in enumerate(zip(self.prompt_ids, self.response_ids, self.engine_log_probs)):
            input_ids[i, :len(p) + len(r)] = torch.tensor(p + r, dtype=torch.long)
            response_mask[i, :len(r)] = 1.0
            old_log_probs[i, :len(r)] = torch.tensor(lp, dtype=torch.float32)
        # Masked-out responses (missing reward, DAPO overlong filter) keep their tokens but add nothing to the loss.
        response_mask = response_mask * loss_mask.float()[:, None]
        return ActorBatch(input_ids=input_ids.to(device), prompt_lens=torch.tensor(self.prompt_lengths).to(device),
                          response_lens=torch.tensor(self.response_lengths).to(device),
                          response_mask=response_mask.to(device), old_log_probs=old_log_probs.to(device),
                          advantages=(advantages.float()[:, None] * response_mask).to(device),
                          group_ids=torch.tensor(self.group_ids).to(device), temperature=temperature)


@dataclass
class ActorBatch:
    """Tensors of one step's responses for the actor; N rows, T = longest prompt+response, R = longest response.

    Rows are right padded: under causal attention a real token never sees the padding after it, so no attention
    mask is needed and positions are simply 0..T-1.
    """
    input_ids: torch.Tensor  # [N, T] long: prompt tokens then response tokens, then 0 padding
    prompt_lens: torch.Tensor  # [N] long
    response_lens: torch.Tensor  # [N] long
    response_mask: torch.Tensor  # [N, R] float: 1 on response tokens that count in the loss
    old_log_probs: torch.Tensor  # [N, R] float: log-prob of each response token under the rollout policy
    advantages: torch.Tensor  # [N, R] float: the response's advantage on its tokens, 0 elsewhere
    group_ids: torch.Tensor  # [N] long
    temperature: float  # logits are divided by it, as the engine did for its log-probs
    ref_log_probs: torch.Tensor | None = None  # [N, R] float, when actor.use_kl_loss

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def rows(self, idx: Sequence[int]) -> "ActorBatch":
        """A sub-batch of rows, trimmed to its own longest sequence and response."""
        index = torch.as_tensor(list(idx), dtype=torch.long, device=self.input_ids.device)
        if len(index) == 0:
            return ActorBatch(self.input_ids[:0, :1], self.prompt_lens[:0], self.response_lens[:0],
                              self.response_mask[:0, :1], self.old_log_probs[:0, :1], self.advantages[:0, :1],
                              self.group_ids[:0], self.temperature, None)
        t = int((self.prompt_lens[index] + self.response_lens[index]).max())
        r = max(int(self.response_lens[index].max()), 1)
        ref = None if self.ref_log_probs is None else self.ref_log_probs[index, :r]
        return ActorBatch(self.input_ids[index, :t], self.prompt_lens[index], self.response_lens[index],
                          self.response_mask[index, :r], self.old_log_probs[index, :r], self.advantages[index, :r],
                          self.group_ids[index], self.temperature, ref)


def rollout_request(batch: Sequence[PromptExample], cfg: Config, step: int, attempt: int, rank: int, per_rank: int,
                    return_hidden_states: bool = False) -> tuple[list[PromptExample], list[SamplingParams]]:
    """This rank's share of a step's global prompt batch and their sampling params: the config's rollout settings,
    the seeds of (trainer.seed, step, attempt)."""
    r = cfg.rollout
    prompts = list(batch[rank * per_rank:(rank + 1) * per_rank])  # the same global batch on every rank
    params = sampling_params_for(len(prompts), r.n, r.temperature, r.top_p, r.top_k, cfg.data.max_response_length,
                                 rollout_seed(cfg.trainer.seed, step, attempt), first_prompt=rank * per_rank,
                                 return_hidden_states=return_hidden_states)
    return prompts, params


def sampling_params_for(num_prompts: int, n: int, temperature: float, top_p: float, top_k: int, max_tokens: int,
                        base_seed: int, first_prompt: int, return_hidden_states: bool = False) -> list[SamplingParams]:
    """One SamplingParams per prompt; sample i of global prompt j uses seed base_seed + j * n + i."""
    return [SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens,
                           seed=base_seed + (first_prompt + j) * n, return_hidden_states=return_hidden_states)
            for j in range(num_prompts)]


def generate_rollouts(llm, examples: Sequence[PromptExample], params: list[SamplingParams],
                      first_group_id: int) -> tuple[RolloutBatch, list[RequestOutput]]:
    """Sample params[j].n responses for each example; group ids are first_group_id + j (global prompt index)."""
    group_ids = [first_group_id + j for j in range(len(examples))]
    outputs = llm.generate(prompt_token_ids=[ex.prompt_ids for ex in examples], sampling_params=params,
                           group_ids=group_ids)
    batch = RolloutBatch([], [], [], [], [], [], [], [])
    for ex, gid, out in zip(examples, group_ids, outputs):
        for completion in out.outputs:
            batch.examples.append(ex)
            batch.group_ids.append(gid)
            batch.prompt_ids.append(list(ex.prompt_ids))
            batch.response_ids.append(list(completion.token_ids))
            batch.engine_log_probs.append(list(completion.logprobs))
            batch.finish_reasons.append(completion.finish_reason)
            batch.texts.append(completion.text)
    return batch, outputs
