"""RolloutReplica and LocalSpotRollout without Ray: rollout + hidden-state recording, preemptible drafter
training, the held-out publish gate, drafter swaps mid-rollout, weights sent as a state dict."""
import threading
import time

import pytest
import torch

import tlt
from tlt.models.loader import read_config
from tlt.workers.rollout_worker import ReplicaConfig, RolloutReplica
from tlt.workers.spot import LocalSpotRollout, SpotConfig

SPEC = {"method": "eagle", "bs_threshold": None, "adaptive": False, "num_speculative_tokens": 3}
GROUPS = [(10, [1, 2, 3]), (11, [4, 5, 6, 7]), (12, [8, 9])]


def cfg(**kw):
    base = dict(speculative=SPEC, device="cpu", dtype="float32", holdout_every=0, batch_tokens=64, window_len=32)
    return ReplicaConfig(**{**base, **kw})


def plain_outputs(path, groups, params):
    llm = tlt.LLM(model=path, device="cpu", dtype="float32")
    outs = llm.generate(prompt_token_ids=[p for _, p in groups], sampling_params=params,
                        group_ids=[g for g, _ in groups])
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.fixture()
def replica(tiny_llama_dir):
    return RolloutReplica(tiny_llama_dir, 0, cfg())


def test_generate_groups_matches_plain_engine_and_fills_buffer(tiny_llama_dir, replica):
    params = tlt.SamplingParams(n=2, temperature=0.0, max_tokens=12)
    res = replica.generate_groups(GROUPS, params, rl_step=0)
    assert [o.group_id for o in res.outputs] == [10, 11, 12]
    assert [[c.token_ids for c in o.outputs] for o in res.outputs] == plain_outputs(tiny_llama_dir, GROUPS, params)
    assert all(c.hidden_states is None for o in res.outputs for c in o.outputs)  # not asked: stay in the replica
    assert len(replica.buffer) == 6 and res.train_tokens == replica.num_train_tokens() > 0
    s = replica.buffer.samples[0]
    assert s.response_start == 3 and s.hidden_start == 2 and s.hidden.shape == (12, 64) and s.rl_step == 0
    assert "spec_accept_length" in res.stats


def test_hidden_states_in_buffer_are_the_engine_outputs(replica):
    params = tlt.SamplingParams(n=1, temperature=1.0, max_tokens=6, seed=3, return_hidden_states=True)
    res = replica.generate_groups(GROUPS[:1], params, rl_step=4)
    h = res.outputs[0].outputs[0].hidden_states
    assert h.shape == (6, 64)
    assert torch.equal(replica.buffer.samples[0].hidden, h.to(torch.bfloat16))
    assert replica.buffer.samples[0].token_ids.tolist() == GROUPS[0][1] + res.outputs[0].outputs[0].token_ids


def test_train_drafter_stops_on_flag(replica):
    replica.generate_groups(GROUPS, tlt.SamplingParams(n=2, temperature=1.0, max_tokens=16, seed=0), 0)
    before = replica.drafter_state()
    flag, out = threading.Event(), {}
    th = threading.Thread(target=lambda: out.setdefault("r", replica.train_drafter(10_000, 0, stop_flag=flag)))
    th.start()
    deadline = time.monotonic() + 30
    while replica.trainer.total_steps < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    flag.set()
    th.join(timeout=30)
    r = out["r"]
    assert not th.is_alive() and r.preempted and 2 <= r.steps < 10_000 and r.publish
    after = replica.drafter_state()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    # stop_training(session) before the session starts: it runs no step
    replica.stop_training(session=7)
    r = replica.train_drafter(100, 0, session=7)
    assert r.steps == 0 and r.preempted and not r.publish


def test_publish_gate_rolls_back_worse_drafter(replica):
    replica.cfg.holdout_every = 2
    replica.buffer.holdout_every = 2
    replica.generate_groups(GROUPS, tlt.SamplingParams(n=2, temperature=1.0, max_tokens=16, seed=0), 0)
    assert replica.buffer.heldout_batch(64, 4096) is not None
    before = replica.drafter_state()
    accs = iter([0.5, 0.1])  # held-out accuracy before, after: the session made it worse
    replica.trainer.evaluate = lambda batch, depth=8: {"acc": next(accs)}
    r = replica.train_drafter(3, 0)
    assert r.steps == 3 and not r.publish and r.eval_after == {"acc": 0.1}
    assert all(torch.equal(before[k], v) for k, v in replica.drafter_state().items())
    accs = iter([0.1, 0.2])
    assert replica.train_drafter(3, 0).publish


def test_set_drafter_mid_rollout_keeps_outputs_exact(tiny_llama_dir, replica):
    groups = [(0, [1, 2, 3]), (1, [5, 6])]
    params = tlt.SamplingParams(n=1, temperature=0.0, max_tokens=120)
    new = {k: torch.randn_like(v) * 0.05 for k, v in replica.drafter_state().items()}
    out = {}
    th = threading.Thread(target=lambda: out.setdefault("r", replica.generate_groups(groups, params, 0)))
    th.start()
    while not replica._generating and th.is_alive():
        time.sleep(0.001)
    assert replica.set_drafter(new, 1)  # the rollout loads it at its next engine-step boundary
    assert not replica.set_drafter(new, 1)  # stale version: ignored
    while replica.spec.drafter_version == 0 and th.is_alive():
        time.sleep(0.001)
    assert th.is_alive() and replica._generating  # it landed mid-rollout
    th.join(timeout=60)
    assert replica.drafter_version == 1 and replica.spec.drafter_version == 1
    assert torch.equal(replica.spec.drafter.trainable_state_dict()["fc.weight"], new["fc.weight"])
    assert [[c.token_ids for c in o.outputs] for o in out["r"].outputs] == plain_outputs(tiny_llama_dir, groups,
                                                                                         params)


def test_drafter_published_as_a_rollout_ends_is_loaded_before_it_returns(replica):
    """A drafter that reaches the mailbox after the rollout's last step boundary is loaded as the rollout ends (no
    later step would), and with no rollout running set_drafter loads it itself."""
    new = {k: torch.randn_like(v) * 0.05 for k, v in replica.drafter_state().items()}
    engine, step = replica.llm.engine, replica.llm.engine.step

    def last_step_publishes():
        step()
        if not engine.has_unfinished():  # as if another thread published between this step and the loop's end
            assert replica.set_drafter(new, 1) and replica.spec.drafter_version == 0

    engine.step = last_step_publishes
    replica.generate_groups(GROUPS, tlt.SamplingParams(n=1, temperature=0.0, max_tokens=4), 0)
    assert replica.spec.drafter_version == 1 and replica._pending_drafter is None
    assert torch.equal(replica.spec.drafter.trainable_state_dict()["fc.weight"], new["fc.weight"])
    engine.step = step
    assert replica.set_drafter(new, 2) and replica.spec.drafter_version == 2


def test_a_published_drafter_tells_the_policy_its_gain(replica):
    """set_drafter hands the policy the publish's held-out gain (AdaptivePolicy.drafter_changed): one version's as
    sent, two versions' composed where one replaced another before the engine took it, and None (re-try every parked
    arm) after a version this replica never had. Control: a publish without a gain hands the policy None."""
    gains = []
    replica.spec.policy.drafter_changed = gains.append
    state = replica.drafter_state()
    assert replica.set_drafter(state, 1, gain=0.5)  # no rollout: loaded at once
    with replica._gen_lock:  # a rollout runs: both wait for its next step boundary
        assert replica.set_drafter(state, 2, gain=0.2) and replica.set_drafter(state, 3, gain=0.5)
    with replica._step_lock:
        replica._load_pending_drafter()
    assert replica.set_drafter(state, 5, gain=0.1) and replica.set_drafter(state, 6)
    assert gains == [0.5, pytest.approx(0.8), None, None]


def test_policy_weights_from_state_dict(tiny_llama_dir, replica):
    blank = RolloutReplica(read_config(tiny_llama_dir), 1, cfg())
    assert blank.set_policy_weights(replica.model.state_dict()) == 1
    params = tlt.SamplingParams(n=1, temperature=0.0, max_tokens=8)
    a = replica.generate_groups(GROUPS, params, 0).outputs
    b = blank.generate_groups(GROUPS, params, 0).outputs
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_local_spot_rollout_two_steps(tiny_llama_dir):
    rollout = LocalSpotRollout(tiny_llama_dir, cfg(), SpotConfig(min_train_tokens=8, local_max_steps=3))
    groups = [(g, [1 + g, 2 + g, 3]) for g in range(4)]
    for step in range(2):
        params = [tlt.SamplingParams(n=2, temperature=1.0, max_tokens=4 + 8 * (g % 2), seed=100 * step + g)
                  for g in range(4)]
        outs, rep = rollout.run_step(groups, params, step)
        assert [o.group_id for o in outs] == [0, 1, 2, 3]
        assert [len(o.outputs[0].token_ids) for o in outs] == [4, 12, 4, 12]
        assert rep.drafter_steps == 3 and rep.drafter_version == step + 1 and rep.published == [step + 1]
    assert rollout.replica.drafter_version == 2
    outs = rollout.generate(prompt_token_ids=[[1, 2]], sampling_params=tlt.SamplingParams(max_tokens=3),
                            group_ids=[5], rl_step=2)
    assert outs[0].group_id == 5 and rollout.last_report.step == 2


def test_replica_config_carries_every_speculative_key():
    """The Ray replicas build their SpecDecoder from the run's config: every speculative key reaches it (the
    fixed-arm and acceptance keys were once dropped, so replicas ran the adaptive default whatever was asked)."""
    from tlt.config import load_config
    from tlt.speculative.config import SpecConfig
    run = load_config(None, ["speculative.adaptive=false", "speculative.draft_topk=3",
                             "speculative.num_draft_tokens=7", "speculative.acceptance=rejection",
                             "speculative.arm_table=gpu", "speculative.bs_threshold=12"])
    spec = ReplicaConfig.from_config(run).speculative
    got = SpecConfig.from_dict({**spec, "model": "<fresh>"})
    assert (got.adaptive, got.draft_topk, got.num_draft_tokens, got.acceptance, got.arm_table, got.bs_threshold) == \
        (False, 3, 7, "rejection", "gpu", 12)


def test_replica_reports_the_graphs_captured_in_each_rl_step(tiny_llama_dir, monkeypatch):
    """A replica's results carry the CUDA graphs its engine captured since the RL step's first generate (the
    engine's counters are faked here: no capture on CPU), and LocalSpotRollout's report sums them as spot/ metrics."""
    from tlt.engine.llm_engine import LLMEngine
    counters = [2, 0.5]
    monkeypatch.setattr(LLMEngine, "num_graph_captures", property(lambda self: counters[0]))
    monkeypatch.setattr(LLMEngine, "graph_capture_time_s", property(lambda self: counters[1]))
    replica = RolloutReplica(tiny_llama_dir, 0, cfg())
    params = tlt.SamplingParams(n=1, temperature=0.0, max_tokens=4)

    def step_stats(step):
        st = replica.generate_groups(GROUPS, params, step).stats
        return st["step_graph_captures"], st["step_graph_capture_time_s"]
    assert step_stats(0) == (0, 0.0)
    counters[:] = [5, 1.5]
    assert step_stats(0) == (3, 1.0)  # the same RL step: since its first generate
    assert step_stats(1) == (0, 0.0)
    rollout = LocalSpotRollout(tiny_llama_dir, cfg(), SpotConfig(min_train_tokens=10**9))
    _, rep = rollout.run_step(GROUPS, [params] * len(GROUPS), 0)
    counters[:] = [9, 4.0]
    _, rep = rollout.run_step(GROUPS, [params] * len(GROUPS), 0)
    m = rep.metrics()
    assert (m["spot/graph_captures"], m["spot/graph_capture_time_s"]) == (4.0, 2.5)


def test_replica_trains_the_drafter_on_its_draft_vocabulary(tiny_llama_dir, tmp_path):
    """A drafter with a reduced draft vocabulary: the replica's training copy scores the same vocabulary the engine
    drafts with."""
    from tlt.models.loader import read_config
    from tlt.speculative.drafter import Drafter
    from tlt.speculative.drafter_io import save_drafter
    drafter = Drafter(read_config(tiny_llama_dir))
    drafter.d2t = torch.arange(0, drafter.cfg.vocab_size, 4)
    path = save_drafter(drafter, tmp_path / "drafter")
    replica = RolloutReplica(tiny_llama_dir, 0, cfg(speculative={**SPEC, "model": str(path)}))
    assert torch.equal(replica.spec.drafter.d2t, drafter.d2t)
    assert replica.train_copy.d2t is replica.spec.drafter.d2t
