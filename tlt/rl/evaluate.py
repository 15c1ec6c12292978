"""Accuracy of a policy on a prompt dataset: mean@k and pass@k (unbiased estimator), response lengths.

    tlt eval runs/tlt/default/global_step_20 data.val_files=val.parquet rollout.n=8

The checkpoint's own config.yaml (when present) is the base, then the overrides. Rewards are scored without the
format bonus (reward.format_weight is set to 0): accuracy/mean@k is the mean task score over the k samples of
every prompt, and a sample counts as correct for pass@k when its score is >= 1. Prints one JSON line.
"""
from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
from math import comb
from pathlib import Path
from typing import Sequence

import numpy as np

from tlt.config import Config, ConfigError, load_config
from tlt.device import DTYPES, resolve_device
from tlt.llm import LLM
from tlt.models.loader import load_model, load_tokenizer
from tlt.prompts import PromptExample, load_examples
from tlt.rl.checkpoint import CONFIG_FILE
from tlt.rl.rewards import RewardManager
from tlt.rl.rollout import generate_rollouts, rollout_seed, sampling_params_for


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per prompt, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


@dataclass
class EvalResult:
    num_prompts: int
    n: int  # samples per prompt
    accuracy: float  # mean@n: mean score over all samples
    pass_at_k: dict[int, float]  # k -> unbiased pass@k, for k in 1, 2, 4, ... <= n
    response_length_mean: float
    response_length_max: int
    response_length_min: int
    clip_ratio: float  # fraction of responses cut at the max length
    num_reward_errors: int

    def to_json(self) -> str:
        return json.dumps({**dataclasses.asdict(self), "pass_at_k": {str(k): v for k, v in self.pass_at_k.items()}})


def evaluate(llm, examples: Sequence[PromptExample], rewards: RewardManager, n: int = 1, temperature: float = 0.0,
             top_p: float = 1.0, top_k: int = -1, max_tokens: int = 256, seed: int = 0,
             batch_size: int | None = None) -> EvalResult:
    """Sample n responses per example (greedy when temperature is 0), score them, aggregate."""
    scores: list[float] = []
    lengths: list[int] = []
    finish: list[str] = []
    num_errors = 0
    batch_size = batch_size or len(examples)
    base = rollout_seed(seed, step=-1)  # evaluation draws its own seeds, never a training step's
    for start in range(0, len(examples), batch_size):
        chunk = list(examples[start:start + batch_size])
        params = sampling_params_for(len(chunk), n, temperature, top_p, top_k, max_tokens, base, start)
        batch, _ = generate_rollouts(llm, chunk, params, first_group_id=start)
        result = rewards.score(batch.examples, batch.texts)
        num_errors += result.num_errors
        scores += [0.0 if s is None else s for s in result.scores]
        lengths += batch.response_lengths
        finish += batch.finish_reasons
    per_prompt = np.asarray(scores, dtype=np.float64).reshape(len(examples), n)
    correct = (per_prompt >= 1.0).sum(axis=1)
    ks = [k for k in (1, 2, 4, 8, 16, 32, 64, 128) if k <= n]
    return EvalResult(
        num_prompts=len(examples), n=n, accuracy=float(per_prompt.mean()),
        pass_at_k={k: float(np.mean([pass_at_k(n, int(c), k) for c in correct])) for k in ks},
        response_length_mean=float(np.mean(lengths)), response_length_max=int(max(lengths)),
        response_length_min=int(min(lengths)), clip_ratio=float(np.mean([f == "length" for f in finish])),
        num_reward_errors=num_errors)


def _load_eval_config(checkpoint: str, overrides: list[str]) -> Config:
    saved = Path(checkpoint) / CONFIG_FILE
    cfg = load_config(str(saved) if saved.is_file() else None, overrides)
    if not cfg.data.val_files:
        raise ConfigError("tlt eval needs a dataset: add data.val_files=path/to/val.parquet (or .jsonl)")
    return cfg


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or "=" in argv[0] or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    checkpoint, overrides = argv[0], argv[1:]
    if not (Path(checkpoint) / "config.json").is_file():
        print(f"tlt eval: {checkpoint} is not a model directory (no config.json): pass a global_step_N checkpoint "
              f"or an HF model directory", file=sys.stderr)
        return 2
    try:
        cfg = _load_eval_config(checkpoint, overrides)
    except ConfigError as e:
        print(f"tlt eval: {e}", file=sys.stderr)
        return 2
    from tlt.models.weights_check import check_model_weights
    check_model_weights(checkpoint, "Evaluate another checkpoint, or copy this one again")  # before loading it
    device = resolve_device(cfg.model.device)
    model = load_model(checkpoint, dtype=DTYPES[cfg.policy_dtype()], device=str(device))
    tokenizer = load_tokenizer(checkpoint)
    d, r = cfg.data, cfg.rollout
    examples, num_filtered = load_examples(d.val_files, tokenizer, d.prompt_key, d.max_prompt_length,
                                           d.filter_overlong_prompts)
    llm = LLM(model=model, tokenizer=tokenizer, **cfg.engine_args())
    rewards = RewardManager(dataclasses.replace(cfg.reward, format_weight=0.0))
    result = evaluate(llm, examples, rewards, n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                      max_tokens=d.max_response_length, seed=cfg.trainer.seed, batch_size=d.val_batch_size)
    if num_filtered:
        print(f"tlt eval: {num_filtered} overlong prompts were left out", file=sys.stderr)
    print(result.to_json(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
