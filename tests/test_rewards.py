"""Rewards: math-verify scorer, the three function shapes, timeouts and errors that score 0 without hanging, and
the worker processes that kill hung scorers and survive crashing ones."""

import ctypes
import importlib.util
import math
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tlt.config import RewardConfig
from tlt.prompts import PromptExample
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
@pytest.mark.needs("math_verify")
def test_math_score(response, truth, expected):
    assert math_score("math", response, truth) == expected


@pytest.mark.needs("math_verify")
def test_manager_default_fallback_and_metrics():
    manager = RewardManager(RewardConfig(timeout_s=10))
    result = manager.score([ex("openai/gsm8k"), ex("openai/gsm8k"), ex("other", truth=None)],
                           ["\\boxed{3}", "\\boxed{5}", "\\boxed{3}"])
    assert result.scores == [1.0, 0.0, None]
    assert result.num_errors == 0
    assert result.metrics["reward/openai/gsm8k/mean"] == 0.5
    assert result.metrics["reward/num_missing"] == 1.0


@pytest.mark.needs("math_verify")
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


@pytest.mark.needs("math_verify")
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


# ---------------------------------------------------------------- worker processes: kill, replace, count


@register_reward("test_pid")
def pid_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 1.0, "pid": os.getpid()}


@register_reward("test_hangs_forever")
def hangs_forever(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(600)
    return 1.0


@register_reward("test_crashes")
def crashes(data_source, solution_str, ground_truth, extra_info=None):
    """Each way a scorer can take its process down, picked by the response."""
    if solution_str == "exit":
        os._exit(3)
    if solution_str == "segfault":
        ctypes.string_at(0)  # reads address 0: SIGSEGV
    if solution_str == "recursion":
        return crashes(data_source, solution_str, ground_truth, extra_info)  # RecursionError, an exception
    return 1.0


@register_reward("test_bad_values")
def bad_values(data_source, solution_str, ground_truth, extra_info=None):
    return {"nan": math.nan, "inf": -math.inf, "string": "1.0", "no_score": {"acc": 1.0}}.get(solution_str, 0.5)


@register_reward("test_trl_wrong_length")
def trl_wrong_length(prompts, completions, **kwargs):
    return [1.0]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def counts(result) -> dict[str, float]:
    return {k: result.metrics[f"reward/num_{k}"] for k in ("errors", "timeouts", "crashes", "exceptions",
                                                           "non_numbers")}


@pytest.mark.needs("math_verify")
def test_hung_scorer_is_killed_and_its_worker_replaced():
    with RewardManager(RewardConfig(timeout_s=1.0, num_workers=1)) as manager:
        first = manager.score([ex("test_pid")], ["x"]).extra[0]["pid"]
        start = time.monotonic()
        result = manager.score([ex("test_hangs_forever"), ex()], ["a", "\\boxed{3}"])
        assert time.monotonic() - start < 60  # the scorer sleeps 600 s: the call was cut, not waited for
        assert result.scores == [0.0, 1.0]
        assert counts(result) == {"errors": 1, "timeouts": 1, "crashes": 0, "exceptions": 0, "non_numbers": 0}
        assert "timed out after 1s" in result.error_messages[0]
        assert not alive(first)  # killed, not abandoned
        after = manager.score([ex("test_pid")], ["x"])
        assert after.scores == [1.0] and after.num_errors == 0
        assert after.extra[0]["pid"] != first and alive(after.extra[0]["pid"])  # a fresh worker in its slot


@pytest.mark.needs("math_verify")
def test_crashing_scorers_score_zero_are_counted_and_scoring_goes_on():
    with RewardManager(RewardConfig(timeout_s=30, num_workers=2)) as manager:
        result = manager.score([ex("test_crashes")] * 5 + [ex()], ["ok", "exit", "segfault", "recursion", "ok",
                                                                     "\\boxed{3}"])
        assert result.scores == [1.0, 0.0, 0.0, 0.0, 1.0, 1.0]
        assert counts(result) == {"errors": 3, "timeouts": 0, "crashes": 2, "exceptions": 1, "non_numbers": 0}
        assert result.metrics["reward/test_crashes/num_errors"] == 3.0
        text = " ".join(result.error_messages)
        assert "exit code 3" in text and "SIGSEGV" in text and "RecursionError" in text
        again = manager.score([ex("test_crashes"), ex()], ["ok", "\\boxed{3}"])
        assert again.scores == [1.0, 1.0] and again.num_errors == 0 and manager.total_errors == 3
        with pytest.raises(RewardError, match="exit code 3"):
            RewardManager(RewardConfig(errors_fatal=True, num_workers=1)).score([ex("test_crashes")], ["exit"])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_non_numbers_are_errors(num_workers):
    manager = RewardManager(RewardConfig(timeout_s=30, num_workers=num_workers))
    result = manager.score([ex("test_bad_values")] * 5 + [ex("test_trl_wrong_length")] * 2,
                           ["nan", "inf", "string", "no_score", "fine", "a", "b"])
    assert result.scores == [0.0, 0.0, 0.0, 0.0, 0.5, 0.0, 0.0]
    assert counts(result) == {"errors": 6, "timeouts": 0, "crashes": 0, "exceptions": 0, "non_numbers": 6}
    text = " ".join(result.error_messages)
    assert "not finite: nan" in text and "got str" in text and "'score' key" in text and "list of 2" in text
    manager.close()


@pytest.mark.needs("math_verify")
def test_workers_give_the_in_process_rewards(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    return {'score': float(len(solution_str)), 'source': data_source}\n")
    examples = [ex("openai/gsm8k"), ex("math", truth="0.5"), ex("other", truth=None), ex("test_verl_shape"),
                ex("test_trl_shape"), ex("test_trl_shape"), ex("test_raises")]
    responses = ["\\boxed{3}", "\\boxed{\\frac{1}{2}}", "\\boxed{3}", "3", "abcd", "ab", "x"]
    results = {}
    for num_workers in (0, 3):
        cfg = RewardConfig(timeout_s=30, format_weight=0.1, num_workers=num_workers)
        with RewardManager(cfg) as manager:
            results[num_workers] = manager.score(examples, responses)
        with RewardManager(RewardConfig(custom_function=f"{path}:score", num_workers=num_workers)) as manager:
            custom = manager.score(examples[:2], ["abc", "de"])
            assert custom.scores == [3.0, 2.0] and custom.extra[1] == {"source": "math"}
    assert results[3].scores == results[0].scores == pytest.approx([1.1, 1.1, None, 1.0, 0.4, 0.2, 0.0])
    assert results[3].extra == results[0].extra and results[3].metrics == results[0].metrics


def test_pool_starts_lazily_is_reused_and_closes_without_leaks():
    manager = RewardManager(RewardConfig(timeout_s=30, num_workers=2))
    assert manager.pool.pids() == []  # nothing started until the first score()
    pids = {r["pid"] for r in manager.score([ex("test_pid")] * 6, ["x"] * 6).extra}
    assert pids == set(manager.pool.pids()) and len(pids) == 2
    assert {r["pid"] for r in manager.score([ex("test_pid")] * 6, ["x"] * 6).extra} == pids  # reused across steps
    future = manager.submit([ex("test_pid")], ["x"])  # async: scored in the background
    assert future.result().scores == [1.0]
    manager.close()
    assert manager.pool.pids() == [] and not any(alive(pid) for pid in pids)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("tlt-reward")]


def test_unpicklable_reward_function_error_says_what_to_do():
    register_reward("test_lambda")(lambda data_source, solution_str, ground_truth, extra_info=None: 1.0)
    with pytest.raises(RewardError, match="cannot be sent to a reward worker.*custom_function.*num_workers=0"):
        RewardManager(RewardConfig(num_workers=1)).score([ex("test_lambda")], ["x"])
    assert RewardManager(RewardConfig(num_workers=0)).score([ex("test_lambda")], ["x"]).scores == [1.0]


def test_function_the_workers_cannot_import_is_a_clear_error(tmp_path):
    path = tmp_path / "parent_only.py"  # importable here (sys.modules) but not from the workers (not on sys.path)
    path.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    spec = importlib.util.spec_from_file_location("tlt_test_parent_only", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["tlt_test_parent_only"] = module
    try:
        register_reward("test_parent_only")(module.score)
        with pytest.raises(RewardError, match="cannot load reward function.*No module named 'tlt_test_parent_only'"):
            RewardManager(RewardConfig(num_workers=1)).score([ex("test_parent_only")], ["x"])
    finally:
        del sys.modules["tlt_test_parent_only"]


def test_script_without_main_guard_gets_a_clear_error(tmp_path):
    """Workers import the main module; a script that scores at import time must say so, not score 0 forever."""
    script = tmp_path / "train.py"
    script.write_text("from tlt.config import RewardConfig\nfrom tlt.prompts import PromptExample\n"
                      "from tlt.rl.rewards import RewardManager\n"
                      "ex = PromptExample(0, 'math', [{'role': 'user', 'content': 'q'}], '3', {})\n"
                      "print(RewardManager(RewardConfig(num_workers=1)).score([ex], ['\\\\boxed{3}']).scores)\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          env=os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert proc.returncode != 0
    assert "RewardError" in proc.stderr and "if __name__ == '__main__':" in proc.stderr


def score_in_this_process(conn) -> None:
    manager = RewardManager(RewardConfig(num_workers=2))
    conn.send((manager.pool is None, manager.score([ex("test_pid")], ["x"]).extra[0]["pid"], os.getpid()))


def test_daemonic_process_scores_in_process():
    """A daemonic process may not start children: the manager scores in-process (with a warning), not fail."""
    ctx = multiprocessing.get_context("forkserver")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=score_in_this_process, args=(child,), daemon=True)
    process.start()
    in_process, scorer_pid, pid = parent.recv()
    process.join()
    assert in_process and scorer_pid == pid and process.exitcode == 0


def test_a_killed_trainer_leaves_no_worker_behind(tmp_path):
    """SIGKILL of the trainer (no close(), no atexit) while a worker is stuck in a scorer: the worker exits too."""
    script = tmp_path / "train.py"
    script.write_text(
        "import os, sys, time\nfrom tlt.config import RewardConfig\nfrom tlt.prompts import PromptExample\n"
        "from tlt.rl.rewards import RewardManager, register_reward\n"
        "def hang(data_source, solution_str, ground_truth, extra_info=None):\n    time.sleep(600)\n"
        "if __name__ == '__main__':\n"
        "    register_reward('hang')(hang)\n"
        "    manager = RewardManager(RewardConfig(num_workers=1, timeout_s=600))\n"
        "    manager.submit([PromptExample(0, 'hang', [], '3', {})], ['x'])\n"
        "    while not manager.pool.pids():\n        time.sleep(0.05)\n"
        "    time.sleep(1)  # the worker is inside hang()\n"
        "    print(manager.pool.pids()[0], flush=True)\n    os.kill(os.getpid(), 9)\n")
    with open(tmp_path / "stderr.txt", "w") as err:
        proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=err, text=True,
                                env=os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[1])})
        worker = int(proc.stdout.readline() or 0)
        assert proc.wait(timeout=300) == -9 and worker, (tmp_path / "stderr.txt").read_text()
    try:
        deadline = time.monotonic() + 30
        while alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(worker)
    finally:
        if alive(worker):
            os.kill(worker, 9)


@pytest.mark.needs("reasoning_gym")
def test_imports_are_not_the_calls_time(tmp_path):
    """A custom file's slow module-level imports run before the call's timeout starts; so does reasoning-gym, which
    the default task's scorer needs (preloaded by the workers' forkserver)."""
    from tlt.tasks.default_task import make_examples
    path = tmp_path / "slow_import.py"
    path.write_text("import time\ntime.sleep(3)  # a heavy import\n"
                    "def score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    with RewardManager(RewardConfig(custom_function=f"{path}:score", timeout_s=1.0, num_workers=1)) as manager:
        assert manager.score([ex()], ["x"]).scores == [1.0]
    row = next(make_examples("train", 1, 0))
    task_ex = PromptExample(0, row["data_source"], row["prompt"], row["reward_model"]["ground_truth"],
                            row["extra_info"])
    with RewardManager(RewardConfig(timeout_s=0.25, num_workers=1)) as manager:  # its import: > 0.5 s
        result = manager.score([task_ex, task_ex], [f"Answer: {task_ex.ground_truth}", "Answer: -1"])
        assert result.scores == [1.0, 0.0] and result.num_errors == 0
