"""The default task of `tlt train`: graded arithmetic from reasoning-gym, solved step by step.

Each example is a reasoning-gym entry (question, answer, metadata) turned into one verl-schema row. The prompt
asks for worked steps and a last line `Answer: <number>`; the reward is the generator's own scorer applied to
the extracted answer. The mix is graded (easy -> hard per generator) so that SmolLM2-135M-Instruct starts well
above zero and well below the ceiling: a task that RL can visibly improve on.

Row schema (verl's):
    {data_source: "tlt/<generator>", prompt: [{role: "user", content}], ability: "math",
     reward_model: {style: "rule", ground_truth: <answer str>},
     extra_info: {split, index, generator, difficulty, question, metadata: <entry metadata as JSON>}}
The metadata is stored as a JSON string because its keys differ between generators (parquet needs one schema).
`score` is the rows' reward function; tlt.tasks.SCORERS names it for their data_source ("tlt/*").
"""
from __future__ import annotations

import functools
import json
import re
import zlib
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any, Callable, Iterator


@dataclass(frozen=True)
class Level:
    """One reasoning-gym generator at one difficulty."""
    generator: str                                        # reasoning-gym dataset name
    difficulty: str                                       # label stored with each row: "easy" | "medium" | ...
    kwargs: dict[str, Any] = field(default_factory=dict)  # config overrides passed to reasoning_gym.create_dataset


_NO_NEG = dict(allow_negation=False)
_PLAIN = dict(allow_parentheses=False, allow_negation=False, operators=("+", "-", "*"))
DEFAULT_MIX: tuple[Level, ...] = (
    Level("chain_sum", "easy", dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1, **_NO_NEG)),
    Level("chain_sum", "medium", dict(min_terms=2, max_terms=3, min_digits=1, max_digits=2, **_NO_NEG)),
    Level("chain_sum", "hard", dict(min_terms=3, max_terms=4, min_digits=2, max_digits=2, **_NO_NEG)),
    Level("basic_arithmetic", "easy", dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1, **_PLAIN)),
    Level("basic_arithmetic", "medium", dict(min_terms=3, max_terms=3, min_digits=1, max_digits=2, **_PLAIN)),
    Level("products", "easy", dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1, **_NO_NEG)),
    Level("products", "medium", dict(min_terms=2, max_terms=2, min_digits=1, max_digits=2, **_NO_NEG)),
)
# Generators whose answer is one number: partial credit from reasoning-gym's substring fallback ("14" inside
# "214" scores 2/3) is meaningless there, so their reward is 1 for an exact numeric match and 0 otherwise.
NUMERIC_GENERATORS = frozenset(lvl.generator for lvl in DEFAULT_MIX)

INSTRUCTION = "Solve it step by step. Then finish with a line of the form `Answer: <number>`."
_SPLIT_IDS = {"train": 0, "val": 1, "test": 2}


def build_prompt(entry: dict[str, Any], generator: str) -> str:
    """User message: the arithmetic expression for the default mix, reasoning-gym's own question otherwise."""
    expression = entry["metadata"].get("expression")
    question = f"Calculate {expression}." if generator in NUMERIC_GENERATORS and expression else entry["question"]
    return f"{question}\n{INSTRUCTION}"


def _level_seed(split: str, seed: int, level: Level) -> int:
    """Independent, reproducible seed per (split, seed, generator, difficulty): train and val never share one."""
    if split not in _SPLIT_IDS:
        raise ValueError(f"unknown split {split!r}: use one of {sorted(_SPLIT_IDS)}")
    return zlib.crc32(f"{split}/{seed}/{level.generator}/{level.difficulty}".encode()) & 0x7FFFFFFF


def make_examples(split: str, n: int, seed: int, levels: tuple[Level, ...] = DEFAULT_MIX) -> Iterator[dict]:
    """Yield n verl rows, round-robin over the levels so that every prefix of the stream is mixed."""
    import reasoning_gym

    if not levels:
        raise ValueError("make_examples needs at least one Level")
    counts = [n // len(levels) + (i < n % len(levels)) for i in range(len(levels))]
    iters = []
    for level, count in zip(levels, counts):
        if count:
            ds = reasoning_gym.create_dataset(level.generator, size=count, seed=_level_seed(split, seed, level),
                                              **level.kwargs)
            iters.append((level, iter(ds)))
    index = 0
    while iters:
        for item in list(iters):
            level, it = item
            entry = next(it, None)
            if entry is None:
                iters.remove(item)
                continue
            yield to_row(entry, level, split, index)
            index += 1


def to_row(entry: dict[str, Any], level: Level, split: str, index: int) -> dict:
    return {
        "data_source": f"tlt/{level.generator}",
        "prompt": [{"role": "user", "content": build_prompt(entry, level.generator)}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(entry["answer"])},
        "extra_info": {"split": split, "index": index, "generator": level.generator,
                       "difficulty": level.difficulty, "question": entry["question"],
                       "metadata": json.dumps(entry["metadata"], default=str)},
    }


# "Answer: 7", "**Answer:** 7", "answer = 7", and the model's habit "The answer is 7." (SmolLM2 writes it often).
_ANSWER_LINE = re.compile(r"\banswer\s*(?:is\s*:?|:|=)\s*(.*)", re.IGNORECASE)
_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?")


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None  # unbalanced: truncated mid-answer


def extract_answer(text: str | None) -> str | None:
    """The final answer: the text after the last `Answer:` (or `answer is`), else the last \\boxed{...}.

    Markdown and LaTeX decoration around it (`**`, backticks, `$`, a trailing period) is stripped. Returns None
    when the response has neither form or the answer is empty: a malformed response earns no reward.
    """
    if not text:
        return None
    matches = [m.group(1) for m in _ANSWER_LINE.finditer(text)]
    candidate = matches[-1] if matches else _last_boxed(text)
    if candidate is None:
        return None
    candidate = candidate.split("\n")[0]
    while (inner := _ANSWER_LINE.search(candidate)) is not None:  # "The answer is: Answer: 22"
        candidate = inner.group(1)
    boxed = _last_boxed(candidate)
    candidate = boxed if boxed is not None else candidate
    candidate = candidate.strip().strip("*`$ ").rstrip(".").strip("*`$ ")
    return candidate or None


def final_number(answer: str) -> str | None:
    """The last number in an extracted answer ("12 + 7 = 19" -> "19", "1,234 apples" -> "1234")."""
    numbers = _NUMBER.findall(answer)
    return numbers[-1].replace(",", "").lstrip("+") if numbers else None


@functools.lru_cache(maxsize=None)
def _scorer(generator: str) -> Callable[[str | None, dict], float]:
    import reasoning_gym
    return reasoning_gym.get_score_answer_fn(generator)


def score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """verl compute_score: reward in [0, 1] of one response, by the generator's reasoning-gym scorer."""
    generator = (extra_info or {}).get("generator") or data_source.removeprefix("tlt/")
    answer = extract_answer(solution_str)
    if answer is None:
        return 0.0
    metadata = json.loads((extra_info or {}).get("metadata") or "{}")
    entry = {"question": (extra_info or {}).get("question", ""), "answer": ground_truth, "metadata": metadata}
    if generator not in NUMERIC_GENERATORS:
        return float(_scorer(generator)(answer, entry))
    number = final_number(answer)
    if number is None:
        return 0.0
    # Full credit only; Decimal equality as well because basic_arithmetic's scorer compares strings ("3.0" != "3").
    return float(_scorer(generator)(number, entry) >= 1.0 or _numbers_equal(number, ground_truth))


def _numbers_equal(a: str, b: str) -> bool:
    try:
        return Decimal(a) == Decimal(b.replace(",", ""))
    except InvalidOperation:
        return False
