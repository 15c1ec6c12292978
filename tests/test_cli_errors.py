"""What a new user's mistakes look like through the real console entry point (`python -m tlt train ...`): one
message naming the key, file or row and what to do, exit code 2, no traceback, and no expensive work done first
(the model cache stays empty: nothing was converted or built)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GOOD_ROW = {"prompt": [{"role": "user", "content": "What is 2+2?"}], "reward_model": {"ground_truth": "4"}}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tlt.rl.tiny_model import build_tiny_model
    return build_tiny_model(tmp_path_factory.mktemp("tiny_with_tokenizer"))


def write_jsonl(path: Path, rows: list, broken_tail: str | None = None) -> str:
    text = "".join(json.dumps(r) + "\n" for r in rows) + (broken_tail or "")
    path.write_text(text)
    return str(path)


def tlt_train(tmp_path: Path, *args: str, debug: bool = False) -> subprocess.CompletedProcess:
    """`python -m tlt train ARGS` with an empty model cache and outputs under tmp_path."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "TLT_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    env.pop("TLT_DEBUG", None)
    if not any(a.startswith("trainer.default_local_dir=") for a in args):
        args = (*args, f"trainer.default_local_dir={tmp_path / 'runs'}")
    cmd = [sys.executable, "-m", "tlt", "train", *args, *(["--debug"] if debug else [])]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def assert_user_error(proc: subprocess.CompletedProcess, tmp_path: Path, *fragments: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    message = proc.stderr.strip().splitlines()[-1]
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    cache = tmp_path / "cache"
    assert not cache.exists() or not any(cache.iterdir()), f"work was done before the error: {list(cache.iterdir())}"


def test_unknown_key(tmp_path):
    assert_user_error(tlt_train(tmp_path, "trainer.totl_steps=3"), tmp_path, "unknown config key 'totl_steps'",
                      "total_steps")


def test_bad_value(tmp_path):
    assert_user_error(tlt_train(tmp_path, "rollout.temperature=-1"), tmp_path, "rollout.temperature=-1",
                      "out of range", ">= 0")


def test_missing_config_file(tmp_path):
    assert_user_error(tlt_train(tmp_path, "no_such.yaml"), tmp_path, "config file not found: no_such.yaml")


def test_missing_model(tmp_path):
    assert_user_error(tlt_train(tmp_path, "model.path=/nonexistent/model"), tmp_path,
                      "model.path: /nonexistent/model is not a directory")


def test_model_directory_without_weights_or_with_a_partial_config(tmp_path, tiny_model):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text((Path(tiny_model) / "config.json").read_text())
    assert_user_error(tlt_train(tmp_path, f"model.path={tmp_path / 'm'}"), tmp_path, "model.path:",
                      "no *.safetensors weights")
    (tmp_path / "m" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert_user_error(tlt_train(tmp_path, f"model.path={tmp_path / 'm'}"), tmp_path, "model.path:",
                      "config.json has no 'num_attention_heads'")


def test_unsupported_architecture(tmp_path, tiny_model):
    (tmp_path / "m").mkdir()
    hf = json.loads((Path(tiny_model) / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**hf, "architectures": ["MixtralForCausalLM"],
                                                            "model_type": "mixtral"}))
    assert_user_error(tlt_train(tmp_path, f"model.path={tmp_path / 'm'}"), tmp_path, "model.path:",
                      "unsupported architecture 'MixtralForCausalLM'")


def test_malformed_row_fails_before_the_default_model_is_converted(tmp_path):
    """The second row cut short: the error names the file and the row, and comes before the default model's
    conversion and drafter warm-up (minutes of work on a CPU)."""
    bad = write_jsonl(tmp_path / "bad.jsonl", [GOOD_ROW], broken_tail='{"prompt": [{"role": "us\n')
    assert_user_error(tlt_train(tmp_path, f"data.train_files={bad}"), tmp_path, "data.train_files:", "bad.jsonl",
                      "row 2", "invalid JSON")


def test_row_without_a_prompt(tmp_path):
    bad = write_jsonl(tmp_path / "noprompt.jsonl", [GOOD_ROW, GOOD_ROW, {"question": "2+2?"}])
    assert_user_error(tlt_train(tmp_path, f"data.train_files={bad}"), tmp_path, "row 3", "missing 'prompt'")


def test_empty_data_file(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert_user_error(tlt_train(tmp_path, f"data.train_files={empty}"), tmp_path, "data.train_files:",
                      "holds no rows")


def test_missing_data_file(tmp_path):
    assert_user_error(tlt_train(tmp_path, "data.train_files=nope.jsonl"), tmp_path,
                      "data.train_files: data file not found: nope.jsonl")


def test_prompts_all_too_long(tmp_path, tiny_model):
    data = write_jsonl(tmp_path / "d.jsonl", [GOOD_ROW] * 3)
    assert_user_error(tlt_train(tmp_path, f"model.path={tiny_model}", f"data.train_files={data}",
                                "data.max_prompt_length=4"), tmp_path,
                      "every prompt is longer than data.max_prompt_length=4")
    assert_user_error(tlt_train(tmp_path, f"model.path={tiny_model}", f"data.train_files={data}",
                                "data.max_prompt_length=4", "data.filter_overlong_prompts=false"), tmp_path,
                      "3 of 3 prompts are longer", "data.filter_overlong_prompts=true")


@pytest.mark.parametrize("source,fragments", [
    (None, ("custom reward file not found",)),
    ("def other(data_source, solution_str, ground_truth, extra_info):\n    return 1.0\n", ("has no function 'score'",)),
    ("import no_such_module_anywhere\n", ("failed with ModuleNotFoundError", "no_such_module_anywhere")),
    ("score = 3\n", ("has no function 'score'",)),
], ids=["missing-file", "missing-function", "import-fails", "not-callable"])
def test_reward_function_that_cannot_be_used(tmp_path, source, fragments):
    path = tmp_path / "my_reward.py"
    if source is not None:
        path.write_text(source)
    assert_user_error(tlt_train(tmp_path, f"reward.custom_function={path}:score"), tmp_path,
                      "reward.custom_function:", *fragments)


def test_drafter_directory_that_is_not_one(tmp_path):
    (tmp_path / "drafter").mkdir()
    assert_user_error(tlt_train(tmp_path, f"speculative.model={tmp_path / 'drafter'}"), tmp_path,
                      "speculative.model:", "not a drafter directory", "tlt train-drafter")


def test_output_directory_that_cannot_be_written(tmp_path):
    (tmp_path / "afile").write_text("x")
    proc = tlt_train(tmp_path, f"trainer.default_local_dir={tmp_path / 'afile' / 'runs'}")
    assert_user_error(proc, tmp_path, "trainer.default_local_dir:", "afile", "is a file")


def test_debug_shows_the_traceback(tmp_path):
    proc = tlt_train(tmp_path, "trainer.totl_steps=3", debug=True)
    assert proc.returncode == 2 and "Traceback" in proc.stderr and "unknown config key" in proc.stderr
