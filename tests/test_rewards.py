"""Rewards: math-verify scorer, the three function shapes, timeouts and errors that score 0 without hanging."""

import time

import pytest

from tlt.config import RewardConfig
from tlt.rl.data import PromptExample
from tlt.rl.rewards import (RewardError, RewardManager, boxed_format_score, detect_shape, last_boxed, math_score,
                            register_reward)


def ex(source: str = "math", truth: str | None = "3", prompt: str = "what is 1 + 2?") -> PromptExample:
    return PromptExample(index=0, data_source=source, messages=[{"role": "user", "content": prompt}],
                         ground_truth=truth, extra_info={"split": "test"})


def test_last_boxed_and_format():
    assert last_boxed("a \\boxed{1} then \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{3") is None and last_boxed("no answer") is None
    assert boxed_format_score("so \\boxed{3}") == 1.0 and boxed_format_score("so 3") == 0.0


@pytest.mark.parametrize("response, truth, expected", [
    ("1 + 2 = 3, so \\boxed{3}", "3", 1.0),
    ("half: \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("first \\boxed{2}, no wait \\boxed{3}", "3", 1.0),  # the last boxed answer counts
    ("The answer is 3.", "3", 1.0),  # no box: math-verify's final-answer extraction
    ("\\boxed{4}", "3", 0.0),
    ("\\boxed{x^{2", "3", 0.0),  # malformed: unbalanced braces
    ("banana", "3", 0.0),
    ("\\boxed{7}", ["6", "7"], 1.0),  # several accepted answers
    ("\\boxed{3}", None, None),  # no ground truth: missing, not wrong
])
def test_math_score(response, truth, expected):
    assert math_score("math", response, truth) == expected


def test_manager_default_fallback_and_metrics():
    manager = RewardManager(RewardConfig(timeout_s=10))
    result = manager.score([ex("openai/gsm8k"), ex("openai/gsm8k"), ex("other", truth=None)],
                           ["\\boxed{3}", "\\boxed{5}", "\\boxed{3}"])
    assert result.scores == [1.0, 0.0, None]
    assert result.num_errors == 0
    assert result.metrics["reward/openai/gsm8k/mean"] == 0.5
    assert result.metrics["reward/num_missing"] == 1.0


def test_format_weight_adds_format_reward():
    manager = RewardManager(RewardConfig(format_weight=0.1, timeout_s=10))
    result = manager.score([ex(), ex()], ["\\boxed{4}", "3"])
    assert result.scores == pytest.approx([0.1, 1.0])  # wrong but formatted; right (final answer) but no box


@register_reward("test_verl_shape")
def verl_style(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(solution_str.strip() == ground_truth), "acc": extra_info["split"]}


@register_reward("test_trl_shape")
def trl_style(prompts, completions, ground_truth, **kwargs):
    assert kwargs["data_source"] == ["test_trl_shape"] * len(prompts) and prompts[0] == "what is 1 + 2?"
    return [len(c) / 10 if gt is not None else None for c, gt in zip(completions, ground_truth)]


@register_reward("test_raises")
def raises(data_source, solution_str, ground_truth, extra_info=None):
    raise ZeroDivisionError("boom")


@register_reward("test_hangs")
def hangs(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(5)
    return 1.0


def test_shape_detection():
    assert detect_shape(verl_style) == "verl" and detect_shape(trl_style) == "trl"
    assert detect_shape(math_score) == "verl"
    with pytest.raises(RewardError, match="cannot tell the shape"):
        detect_shape(lambda x: x)


def test_verl_and_trl_shapes():
    result = RewardManager(RewardConfig(timeout_s=10)).score(
        [ex("test_verl_shape"), ex("test_verl_shape"), ex("test_trl_shape"), ex("test_trl_shape", truth=None)],
        ["3", "4", "abcd", "ab"])
    assert result.scores == [1.0, 0.0, 0.4, None]
    assert result.extra[0] == {"acc": "test"}


def test_custom_function_from_path(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    return 2.0 if ground_truth in solution_str else -1.0\n"
                    "def batched(prompts, completions, **kwargs):\n"
                    "    return [float(len(c)) for c in completions]\n")
    examples = [ex("a"), ex("b")]
    manager = RewardManager(RewardConfig(custom_function=f"{path}:score"))
    assert manager.score(examples, ["it is 3", "it is 4"]).scores == [2.0, -1.0]
    manager = RewardManager(RewardConfig(custom_function=f"{path}:batched"))
    assert manager.score(examples, ["x", "yy"]).scores == [1.0, 2.0]
    with pytest.raises(RewardError, match="no function 'nope'.*score"):
        RewardManager(RewardConfig(custom_function=f"{path}:nope"))
    with pytest.raises(RewardError, match="not found"):
        RewardManager(RewardConfig(custom_function=f"{tmp_path}/missing.py:score"))


def test_raising_reward_scores_zero_and_is_counted(caplog):
    manager = RewardManager(RewardConfig(timeout_s=10, format_weight=0.5))  # no format reward on failure
    result = manager.score([ex("test_raises"), ex()], ["\\boxed{3}", "\\boxed{3}"])
    assert result.scores == [0.0, 1.5]
    assert result.num_errors == 1 and result.metrics["reward/test_raises/num_errors"] == 1.0
    msg = result.error_messages[0]
    assert "test_raises" in msg and "ZeroDivisionError" in msg and "boom" in msg
    assert "boom" in caplog.text
    with pytest.raises(RewardError, match="boom"):
        RewardManager(RewardConfig(errors_fatal=True)).score([ex("test_raises")], ["x"])


def test_hanging_reward_times_out_without_hanging():
    manager = RewardManager(RewardConfig(timeout_s=0.2))
    start = time.monotonic()
    result = manager.score([ex("test_hangs"), ex("test_hangs")], ["a", "b"])
    assert time.monotonic() - start < 2.0
    assert result.scores == [0.0, 0.0]
    assert result.num_errors == 2 and result.metrics["reward/num_timeouts"] == 2.0
    assert "test_hangs" in result.error_messages[0] and "timed out" in result.error_messages[0]
    assert manager.total_errors == 2
