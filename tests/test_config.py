"""Config loading: defaults, YAML + overrides, round trip, and the fix-it error messages."""

from pathlib import Path

import pytest

from tlt.config import (Config, ConfigError, config_reference_markdown, config_to_dict, format_config, load_config,
                        save_config)


def test_defaults_match_brief():
    cfg = load_config()
    assert cfg == Config()
    assert cfg.model.path is None and cfg.rollout.n == 4 and cfg.actor.clip_ratio_high == 0.28
    assert cfg.speculative.bs_threshold == 32 and cfg.trainer.total_steps == 20


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rollout:\n  n: 2\n  temperature: 0.7\nactor:\n  lr: 1e-5\ntrainer:\n  total_steps: 5\n")
    cfg = load_config(str(path), ["trainer.total_steps=20", "rollout.n=8", "speculative.bs_threshold=null",
                                  "data.train_files=[a.parquet, b.jsonl]", "trainer.logger=console",
                                  "actor.betas=[0.9, 0.95]"])
    assert cfg.rollout.n == 8 and cfg.rollout.temperature == 0.7
    assert cfg.actor.lr == 1e-5  # YAML 1.1 reads 1e-5 as a string; float fields accept it
    assert cfg.trainer.total_steps == 20
    assert cfg.speculative.bs_threshold is None
    assert cfg.data.train_files == ["a.parquet", "b.jsonl"]
    assert cfg.trainer.logger == ["console"]
    assert cfg.actor.betas == [0.9, 0.95]


def test_round_trip(tmp_path):
    cfg = load_config(None, ["rollout.n=8", "reward.custom_function=my/r.py:score", "trainer.experiment_name=x1",
                             "speculative.draft_topk=2", "actor.loss_agg_mode=seq-mean-token-mean"])
    path = tmp_path / "saved.yaml"
    save_config(cfg, str(path))
    assert load_config(str(path), []) == cfg
    assert config_to_dict(cfg)["rollout"]["n"] == 8
    assert "rollout:\n  n: 8\n" in format_config(cfg)


def test_unknown_key_names_nearest():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["rollout.tempreature=0.5"])
    msg = str(e.value)
    assert "'tempreature'" in msg and "Did you mean 'temperature'" in msg and "top_p" in msg  # valid keys listed
    with pytest.raises(ConfigError, match="Did you mean 'rollout'"):
        load_config(None, ["rolout.n=2"])
    with pytest.raises(ConfigError, match="exists in section"):
        load_config(None, ["actor.n=2"])


def test_unknown_key_in_yaml_names_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("data:\n  train_batch_sise: 4\n")
    with pytest.raises(ConfigError) as e:
        load_config(str(path))
    assert "train_batch_sise" in str(e.value) and "train_batch_size" in str(e.value) and str(path) in str(e.value)


@pytest.mark.parametrize("override, needles", [
    ("rollout.n=abc", ["rollout.n", "'abc'", "expected int"]),
    ("rollout.n=0", ["rollout.n=0", ">= 1"]),
    ("rollout.temperature=-1", ["rollout.temperature", ">= 0"]),
    ("rollout.top_p=0", ["rollout.top_p", "> 0 and <= 1"]),
    ("rollout.top_p=1.5", ["rollout.top_p", "<= 1"]),
    ("actor.clip_ratio_low=-0.1", ["actor.clip_ratio_low", ">= 0"]),
    ("actor.loss_agg_mode=mean", ["actor.loss_agg_mode", "'mean'", '"token-mean"']),
    ("speculative.method=medusa", ["speculative.method", '"eagle" | "ngram"']),
    ("trainer.logger=[console, mlflow]", ["trainer.logger", '"wandb"']),
    ("data.shuffle=maybe", ["data.shuffle", "expected bool"]),
    ("actor.ppo_mini_batch_size=3", ["ppo_mini_batch_size=3", "divide"]),
    ("reward.custom_function=score", ["path/to/file.py:function_name"]),
    ("rollout.n", ["section.key=value"]),
])
def test_bad_values_explain_what_is_allowed(override, needles):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    for needle in needles:
        assert needle in str(e.value)


def test_reference_markdown_covers_every_key():
    md = config_reference_markdown()
    for section, values in config_to_dict(Config()).items():
        for key in values:
            assert f"`{section}.{key}`" in md
    assert "| `rollout.n` | int | `4` |" in md


def test_docs_config_md_is_current():
    """docs/config.md is generated: regenerate it with
    python -c "from tlt.config import config_reference_markdown as m; open('docs/config.md','w').write(m())" """
    path = Path(__file__).resolve().parents[1] / "docs" / "config.md"
    assert path.read_text() == config_reference_markdown()


@pytest.mark.parametrize("fast_bf16", [True, False])
def test_rollout_dtype_auto_is_bf16_where_bf16_is_fast(monkeypatch, fast_bf16):
    """rollout.dtype=auto: the engine decodes a bf16 copy of the fp32 policy on hardware with fast bf16 (verl's
    bf16 rollouts), the policy's own weights elsewhere; an explicit dtype is taken as given."""
    import tlt.device
    monkeypatch.setattr(tlt.device, "cpu_has_fast_bf16", lambda: fast_bf16)
    cfg = load_config(None, ["model.device=cpu"])
    assert cfg.policy_dtype() == "float32"
    assert cfg.rollout_dtype() == ("bfloat16" if fast_bf16 else "float32")
    assert load_config(None, ["model.device=cpu", "rollout.dtype=float32"]).rollout_dtype() == "float32"
    assert load_config(None, ["model.device=cpu", "rollout.dtype=bfloat16"]).rollout_dtype() == "bfloat16"
    assert load_config(None, ["model.device=cpu", "model.dtype=bfloat16"]).rollout_dtype() == "bfloat16"


@pytest.mark.parametrize("value", ["[]", "[-1]", "[0.7, -0.5]"])
def test_warmup_temperatures_are_checked_at_load(value):
    with pytest.raises(ConfigError, match="warmup_temperatures"):
        load_config(None, [f"drafter_train.warmup_temperatures={value}"])
    load_config(None, ["drafter_train.warmup_temperatures=[0.7, 1.0]"])  # controls; 0 = greedy, as for rollouts
    load_config(None, ["drafter_train.warmup_temperatures=[0]"])
