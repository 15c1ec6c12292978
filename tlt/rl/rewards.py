"""Reward functions: a registry keyed by data_source, a math-verify scorer, and a RewardManager that scores batches.

Three function shapes are accepted (detected from the signature):
- verl:  compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | {"score": ..., ...}
- TRL:   reward_func(prompts, completions, **kwargs) -> list[float | None]   (batched; kwargs carry ground_truth,
         answer (same values), data_source, extra_info, prompt_messages). prompts and completions are plain strings.
- custom: "path/to/file.py:function_name" (either shape), set as reward.custom_function for every data_source.

Every call runs in a daemon thread with a timeout: a scorer that raises or runs past the timeout scores 0 and is
counted as an error (message names the data_source and the exception). A timed-out thread cannot be killed; it is
left to finish in the background, and because it is a daemon it never blocks the run or interpreter exit.
math-verify's own timeouts use signal.alarm (main thread only), so they are disabled here and ours applies.
"""

import importlib.util
import inspect
import logging
import math
import numbers
import os
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Sequence

from math_verify import parse, verify

from tlt.config import RewardConfig
from tlt.rl.data import PromptExample
from tlt.tasks import SCORERS as TASK_SCORERS

# We disable math-verify's signal-based timeouts (they break outside the main thread) and bound every scorer with
# our own thread timeout instead; its one-time warning about that would only confuse users.
for _name in ("math_verify.grader", "math_verify.parser"):
    logging.getLogger(_name).setLevel(logging.ERROR)

logger = logging.getLogger(__name__)

Shape = Literal["verl", "trl"]
MAX_LOGGED_ERRORS = 3  # per score() call; all errors are still counted


class RewardError(RuntimeError):
    """A reward function failed and reward.errors_fatal is set, or a function has an unknown shape."""


class RewardTimeout(TimeoutError):
    pass


@dataclass
class RewardFn:
    fn: Callable[..., Any]
    shape: Shape
    name: str


_REGISTRY: dict[str, RewardFn] = {}


def detect_shape(fn: Callable[..., Any]) -> Shape:
    """'trl' if the function takes `completions`, 'verl' if it takes solution_str or >= 3 positional args."""
    params = inspect.signature(fn).parameters
    if "completions" in params:
        return "trl"
    positional = [p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    has_varargs = any(p.kind == p.VAR_POSITIONAL for p in params.values())
    if "solution_str" in params or len(positional) >= 3 or has_varargs:
        return "verl"
    raise RewardError(f"cannot tell the shape of reward function {getattr(fn, '__name__', fn)}{inspect.signature(fn)}:"
                      " use verl's (data_source, solution_str, ground_truth, extra_info=None) or TRL's"
                      " (prompts, completions, **kwargs)")


def register_reward(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: use this function for rows whose data_source is `name` ("default" = the fallback; a name ending
    in "*" matches every data_source with that prefix, e.g. "tlt/*")."""
    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        if name in _REGISTRY and _REGISTRY[name].fn is not fn:
            logger.warning("reward for data_source '%s' re-registered: %s replaces %s", name, fn, _REGISTRY[name].fn)
        _REGISTRY[name] = RewardFn(fn, detect_shape(fn), name)
        return fn
    return wrap


def get_reward_fn(data_source: str) -> RewardFn:
    """Exact name, else the longest matching "prefix*" registration, else "default"."""
    if data_source in _REGISTRY:
        return _REGISTRY[data_source]
    prefixes = [k for k in _REGISTRY if k.endswith("*") and data_source.startswith(k[:-1])]
    return _REGISTRY[max(prefixes, key=len)] if prefixes else _REGISTRY["default"]


def load_custom_function(spec: str) -> RewardFn:
    """Load `path/to/file.py:function_name`; errors say what is missing."""
    path, sep, name = spec.rpartition(":")
    if not sep or not path.endswith(".py") or not name:
        raise RewardError(f"custom reward '{spec}' must look like 'path/to/file.py:function_name'")
    if not os.path.exists(path):
        raise RewardError(f"custom reward file not found: {path}")
    stem = os.path.splitext(os.path.basename(path))[0]
    module_spec = importlib.util.spec_from_file_location(f"tlt_custom_reward_{stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if not callable(fn):
        found = [k for k, v in vars(module).items() if callable(v) and not k.startswith("_")]
        raise RewardError(f"{path} has no function '{name}' (functions found: {', '.join(found) or 'none'})")
    return RewardFn(fn, detect_shape(fn), f"{os.path.basename(path)}:{name}")


def call_with_timeout(fn: Callable[..., Any], timeout_s: float, *args: Any, **kwargs: Any) -> Any:
    """fn(*args, **kwargs) in a daemon thread; RewardTimeout if it runs longer than timeout_s."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn(*args, **kwargs)
        except Exception as e:  # re-raised in the caller's thread below
            box["error"] = e

    thread = threading.Thread(target=target, daemon=True, name="tlt-reward")
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise RewardTimeout(f"timed out after {timeout_s:g}s")
    if "error" in box:
        raise box["error"]
    if "value" not in box:
        raise RewardError("reward function exited without returning a value")
    return box["value"]


# ---------------------------------------------------------------- built-in math scorer


def last_boxed(text: str) -> str | None:
    """Content of the last balanced \\boxed{...} (or \\fbox{...}) in text, or None."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, begin = 1, i
    while i < len(text):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[begin:i].strip()
        i += 1
    return None  # unbalanced: no final answer


def boxed_format_score(text: str) -> float:
    """1.0 if the response ends its reasoning with a non-empty \\boxed{answer}, else 0.0."""
    return 1.0 if last_boxed(text) else 0.0


@register_reward("default")
@register_reward("math")
def math_score(data_source: str, solution_str: str, ground_truth: str | list[str] | None,
               extra_info: dict | None = None) -> float | None:
    """1.0 if the last \\boxed{} (or, without one, the final answer math-verify finds) equals the ground truth."""
    if ground_truth is None:
        return None
    boxed = last_boxed(solution_str)
    pred = parse("\\boxed{" + boxed + "}" if boxed else solution_str, parsing_timeout=None)
    if not pred:
        return 0.0
    truths = ground_truth if isinstance(ground_truth, list) else [ground_truth]
    for truth in truths:
        gold = parse(truth if ("\\boxed" in truth or "$" in truth) else "\\boxed{" + truth + "}",
                     parsing_timeout=None)
        if gold and verify(gold, pred, timeout_seconds=None):
            return 1.0
    return 0.0


for _pattern, _fn in TASK_SCORERS.items():  # the built-in tasks' own scorers, e.g. "tlt/*"
    register_reward(_pattern)(_fn)


# ---------------------------------------------------------------- manager


@dataclass
class RewardResult:
    scores: list[float | None]  # [num_responses]; None = no ground truth (excluded from advantages)
    metrics: dict[str, float]  # reward/mean, reward/<data_source>/mean, reward/num_errors, ...
    num_errors: int
    error_messages: list[str] = field(default_factory=list)
    extra: list[dict[str, Any]] = field(default_factory=list)  # extra keys of dict-valued scores, per response


def _to_score(value: Any) -> tuple[float | None, dict[str, Any]]:
    extra: dict[str, Any] = {}
    if isinstance(value, dict):
        if "score" not in value:
            raise RewardError(f"dict reward must have a 'score' key, got keys {sorted(value)}")
        extra = {k: v for k, v in value.items() if k != "score"}
        value = value["score"]
    if value is None:
        return None, extra
    if not isinstance(value, numbers.Real):  # int, float, bool, numpy scalars
        raise RewardError(f"reward must be a number, None or a dict with 'score', got {type(value).__name__}")
    if not math.isfinite(float(value)):
        raise RewardError(f"reward is not finite: {value}")
    return float(value), extra


class RewardManager:
    """Scores (example, response) pairs with the data_source's reward function, a timeout and error counting."""

    def __init__(self, cfg: RewardConfig | None = None,
                 format_fn: Callable[[str], float] = boxed_format_score):
        self.cfg = cfg or RewardConfig()
        self.format_fn = format_fn
        self.custom = load_custom_function(self.cfg.custom_function) if self.cfg.custom_function else None
        self.total_errors = 0  # over the manager's lifetime

    def _fn_for(self, data_source: str) -> RewardFn:
        return self.custom or get_reward_fn(data_source)

    def score(self, examples: Sequence[PromptExample], responses: Sequence[str]) -> RewardResult:
        if len(examples) != len(responses):
            raise ValueError(f"{len(examples)} examples but {len(responses)} responses")
        scores: list[float | None] = [None] * len(examples)
        extra: list[dict[str, Any]] = [{} for _ in examples]
        failed: list[tuple[int, str, bool]] = []  # (response index, message, timed out)
        by_source: dict[str, list[int]] = defaultdict(list)
        for i, ex in enumerate(examples):
            by_source[ex.data_source].append(i)

        for source, idx in by_source.items():
            rfn = self._fn_for(source)
            if rfn.shape == "trl":
                self._score_batched(rfn, source, idx, examples, responses, scores, extra, failed)
                continue
            for i in idx:
                ex = examples[i]
                try:
                    value = call_with_timeout(rfn.fn, self.cfg.timeout_s, source, responses[i], ex.ground_truth,
                                              ex.extra_info)
                    scores[i], extra[i] = _to_score(value)
                except Exception as e:  # any scorer failure scores 0; see module docstring
                    failed.append((i, self._error(rfn, source, e), isinstance(e, RewardTimeout)))

        if self.cfg.format_weight:
            for i, s in enumerate(scores):
                if s is not None:
                    scores[i] = s + self.cfg.format_weight * self.format_fn(responses[i])
        for i, _, _ in failed:
            scores[i] = 0.0  # a failed scorer gives exactly 0, format reward included
        return self._result(examples, scores, extra, failed)

    def _score_batched(self, rfn: RewardFn, source: str, idx: list[int], examples: Sequence[PromptExample],
                       responses: Sequence[str], scores: list, extra: list, failed: list) -> None:
        exs = [examples[i] for i in idx]
        truths = [ex.ground_truth for ex in exs]
        kwargs = {"ground_truth": truths, "answer": truths, "data_source": [source] * len(exs),
                  "extra_info": [ex.extra_info for ex in exs], "prompt_messages": [ex.messages for ex in exs]}
        params = inspect.signature(rfn.fn).parameters
        if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
            kwargs = {k: v for k, v in kwargs.items() if k in params}
        prompts = ["\n".join(m["content"] for m in ex.messages) for ex in exs]
        try:
            # a batched call gets the per-item budget for each of its items
            values = call_with_timeout(rfn.fn, self.cfg.timeout_s * len(idx), prompts=prompts,
                                       completions=[responses[i] for i in idx], **kwargs)
            if not isinstance(values, (list, tuple)) or len(values) != len(idx):
                raise RewardError(f"batched reward must return a list of {len(idx)} values, got {values!r:.80}")
            for i, value in zip(idx, values):
                scores[i], extra[i] = _to_score(value)
        except Exception as e:  # the whole batch scores 0
            msg = self._error(rfn, source, e)
            failed.extend((i, msg, isinstance(e, RewardTimeout)) for i in idx)

    def _error(self, rfn: RewardFn, source: str, e: Exception) -> str:
        msg = f"reward function '{rfn.name}' failed for data_source '{source}': {type(e).__name__}: {e}"
        if self.cfg.errors_fatal:
            raise RewardError(msg) from e
        return msg

    def _result(self, examples: Sequence[PromptExample], scores: list[float | None], extra: list[dict],
                failed: list[tuple[int, str, bool]]) -> RewardResult:
        messages = list(dict.fromkeys(m for _, m, _ in failed))
        for m in messages[:MAX_LOGGED_ERRORS]:
            logger.warning("%s (scored 0)", m)
        self.total_errors += len(failed)
        failed_idx = {i for i, _, _ in failed}
        valid = [s for s in scores if s is not None]
        metrics: dict[str, float] = {
            "reward/mean": sum(valid) / len(valid) if valid else 0.0,
            "reward/num_errors": float(len(failed)),
            "reward/num_timeouts": float(sum(timed_out for _, _, timed_out in failed)),
            "reward/num_missing": float(len(scores) - len(valid)),
            "reward/total_errors": float(self.total_errors),
        }
        for source in dict.fromkeys(ex.data_source for ex in examples):
            idx = [i for i, ex in enumerate(examples) if ex.data_source == source]
            vals = [scores[i] for i in idx if scores[i] is not None]
            metrics[f"reward/{source}/mean"] = sum(vals) / len(vals) if vals else 0.0
            metrics[f"reward/{source}/num_errors"] = float(sum(i in failed_idx for i in idx))
        return RewardResult(scores, metrics, len(failed), messages, extra)
