"""GRPO trainer end to end on a tiny random Llama: parameters change, checkpoints load in transformers, resume is
exact, metrics are complete, failing rewards are counted, bad config fails fast, and 2-process data parallel
keeps the ranks identical.

    pytest tests/test_trainer.py -q
"""
from __future__ import annotations

import dataclasses
import json
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from tlt.config import load_config
from tlt.rl.actor import micro_batches, split_groups
from tlt.rl.evaluate import pass_at_k
from tlt.rl.tiny_model import build_tiny_model
from tlt.rl.trainer import DrafterHook, GRPOTrainer, main

VARIED_REWARD = """
def score(data_source, solution_str, ground_truth, extra_info=None):
    return (sum(map(ord, solution_str)) % 7) / 6  # arbitrary but varied: groups get nonzero advantages
"""
FAILING_REWARD = """
import time
def score(data_source, solution_str, ground_truth, extra_info=None):
    kind = len(solution_str) % 3
    if kind == 0:
        raise ValueError("boom")
    if kind == 1:
        time.sleep(3)
    return 1.0
"""


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models on a shared CPU: one thread is much faster than oversubscribed OpenMP."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny_policy"))


def write_data(path, n: int) -> str:
    rows = [{"prompt": f"What is {i % 10} + {(3 * i) % 10}?", "answer": str(i % 10 + (3 * i) % 10)} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def make_overrides(tmp_path, tiny_dir, reward: str = VARIED_REWARD, **extra) -> list[str]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "reward.py").write_text(reward)
    base = {
        "model.path": tiny_dir, "model.device": "cpu",
        "data.train_files": write_data(tmp_path / "train.jsonl", 16),
        "data.val_files": write_data(tmp_path / "val.jsonl", 3),
        "data.max_prompt_length": 64, "data.max_response_length": 16, "data.train_batch_size": 2,
        "rollout.n": 4, "rollout.dtype": "float32",  # the shared fp32 policy whatever this CPU's bf16 (auto)
        "drafter_train.spot": False,  # drafter sessions after the update, whatever this machine's cores (null)
        "actor.lr": 1e-3, "reward.custom_function": f"{tmp_path / 'reward.py'}:score",
        "speculative.enabled": False, "trainer.total_steps": 2, "trainer.save_freq": -1, "trainer.test_freq": -1,
        "trainer.default_local_dir": str(tmp_path / "runs"), "trainer.logger": "[jsonl]", "trainer.resume": "disable",
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def run(tmp_path, tiny_dir, hook: DrafterHook | None = None, **extra) -> GRPOTrainer:
    cfg = load_config(None, make_overrides(tmp_path, tiny_dir, **extra))
    trainer = GRPOTrainer(cfg, drafter_hook=hook)
    trainer.fit()
    return trainer


def read_metrics(trainer: GRPOTrainer) -> list[dict]:
    return [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_steps_change_params_and_checkpoint_loads_in_transformers(tmp_path, tiny_dir):
    from tlt.models.loader import load_model
    initial = load_model(tiny_dir).state_dict()
    trainer = run(tmp_path, tiny_dir)
    final = trainer.model.state_dict()
    assert all(torch.isfinite(v).all() for v in final.values()), "NaN/inf in parameters"
    changed = [k for k in initial if not torch.equal(initial[k], final[k])]
    assert len(changed) >= len(initial) // 2, f"only {changed} changed"

    ckpt = trainer.run_dir / "global_step_2"
    assert (trainer.run_dir / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert not [p for p in trainer.run_dir.iterdir() if p.name.startswith(".")], "temp dirs left behind"
    from tlt.models.loader import umask
    modes = {str(f.relative_to(ckpt)): oct(f.stat().st_mode & 0o777) for f in ckpt.rglob("*") if f.is_file()}
    assert set(modes.values()) == {oct(0o666 & ~umask())}, modes  # safetensors' files too: shareable as any other
    from transformers import AutoModelForCausalLM, AutoTokenizer
    hf = AutoModelForCausalLM.from_pretrained(str(ckpt)).eval()
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    ids = torch.tensor([tok("What is 1 + 2?")["input_ids"]])
    with torch.no_grad():
        ours = trainer.model.logits(trainer.model(ids))
        theirs = hf(ids).logits
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


class CountingHook(DrafterHook):
    """Counts calls (state saved in checkpoints); crashes at `crash_at` to simulate a preempted run."""

    def __init__(self, crash_at: int | None = None):
        self.calls, self.crash_at = 0, crash_at

    def after_rollout(self, step, rollout, outputs):
        if step == self.crash_at:
            raise RuntimeError("simulated preemption")
        self.calls += 1
        assert len(rollout) == len(outputs) * 4 and all(len(o.outputs) == 4 for o in outputs)
        return {"drafter/calls": float(self.calls)}

    def state_dict(self):
        return {"calls": self.calls}

    def load_state_dict(self, state):
        self.calls = state["calls"]


def test_resume_is_exact(tmp_path, tiny_dir):
    """2 steps + checkpoint + crash, then resume=auto and 2 more steps == 4 straight steps."""
    opts = {"actor.use_kl_loss": True, "actor.ppo_mini_batch_size": 1, "actor.ppo_max_token_len": 64,
            "actor.lr_scheduler": "cosine", "actor.warmup_steps": 1, "trainer.total_steps": 4}
    straight = run(tmp_path / "a", tiny_dir, **opts)
    with pytest.raises(RuntimeError, match="simulated preemption"):
        run(tmp_path / "b", tiny_dir, hook=CountingHook(crash_at=3), **opts, **{"trainer.save_freq": 2})
    hook = CountingHook()
    resumed = GRPOTrainer(load_config(None, make_overrides(tmp_path / "b", tiny_dir, **opts,
                                                           **{"trainer.resume": "auto"})), drafter_hook=hook)
    assert resumed.start_step == 2 and hook.calls == 2
    resumed.fit()
    assert hook.calls == 4
    a, b = straight.model.state_dict(), resumed.model.state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=0, msg=f"{k} differs after resume")
    steps = [m["step"] for m in read_metrics(resumed)]
    assert steps == [1, 2, 3, 4]


def test_metrics_have_verl_names(tmp_path, tiny_dir):
    trainer = run(tmp_path, tiny_dir, **{"actor.use_kl_loss": True, "trainer.test_freq": 1,
                                         "rollout.recompute_logprobs": True, "actor.bf16_autocast": False,
                                         "trainer.logger": "[jsonl, tensorboard]"})
    lines = read_metrics(trainer)
    assert [m["step"] for m in lines] == [0, 1, 2]  # step 0: validation before training (verl's val_before_train)
    assert set(lines[0]) == {"step", "val/accuracy", "val/response_length/mean"}
    expected = {"actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "actor/lr",
                "critic/score/mean", "critic/score/max", "critic/score/min", "critic/advantages/mean",
                "response_length/mean", "response_length/max", "response_length/min", "response_length/p50",
                "response_length/p90", "response_length/clip_ratio", "prompt_length/mean", "timing_s/gen",
                "timing_s/reward", "timing_s/old_log_prob", "timing_s/update_actor", "timing_s/step",
                "timing_s/testing", "throughput/tokens_per_s", "rollout/num_generated_tokens",
                "rollout/logprob_max_diff", "data/num_filtered_prompts", "val/accuracy", "reward/num_errors",
                "response_length/p90_over_p50", "response_length/max_over_p50", "timing_s/ref",
                "timing_s/weight_sync", "timing_s/drafter", "timing_s/rollout_fraction"}
    missing = expected - set(lines[-1])
    assert not missing, f"missing metrics: {sorted(missing)}"
    for m in lines[1:]:
        phases = ("gen", "reward", "old_log_prob", "ref", "update_actor", "weight_sync", "drafter", "testing")
        assert sum(m.get(f"timing_s/{p}", 0.0) for p in phases) <= m["timing_s/step"] + 1e-6
        assert m["timing_s/rollout_fraction"] == pytest.approx(m["timing_s/gen"] / m["timing_s/step"])
        assert 0 < m["timing_s/rollout_fraction"] < 1
        p50 = max(m["response_length/p50"], 1.0)
        assert m["response_length/max_over_p50"] == pytest.approx(m["response_length/max"] / p50)
        assert m["response_length/p90_over_p50"] == pytest.approx(m["response_length/p90"] / p50)
        # the step's own decode time at a running batch <= k (8 sequences: all of it at <= 8), not a running sum
        tail = [m[f"rollout/decode_time_upto_bs/{k}"] for k in (1, 2, 4, 8)]
        assert tail == sorted(tail) and tail[-1] == pytest.approx(m["rollout/decode_time_s"])
    # fp32 engine and fp32 trainer forward on the same weights: the engine's log-probs are the old policy's
    assert lines[1]["rollout/logprob_max_diff"] < 1e-4
    assert any(p.name.startswith("events") for p in (trainer.run_dir / "tensorboard").iterdir())


def test_gspo_trains_from_the_command_line_config(tmp_path, tiny_dir):
    """actor.policy_loss=gspo with the paper's clip ranges runs a step that moves the policy, logging verl's names."""
    from tlt.models.loader import load_model
    initial = load_model(tiny_dir).state_dict()
    trainer = run(tmp_path, tiny_dir, **{"actor.policy_loss": "gspo", "actor.clip_ratio_low": 3e-4,
                                         "actor.clip_ratio_high": 4e-4, "trainer.total_steps": 1})
    m = read_metrics(trainer)[0]
    assert m["actor/pg_clipfrac"] == 0 and m["actor/ppo_kl"] == 0  # one mini-batch: on policy, ratio 1
    assert all(torch.isfinite(torch.tensor(m[k])) for k in ("actor/pg_loss", "actor/grad_norm"))
    final = trainer.model.state_dict()
    assert sum(not torch.equal(initial[k], final[k]) for k in initial) >= len(initial) // 2


def test_unknown_policy_loss_or_estimator_fails_before_any_rollout(tmp_path, tiny_dir):
    from tlt.config import ConfigError
    for key, value, valid in (("actor.policy_loss", "gpso", "gspo, vanilla"),
                              ("algorithm.adv_estimator", "rlo", "grpo, rloo")):
        cfg = load_config(None, make_overrides(tmp_path, tiny_dir, **{key: value}))
        with pytest.raises(ConfigError, match=f"'{value}'; registered: {valid}.*{key}"):
            GRPOTrainer(cfg)


def test_failing_and_hanging_rewards_are_counted_and_run_goes_on(tmp_path, tiny_dir):
    trainer = run(tmp_path, tiny_dir, reward=FAILING_REWARD, **{"reward.timeout_s": 0.2})
    lines = read_metrics(trainer)
    assert len(lines) == 2
    errors = sum(m["reward/num_errors"] for m in lines)
    timeouts = sum(m["reward/num_timeouts"] for m in lines)
    assert errors > 0 and lines[-1]["reward/total_errors"] == errors
    assert 0 < timeouts <= errors
    assert all(m["critic/score/min"] == 0.0 for m in lines if m["reward/num_errors"])  # failures score 0


def test_speculative_rollouts_log_spec_metrics(tmp_path, tiny_dir):
    trainer = run(tmp_path, tiny_dir, **{"speculative.enabled": True, "speculative.method": "ngram",
                                         "speculative.adaptive": False,  # SD every step, whatever it pays here
                                         "trainer.total_steps": 1})
    metrics = read_metrics(trainer)[0]
    assert metrics["rollout/num_spec_steps"] > 0 and metrics["rollout/spec_accept_length"] >= 1.0


def test_eval_command_reports_mean_and_pass_at_k(tmp_path, tiny_dir, capsys):
    from tlt.rl.evaluate import main as eval_main
    trainer = run(tmp_path, tiny_dir, **{"trainer.total_steps": 1})
    val = str(tmp_path / "val.jsonl")
    assert eval_main([str(trainer.run_dir / "global_step_1"), f"data.val_files={val}", "rollout.n=2"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["num_prompts"] == 3 and result["n"] == 2 and set(result["pass_at_k"]) == {"1", "2"}
    assert 0 <= result["accuracy"] <= 1 and result["response_length_max"] <= 16


def test_dynamic_sampling_drops_flat_groups_and_skips_an_empty_update(tmp_path, tiny_dir):
    from tlt.models.loader import load_model
    constant = "def score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n"
    trainer = run(tmp_path, tiny_dir, reward=constant, **{"rollout.dynamic_sampling": True,
                                                           "rollout.overlong_filter": True, "trainer.total_steps": 1})
    m = read_metrics(trainer)[0]
    assert m["data/num_gen_batches"] == 4 and m["data/num_dropped_groups"] == 8  # 4 rounds x 2 prompts, all flat
    assert m["actor/num_skipped_steps"] == 1  # nothing left to train on: no optimiser step at all
    initial = load_model(tiny_dir).state_dict()
    assert all(torch.equal(v, trainer.model.state_dict()[k]) for k, v in initial.items())


def test_bad_config_key_fails_fast(capsys):
    from tlt.cli import main as tlt_main
    assert tlt_main(["train", "trainer.totl_steps=3"]) == 2
    err = capsys.readouterr().err
    assert "unknown config key 'totl_steps'" in err and "total_steps" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_on_a_cpu_machine_is_a_config_error(capsys, monkeypatch):
    from tlt.cli import main as tlt_main
    monkeypatch.chdir(REPO)
    assert tlt_main(["train", "configs/smoke.yaml", "model.device=cuda"]) == 2
    assert "model.device" in capsys.readouterr().err


def test_micro_batches_respect_token_budget_and_groups_split():
    assert micro_batches([10, 10, 30, 5], 40) == [[2], [0, 1, 3]]  # longest first
    assert micro_batches([100], 10) == [[0]]  # one row always fits
    # a long tail: arrival order pads the short rows next to the long ones (1240 tokens); sorted: 680
    assert micro_batches([300, 20, 20, 300, 20, 20], 800) == [[0, 3], [1, 2, 4, 5]]
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        lens = (torch.randint(1, 40, (30,), generator=g) ** 2).tolist()
        chunks = micro_batches(lens, 2000)
        assert sorted(i for c in chunks for i in c) == list(range(30))
        assert all(len(c) * max(lens[i] for i in c) <= 2000 or len(c) == 1 for c in chunks)
        padded = sum(len(c) * max(lens[i] for i in c) for c in chunks)
        arrival, cur = 0, []  # the greedy split in arrival order, for comparison
        for n in lens + [None]:
            if cur and (n is None or (len(cur) + 1) * max(cur + [n]) > 2000):
                arrival, cur = arrival + len(cur) * max(cur), []
            if n is not None:
                cur.append(n)
        assert padded <= arrival
    assert split_groups([7, 7, 8, 8, 9, 9], 3) == [[0, 1], [2, 3], [4, 5]]
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25) and pass_at_k(4, 1, 4) == 1.0 and pass_at_k(4, 0, 2) == 0.0


def _actor_batch(prompt_shared: bool):
    from tlt.rl.rollout import ActorBatch
    g = torch.Generator().manual_seed(1)
    N = 6
    plens = torch.tensor([5, 5, 7, 7, 4, 4])
    resp = torch.tensor([3, 17, 2, 9, 17, 1])
    T, R = int((plens + resp).max()), int(resp.max())
    ids = torch.randint(1, 100, (N, T), generator=g)
    if prompt_shared:  # the two responses of each group answer one prompt
        for a in range(0, N, 2):
            ids[a + 1, :plens[a]] = ids[a, :plens[a]]
    for i in range(N):
        ids[i, plens[i] + resp[i]:] = 0
    mask = (torch.arange(R)[None] < resp[:, None]).float()
    return ActorBatch(ids, plens, resp, mask, -torch.rand(N, R, generator=g), torch.randn(N, 1, generator=g) * mask,
                      torch.arange(N) // 2, 1.0)


def _log_probs_and_grads(tiny_dir, batch, **cfg):
    from tlt.config import ActorConfig
    from tlt.models import load_model
    from tlt.rl.actor import Actor
    model = load_model(tiny_dir, dtype=torch.float32, device="cpu")
    # fp32 throughout: the layouts are equal in exact arithmetic, and bf16 autocast (on by default where the CPU
    # has native bf16) would round each layout differently, ~1e-3
    actor = Actor(model, ActorConfig(lr=0.0, bf16_autocast=False, **cfg), total_steps=1)
    lp = actor.compute_log_probs(batch)
    actor.update(batch, num_mini_batches=1)  # lr 0: the gradients stay in .grad, the weights unchanged
    return lp, {k: p.grad.clone() for k, p in model.named_parameters()}


def _assert_same(a, b):
    (lp_a, g_a), (lp_b, g_b) = a, b
    torch.testing.assert_close(lp_b, lp_a, atol=1e-5, rtol=0)
    assert any(g.abs().sum() > 0 for g in g_a.values())
    for k in g_a:
        torch.testing.assert_close(g_b[k], g_a[k], atol=1e-6, rtol=1e-4, msg=k)


def test_actor_same_result_whatever_the_micro_batch_split(tiny_dir):
    """Sorted, padded micro-batches (many, under a small token budget) give the log-probs of one whole-batch
    forward, row for row, and the same accumulated gradient."""
    batch = _actor_batch(prompt_shared=False)
    assert micro_batches((batch.prompt_lens + batch.response_lens).tolist(), 30) == [[1], [4], [3], [2, 0, 5]]
    one = _log_probs_and_grads(tiny_dir, batch, ppo_max_token_len=10**6)
    _assert_same(one, _log_probs_and_grads(tiny_dir, batch, ppo_max_token_len=30))
    lp = one[0]
    assert (lp[batch.response_mask == 0] == 0).all() and not torch.equal(lp[1:], lp[:-1])


def test_shared_prompt_packing_is_exact(tiny_dir):
    """Responses packed behind their group's one prompt (per-segment attention on CPU, their own positions) give
    the log-probs and gradient of one row per response, under any token budget; so does the layout's dense mask
    (the path off CPU); a mask that lets a response see its pack-mates (the negative control) does not."""
    from tlt.rl.actor import pack_layout, response_log_probs, share_prompts
    from tlt.models import load_model
    from tlt.models.decoder import PackedRows
    batch = _actor_batch(prompt_shared=True)
    packs = share_prompts(batch)
    assert sorted(map(sorted, packs)) == [[0, 1], [2, 3], [4, 5]]  # every group shares its prompt
    assert sorted(map(sorted, share_prompts(_actor_batch(prompt_shared=False)))) == [[i] for i in range(6)]
    alone = _log_probs_and_grads(tiny_dir, batch, share_prompt=False, ppo_max_token_len=10**6)
    _assert_same(alone, _log_probs_and_grads(tiny_dir, batch, share_prompt=True, ppo_max_token_len=10**6))
    _assert_same(alone, _log_probs_and_grads(tiny_dir, batch, share_prompt=True, ppo_max_token_len=25))
    model = load_model(tiny_dir, dtype=torch.float32, device="cpu")
    rows = [r for pk in packs for r in pk]
    sub = batch.rows(rows)
    layout = pack_layout(sub, [len(pk) for pk in packs])
    assert isinstance(layout.attn_mask, PackedRows) and layout.input_ids.shape[0] == 3
    B, T = layout.input_ids.shape
    with torch.no_grad():
        good = response_log_probs(model, sub, layout=layout)[0]
        packed = layout.attn_mask
        layout.attn_mask = packed.dense_mask(T, "cpu")
        dense = response_log_probs(model, sub, layout=layout)[0]
        layout.attn_mask = torch.ones(B, T, T, dtype=torch.bool).tril()  # pack-mates visible: wrong
        leaky = response_log_probs(model, sub, layout=layout)[0]
    torch.testing.assert_close(good, alone[0][rows], atol=1e-5, rtol=0)
    torch.testing.assert_close(dense, good, atol=1e-5, rtol=0)
    assert not torch.allclose(leaky, good, atol=1e-3)


def test_tied_embedding_gradient_is_the_dense_one(tmp_path):
    """With tied embeddings the actor takes the lookup's gradient as sparse rows (no [V, H] scatter); summed
    into the LM head's dense gradient it equals the all-dense gradient, and .grad stays dense (AdamW's kind).
    Control: without the lookup's share the gradient differs beyond the tolerance."""
    import torch.nn.functional as F
    from tests.conftest import make_tiny_checkpoint
    from tlt.config import ActorConfig
    from tlt.models import load_model
    from tlt.rl.actor import Actor
    path = make_tiny_checkpoint(tmp_path / "tied", "qwen3", tie=True)
    batch = _actor_batch(prompt_shared=True)
    grads = {}
    for mode in ("sparse", "dense", "head only"):
        model = load_model(path, dtype=torch.float32, device="cpu")
        actor = Actor(model, ActorConfig(lr=0.0), total_steps=1)
        emb = model.embed_tokens
        assert model.lm_head is None and emb.sparse
        emb.sparse = mode == "sparse"
        if mode == "head only":
            emb.forward = lambda ids, emb=emb: F.embedding(ids, emb.weight.detach())
        actor.update(batch, num_mini_batches=1)
        assert not emb.weight.grad.is_sparse
        grads[mode] = emb.weight.grad.clone()
    torch.testing.assert_close(grads["sparse"], grads["dense"], atol=1e-6, rtol=1e-5)
    assert not torch.allclose(grads["head only"], grads["dense"], atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------- data parallel


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ddp_worker(rank: int, world: int, port: int, overrides: list[str], out_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    trainer = GRPOTrainer(load_config(None, overrides))
    trainer.fit()
    torch.save(trainer.model.state_dict(), os.path.join(out_dir, f"rank{rank}.pt"))
    torch.distributed.destroy_process_group()


def test_two_process_data_parallel_keeps_ranks_identical(tmp_path, tiny_dir):
    overrides = make_overrides(tmp_path, tiny_dir, **{"trainer.total_steps": 1, "actor.bf16_autocast": False})
    mp.spawn(_ddp_worker, args=(2, _free_port(), overrides, str(tmp_path)), nprocs=2, join=True)
    r0 = torch.load(tmp_path / "rank0.pt")
    r1 = torch.load(tmp_path / "rank1.pt")
    for k in r0:
        assert torch.equal(r0[k], r1[k]), f"{k} differs between ranks"
    # summed gradients with global normalisation: the same update as one process on the whole batch
    single = run(tmp_path / "single", tiny_dir, **{"trainer.total_steps": 1, "actor.bf16_autocast": False})
    lines = read_metrics(single)
    assert lines[0]["critic/score/mean"] == pytest.approx(
        json.loads((tmp_path / "runs/tlt/default/metrics.jsonl").read_text().splitlines()[0])["critic/score/mean"])
    moved = [k for k in r0 if not torch.equal(r0[k], single.model.state_dict()[k])]
    for k in moved:
        torch.testing.assert_close(r0[k], single.model.state_dict()[k], atol=2e-5, rtol=0)


# ---------------------------------------------------------------- speculative rollouts + online drafter


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_smoke_recipe_with_eagle_sd_and_online_drafter(tmp_path, monkeypatch, capsys):
    """configs/smoke.yaml end to end through `tlt train`: eagle SD rollouts, the online drafter hook, checkpoint,
    response lengths, the SD on/off comparison and the report."""
    monkeypatch.chdir(REPO)  # the recipe's data paths are relative to the repository root
    retained = []  # trainer.retain_freed_memory (null: on CPU) reaches the process that trains, once
    monkeypatch.setattr("tlt.rl.trainer.retain_freed_host_memory", lambda: retained.append(1) or True)
    assert main(["configs/smoke.yaml", f"trainer.default_local_dir={tmp_path}", "trainer.logger=[jsonl]",
                 "trainer.total_steps=3", "trainer.save_freq=-1", "trainer.test_freq=3"]) == 0
    assert retained == [1]
    run_dir = tmp_path / "tlt" / "smoke"
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1, 2, 3]  # step 0: held-out accuracy before training
    assert "val/accuracy" in lines[0] and "val/accuracy" in lines[-1]
    steps = lines[1:]
    # every step's rollout went through the speculator (whether the policy chose SD steps follows this CPU's timings)
    assert all(m["critic/score/mean"] is not None and "rollout/spec_on_fraction" in m for m in steps)
    for key in ("drafter/steps", "drafter/train_time_s", "drafter/published", "drafter/version",
                "drafter/buffer_tokens", "drafter/loss", "drafter/acc", "drafter/accept_proxy",
                "rollout/spec_accept_length", "rollout/spec_on_fraction", "rollout/decode_time_tail_s"):
        assert key in steps[-1], f"missing {key}"
    assert any(k.startswith("rollout/spec_arm_counts/") for k in steps[-1])
    # drafters compared on each step's fresh held-out responses (with spot training, in the next step's thread:
    # logged a step late); before any session online IS the warm start
    compared = [m for m in steps if "drafter/compare/tokens" in m]
    assert len(compared) >= len(steps) - 1
    assert [m["drafter/compare/rl_step"] for m in compared] == [m["step"] - len(steps) + len(compared) for m in compared]
    assert all(m["drafter/compare/tokens"] > 0 and m["drafter/compare/ngram"] >= 1 for m in compared)
    assert compared[0]["drafter/compare/online"] == compared[0]["drafter/compare/frozen"]
    assert "timing_s/drafter" in steps[0]
    # the drafter either advanced or a refusal was logged (published == 0 after training steps)
    assert steps[-1]["drafter/version"] >= 1 or any(m["drafter/steps"] > 0 and m["drafter/published"] == 0
                                                    for m in steps)
    assert (run_dir / "global_step_3" / "model.safetensors").is_file()
    assert (run_dir / "global_step_3" / "drafter" / "drafter.safetensors").is_file()
    lengths = [json.loads(x) for x in (run_dir / "response_lengths.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lengths] == [1, 2, 3] and all(len(r["lengths"]) == 16 for r in lengths)
    cmp = json.loads((run_dir / "sd_compare.json").read_text())
    assert len(cmp["with_sd_s"]) == len(cmp["without_sd_s"]) == len(cmp["pair_speedups"]) == 2
    assert min(cmp["with_sd_s"] + cmp["without_sd_s"]) > 0 and cmp["speedup"] > 0
    # the same engine weights (rollout.dtype=auto: a bf16 copy on bf16 CPUs) with SD on and off: the same samples
    assert cmp["same_tokens"] is True and cmp["tokens"] > 0
    # what the online drafter did, in the summary (a round every step here; with spot on, one step later)
    account = summary["drafter"]
    assert account["rounds"] >= 2 and account["why"] is None
    assert account["published"] + account["refused"] == account["rounds"]
    assert cmp["accept_length"] is None or cmp["accept_length"] >= 1  # None: only the "off" arm was chosen
    assert (run_dir / "report.html").is_file() and summary["report"] == str(run_dir / "report.html")
    assert (run_dir / "drafters.png").is_file() and "drafters.png" in (run_dir / "report.html").read_text()
    assert (run_dir / "overview.png").is_file() and "max / p50" in (run_dir / "report.html").read_text()
    assert summary["initial_val_accuracy"] is not None and summary["final_val_accuracy"] is not None


def test_online_drafter_hook_state_round_trip(tmp_path, tiny_dir):
    from tlt.drafter_train.online import OnlineDrafterHook
    opts = {"speculative.enabled": True, "speculative.method": "eagle", "speculative.bs_threshold": 64,
            "drafter_train.min_buffer_tokens": 0, "drafter_train.batch_tokens": 128,
            "drafter_train.window_len": 32, "drafter_train.holdout_fraction": 0.0, "trainer.total_steps": 2,
            "trainer.save_freq": 2}
    trainer = run(tmp_path / "a", tiny_dir, **opts)
    hook = trainer.drafter_hook
    assert isinstance(hook, OnlineDrafterHook) and hook.version == 2  # no held-out slice: every session publishes
    assert trainer.llm.spec.drafter_version == 2
    for k, v in hook.drafter.trainable_state_dict().items():  # the engine drafts with the published weights
        torch.testing.assert_close(trainer.llm.spec.drafter.state_dict()[k], v)
    state = hook.state_dict()
    resumed = GRPOTrainer(load_config(None, make_overrides(tmp_path / "a", tiny_dir, **opts,
                                                           **{"trainer.resume": "auto"})))
    new = resumed.drafter_hook
    assert resumed.start_step == 2 and new.version == 2 and new.trainer.total_steps == hook.trainer.total_steps
    assert len(new.buffer) == len(hook.buffer) > 0 and new.buffer.num_tokens == hook.buffer.num_tokens
    for k, v in state["drafter"].items():
        torch.testing.assert_close(new.drafter.state_dict()[k], v)
        torch.testing.assert_close(resumed.llm.spec.drafter.state_dict()[k], v)
    for k, v in hook.frozen.drafter.trainable_state_dict().items():  # the comparison keeps the run's warm start
        torch.testing.assert_close(new.frozen.drafter.trainable_state_dict()[k], v)
        assert not torch.equal(v, state["drafter"][k])
    opt_a, opt_b = hook.trainer.opt.state_dict()["state"], new.trainer.opt.state_dict()["state"]
    assert opt_a.keys() == opt_b.keys() and all(torch.equal(opt_a[i]["exp_avg"], opt_b[i]["exp_avg"]) for i in opt_a)


def test_online_drafter_refuses_a_worse_drafter(tmp_path, tiny_dir):
    """A session whose held-out accuracy drops is rolled back and not published (refusal logged)."""
    from tlt.drafter_train.online import OnlineDrafterHook

    class AlwaysWorse(OnlineDrafterHook):
        def train_session(self, step):
            evaluate = self.trainer.evaluate
            scores = iter([{"acc": 0.9, "accept_proxy": 2.0}, {"acc": 0.1, "accept_proxy": 1.0}])
            self.trainer.evaluate = lambda batch, **kw: {**evaluate(batch), **next(scores)}
            try:
                return super().train_session(step)
            finally:
                self.trainer.evaluate = evaluate

    cfg = load_config(None, make_overrides(tmp_path, tiny_dir, **{
        "speculative.enabled": True, "speculative.method": "eagle", "drafter_train.min_buffer_tokens": 0,
        "drafter_train.batch_tokens": 128, "drafter_train.window_len": 32, "drafter_train.holdout_fraction": 0.5,
        "trainer.total_steps": 1}))
    trainer = GRPOTrainer(cfg, drafter_hook=None)
    trainer.drafter_hook = AlwaysWorse(cfg.drafter_train, trainer.llm.spec)
    before = {k: v.clone() for k, v in trainer.llm.spec.drafter.trainable_state_dict().items()}
    trainer.fit()
    m = read_metrics(trainer)[-1]
    assert m["drafter/steps"] > 0 and m["drafter/published"] == 0 and m["drafter/version"] == 0
    after = trainer.llm.spec.drafter.trainable_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(torch.equal(before[k], v) for k, v in trainer.drafter_hook.drafter.trainable_state_dict().items())


def test_default_config_ships_with_the_package():
    from tlt.rl.trainer import DEFAULT_CONFIG
    assert DEFAULT_CONFIG.is_file() and os.path.samefile(DEFAULT_CONFIG, os.path.join(REPO, "configs", "default.yaml"))
    cfg = load_config(str(DEFAULT_CONFIG))
    assert cfg.model.path is None and not cfg.data.train_files  # the default model and the default task
    assert cfg.speculative.enabled and cfg.speculative.method == "eagle" and cfg.drafter_train.enabled


@pytest.mark.slow
def test_default_run_raises_heldout_accuracy(tmp_path, capsys):
    """`tlt train` with no arguments (about 15 minutes on 2 CPU cores): held-out accuracy rises."""
    assert main([f"trainer.default_local_dir={tmp_path}"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["final_val_accuracy"] > summary["initial_val_accuracy"]
    assert (tmp_path / "tlt" / "default" / "report.html").is_file()


def test_update_gradient_is_bitwise_reproducible_with_threads(tmp_path):
    """The same batch gives the same gradient bit for bit on every call, with two intra-op threads (as `tlt train`
    runs), so RL runs replay exactly: SD on or off, resumed or not. A pack's responses share the prompt's last
    state, so the LM head's input repeats rows; advanced indexing's backward adds the repeats with atomics in
    thread order (it failed here within a few calls), index_select's backward in a fixed order. Hidden size 256 and
    ~1000 response tokens: enough work for torch to split the backward's rows over the threads."""
    from tests.conftest import make_tiny_checkpoint
    from tlt.models import load_model
    from tlt.rl.actor import pack_layout, response_log_probs
    from tlt.rl.rollout import ActorBatch
    g = torch.Generator().manual_seed(3)
    N, P, R = 64, 6, 32  # one prompt, 64 responses in one pack: the prompt's last state is read 64 times
    ids = torch.randint(1, 100, (N, P + R), generator=g)
    ids[1:, :P] = ids[0, :P]
    resp = torch.randint(1, R + 1, (N,), generator=g)
    mask = (torch.arange(R)[None] < resp[:, None]).float()
    batch = ActorBatch(ids, torch.full((N,), P), resp, mask, torch.zeros(N, R), mask, torch.zeros(N, dtype=torch.long),
                       1.0)
    model = load_model(make_tiny_checkpoint(tmp_path / "m", hidden_size=256), dtype=torch.float32, device="cpu")
    layout = pack_layout(batch, [N])
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        grads = []
        for _ in range(12):
            model.zero_grad(set_to_none=True)
            lp, _ = response_log_probs(model, batch, layout=layout)
            (lp * torch.randn(N, R, generator=torch.Generator().manual_seed(0))).sum().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
    finally:
        torch.set_num_threads(threads)
    for other in grads[1:]:
        assert all(torch.equal(a, b) for a, b in zip(grads[0], other))


def test_chunked_log_probs_equal_the_whole_micro_batch(tmp_path):
    """actor.logprob_chunk_tokens: the LM head and log-softmax run a chunk of tokens at a time, recomputed in the
    backward; log-probs, entropies and gradients equal the unchunked ones. Control: chunks that drop the
    temperature differ."""
    from tests.conftest import make_tiny_checkpoint
    from tlt.models import load_model
    from tlt.rl.actor import pack_layout, response_log_probs
    from tlt.rl.rollout import ActorBatch
    g = torch.Generator().manual_seed(5)
    N, P, R = 6, 5, 20
    ids = torch.randint(1, 100, (N, P + R), generator=g)
    resp = torch.randint(1, R + 1, (N,), generator=g)
    mask = (torch.arange(R)[None] < resp[:, None]).float()
    batch = ActorBatch(ids, torch.full((N,), P), resp, mask, torch.zeros(N, R), mask, torch.zeros(N, dtype=torch.long),
                       0.7)
    model = load_model(make_tiny_checkpoint(tmp_path / "m"), dtype=torch.float32, device="cpu")
    weights = torch.randn(N, R, generator=g)

    def run(chunk, temperature=0.7):
        model.zero_grad(set_to_none=True)
        b = dataclasses.replace(batch, temperature=temperature)
        lp, ent = response_log_probs(model, b, with_entropy=True, layout=pack_layout(b, [1] * N), chunk_tokens=chunk)
        ((lp + 0.1 * ent) * weights).sum().backward()
        return lp.detach(), ent.detach(), [p.grad.clone() for p in model.parameters()]

    whole = run(None)
    for chunk in (7, 16):
        lp, ent, grads = run(chunk)
        torch.testing.assert_close(lp, whole[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(ent, whole[1], rtol=0, atol=1e-6)
        for a, b in zip(grads, whole[2]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert (run(7, temperature=1.0)[0] - whole[0]).abs().max() > 1e-3  # control


def test_bf16_rollout_copy_follows_the_fp32_policy(tmp_path, tiny_dir):
    """rollout.dtype=bfloat16 with the fp32 policy: the engine decodes a bf16 copy, refreshed after every update
    (its weights are the policy's rounded to bf16 at the end, not the initial copy's), and the old log-probs are
    recomputed by the trainer (the engine's are the copy's: they differ by bf16 rounding, logged)."""
    trainer = run(tmp_path, tiny_dir, **{"rollout.dtype": "bfloat16", "actor.bf16_autocast": False,
                                         "actor.lr": 1e-3})
    assert trainer.rollout_model is not trainer.model and trainer.llm.model is trainer.rollout_model
    assert next(trainer.rollout_model.parameters()).dtype == torch.bfloat16
    assert next(trainer.model.parameters()).dtype == torch.float32
    policy, copy = trainer.model.state_dict(), trainer.rollout_model.state_dict()
    assert all(torch.equal(copy[k], v.to(torch.bfloat16)) for k, v in policy.items())
    from tlt.models.loader import load_model
    initial = load_model(tiny_dir).state_dict()
    assert any(not torch.equal(copy[k], v.to(torch.bfloat16)) for k, v in initial.items())  # it was refreshed
    lines = read_metrics(trainer)
    assert all(0 < m["rollout/logprob_max_diff"] < 0.5 for m in lines if m["step"] > 0)



def _count_recomputed_rows(monkeypatch) -> list[int]:
    """Patch Actor.compute_log_probs to record the number of rows of each call on the policy (not the reference)."""
    from tlt.rl.actor import Actor
    calls: list[int] = []
    original = Actor.compute_log_probs

    def counting(self, batch, model=None):
        if model is None:
            calls.append(len(batch))
        return original(self, batch, model)
    monkeypatch.setattr(Actor, "compute_log_probs", counting)
    return calls


@pytest.mark.parametrize("on_policy", [True, False])
def test_on_policy_old_log_probs_are_the_update_forwards_own(tmp_path, tiny_dir, monkeypatch, on_policy):
    """actor.on_policy_logprobs with one mini-batch and one epoch: the old log-probs are the update forward's own,
    so the ratio is exactly 1 (ppo_kl and clipfrac exactly 0) and no separate old-log-prob pass runs, even for a
    bf16 engine copy, whose log-probs are then compared with the trainer's. Negative control: with the option off,
    the recompute pass runs over every row and the engine's fp32 log-probs (other kernels) give a ratio != 1."""
    calls = _count_recomputed_rows(monkeypatch)
    trainer = run(tmp_path / "bf16", tiny_dir, **{"rollout.dtype": "bfloat16", "actor.bf16_autocast": False,
                                                   "actor.on_policy_logprobs": on_policy})
    assert calls == ([] if on_policy else [8, 8])  # 2 steps x (2 prompts x 4 responses)
    assert all(1e-3 < m["rollout/logprob_max_diff"] < 0.5 for m in read_metrics(trainer) if m["step"] > 0)
    shared = read_metrics(run(tmp_path / "fp32", tiny_dir, **{"actor.on_policy_logprobs": on_policy,
                                                               "actor.bf16_autocast": False}))
    kl = [m["actor/ppo_kl"] for m in shared if m["step"] > 0]
    if on_policy:
        assert kl == [0.0, 0.0] and all(m["actor/pg_clipfrac"] == 0.0 for m in shared if m["step"] > 0)
        assert all(0 < m["rollout/logprob_max_diff"] < 1e-4 for m in shared if m["step"] > 0)
    else:
        assert any(k != 0.0 for k in kl) and "rollout/logprob_max_diff" not in shared[-1]


def test_on_policy_old_log_probs_change_nothing_but_the_pass(tmp_path, tiny_dir, monkeypatch):
    """The update's own detached log-probs are the recompute pass's (same fp32 weights, same forward): training
    with the shortcut ends at the weights of training with the pass, up to float rounding. With two mini-batches
    only the second one's rows are recomputed (the first is optimised before the policy moves)."""
    calls = _count_recomputed_rows(monkeypatch)
    common = {"rollout.dtype": "bfloat16", "actor.bf16_autocast": False}
    fast = run(tmp_path / "fast", tiny_dir, **common, **{"actor.on_policy_logprobs": True})
    slow = run(tmp_path / "slow", tiny_dir, **common, **{"actor.on_policy_logprobs": False})
    a, b = fast.model.state_dict(), slow.model.state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=0, msg=f"{k} differs")
    calls.clear()
    run(tmp_path / "mini", tiny_dir, **common, **{"actor.ppo_mini_batch_size": 1})
    assert calls == [4, 4]  # per step: the second prompt's 4 responses


def test_spot_session_trains_alongside_the_next_rollout(tmp_path, tiny_dir):
    """drafter_train.spot=true: the session on step k's data runs in a thread while step k+1's rollout runs and is
    published after it, so version v reaches the engine one step later than with spot=false. The weights are
    the ones spot=false trains (the same data, seed and steps): the thread changes when, not what."""
    opts = {"speculative.enabled": True, "speculative.method": "eagle", "speculative.bs_threshold": 64,
            "drafter_train.min_buffer_tokens": 0, "drafter_train.batch_tokens": 128,
            "drafter_train.window_len": 32, "drafter_train.holdout_fraction": 0.0, "drafter_train.compare_drafters":
            False}
    spot = run(tmp_path / "spot", tiny_dir, **opts, **{"drafter_train.spot": True, "trainer.total_steps": 3})
    off = run(tmp_path / "off", tiny_dir, **opts, **{"drafter_train.spot": False, "trainer.total_steps": 2})
    assert spot.drafter_hook.spot and not off.drafter_hook.spot
    versions = [m["drafter/version"] for m in read_metrics(spot)]
    assert versions == [0, 1, 2]  # nothing to train before step 1's data; then one session a step, a step late
    assert [m["drafter/version"] for m in read_metrics(off)] == [1, 2]
    assert all(m["drafter/train_time_s"] > 0 for m in read_metrics(spot)[1:])
    for k, v in off.drafter_hook.drafter.trainable_state_dict().items():
        torch.testing.assert_close(spot.drafter_hook.drafter.trainable_state_dict()[k], v, rtol=0, atol=0)
        torch.testing.assert_close(spot.llm.spec.drafter.state_dict()[k], v.to(spot.llm.spec.drafter.state_dict()[k].dtype))


def test_spot_null_means_an_idle_cpu_core(monkeypatch):
    from tlt.rl.trainer import spot_training
    cpu = torch.device("cpu")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert spot_training(None, cpu) and not spot_training(None, cpu, world_size=2)
    assert not spot_training(None, torch.device("cuda")) and spot_training(True, torch.device("cuda"))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert not spot_training(None, cpu) and not spot_training(False, cpu)


@pytest.mark.parametrize("rollout_dtype", ["float32", "bfloat16"])
def test_rl_steps_capture_each_cuda_graph_once(tmp_path, tiny_dir, monkeypatch, rollout_dtype):
    """Graphs read weights, caches and the draft head by address, so an RL run that keeps them valid captures each
    graph (target forwards, K/V moves, drafting, acceptance) once: a later step replays what an earlier one captured
    and captures only shapes not seen before. Graphs simulated on CPU (the static code runs, a capture is recorded
    under its graph's key), with a reduced draft vocabulary, a drafter published every step, and the engine
    sharing the policy's weights (float32) or holding a bf16 copy refreshed after each update. With the draft
    head copied to a new tensor after each update, 18 captures held 10 distinct graphs."""
    from tlt.engine.cuda_graph import GraphedForward, GraphPool, GraphSet
    from tlt.engine.model_runner import ModelRunner
    from tlt.models.loader import load_model
    from tlt.speculative.drafter import Drafter
    from tlt.speculative.drafter_io import save_drafter
    keys, captured = [], []

    def fake_capture(self, run):  # a GraphSet's capture, under the key its replay is at
        self.num_captured += 1
        captured.append(keys[-1])
        return None, run()

    def replay(self, shape, B, *a, **k):
        keys.append((id(self), self.bucket(B), shape))
        try:
            return set_replay(self, shape, B, *a, **k)
        finally:
            keys.pop()

    def runner_init(self, model, kv, max_prefill_tokens=None, cuda_graphs=False, clock=None):
        runner_init_(self, model, kv, max_prefill_tokens, clock=clock)
        self.graphs = GraphedForward(model, kv)  # as on CUDA

    set_replay, set_init, runner_init_ = GraphSet.replay, GraphSet.__init__, ModelRunner.__init__
    monkeypatch.setattr(GraphPool, "capture", fake_capture)
    monkeypatch.setattr(GraphSet, "replay", replay)
    monkeypatch.setattr(GraphSet, "__init__", lambda self, n, capture=True, pool=None, static=True:
                        set_init(self, n, static, pool, static))
    monkeypatch.setattr(ModelRunner, "__init__", runner_init)
    target = load_model(tiny_dir)
    torch.manual_seed(0)
    drafter = Drafter(target.cfg)
    drafter.d2t = torch.arange(0, target.cfg.vocab_size, 3)  # a reduced draft vocabulary: a copied head
    opts = {"speculative.enabled": True, "speculative.method": "eagle", "speculative.bs_threshold": 64,
            "speculative.model": str(save_drafter(drafter, tmp_path / "drafter")),
            "speculative.adaptive": False,  # SD in every step
            "drafter_train.min_buffer_tokens": 0, "drafter_train.batch_tokens": 128, "drafter_train.window_len": 32,
            "drafter_train.holdout_fraction": 0.0,
            "trainer.total_steps": 3, "rollout.dtype": rollout_dtype}
    cfg = load_config(None, make_overrides(tmp_path, tiny_dir, **opts))
    trainer = GRPOTrainer(cfg)
    trainer.fit()
    spec = trainer.llm.spec
    assert spec.drafter.d2t is not None and spec.drafter_version == 3
    assert (trainer.llm.model is trainer.model) == (rollout_dtype == "float32")
    metrics = read_metrics(trainer)
    assert len(metrics) == 3 and all(m["rollout/spec_on_fraction"] > 0 for m in metrics)
    drafting = [k for k in captured if k[0] == id(spec.draft_graphs.set)]
    assert len(drafting) >= 3
    assert len(set(captured)) == len(captured)  # none captured twice
