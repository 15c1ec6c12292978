"""The long-tail sorting task: deterministic rows, a heavy-tailed size law, an exact scorer, its registration."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tlt.rl.rewards import get_reward_fn
from tlt.tasks.longtail_sort import DATA_SOURCE, SortTaskSpec, make_examples, score, write_datasets


def test_rows_deterministic_per_seed_and_split():
    a = list(make_examples("train", 50, seed=1))
    assert a == list(make_examples("train", 50, seed=1))
    assert a != list(make_examples("train", 50, seed=2))
    assert a != list(make_examples("val", 50, seed=1))


def test_sizes_heavy_tailed():
    sizes = np.array([r["extra_info"]["size"] for r in make_examples("train", 2000, seed=0)])
    p50, p90 = np.percentile(sizes, [50, 90])
    assert sizes.min() >= 3 and sizes.max() <= 200
    assert p90 / p50 >= 3.5, (p50, p90)            # log-uniform 3..200: p90/p50 ~ 5.5
    assert sizes.max() / p50 >= 7, (p50, sizes.max())  # ~ 8.3
    narrow = [r["extra_info"]["size"] for r in make_examples("train", 2000, 0, SortTaskSpec(min_size=50, max_size=60))]
    assert np.percentile(narrow, 90) / np.percentile(narrow, 50) < 1.3  # control: a narrow law is not heavy-tailed


def test_prompt_says_the_format_and_truth_is_sorted():
    row = next(make_examples("val", 1, seed=0))
    assert "Answer: a, b, c" in row["prompt"][0]["content"]
    truth = [int(x) for x in row["reward_model"]["ground_truth"].split(", ")]
    assert truth == sorted(truth) and len(truth) == row["extra_info"]["size"]


def test_score_right_wrong_malformed():
    row = next(make_examples("val", 1, seed=4))
    truth = row["reward_model"]["ground_truth"]
    nums = [int(x) for x in truth.split(", ")]
    right = f"Let me sort them.\nAnswer: {truth}"
    assert score(DATA_SOURCE, right, truth) == 1.0
    assert score(DATA_SOURCE, f"**Answer:** [{truth}].", truth) == 1.0
    swapped = nums[:]
    swapped[0], swapped[-1] = swapped[-1], swapped[0]
    assert score(DATA_SOURCE, "Answer: " + ", ".join(map(str, swapped)), truth) == 0.0
    assert score(DATA_SOURCE, "Answer: " + ", ".join(map(str, nums[:-1])), truth) == 0.0  # one missing
    assert score(DATA_SOURCE, "Answer: 1, two, 3", "1, 2, 3") == 0.0
    assert score(DATA_SOURCE, truth, truth) == 0.0                                     # no Answer line
    assert score(DATA_SOURCE, f"Answer: 0\nAnswer: {truth}", truth) == 1.0             # the last one counts


def test_registered_for_its_data_source_not_the_default_task():
    fn = get_reward_fn(DATA_SOURCE).fn
    assert fn is score


def test_write_datasets(tmp_path):
    train, val = write_datasets(tmp_path, n_train=7, n_val=3, seed=0)
    rows = [json.loads(line) for line in train.read_text().splitlines()]
    assert len(rows) == 7 and len(val.read_text().splitlines()) == 3
    assert rows == list(make_examples("train", 7, 0))


def test_bad_spec():
    with pytest.raises(ValueError):
        SortTaskSpec(min_size=10, max_size=5)


def test_recipe_config_loads_and_points_at_the_shipped_data():
    from pathlib import Path

    from tlt.config import load_config
    root = Path(__file__).resolve().parents[1]
    cfg = load_config(str(root / "configs" / "gpu_longtail.yaml"))
    assert (cfg.data.train_batch_size, cfg.rollout.n, cfg.data.max_response_length) == (32, 8, 4096)
    assert cfg.rollout.temperature == 1.0
    shipped = [json.loads(line) for line in (root / cfg.data.train_files[0]).read_text().splitlines()]
    assert shipped == list(make_examples("train", len(shipped), seed=0))  # regenerable from the documented command


def test_recipe_warms_up_a_stronger_drafter_on_its_own_data(monkeypatch, tmp_path):
    from pathlib import Path

    import tlt.drafter_train.offline as offline
    import tlt.models.smollm as smollm
    from tlt.config import load_config
    from tlt.rl.trainer import DistInfo, prepare_config
    root = Path(__file__).resolve().parents[1]
    seen = {}
    monkeypatch.setattr(smollm, "default_model_path", lambda: tmp_path / "SmolLM2-135M-Instruct")
    monkeypatch.setattr(offline, "default_drafter_path", lambda path, build: seen.setdefault("build", build))
    cfg = load_config(str(root / "configs" / "gpu_longtail.yaml"))
    prepare_config(cfg, DistInfo(rank=0, world_size=1))
    build = seen["build"]
    assert (build["num_prompts"], build["n"], build["max_tokens"], build["steps"]) == (256, 4, 1024, 2000)
    assert build["temperatures"] == "1.0" and build["data"] == "configs/longtail_data/train.jsonl"
    assert offline.drafter_cache_dir("m", build) != offline.drafter_cache_dir("m", offline.DEFAULT_BUILD)
    # warmup_temperatures=null: the warm-up samples at the run's rollout temperature
    cfg = load_config(None, ["rollout.temperature=0.8", f"data.train_files=[{root / cfg.data.train_files[0]}]"])
    seen.clear()
    prepare_config(cfg, DistInfo(rank=0, world_size=1))
    assert seen["build"]["temperatures"] == "0.8" and cfg.drafter_train.warmup_temperatures is None
