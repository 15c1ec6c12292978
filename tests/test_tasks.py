"""Default task: answer extraction, scoring per generator, dataset files in verl's schema, GSM8K conversion."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tlt.tasks import datagen
from tlt.tasks.default_task import (DEFAULT_MIX, INSTRUCTION, Level, extract_answer, final_number, make_examples,
                                    score)

ROOT = Path(__file__).resolve().parents[1]


def _convert_gsm8k_module():
    spec = importlib.util.spec_from_file_location("convert_gsm8k", ROOT / "scripts" / "convert_gsm8k.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("text, expected", [
    ("3 + 4 = 7\nAnswer: 7", "7"),
    ("Step 1: ...\n**Answer:** `-12`.", "-12"),
    ("answer: 1,234\n", "1,234"),
    ("Answer: 5\nWait, let me redo it.\nAnswer: 6", "6"),
    ("so the result is \\boxed{42}", "42"),
    ("The final answer is: 19 apples", "19 apples"),
    ("So, the answer is 14.", "14"),
    ("9 * 3 = 27\n\nThe answer is: Answer: 27", "27"),
    ("To answer this, add them: 3 + 4 = 7", None),
    ("Answer: $\\boxed{\\frac{1}{2}}$", "\\frac{1}{2}"),
    ("I think it's 7", None),
    ("Answer:   \n", None),
    ("\\boxed{12", None),
    ("", None),
    (None, None),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_final_number():
    assert final_number("12 + 7 = 19") == "19"
    assert final_number("1,234 apples") == "1234"
    assert final_number("-5") == "-5"
    assert final_number("+3.50") == "3.50"
    assert final_number("none") is None


@pytest.mark.needs("reasoning_gym")
@pytest.mark.parametrize("level", DEFAULT_MIX, ids=lambda lvl: f"{lvl.generator}-{lvl.difficulty}")
def test_score_right_wrong_malformed(level):
    row = next(make_examples("val", 1, seed=3, levels=(level,)))
    truth = row["reward_model"]["ground_truth"]
    args = (row["data_source"], truth, row["extra_info"])

    def reward(text):
        return score(args[0], text, args[1], args[2])

    assert reward(f"Let me work it out.\nAnswer: {truth}") == 1.0
    assert reward(f"**Answer:** {truth}.") == 1.0
    assert reward(f"step ... = {truth}\n\\boxed{{{truth}}}") == 1.0
    assert reward(f"Answer: {int(truth) + 1}") == 0.0
    assert reward(f"Answer: 1{truth.lstrip('-')}") == 0.0  # contains the truth: no substring partial credit
    assert reward(f"The result is {truth}") == 0.0          # right number, missing the required format
    assert reward("Answer: I don't know") == 0.0
    assert reward("") == 0.0


@pytest.mark.needs("reasoning_gym")
def test_score_without_extra_info_uses_data_source():
    assert score("tlt/chain_sum", "Answer: 12", "12", None) == 1.0
    assert score("tlt/products", "Answer: 13", "12", None) == 0.0


@pytest.mark.needs("reasoning_gym")
def test_score_other_reasoning_gym_task():
    row = next(make_examples("train", 1, seed=0, levels=(Level("spell_backward", "default"),)))
    truth = row["reward_model"]["ground_truth"]
    assert score(row["data_source"], f"Answer: {truth}", truth, row["extra_info"]) == 1.0
    assert score(row["data_source"], "no answer here", truth, row["extra_info"]) == 0.0


@pytest.mark.needs("reasoning_gym")
def test_make_examples_mix_and_determinism():
    rows = list(make_examples("train", 2 * len(DEFAULT_MIX) + 1, seed=0))
    assert len(rows) == 2 * len(DEFAULT_MIX) + 1
    assert [r["extra_info"]["index"] for r in rows] == list(range(len(rows)))
    first = [(r["extra_info"]["generator"], r["extra_info"]["difficulty"]) for r in rows[:len(DEFAULT_MIX)]]
    assert first == [(lvl.generator, lvl.difficulty) for lvl in DEFAULT_MIX]  # round-robin
    assert rows == list(make_examples("train", len(rows), seed=0))
    val = list(make_examples("val", len(rows), seed=0))
    assert [r["prompt"] for r in val] != [r["prompt"] for r in rows]
    for r in rows:
        assert r["data_source"] == f"tlt/{r['extra_info']['generator']}"
        assert r["prompt"][0]["role"] == "user" and r["prompt"][0]["content"].endswith(INSTRUCTION)
        assert r["ability"] == "math" and r["reward_model"]["style"] == "rule"
        assert isinstance(json.loads(r["extra_info"]["metadata"]), dict)
    with pytest.raises(ValueError, match="unknown split"):
        next(make_examples("dev", 1, seed=0))


def _check_schema(rows, n):
    assert len(rows) == n
    for r in rows:
        assert set(r) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
        assert r["prompt"][0]["role"] == "user"
        assert isinstance(r["reward_model"]["ground_truth"], str)
        assert {"generator", "difficulty", "metadata", "index", "split"} <= set(r["extra_info"])


@pytest.mark.needs("reasoning_gym")
@pytest.mark.parametrize("fmt", datagen.FORMATS)
def test_write_dataset_default_mix(tmp_path, fmt):
    paths = datagen.write_dataset(tmp_path, None, n_train=20, n_val=7, seed=1, fmt=fmt)
    assert set(paths) == {"train", "val"}
    for split, n in (("train", 20), ("val", 7)):
        path = paths[split]
        rows = pq.read_table(path).to_pylist() if fmt == "parquet" else [
            json.loads(line) for line in path.read_text().splitlines()]
        _check_schema(rows, n)
        row = rows[0]
        truth = row["reward_model"]["ground_truth"]
        assert score(row["data_source"], f"Answer: {truth}", truth, row["extra_info"]) == 1.0
    assert not list(tmp_path.glob(".*tmp"))


@pytest.mark.needs("reasoning_gym")
def test_write_dataset_named_tasks(tmp_path):
    paths = datagen.write_dataset(tmp_path, ["chain_sum", "spell_backward"], n_train=6, n_val=2, fmt="parquet")
    rows = pq.read_table(paths["train"]).to_pylist()
    _check_schema(rows, 6)
    assert {r["data_source"] for r in rows} == {"tlt/chain_sum", "tlt/spell_backward"}
    with pytest.raises(ValueError, match="unknown reasoning-gym task"):
        datagen.write_dataset(tmp_path, ["no_such_task"], n_train=1, n_val=1)
    with pytest.raises(ValueError, match="unknown format"):
        datagen.write_dataset(tmp_path, None, n_train=1, n_val=1, fmt="csv")


GSM8K_RECORDS = [
    {"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "A farm sells 1,000 eggs twice. How many?", "answer": "1000*2=<<1000*2=2000>>2000\n#### 2,000"},
]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_convert_gsm8k(tmp_path, fmt):
    import pyarrow as pa

    conv = _convert_gsm8k_module()
    src = tmp_path / "src"
    src.mkdir()
    if fmt == "parquet":
        pq.write_table(pa.Table.from_pylist(GSM8K_RECORDS), src / "train-00000-of-00001.parquet")
    else:
        (src / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in GSM8K_RECORDS))
    assert conv.main(["--src", str(src), "--out", str(tmp_path / "out"), "--fmt", "jsonl"]) == 0
    split = "train" if fmt == "parquet" else "test"
    rows = [json.loads(line) for line in (tmp_path / "out" / f"{split}.jsonl").read_text().splitlines()]
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["7", "2000"]
    assert all(r["data_source"] == "openai/gsm8k" and "\\boxed{}" in r["prompt"][0]["content"] for r in rows)
    assert rows[1]["extra_info"]["index"] == 1 and rows[1]["extra_info"]["split"] == split


def test_convert_gsm8k_rejects_bad_answer(tmp_path):
    conv = _convert_gsm8k_module()
    bad = tmp_path / "train.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "no marker"}) + "\n")
    with pytest.raises(ValueError, match="####"):
        conv.convert(bad, tmp_path / "out")


@pytest.mark.needs("reasoning_gym")
def test_default_task_rows_are_scored_by_the_task_scorer():
    """tlt/<generator> data sources route to the task's own scorer (prefix registration), not generic math."""
    from tlt.rl.rewards import get_reward_fn
    from tlt.tasks.default_task import make_examples, score
    row = next(make_examples("train", 1, 0))
    fn = get_reward_fn(row["data_source"])
    assert fn.fn is score
    truth = row["reward_model"]["ground_truth"]
    assert fn.fn(row["data_source"], f"work...\nAnswer: {truth}", truth, row["extra_info"]) == 1.0
    assert get_reward_fn("openai/gsm8k").name == "default"


def test_tasks_do_not_import_the_reward_machinery():
    """One-way dependency: tlt.rl.rewards registers the tasks' scorers (tlt.tasks.SCORERS); tasks never import it."""
    code = ("import sys, tlt.tasks, tlt.tasks.datagen\n"
            "assert 'tlt.rl.rewards' not in sys.modules, 'a task module imports tlt.rl.rewards'\n"
            "import tlt.rl.rewards\n"
            "assert tlt.rl.rewards.get_reward_fn('tlt/chain_sum').fn is tlt.tasks.default_task.score\n")
    subprocess.run([sys.executable, "-c", code], check=True, env=os.environ | {"PYTHONPATH": str(ROOT)})
