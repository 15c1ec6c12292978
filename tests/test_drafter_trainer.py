"""DrafterTrainer: loss goes down on fixed data, stop flag preempts within one step, async atomic checkpoints."""
import threading

import pytest
import torch
from safetensors.torch import load_file

from tlt.drafter_train.buffer import DrafterBuffer
from tlt.drafter_train.trainer import DrafterTrainer, should_publish
from tlt.models import load_model
from tlt.speculative.drafter import Drafter


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM
    path = tmp_path_factory.mktemp("tiny_llama")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return load_model(path)


@pytest.fixture(scope="module")
def buffer(target):
    """Rollout-like data: the target's own hidden states over random prompt + response sequences."""
    buf = DrafterBuffer(max_tokens=100_000, window_len=32, holdout_every=5)
    g = torch.Generator().manual_seed(0)
    for i in range(20):
        ids = torch.randint(0, 128, (1, 48), generator=g)
        with torch.no_grad():
            h = target(ids)[0]  # [L, H] post-norm last hidden = what the engine keeps
        buf.add(ids[0], h, response_start=8, rl_step=0)
    return buf


def make_trainer(target, **kw):
    torch.manual_seed(1)
    drafter = Drafter(target.cfg).attach(target)
    return DrafterTrainer(drafter, lr=kw.pop("lr", 3e-3), batch_tokens=64, num_rows=2, **kw)


def test_loss_decreases_on_fixed_data(target, buffer):
    tr = make_trainer(target, amp_dtype=None)
    batch = buffer.sample_batch(2, 64, generator=torch.Generator().manual_seed(0))
    held = buffer.heldout_batch(64, 256)
    before = tr.evaluate(batch)
    metrics = [tr.train_step(batch) for _ in range(40)]
    after = tr.evaluate(batch)
    # the CE part has a floor (the target's entropy, ~0.1 * log 128 for a random model); the hidden part has not
    assert metrics[-1].loss < 0.7 * metrics[0].loss
    assert metrics[-1].hidden_loss < 0.3 * metrics[0].hidden_loss
    assert after["loss"] < before["loss"] and after["acc"] >= before["acc"]
    assert 1.0 <= after["accept_proxy"] <= 9.0
    assert not any(p.grad is not None for p in target.parameters())  # target stays frozen
    ev = tr.evaluate(held)
    assert set(ev) >= {"acc", "accept_proxy", "loss", "hidden_loss", "ce"}
    assert should_publish(ev, None) and not should_publish({"acc": 0.1}, {"acc": 0.5})


def test_train_steps_bf16_autocast_runs(target, buffer):
    tr = make_trainer(target, amp_dtype=torch.bfloat16)
    stats = tr.train_steps(buffer, max_steps=3)
    assert stats.steps == 3 and not stats.preempted and stats.tokens > 0 and torch.isfinite(
        torch.tensor(stats.last.loss))


def test_stop_flag_stops_within_one_step(target, buffer):
    tr = make_trainer(target)
    calls = []

    def stop():  # raised by the coordinator while step 3 runs: at most one more step may finish
        calls.append(1)
        return len(calls) > 3

    stats = tr.train_steps(buffer, max_steps=100, stop_flag=stop)
    assert stats.steps == 3 and stats.preempted
    ev = threading.Event()
    ev.set()
    assert tr.train_steps(buffer, max_steps=100, stop_flag=ev).steps == 0


def test_async_checkpoint_atomic_trainable_only(target, buffer, tmp_path):
    tr = make_trainer(target, ckpt_dir=tmp_path, ckpt_every=2)
    tr.train_steps(buffer, max_steps=4)
    tr.checkpointer.wait()
    path = tmp_path / "drafter.safetensors"
    assert path.is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["drafter.safetensors"]  # no temp file left behind
    sd = load_file(path)
    assert sd and all(k.startswith(("fc.", "layer.")) for k in sd)
    fresh = Drafter(target.cfg).attach(target)
    missing, unexpected = fresh.load_state_dict(sd, strict=False)
    assert not unexpected and not [k for k in missing if k.startswith(("fc.", "layer."))]
    for k, v in tr.drafter.trainable_state_dict().items():
        torch.testing.assert_close(fresh.state_dict()[k], v)


def test_run_step_local_trains_in_the_gaps(target, buffer):
    from tlt.drafter_train.coordinator import SpotCoordinator
    from tlt.drafter_train.local import run_step_local
    slices = {0: 1, 1: 6, 2: 3}  # replica 0 finishes first, replica 1 is the long tail

    def rollout(replica, group_ids, version):
        for _ in range(slices[replica] - 1):
            yield []
        yield group_ids

    tr = make_trainer(target)
    co = SpotCoordinator([0, 1, 2], min_train_tokens=100, available_tokens=buffer.num_train_tokens)
    published = []
    rep = run_step_local(co, 0, list(range(6)), rollout, tr, buffer, on_publish=published.append)
    assert rep.drafter_steps == 5 and published == [1] and rep.drafter_version == 1
    assert tr.total_steps == 5


def _spot_setup(model_dir, tmp_path, compare_drafters: bool):
    """An SD engine with an untrained drafter, a spot round's config, and 8 sampled responses to train on."""
    import tlt
    from tlt.config import DrafterTrainConfig
    from tlt.speculative.drafter import Drafter
    from tlt.speculative.drafter_io import save_drafter

    plain = tlt.LLM(model_dir, dtype="float32")
    drafter_dir = save_drafter(Drafter(plain.engine.model.cfg), tmp_path / "d")
    llm = tlt.LLM(model_dir, dtype="float32", speculative_config={"method": "eagle", "model": str(drafter_dir)})
    cfg = DrafterTrainConfig(min_buffer_tokens=0, batch_tokens=64, window_len=16, holdout_fraction=0.0,
                             compare_drafters=compare_drafters)
    outs = plain.generate([[3, 5, 7, 9]] * 8, tlt.SamplingParams(temperature=1.0, max_tokens=40, seed=1,
                                                               return_hidden_states=True, ignore_eos=True))
    return llm, cfg, outs


def test_a_spot_round_yields_to_the_update_and_finishes_after_it(tiny_llama_dir, tmp_path):
    """Spot training (docs/design.md §5): the round started alongside the rollout has paused before its next drafter
    step when rollout_done returns, stays paused while the update would run, and finishes after it (after_rollout),
    with every planned step trained. Control: without rollout_done it keeps training meanwhile."""
    import time

    from tlt.drafter_train.online import OnlineDrafterHook

    llm, cfg, outs = _spot_setup(tiny_llama_dir, tmp_path, compare_drafters=False)

    def round_(yield_to_update: bool) -> tuple[int, int, int]:
        hook = OnlineDrafterHook(cfg, llm.spec, spot=True)
        hook.add_outputs(1, outs)
        hook.last_step = 1
        hook.new_tokens *= 40  # a long round: hundreds of drafter steps
        planned = hook.session_steps()
        hook.before_rollout(2)
        time.sleep(0.2)
        if yield_to_update:
            hook.rollout_done(2)  # returns once the round has paused
        paused_at = hook.trainer.total_steps
        time.sleep(0.5)  # "the update"
        during_update = hook.trainer.total_steps - paused_at
        metrics = hook.after_rollout(2, None, [])
        return planned, int(metrics["drafter/steps"]), during_update

    planned, trained, during_update = round_(yield_to_update=True)
    assert trained == planned and during_update == 0
    planned, trained, during_update = round_(yield_to_update=False)
    assert trained == planned and during_update > 0  # control


def test_a_spot_round_trains_the_same_drafter_wherever_the_update_lands(tiny_llama_dir, tmp_path, monkeypatch):
    """A spot round reads the target's embedding and LM head as they were when it started (TargetSnapshot), so the
    drafter it trains is bitwise the same whether the update lands before its first drafter step or after its last:
    a killed and resumed run trains what an uninterrupted one does. Control: attached to the live target, the two
    differ."""
    import tlt.drafter_train.online as online

    llm, cfg, outs = _spot_setup(tiny_llama_dir, tmp_path, compare_drafters=True)
    target = llm.engine.model
    weights = {k: v.detach().clone() for k, v in target.state_dict().items()}
    start = {k: v.clone() for k, v in llm.spec.drafter.trainable_state_dict().items()}

    def round_(update_first: bool) -> dict[str, torch.Tensor]:
        target.load_state_dict(weights)
        llm.spec.load_drafter_state(start)
        hook = online.OnlineDrafterHook(cfg, llm.spec, spot=True)
        hook.add_outputs(1, outs)
        hook.last_step = 1
        hook.new_tokens *= 10  # tens of drafter steps
        hook.before_rollout(2)
        if update_first:
            hook.rollout_done(2)  # the round pauses before its first or second drafter step
        else:
            hook._pending[0].join()  # the round has finished
            hook.rollout_done(2)
        with torch.no_grad():  # "the update": the embedding and LM head (tied) change in place
            target.embed_tokens.weight.mul_(1.5).add_(0.05)
        assert hook.after_rollout(2, None, [])["drafter/steps"] > 5
        assert hook.drafter.target is target  # attached to the live target again
        return {k: v.clone() for k, v in hook.drafter.trainable_state_dict().items()}

    early, late = round_(update_first=True), round_(update_first=False)
    assert all(torch.equal(early[k], late[k]) for k in early)
    monkeypatch.setattr(online, "TargetSnapshot", lambda t: t)  # control: the round reads the live target
    early, late = round_(update_first=True), round_(update_first=False)
    assert not all(torch.equal(early[k], late[k]) for k in early)
    target.load_state_dict(weights)


def test_a_drafter_attached_to_another_target_drafts_with_its_head_at_the_same_address(target):
    """The reduced draft head is a cached slice of the target's LM head, keyed by its address and version: a drafter
    attached to another target (a spot round's next TargetSnapshot, which may reuse the freed copy's memory) takes
    that target's rows. Control: the same swap without attach, which the cache cannot see, keeps the stale rows."""
    from types import SimpleNamespace
    drafter = Drafter(target.cfg)
    drafter.d2t = torch.arange(0, 128, 2)
    buf = target.lm_head_weight.detach().clone()
    drafter.attach(SimpleNamespace(cfg=target.cfg, lm_head_weight=buf))
    first = drafter.draft_head().clone()
    buf.data.copy_(torch.randn_like(buf))  # new content at the same address, the version counter untouched
    assert torch.equal(drafter.draft_head(), first)  # control: the cache cannot tell
    drafter.attach(SimpleNamespace(cfg=target.cfg, lm_head_weight=buf))
    assert torch.equal(drafter.draft_head(), buf[drafter.d2t])


def _chain_forward(drafter, inputs, ids, pos):
    """A plain causal forward over one drafting chain [n, H]: what the drafter computes at inference."""
    return drafter(inputs[None], ids[None], pos[None])[0, -1]


@pytest.mark.parametrize("passes", [2, 3])
def test_unrolled_pass_equals_drafting_at_that_depth(target, buffer, passes):
    """Pass k + 1's prediction at t equals the drafter run causally over what depth k + 1 sees at inference: the
    target's features of its window up to t - k (the cache), then its own earlier predictions one a position."""
    from tlt.drafter_train.trainer import unrolled_predictions
    torch.manual_seed(2)
    drafter = Drafter(target.cfg).attach(target).float()
    b = buffer.sample_batch(2, 100, generator=torch.Generator().manual_seed(3))
    assert (b.seg_ids < 0).any() and (b.seg_ids.amax(1) > 0).any()  # padding, and rows of several windows
    with torch.no_grad():
        preds = unrolled_predictions(drafter, b.hidden_in.float(), b.next_ids, b.positions, b.attn_mask, passes)
        assert all(torch.isfinite(p).all() for p in preds)  # no fully masked query row, padding included
        checked = 0
        for row in range(b.seg_ids.shape[0]):
            for t in range(b.seg_ids.shape[1]):
                seg = b.seg_ids[row, t]
                start = int((b.seg_ids[row] == seg).nonzero()[0])
                for k in range(1, passes):
                    if seg < 0 or t - k < start:
                        continue
                    # depth k + 1 at t: the cache holds positions start..t-k; the chain's entries at t-k+1..t read
                    # the prediction of the pass before at the position before
                    inputs = [b.hidden_in[row, start:t - k + 1].float()]
                    inputs += [preds[j - 1][row, t - k + j - 1][None] for j in range(1, k + 1)]
                    want = _chain_forward(drafter, torch.cat(inputs), b.next_ids[row, start:t + 1],
                                          b.positions[row, start:t + 1])
                    torch.testing.assert_close(preds[k][row, t], want, rtol=1e-4, atol=1e-4)
                    checked += 1
    assert checked > 50
    # the control: teacher-forced features in place of the drafter's own predictions give another answer
    row = 0
    t = int((b.seg_ids[row] == 0).nonzero()[-1])
    start = int((b.seg_ids[row] == 0).nonzero()[0])
    with torch.no_grad():
        forced = _chain_forward(drafter, b.hidden_in[row, start:t + 1].float(), b.next_ids[row, start:t + 1],
                                b.positions[row, start:t + 1])
    assert not torch.allclose(preds[1][row, t], forced, rtol=1e-3, atol=1e-3)


def test_unrolled_pass_gradients_reach_the_earlier_passes(target, buffer):
    """Pass 2's loss trains the drafter through pass 1's prediction it reads as well as through its own forward:
    its gradient equals that of the drafter run causally over its context on pass 1's (undetached) prediction.
    Control: with that prediction detached the gradient differs."""
    from tlt.drafter_train.trainer import unrolled_predictions
    torch.manual_seed(4)
    drafter = Drafter(target.cfg).attach(target).float()
    params = [p for n, p in drafter.named_parameters() if n.startswith(("fc.", "layer."))]
    b = buffer.sample_batch(1, 64, generator=torch.Generator().manual_seed(5))
    row, t = 0, int((b.seg_ids[0] == 0).nonzero()[-1])
    start = int((b.seg_ids[0] == 0).nonzero()[0])
    h = b.hidden_in.float()
    preds = unrolled_predictions(drafter, h, b.next_ids, b.positions, b.attn_mask, 2)
    got = torch.autograd.grad(preds[1][row, t].sum(), params)

    def chain_grad(detach: bool):
        first = drafter(h, b.next_ids, b.positions, attn_mask=b.attn_mask)[row, t - 1]
        inputs = torch.cat([h[row, start:t], (first.detach() if detach else first)[None]])
        out = _chain_forward(drafter, inputs, b.next_ids[row, start:t + 1], b.positions[row, start:t + 1])
        return torch.autograd.grad(out.sum(), params)
    for g, w in zip(got, chain_grad(False)):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    assert any(not torch.allclose(g, w, rtol=1e-3, atol=1e-5) for g, w in zip(got, chain_grad(True)))


def test_unrolled_training_one_pass_is_teacher_forcing(target, buffer):
    """ttt_steps=1 is the teacher-forced loss; more passes add the unrolled ones to a training step's loss, while
    evaluation scores the teacher-forced pass whatever ttt_steps; an unrolled trainer trains."""
    batch = buffer.sample_batch(2, 64, generator=torch.Generator().manual_seed(0))
    one, three = make_trainer(target, amp_dtype=None), make_trainer(target, amp_dtype=None, ttt_steps=3)
    e1, e3 = one.evaluate(batch), three.evaluate(batch)
    assert e1 == pytest.approx(e3)
    assert e1["loss"] == pytest.approx(e1["hidden_loss"] + 0.1 * e1["ce"], rel=1e-5)
    with torch.no_grad():
        l1, l3 = one._forward(batch)[0].item(), three._forward(batch)[0].item()
    assert l1 == pytest.approx(e1["loss"]) and l3 != pytest.approx(l1, rel=1e-3)
    first = three.train_step(batch).loss
    for _ in range(30):
        last = three.train_step(batch).loss
    assert last < 0.7 * first
    with pytest.raises(ValueError, match="ttt_steps"):
        make_trainer(target, ttt_steps=0)


def test_ttt_steps_reach_the_online_and_replica_trainers(tiny_llama_dir, tmp_path):
    """drafter_train.ttt_steps trains online (in-process hook) and on Ray replicas (ReplicaConfig) unrolled."""
    import tlt
    from tlt.config import Config, DrafterTrainConfig
    from tlt.drafter_train.online import OnlineDrafterHook
    from tlt.speculative.drafter_io import save_drafter
    from tlt.workers.rollout_worker import ReplicaConfig

    plain = tlt.LLM(tiny_llama_dir, dtype="float32")
    drafter_dir = save_drafter(Drafter(plain.engine.model.cfg), tmp_path / "d")
    llm = tlt.LLM(tiny_llama_dir, dtype="float32", speculative_config={"method": "eagle", "model": str(drafter_dir)})
    cfg = DrafterTrainConfig(min_buffer_tokens=0, batch_tokens=64, window_len=16, holdout_fraction=0.0,
                             compare_drafters=False, ttt_steps=2)
    hook = OnlineDrafterHook(cfg, llm.spec)
    outs = plain.generate([[3, 5, 7, 9]] * 4, tlt.SamplingParams(temperature=1.0, max_tokens=24, seed=1,
                                                               return_hidden_states=True, ignore_eos=True))
    metrics = hook.after_rollout(1, None, outs)
    assert hook.trainer.ttt_steps == 2 and metrics["drafter/steps"] > 0
    run = Config()
    run.drafter_train.ttt_steps = 3
    assert ReplicaConfig.from_config(run).ttt_steps == 3


def test_a_round_judged_worse_on_fresh_responses_is_undone(tiny_llama_dir, tmp_path):
    """A published round that scores below the weights before it on the next step's held-out responses (prompts no
    drafter trained on) is undone: the next round trains from the weights before it, and the engine gets those back
    if that round is refused, or that round's weights if it publishes. Control: judged better on fresh responses,
    the next round trains on from the published weights."""
    import tlt
    from tlt.config import DrafterTrainConfig
    from tlt.drafter_train.online import OnlineDrafterHook
    from tlt.speculative.drafter_io import save_drafter

    plain = tlt.LLM(tiny_llama_dir, dtype="float32")
    drafter_dir = save_drafter(Drafter(plain.engine.model.cfg), tmp_path / "d")
    outs = plain.generate([[3, 5, 7, 9]] * 8, tlt.SamplingParams(temperature=1.0, max_tokens=24, seed=1,
                                                               return_hidden_states=True, ignore_eos=True))

    def run(heldout_scores, fresh_scores):
        """Two steps; scores by weights (0: the start, 1: round 1's, 2: round 2's) on the own step's held-out slice
        and on the next step's fresh responses. Returns round 2's metrics, the hook, each weights' fc and the
        engine's fc after round 2."""
        llm = tlt.LLM(tiny_llama_dir, dtype="float32",
                      speculative_config={"method": "eagle", "model": str(drafter_dir)})
        cfg = DrafterTrainConfig(min_buffer_tokens=0, batch_tokens=64, window_len=16, holdout_fraction=0.25,
                                 compare_drafters=False)
        hook = OnlineDrafterHook(cfg, llm.spec)
        seen: list[torch.Tensor] = []

        def evaluate(batch, **kw):
            fc = hook.drafter.fc.weight.detach().clone()
            index = next((i for i, w in enumerate(seen) if torch.equal(w, fc)), None)
            if index is None:
                seen.append(fc)
                index = len(seen) - 1
            fresh = hook._fresh is not None and batch is hook._fresh[0]
            score = (fresh_scores if fresh else heldout_scores)[index]
            return {"acc": score / 3, "accept_proxy": score}  # the publish gate reads acc
        hook.trainer.evaluate = evaluate
        gains, load = [], llm.spec.load_drafter_state
        llm.spec.load_drafter_state = lambda state, gain=None: (gains.append(gain), load(state, gain=gain))
        metrics = []
        for step in (1, 2):
            hook.before_rollout(step)
            hook.rollout_done(step)
            metrics.append(hook.after_rollout(step, None, outs))
        assert metrics[0]["drafter/published"] == 1 and len(seen) == 3
        assert gains[0] == pytest.approx(heldout_scores[1] / heldout_scores[0] - 1)  # round 1 over the start
        return metrics[1], hook, seen, llm.spec.drafter.fc.weight.detach(), gains[1:]

    # the gains handed to the policy stay measured one way (each round's own slice): an undo divides out the undone
    # round's 10%
    m, hook, seen, engine, gains = run({0: 1.5, 1: 1.65, 2: 1.4}, {0: 1.5, 1: 1.3})  # round 1 loses on fresh ones
    assert m["drafter/reverted"] == 1 and m["drafter/published"] == 0 and m["drafter/last_round_gain"] < 0
    assert torch.equal(engine, seen[0]) and hook._before_last is None  # round 2 refused: the start's weights again
    assert gains == [pytest.approx(1 / 1.1 - 1)]
    m, hook, seen, engine, gains = run({0: 1.5, 1: 1.65, 2: 1.6}, {0: 1.5, 1: 1.3})
    assert m["drafter/reverted"] == 1 and m["drafter/published"] == 1 and torch.equal(engine, seen[2])
    assert torch.equal(hook._before_last["fc.weight"], seen[0])  # round 2 trained from the start's weights
    assert gains == [pytest.approx((1.6 / 1.5) / 1.1 - 1)]
    m, hook, seen, engine, gains = run({0: 1.5, 1: 1.65, 2: 1.8}, {0: 1.5, 1: 1.6})  # control: round 1 gains there
    assert m["drafter/reverted"] == 0 and m["drafter/published"] == 1 and torch.equal(engine, seen[2])
    assert torch.equal(hook._before_last["fc.weight"], seen[1])  # round 2 trained on from round 1's weights
    assert gains == [pytest.approx(1.8 / 1.65 - 1)]


def test_training_steps_with_a_draft_vocabulary_need_only_its_rows(target, buffer, monkeypatch):
    """A reduced draft vocabulary: a training step multiplies the target's states by the draft vocabulary's rows of
    the LM head only (no [tokens, vocab] product), and its loss and gradient equal those of the whole-vocabulary
    product restricted to them; evaluation keeps the whole product (its exact top-1). Control: normalising the
    target's distribution over the whole vocabulary, then restricting it, gives another distribution, so a
    restricted product normalised the wrong way would change the loss compared here."""
    import tlt.drafter_train.trainer as trainer_module

    trainer = make_trainer(target)
    trainer.drafter.d2t = torch.arange(0, 128, 2)  # the even ids
    head = target.lm_head_weight
    batch = buffer.sample_batch(2, 64, 0, torch.Generator().manual_seed(0))
    whole_products = []
    linear = trainer_module.F.linear
    monkeypatch.setattr(trainer_module.F, "linear", lambda x, w, *a: whole_products.append(
        w.shape == head.shape and w.data_ptr() == head.data_ptr()) or linear(x, w, *a))
    results = {}
    for full in (True, False):
        whole_products.clear()
        trainer.drafter.zero_grad(set_to_none=True)
        loss, _, m = trainer._forward(batch, full_vocab_top1=full)
        loss.backward()
        results[full] = (loss.item(), [p.grad.clone() for p in trainer.params], m.acc, any(whole_products))
    assert results[True][3] and not results[False][3]  # the whole product only where the exact top-1 is asked for
    assert results[False][0] == pytest.approx(results[True][0], rel=1e-5)
    for a, b in zip(results[True][1], results[False][1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert results[False][2] >= results[True][2]  # hits within the draft vocabulary include the exact ones
    monkeypatch.undo()
    w, t = head.detach().float(), batch.target_hidden[batch.loss_mask].float()
    whole = torch.nn.functional.linear(t, w).softmax(-1)[:, trainer.drafter.d2t]
    rows = torch.nn.functional.linear(t, w[trainer.drafter.d2t]).softmax(-1)
    assert not torch.allclose(whole, rows, atol=1e-4)


def test_evaluations_of_one_batch_share_the_targets_side(target, buffer, monkeypatch):
    """TargetCache: two drafters evaluated on one held-out batch multiply the target's states by the whole LM head
    once, with the metrics of uncached evaluations; a changed LM head (its version) or another batch recomputes
    it (the controls)."""
    import tlt.drafter_train.trainer as trainer_module
    from tlt.drafter_train.trainer import TargetCache

    a, b = make_trainer(target), make_trainer(target, lr=1e-3)
    d2t = torch.arange(0, 128, 2)  # one draft vocabulary, as the hook's drafters share the engine's
    for t in (a, b):  # the drafters' own logits use its rows, the target's side the whole head
        t.drafter.d2t = d2t
    b.train_steps(buffer, 2)  # another drafter
    heldout = buffer.heldout_batch(64, 256)
    want = [t.evaluate(heldout) for t in (a, b)]
    head = target.lm_head_weight
    products = []
    linear = trainer_module.F.linear
    monkeypatch.setattr(trainer_module.F, "linear", lambda x, w, *args: products.append(
        w.shape == head.shape and w.data_ptr() == head.data_ptr()) or linear(x, w, *args))
    cache = TargetCache()
    got = [t.evaluate(heldout, targets=cache) for t in (a, b)]
    assert got == want and sum(products) == 1
    products.clear()
    a.evaluate(buffer.heldout_batch(64, 256), targets=cache)  # control: another batch object
    assert sum(products) == 1
    products.clear()
    b.drafter.d2t = torch.arange(1, 128, 2)  # control: another draft vocabulary on the same batch
    a.evaluate(heldout, targets=cache)
    b.evaluate(heldout, targets=cache)
    assert sum(products) == 2
    products.clear()
    with torch.no_grad():
        head.add_(0.0)  # control: an in-place update of the head (version bump)
    a.evaluate(heldout, targets=cache)
    a.evaluate(heldout, targets=cache)
    assert sum(products) == 1


def test_a_full_buffer_still_brings_each_step_its_training_tokens(tiny_llama_dir, tmp_path):
    """The online hook counts what each step's responses bring (the next round's one pass), per sample: a buffer at
    its token cap evicts about as much as it takes in, and its net growth (the control) is about zero."""
    import tlt
    from tlt.config import DrafterTrainConfig
    from tlt.drafter_train.online import OnlineDrafterHook
    from tlt.speculative.drafter_io import save_drafter

    plain = tlt.LLM(tiny_llama_dir, dtype="float32")
    drafter_dir = save_drafter(Drafter(plain.engine.model.cfg), tmp_path / "d")
    llm = tlt.LLM(tiny_llama_dir, dtype="float32", speculative_config={"method": "eagle", "model": str(drafter_dir)})
    outs = plain.generate([[3, 5, 7, 9]] * 4, tlt.SamplingParams(temperature=1.0, max_tokens=24, seed=1,
                                                               return_hidden_states=True, ignore_eos=True))
    hook = OnlineDrafterHook(DrafterTrainConfig(buffer_max_tokens=100, holdout_fraction=0.0, compare_drafters=False),
                             llm.spec)
    hook.add_outputs(1, outs)  # fills the buffer past its cap
    full = hook.buffer.num_train_tokens()
    hook.new_tokens = 0
    hook.add_outputs(2, outs)
    assert hook.buffer.num_train_tokens() - full <= 0  # control: the net growth of a full buffer
    assert hook.new_tokens == sum(s.loss_pairs for s in list(hook.buffer.samples)[-len(outs):]) > 0
