"""`tlt train-drafter` end to end on a tiny random model: generate, train, save; drafter_io loads it back,
provenance is written, held-out loss goes down; the cached default drafter is built once, atomically."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import make_tiny_checkpoint
from tlt.drafter_train import offline
from tlt.models import load_model
from tlt.speculative.drafter_io import load_drafter


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model dir, jsonl of token-id prompts): the tiny checkpoint has no tokenizer, so prompts are ids."""
    root = tmp_path_factory.mktemp("offline")
    model_dir = make_tiny_checkpoint(root / "tiny", "llama", vocab_size=128, hidden_size=64)
    g = torch.Generator().manual_seed(0)
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt_token_ids": torch.randint(1, 128, (int(n),), generator=g).tolist()})
                            + "\n" for n in torch.randint(4, 12, (24,), generator=g)))
    return model_dir, str(data)


ARGS = ["--num-prompts", "24", "--max-tokens", "24", "--batch-tokens", "128", "--window-len", "32",
        "--num-rows", "2", "--holdout-every", "4", "--lr", "3e-3", "--amp", "none", "--dtype", "float32"]


def test_train_drafter_end_to_end(tiny, tmp_path, capsys):
    model_dir, data = tiny
    out = tmp_path / "drafter"
    argv = [f"model={model_dir}", f"data={data}", f"out={out}", "steps=30", "draft_vocab=64", *ARGS]
    assert offline.main(argv) == 0
    prov = json.loads((out / "provenance.json").read_text())
    assert prov["command"].startswith("tlt train-drafter model=")
    assert prov["num_prompts"] == 24 and prov["num_samples"] == 24 and prov["steps"] == 30
    assert prov["num_response_tokens"] == 24 * 24  # random model, no EOS: every response runs to max_tokens
    assert len(prov["target_config_sha256"]) == 64 and prov["tlt_version"]
    before, after = prov["metrics_before"], prov["metrics"]
    assert after["loss"] < before["loss"] and after["hidden_loss"] < 0.95 * before["hidden_loss"]
    assert 1.0 <= after["accept_proxy"] <= 9.0
    target = load_model(model_dir)
    drafter = load_drafter(out).attach(target)
    assert drafter.d2t is not None and drafter.d2t.numel() == 64
    with torch.no_grad():
        pred = drafter(torch.randn(1, 3, 64), torch.tensor([[1, 2, 3]]), torch.tensor([[4, 5, 6]]))
    assert torch.isfinite(drafter.logits(pred)).all()
    assert "accept_proxy" in capsys.readouterr().out


def test_fc_bias_false_trains_vllms_stock_drafter_shape(tiny, tmp_path):
    """fc_bias=false draft_vocab=0: a drafter with no fc bias over the full vocabulary (what `tlt export-drafter`
    writes as plain EAGLE-1), trained: its loss falls like the default shape's."""
    from tlt.export.vllm import stock_misfits
    model_dir, data = tiny
    out = tmp_path / "plain"
    assert offline.main([f"model={model_dir}", f"data={data}", f"out={out}", "steps=20", "fc_bias=false", *ARGS]) == 0
    drafter = load_drafter(out).attach(load_model(model_dir))
    assert drafter.fc.bias is None and drafter.d2t is None and stock_misfits(drafter) == []
    from tlt.drafter_train.online import training_copy
    copy = training_copy(drafter)  # what online rounds train: the same shape, not one with a random bias
    assert copy.fc.bias is None and torch.equal(copy.fc.weight, drafter.fc.weight)
    prov = json.loads((out / "provenance.json").read_text())
    assert prov["config"]["fc_bias"] is False and prov["metrics"]["loss"] < prov["metrics_before"]["loss"]
    assert offline.parse_args(["--fc-bias", "true"]).fc_bias is True  # the default shape, as before the option
    assert offline.drafter_cache_dir("m", dict(offline.DEFAULT_BUILD, fc_bias=False)) != \
        offline.drafter_cache_dir("m")  # another build, cached apart
    with pytest.raises(SystemExit):
        offline.parse_args(["fc_bias=maybe"])


def test_key_value_and_flag_spellings_agree():
    a = offline.parse_args(["num_prompts=5", "temperatures=1.0,0.6", "--lr", "0.01"])
    b = offline.parse_args(["--num-prompts", "5", "--temperatures", "1.0,0.6", "lr=0.01"])
    assert a == b and a.num_prompts == 5 and a.lr == 0.01
    with pytest.raises(SystemExit):
        offline.parse_args(["no_such_option=1"])


def test_default_drafter_path_builds_once(tiny, tmp_path, monkeypatch, capsys):
    """Built once, then reused; a new version's default build replaces the older default drafter in the same
    directory (the default build's directory has no build suffix)."""
    model_dir, data = tiny
    monkeypatch.setenv("TLT_CACHE", str(tmp_path / "cache"))
    build = dict(data=data, num_prompts=8, max_tokens=8, steps=2, draft_vocab=0, batch_tokens=64, window_len=16,
                 holdout_every=4, amp="none", dtype="float32", temperatures="1.0,0.5", threads=1)
    monkeypatch.setattr(offline, "DEFAULT_BUILD", build)
    path = offline.default_drafter_path(model_dir)
    assert path == tmp_path / "cache" / "drafters" / "tiny"
    assert (path / "drafter.safetensors").is_file() and (path / "provenance.json").is_file()
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # temp dir renamed away
    assert json.loads((path / "provenance.json").read_text())["num_samples"] == 16  # 8 prompts x 2 temperatures
    stamp = (path / "provenance.json").stat().st_mtime_ns
    assert offline.default_drafter_path(model_dir) == path  # cached: not rebuilt
    assert (path / "provenance.json").stat().st_mtime_ns == stamp
    assert "rebuilding" not in capsys.readouterr().out
    monkeypatch.setattr(offline, "DEFAULT_BUILD", dict(build, num_prompts=4, temperatures="0.5"))
    assert offline.default_drafter_path(model_dir) == path  # the same directory
    assert "built with other settings than this version's: rebuilding it" in capsys.readouterr().out
    prov = json.loads((path / "provenance.json").read_text())
    assert prov["num_samples"] == 4 and prov["config"]["temperatures"] == "0.5"
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # nothing left aside


def test_the_warm_up_samples_at_the_rollout_temperature():
    """warmup_temperatures=null follows rollout.temperature; the default build is the default config's."""
    from tlt.config import DrafterTrainConfig, load_config
    from tlt.rl.trainer import DEFAULT_CONFIG
    assert offline.warmup_build(DrafterTrainConfig(), None, temperature=1.0)["temperatures"] == "1.0"
    assert offline.warmup_build(DrafterTrainConfig(warmup_temperatures=[0.7, 1]), None, temperature=0.2)[
        "temperatures"] == "0.7,1.0"
    default = load_config(str(DEFAULT_CONFIG))
    assert default.rollout.temperature == offline.DEFAULT_TEMPERATURE
    build = offline.warmup_build(default.drafter_train, None, temperature=default.rollout.temperature)
    assert offline.drafter_cache_dir("m", build) == offline.drafter_cache_dir("m", offline.DEFAULT_BUILD)
    assert offline.drafter_cache_dir("m", offline.warmup_build(default.drafter_train, None, temperature=1.0)) != \
        offline.drafter_cache_dir("m", offline.DEFAULT_BUILD)  # another temperature: another build


class FakeChatTokenizer:
    """Enough of a tokenizer for load_prompts: a chat template and character-code ids."""
    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def __call__(self, text, add_special_tokens):
        return {"input_ids": [ord(c) % 128 for c in text]}


def test_verl_rows_get_the_chat_template(tmp_path):
    rows = [{"data_source": "x", "prompt": [{"role": "user", "content": f"q{i}"}],
             "reward_model": {"style": "rule", "ground_truth": "1"}} for i in range(3)]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ids, source = offline.load_prompts(offline.OfflineConfig(data=str(path), num_prompts=2), FakeChatTokenizer())
    assert source == str(path) and len(ids) == 2
    assert ids[1] == [ord(c) % 128 for c in "<user>q1<assistant>"]
    with pytest.raises(ValueError, match="no tokenizer"):
        offline.load_prompts(offline.OfflineConfig(data=str(path)), None)


def test_warmup_keys_choose_the_build_and_its_own_cache_dir(tiny, tmp_path, monkeypatch):
    from tlt.config import DrafterTrainConfig
    model_dir, data = tiny
    monkeypatch.setenv("TLT_CACHE", str(tmp_path / "cache"))
    default = offline.warmup_build(DrafterTrainConfig(), None, offline.DEFAULT_TEMPERATURE)
    assert offline.drafter_cache_dir(model_dir, default) == tmp_path / "cache" / "drafters" / "tiny"  # as before
    unrolled = offline.warmup_build(DrafterTrainConfig(ttt_steps=3), None, offline.DEFAULT_TEMPERATURE)  # unrolled training: a build of its own
    assert unrolled["ttt_steps"] == 3 and offline.drafter_cache_dir(model_dir, unrolled).name.startswith("tiny-")
    strong_cfg = DrafterTrainConfig(warmup_num_prompts=6, warmup_samples_per_prompt=2, warmup_max_tokens=8,
                                    warmup_steps=3, warmup_temperatures=[0.7], ttt_steps=2)
    strong = offline.warmup_build(strong_cfg, data, offline.DEFAULT_TEMPERATURE) | dict(draft_vocab=0, batch_tokens=64, window_len=16,
                                                          holdout_every=4, amp="none", dtype="float32")
    assert (strong["num_prompts"], strong["n"], strong["max_tokens"], strong["steps"], strong["temperatures"]) == \
        (6, 2, 8, 3, "0.7")
    path = offline.default_drafter_path(model_dir, strong)
    assert path.parent == tmp_path / "cache" / "drafters" and path.name.startswith("tiny-")  # not the default's
    prov = json.loads((path / "provenance.json").read_text())
    assert prov["num_samples"] == 12 and prov["steps"] == 3 and prov["config"]["temperatures"] == "0.7"
    assert prov["config"]["ttt_steps"] == 2
    assert offline.default_drafter_path(model_dir, dict(strong)) == path  # same build, same cache entry
    lines = Path(data).read_text().splitlines(keepends=True)
    Path(data).write_text("".join(lines[1:] + lines[:1]))  # the same path with other content: another build
    try:
        assert offline.drafter_cache_dir(model_dir, strong) != path
    finally:
        Path(data).write_text("".join(lines))


@pytest.mark.parametrize("idle,most,threads", [(None, 2, 2), (0.3, 2, 1), (1.4, 2, 1), (1.6, 2, 2), (5.0, 2, 2)])
def test_build_threads_are_the_idle_cores(monkeypatch, idle, most, threads):
    """threads=0: a thread per core other processes leave idle (at least one, at most torch's default); where that
    cannot be read, torch's default."""
    monkeypatch.setattr(offline, "idle_cpu_cores", lambda: idle)
    assert offline.build_threads(most) == threads


def test_threads_do_not_make_another_build():
    """Threads and logging change how a build runs, not what it builds: a cached drafter stays valid, and other
    builds keep the directory names they had when threads named builds."""
    prov = {"config": dict(offline.DEFAULT_BUILD, threads=1, log_every=50)}
    assert offline._built_as(prov, offline.DEFAULT_BUILD)
    assert not offline._built_as({"config": dict(offline.DEFAULT_BUILD, steps=100)}, offline.DEFAULT_BUILD)
    for build, name in ((dict(offline.DEFAULT_BUILD, steps=100), "m-d74b71af42"),
                        (dict(offline.DEFAULT_BUILD, temperatures="1.0", threads=2), "m-6ebea7b595")):
        assert offline.drafter_cache_dir("m", build).name == name
