"""Placement without Ray: the bundle assignment (tlt.bundles), its config errors at load, and the engine's
sleep/wake (colocated placement frees the KV cache between rollouts; decoding after wake gives the same tokens)."""
import pytest

import tlt
from tlt.config import ConfigError, load_config
from tlt.speculative.drafter import Drafter
from tlt.speculative.drafter_io import save_drafter
from tlt.bundles import assign_bundles


def test_colocated_puts_a_rank_and_a_replica_on_every_bundle():
    a = assign_bundles("colocated", nnodes=2, n_gpus_per_node=4)
    assert a.num_bundles == 8
    assert a.trainer_bundles == a.rollout_bundles == list(range(8))
    assert a.trainer_gpu + a.rollout_gpu <= 1


@pytest.mark.parametrize("rollout_gpus, trainer, rollout", [(None, [0, 1, 2, 3], [4, 5, 6, 7]),
                                                            (2, [0, 1, 2, 3, 4, 5], [6, 7]),
                                                            (7, [0], [1, 2, 3, 4, 5, 6, 7])])
def test_disaggregated_splits_the_bundles(rollout_gpus, trainer, rollout):
    a = assign_bundles("disaggregated", nnodes=1, n_gpus_per_node=8, rollout_gpus=rollout_gpus)
    assert (a.trainer_bundles, a.rollout_bundles) == (trainer, rollout)
    assert not set(a.trainer_bundles) & set(a.rollout_bundles) and a.trainer_gpu == a.rollout_gpu == 1


@pytest.mark.parametrize("overrides, key", [
    (["trainer.placement=disaggregated", "trainer.n_gpus_per_node=4", "trainer.rollout_gpus=5"], "rollout_gpus"),
    (["trainer.placement=disaggregated", "trainer.n_gpus_per_node=4", "trainer.rollout_gpus=4"], "rollout_gpus"),
    (["trainer.placement=disaggregated", "trainer.n_gpus_per_node=1"], "needs >= 2 GPUs"),
    (["trainer.placement=colocated", "trainer.n_gpus_per_node=3", "data.train_batch_size=8"],
     "data.train_batch_size=8 does not divide over 3 trainer ranks"),
    (["trainer.placement=disaggregated", "trainer.n_gpus_per_node=8", "trainer.rollout_gpus=3",
      "data.train_batch_size=5", "rollout.n=1"], "do not divide over 3 rollout replicas"),
    (["trainer.placement=colocated", "trainer.n_gpus_per_node=2", "trainer.num_rollout_workers=3"],
     "num_rollout_workers"),
    (["trainer.placement=colocated", "trainer.n_gpus_per_node=2", "trainer.rollout_gpus=1"], "rollout_gpus"),
])
def test_placement_errors_at_config_load(overrides, key):
    with pytest.raises(ConfigError, match=key):
        load_config(None, overrides)


def test_a_placement_that_fits_loads():  # control for the errors above
    cfg = load_config(None, ["trainer.placement=disaggregated", "trainer.nnodes=2", "trainer.n_gpus_per_node=4",
                             "trainer.rollout_gpus=2", "data.train_batch_size=6", "rollout.n=4"])
    assert cfg.trainer.rollout_gpus == 2


@pytest.mark.parametrize("speculative", [False, True])
def test_engine_sleep_frees_the_kv_cache_and_wake_decodes_the_same(tiny_llama_dir, tmp_path, speculative):
    spec = None
    if speculative:
        llm0 = tlt.LLM(tiny_llama_dir, dtype="float32")
        save_drafter(Drafter(llm0.model.cfg), tmp_path / "d")
        spec = dict(method="eagle", bs_threshold=None, adaptive=False, num_speculative_tokens=3,
                    model=str(tmp_path / "d"))
    llm = tlt.LLM(tiny_llama_dir, dtype="float32", max_num_seqs=4, speculative_config=spec)
    prompts = [[1 + i, 7, 3 + i] for i in range(6)]
    greedy = tlt.SamplingParams(temperature=0, max_tokens=24)
    sampled = tlt.SamplingParams(temperature=1.0, max_tokens=24, seed=5)
    first = [[o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=p)]
             for p in (greedy, sampled)]
    engine = llm.engine
    caches = [engine.kv, *engine.scheduler.slot_caches]
    assert len(caches) == (2 if speculative else 1) and all(c.k for c in caches)
    kv_refs = [t for c in caches for t in c.k + c.v]
    freed = engine.sleep()
    assert freed == sum(t.numel() * t.element_size() for t in kv_refs) > 0
    assert all(c.k == [] and c.v == [] and c.capacity == 0 for c in caches)
    del kv_refs
    with pytest.raises(RuntimeError, match="asleep"):
        llm.generate(prompt_token_ids=prompts, sampling_params=greedy)
    engine.wake()
    again = [[o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=p)]
             for p in (greedy, sampled)]
    assert again == first
    assert all(c.k for c in caches)  # grown back on demand


def test_sleep_refuses_mid_rollout(tiny_llama_dir):
    llm = tlt.LLM(tiny_llama_dir, dtype="float32")
    llm.engine.add_request([1, 2, 3], tlt.SamplingParams(max_tokens=4))
    with pytest.raises(RuntimeError, match="unfinished"):
        llm.engine.sleep()
    assert not llm.engine.asleep


def test_a_disaggregated_rank_keeps_its_engine_copy_in_host_memory(tiny_llama_dir):
    """tlt.rl.weight_sync.rollout_copy: the same weights (then rounded to bf16) and rotary buffers, on the CPU,
    frozen, filled unit by unit; control: a changed policy weight shows up as a difference."""
    import torch
    from tlt.models.loader import load_model
    from tlt.rl.weight_sync import rollout_copy
    policy = load_model(tiny_llama_dir, dtype=torch.float32)
    twin = rollout_copy(policy, torch.bfloat16, "cpu")
    got, want = twin.state_dict(), policy.state_dict()
    assert got.keys() == want.keys()
    assert all(v.device.type == "cpu" and v.dtype == torch.bfloat16 and not v.requires_grad for v in got.values())
    assert all(torch.equal(got[k], want[k].to(torch.bfloat16)) for k in want)
    assert torch.equal(twin.rotary.inv_freq, policy.rotary.inv_freq.to(torch.bfloat16))
    with torch.no_grad():
        policy.lm_head.weight.add_(1.0) if policy.lm_head is not None else policy.embed_tokens.weight.add_(1.0)
    assert not all(torch.equal(got[k], policy.state_dict()[k].to(torch.bfloat16)) for k in want)


@pytest.mark.parametrize("engine_on_host", [True, False])
def test_a_disaggregated_rank_validates_on_the_replicas(monkeypatch, engine_on_host):
    """GRPOTrainer.validate: rank 0 of a disaggregated run evaluates on the replicas it owns (its engine copy is in
    host memory); otherwise (control) on its own engine."""
    from types import SimpleNamespace
    import tlt.rl.evaluate
    from tlt.rl.trainer import GRPOTrainer
    used = []
    monkeypatch.setattr(tlt.rl.evaluate, "evaluate", lambda engine, *a, **k: used.append(engine) or
                        SimpleNamespace(accuracy=0.5, response_length_mean=3.0))
    replicas, own = object(), object()
    cfg = load_config(None)
    fake = SimpleNamespace(dist=SimpleNamespace(is_main=True), engine_on_host=engine_on_host, llm=own,
                           rollout_engine=SimpleNamespace(owner=replicas), val_examples=[], rewards=None, cfg=cfg)
    assert GRPOTrainer.validate(fake) == {"val/accuracy": 0.5, "val/response_length/mean": 3.0}
    assert used == [replicas if engine_on_host else own]


def test_no_final_sd_comparison_on_a_disaggregated_gpu_rank(capsys):
    """compare_sd would time the trainer's host copy; on a GPU run of a disaggregated rank it is not made. Control:
    the same trainer on CPU goes on to build the comparison's plain engine (here from a stand-in, which fails)."""
    from types import SimpleNamespace
    import torch
    from tlt.prompts import PromptExample
    from tlt.rl.data import PromptDataset
    from tlt.rl.run_summary import compare_sd
    data = PromptDataset([PromptExample(index=0, data_source="d", messages=[], ground_truth=None, prompt_ids=[1])], 1)
    fake = SimpleNamespace(llm=SimpleNamespace(spec=object()), start_step=0, engine_on_host=True,
                           device=torch.device("cuda", 0), rollout_model=object(), tokenizer=None,
                           cfg=load_config(None), train_data=data, prompts_per_rank=1, dist=SimpleNamespace(rank=0))
    assert compare_sd(fake) is None
    assert "no final SD comparison" in capsys.readouterr().out
    fake.device = torch.device("cpu")
    with pytest.raises(TypeError):  # tlt.LLM given a stand-in for the model
        compare_sd(fake)


@pytest.mark.parametrize("published", [True, False])
def test_the_final_sd_comparison_decodes_the_replicas_drafter(published):
    """Before the replicas close, rank 0's engine loads the drafter they trained (sd_compare.json would otherwise
    time the warm-up drafter); before any publish (the control) nothing is loaded, nor on a rank that owns none."""
    from types import SimpleNamespace
    from tlt.rl.trainer import GRPOTrainer
    loaded = []
    state = {"fc.weight": object()} if published else None
    spec = SimpleNamespace(load_drafter_state=loaded.append)
    owner = SimpleNamespace(drafter_state=lambda: state)
    GRPOTrainer.adopt_published_drafter(SimpleNamespace(llm=SimpleNamespace(spec=spec),
                                                        rollout_engine=SimpleNamespace(owner=owner)))
    assert loaded == ([state] if published else [])
    GRPOTrainer.adopt_published_drafter(SimpleNamespace(llm=SimpleNamespace(spec=spec),
                                                        rollout_engine=SimpleNamespace(owner=None)))
    assert len(loaded) == int(published)
