"""Reward functions: a registry keyed by data_source, a math-verify scorer, and a RewardManager that scores batches.

Three function shapes are accepted (detected from the signature):
- verl:  compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | {"score": ..., ...}
- TRL:   reward_func(prompts, completions, **kwargs) -> list[float | None]   (batched; kwargs carry ground_truth,
         answer (same values), data_source, extra_info, prompt_messages). prompts and completions are plain strings.
- custom: "path/to/file.py:function_name" (either shape), set as reward.custom_function for every data_source.

Every call runs in a reward worker process (tlt.rl.reward_pool; reward.num_workers of them) under a hard
timeout, reward.timeout_s per response. A call that times out, crashes its worker, raises, or returns something
other than a finite number, None or a dict with a 'score' scores 0 and is counted by kind (reward/num_timeouts,
num_crashes, num_exceptions, num_non_numbers); the run goes on unless reward.errors_fatal is set. Registered
functions reach the workers by reference, so they must be importable: defined at the top level of a module, not a
lambda or a nested function (the error says so). reward.num_workers=0 scores in the trainer's process instead,
in daemon threads: a timed-out call is then abandoned, not killed, and a crash takes the trainer down.
math-verify's own timeouts use signal.alarm (main thread only), so they are disabled here and ours applies.
"""

import importlib.util
import inspect
import logging
import multiprocessing
import os
import threading
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Sequence

from tlt.config import RewardConfig
from tlt.prompts import PromptExample
from tlt.rl.reward_pool import ErrorKind, FileFunction, Outcome, RewardError, RewardPool, ScoreCall, run_call
from tlt.tasks import SCORERS as TASK_SCORERS

# We disable math-verify's signal-based timeouts (they break outside the main thread) and bound every scorer with
# our own timeout instead; its one-time warning about that would only confuse users.
for _name in ("math_verify.grader", "math_verify.parser"):
    logging.getLogger(_name).setLevel(logging.ERROR)

logger = logging.getLogger(__name__)

Shape = Literal["verl", "trl"]
MAX_LOGGED_ERRORS = 3  # per score() call; all errors are still counted
ERROR_METRICS: dict[ErrorKind, str] = {"timeout": "reward/num_timeouts", "crash": "reward/num_crashes",
                                       "exception": "reward/num_exceptions", "non_number": "reward/num_non_numbers"}
# Imported once by the workers' forkserver: the task scorers, math-verify, and reasoning-gym, which the default
# task's scorer imports at its first call; a worker importing it (~2 s) would spend its call's timeout on that.
WORKER_PRELOAD = ("tlt.rl.rewards", "math_verify", "reasoning_gym")  # a missing one is skipped

__all__ = ["RewardError", "RewardTimeout", "RewardFn", "RewardManager", "RewardResult", "detect_shape",
           "register_reward", "get_reward_fn", "load_custom_function", "math_score", "boxed_format_score",
           "last_boxed"]


class RewardTimeout(TimeoutError):
    pass


@dataclass
class RewardFn:
    fn: Callable[..., Any]
    shape: Shape
    name: str
    ref: Callable[..., Any] | FileFunction | None = None  # what a worker is sent; None = fn itself

    def __post_init__(self) -> None:
        self.ref = self.fn if self.ref is None else self.ref


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
    """Load `path/to/file.py:function_name`; errors say what is missing. Workers load the file themselves."""
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
    ref = FileFunction(os.path.abspath(path), name)
    return RewardFn(fn, detect_shape(fn), f"{os.path.basename(path)}:{name}", ref)


def call_with_timeout(fn: Callable[..., Any], timeout_s: float, *args: Any, **kwargs: Any) -> Any:
    """fn(*args, **kwargs) in a daemon thread; RewardTimeout if it runs longer than timeout_s (the thread is
    abandoned, not stopped: use the worker pool to kill a hung scorer)."""
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
    from math_verify import parse, verify  # imported here: tasks with their own scorers run without math-verify
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
    metrics: dict[str, float]  # reward/mean, reward/<data_source>/mean, reward/num_errors, reward/num_timeouts, ...
    num_errors: int
    error_messages: list[str] = field(default_factory=list)
    extra: list[dict[str, Any]] = field(default_factory=list)  # extra keys of dict-valued scores, per response


@dataclass
class _Failure:
    index: int  # response
    message: str
    kind: ErrorKind


class RewardManager:
    """Scores (example, response) pairs with the data_source's reward function, in worker processes with a hard
    timeout, counting errors by kind. close() stops the workers (they start again if it scores again)."""

    def __init__(self, cfg: RewardConfig | None = None,
                 format_fn: Callable[[str], float] = boxed_format_score):
        self.cfg = cfg or RewardConfig()
        self.format_fn = format_fn
        self.custom = load_custom_function(self.cfg.custom_function) if self.cfg.custom_function else None
        self.total_errors = 0  # over the manager's lifetime
        # started at the first score(): a manager that never scores costs no processes
        self.pool = RewardPool(self.cfg.num_workers, WORKER_PRELOAD) if self.cfg.num_workers else None
        if self.pool is not None and multiprocessing.current_process().daemon:
            logger.warning("reward.num_workers=%d, but this is a daemonic process, which may not start any: rewards "
                           "are scored in this process, where a hung scorer cannot be killed (start this process "
                           "with daemon=False to isolate them)", self.cfg.num_workers)
            self.pool = None
        self._submitter: ThreadPoolExecutor | None = None

    def _fn_for(self, data_source: str) -> RewardFn:
        return self.custom or get_reward_fn(data_source)

    def submit(self, examples: Sequence[PromptExample], responses: Sequence[str]) -> "Future[RewardResult]":
        """score() in the background: the scorers run in the workers while the caller goes on; .result() waits."""
        if self._submitter is None:
            self._submitter = ThreadPoolExecutor(1, thread_name_prefix="tlt-reward-submit")
        return self._submitter.submit(self.score, list(examples), list(responses))

    def close(self) -> None:
        if self._submitter is not None:
            self._submitter.shutdown(wait=True)
            self._submitter = None
        if self.pool is not None:
            self.pool.close()

    def __enter__(self) -> "RewardManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def score(self, examples: Sequence[PromptExample], responses: Sequence[str]) -> RewardResult:
        """One score per response: one call per response for verl-shaped functions, one per data_source for
        TRL-shaped ones, all on the workers; a failed call scores 0 for each of its responses and is counted."""
        if len(examples) != len(responses):
            raise ValueError(f"{len(examples)} examples but {len(responses)} responses")
        by_source: dict[str, list[int]] = defaultdict(list)
        for i, ex in enumerate(examples):
            by_source[ex.data_source].append(i)
        calls: list[ScoreCall] = []
        targets: list[tuple[RewardFn, str, list[int]]] = []  # per call: function, data_source, response indices
        for source, idx in by_source.items():
            rfn = self._fn_for(source)
            groups = [idx] if rfn.shape == "trl" else [[i] for i in idx]
            for group in groups:
                calls.append(self._call(rfn, source, group, examples, responses))
                targets.append((rfn, source, group))

        outcomes = self.pool.run(calls) if self.pool is not None else [self._run_in_process(c) for c in calls]
        scores: list[float | None] = [None] * len(examples)
        extra: list[dict[str, Any]] = [{} for _ in examples]
        failed: list[_Failure] = []
        for (rfn, source, group), outcome in zip(targets, outcomes):
            if outcome.error_kind is not None:
                message = self._error(rfn, source, outcome)
                failed.extend(_Failure(i, message, outcome.error_kind) for i in group)
                continue
            for i, (value, keys) in zip(group, outcome.scores):
                scores[i], extra[i] = value, keys

        if self.cfg.format_weight:
            for i, s in enumerate(scores):
                if s is not None:
                    scores[i] = s + self.cfg.format_weight * self.format_fn(responses[i])
        for f in failed:
            scores[f.index] = 0.0  # a failed scorer gives exactly 0, format reward included
        return self._result(examples, scores, extra, failed)

    def _call(self, rfn: RewardFn, source: str, idx: list[int], examples: Sequence[PromptExample],
              responses: Sequence[str]) -> ScoreCall:
        fn = rfn.ref if self.pool is not None else rfn.fn
        if rfn.shape == "verl":
            ex = examples[idx[0]]
            return ScoreCall(fn, (source, responses[idx[0]], ex.ground_truth, ex.extra_info), {}, None,
                             self.cfg.timeout_s)
        exs = [examples[i] for i in idx]
        truths = [ex.ground_truth for ex in exs]
        kwargs = {"ground_truth": truths, "answer": truths, "data_source": [source] * len(exs),
                  "extra_info": [ex.extra_info for ex in exs], "prompt_messages": [ex.messages for ex in exs]}
        params = inspect.signature(rfn.fn).parameters
        if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
            kwargs = {k: v for k, v in kwargs.items() if k in params}
        kwargs["prompts"] = ["\n".join(m["content"] for m in ex.messages) for ex in exs]
        kwargs["completions"] = [responses[i] for i in idx]
        # a batched call gets the per-item budget for each of its items
        return ScoreCall(fn, (), kwargs, len(idx), self.cfg.timeout_s * len(idx))

    @staticmethod
    def _run_in_process(call: ScoreCall) -> Outcome:
        try:
            return call_with_timeout(run_call, call.timeout_s, call)
        except RewardTimeout as e:
            return Outcome(error_kind="timeout", error=str(e))

    def _error(self, rfn: RewardFn, source: str, outcome: Outcome) -> str:
        msg = f"reward function '{rfn.name}' failed for data_source '{source}': {outcome.error}"
        if self.cfg.errors_fatal:
            raise RewardError(msg)
        return msg

    def _result(self, examples: Sequence[PromptExample], scores: list[float | None], extra: list[dict],
                failed: list[_Failure]) -> RewardResult:
        messages = list(dict.fromkeys(f.message for f in failed))
        for m in messages[:MAX_LOGGED_ERRORS]:
            logger.warning("%s (scored 0)", m)
        self.total_errors += len(failed)
        failed_idx = {f.index for f in failed}
        valid = [s for s in scores if s is not None]
        metrics: dict[str, float] = {
            "reward/mean": sum(valid) / len(valid) if valid else 0.0,
            "reward/num_errors": float(len(failed)),
            "reward/num_missing": float(len(scores) - len(valid)),
            "reward/total_errors": float(self.total_errors),
        }
        for kind, key in ERROR_METRICS.items():
            metrics[key] = float(sum(f.kind == kind for f in failed))
        for source in dict.fromkeys(ex.data_source for ex in examples):
            idx = [i for i, ex in enumerate(examples) if ex.data_source == source]
            vals = [scores[i] for i in idx if scores[i] is not None]
            metrics[f"reward/{source}/mean"] = sum(vals) / len(vals) if vals else 0.0
            metrics[f"reward/{source}/num_errors"] = float(sum(i in failed_idx for i in idx))
        return RewardResult(scores, metrics, len(failed), messages, extra)
