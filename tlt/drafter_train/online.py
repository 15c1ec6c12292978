"""Online drafter training inside the single-process RL loop (no Ray): the trainer's DrafterHook (docs/design.md §5).

Every RL step the rollout's target hidden states (kept by the engine, §3) go into the step-tagged DrafterBuffer.
Every `drafter_train.every_k_steps` steps, once the buffer holds `min_buffer_tokens`, one round runs on a training
copy of the engine's drafter: evaluate the published weights on a held-out slice, take a bounded number of drafter
steps (one pass over the loss tokens that arrived since the last round, capped by `max_steps` / `max_seconds`),
evaluate again, and publish into the running engine (`llm.spec.load_drafter_state`) only if held-out accuracy did
not drop (`should_publish`), with its gain in held-out accept length (AdaptivePolicy.drafter_changed); a refused
round is rolled back. A published round is judged again on the next step's held-out responses (prompts no drafter
trained on) against the weights it started from; one judged worse is undone (drafter/reverted). Exactness never
depends on the drafter, so a publish is always safe. Nothing here reads a clock to decide: a resumed run trains
the drafter an uninterrupted one does.

When: with `spot` off, after the policy update, paid on top of the step. With `spot` on, the round on the steps so
far runs in a thread beside the next rollout, on compute the rollout leaves idle, against a copy of the target's
embedding and LM head taken as it starts (TargetSnapshot: the update rewrites them); when the rollout ends,
`rollout_done` returns once the thread has paused before its next drafter step, it stays paused through the
log-probs and the update (which would share memory bandwidth with it), then finishes, and is published after that
rollout (drafter/spot_yield_s, spot_wait_s). The round reads only the buffer
and its training copy; the engine's drafter changes only in the main thread. The drafter comparison
(compare_drafters) runs in the same place, on the previous step's held-out responses (drafter/compare/rl_step).

Checkpoint state: the published weights, the optimiser, the sampling generator, the counters and (save_buffer) the
buffer with its hidden states, so a resumed run trains on what the uninterrupted one would.
"""
from __future__ import annotations

import math
import threading
import time
from pathlib import Path
from typing import Any

import torch

from tlt.config import DrafterTrainConfig
from tlt.drafter_train import compare
from tlt.drafter_train.buffer import DrafterBuffer, DrafterSample
from tlt.drafter_train.hook import DrafterHook
from tlt.drafter_train.packing import PackedBatch, pack
from tlt.drafter_train.trainer import DrafterTrainer, TargetCache, held_out_gain, should_publish
from tlt.engine.outputs import RequestOutput
from tlt.faults import fault_point
from tlt.speculative.drafter import Drafter
from tlt.speculative.drafter_io import save_drafter

HELDOUT_BATCHES = 4  # held-out evaluation uses at most this many packed rows of batch_tokens (newest samples)


class OnlineDrafterHook(DrafterHook):
    wants_hidden_states = True

    def __init__(self, cfg: DrafterTrainConfig, spec, seed: int = 0, max_steps: int | None = None,
                 max_seconds: float | None = None, ckpt_dir: str | None = None, spot: bool = False,
                 save_buffer: bool = True):
        """spec: the engine's SpecDecoder (`llm.spec`) whose drafter is trained and replaced; spot: train alongside
        the next rollout (see the module doc); save_buffer: state_dict holds the buffer too
        (trainer.save_drafter_buffer)."""
        if spec is None or spec.drafter is None:
            raise ValueError("online drafter training needs an engine with an EAGLE drafter "
                             "(speculative.enabled=true, speculative.method=eagle)")
        self.cfg, self.spec = cfg, spec
        self.max_steps, self.max_seconds = max_steps, max_seconds
        self.drafter = training_copy(spec.drafter)
        self.trainer = DrafterTrainer(self.drafter, lr=cfg.lr, batch_tokens=cfg.batch_tokens, seed=seed,
                                      ckpt_dir=ckpt_dir, ckpt_every=cfg.ckpt_every if ckpt_dir else 0,
                                      ttt_steps=cfg.ttt_steps)
        # the warm-start drafter, never trained: the baseline of the per-step comparison (tlt.drafter_train.compare)
        self.frozen = DrafterTrainer(training_copy(spec.drafter), lr=0.0, batch_tokens=cfg.batch_tokens) \
            if cfg.compare_drafters else None
        self.fresh_heldout: list[tuple[DrafterSample, list[int], list[list[int]], int]] = []
        holdout_every = round(1 / cfg.holdout_fraction) if cfg.holdout_fraction > 0 else 0
        self.buffer = DrafterBuffer(cfg.buffer_max_tokens, cfg.window_len,
                                    offset_frac=0.5 if cfg.offset_sampling else 0.0, holdout_every=holdout_every)
        self.version = 0             # rounds published so far
        self.new_tokens = 0          # loss tokens added since the last round
        self.last_train: dict[str, float] = {}
        self.spot, self.save_buffer = spot, save_buffer
        self.last_step = 0           # RL step of the newest data in the buffer
        self._pending: tuple[threading.Thread, dict] | None = None  # a spot round in flight
        self._may_run = threading.Event()  # cleared while the update runs: the spot round waits
        self._may_run.set()
        self._paused = threading.Event()   # set by the spot round while it waits for _may_run
        self._yield_s = 0.0                 # what rollout_done waited for the round's step in flight
        self._spot_start = 0.0              # when the spot round's thread started
        self._rollout_end: float | None = None  # when the rollout it ran beside ended (rollout_done)
        self._before_last: dict[str, torch.Tensor] | None = None  # the weights the last published round started from
        self._published_gain: float | None = None  # the gain handed to the engine with the last publish
        self._fresh: tuple[PackedBatch, TargetCache] | None = None  # fresh_batch(), shared within a step

    # ---- the hook ----------------------------------------------------------------------------------------
    def before_rollout(self, step: int) -> None:
        """spot: in a thread alongside this rollout, compare the drafters on the previous step's held-out responses
        (if compare_drafters) and run the round on the steps so far (if one is due)."""
        if not self.spot:  # the round runs in after_rollout
            return
        compare_due = self._compare_due()
        train_due = self._due(self.last_step)
        if compare_due or train_due:
            result: dict[str, Any] = {}
            self._may_run.set()

            def work():
                try:
                    if compare_due:  # before the round trains on them, as after_rollout does without spot
                        result["compare"] = self.compare_drafters()
                    if train_due:
                        result["trained"] = self._train(self.last_step, pause=self._may_run)
                except BaseException as e:  # re-raised in the main thread by after_rollout
                    result["error"] = e
                finally:
                    self._fresh = None
                    result["end"] = time.perf_counter()
            # the round reads the target's embedding and LM head as they are now, whenever the update runs: what
            # it trains is then the same in every run, resumed or not
            snapshot = TargetSnapshot(self.spec.drafter.target)
            for d in self._drafters():
                d.attach(snapshot)
            thread = threading.Thread(target=work, name="tlt-spot-drafter", daemon=True)
            self._spot_start, self._rollout_end = time.perf_counter(), None
            thread.start()
            self._pending = (thread, result)

    def rollout_done(self, step: int) -> None:
        """The rollout is over: a spot round pauses before its next drafter step until after the update, which
        would share the memory bandwidth. Returns once it has paused (or finished)."""
        self._may_run.clear()
        t0 = time.perf_counter()
        if self._pending is not None:
            thread = self._pending[0]
            while thread.is_alive() and not self._paused.wait(0.005):
                pass
        self._yield_s = time.perf_counter() - t0
        self._rollout_end = t0

    def after_rollout(self, step: int, rollout: Any, outputs: list[RequestOutput]) -> dict[str, float]:
        metrics = {"drafter/steps": 0.0, "drafter/train_time_s": 0.0, "drafter/published": 0.0,
                   "drafter/reverted": 0.0}
        self._may_run.set()
        if self._pending is not None:  # the spot round that ran alongside this rollout: publish it now
            thread, result = self._pending
            t0 = time.perf_counter()
            thread.join()
            metrics["drafter/spot_wait_s"] = time.perf_counter() - t0  # what was left after the rollout
            metrics["drafter/spot_yield_s"] = self._yield_s  # the step in flight when the rollout ended
            # how long it ran beside the rollout (its thread set "end" as it finished)
            rollout_end = self._rollout_end if self._rollout_end is not None else t0
            overlap = max(min(result["end"], rollout_end) - self._spot_start, 0.0)
            metrics["drafter/spot_overlap_s"] = overlap
            self._pending = None
            for d in self._drafters():
                d.attach(self.spec.drafter.target)
            if "error" in result:
                raise result["error"]
            metrics.update(result.get("compare", {}))  # the previous step's responses (drafter/compare/rl_step)
            if "trained" in result:
                metrics.update(self._finish(step, *result["trained"]))
        t0 = time.perf_counter()
        self.add_outputs(step, outputs)
        metrics["drafter/buffer_time_s"] = time.perf_counter() - t0
        self.last_step = step
        if not self.spot and self._compare_due():  # spot: in the next step's thread
            metrics.update(self.compare_drafters())
        if not self.spot and self._due(step):
            metrics.update(self.train_session(step))
        self._fresh = None  # the fresh batch's target side is large: not held through the update
        metrics |= self.last_train  # loss/acc of the latest round, so the curves have a value every step
        metrics.update({"drafter/version": float(self.version), "drafter/buffer_tokens": float(self.buffer.num_tokens)})
        return metrics

    def add_outputs(self, step: int, outputs: list[RequestOutput]) -> None:
        """Every response's hidden states: hidden[i] produced response token i, i.e. is h at position P-1+i."""
        self.fresh_heldout, self._fresh = [], None
        for out in outputs:
            prompt = list(out.prompt_token_ids)
            group = [list(c.token_ids) for c in out.outputs]
            for i, completion in enumerate(out.outputs):
                if completion.hidden_states is None or not completion.token_ids:
                    continue
                sample = self.buffer.add_response(prompt, group[i], completion.hidden_states, step,
                                                  completion.hidden_start)
                if sample is None:
                    continue
                # what arrived, counted per sample: a full buffer evicts about as much as it takes in, so its net
                # growth would fall to zero and the rounds with it
                self.new_tokens += 0 if sample.heldout else sample.loss_pairs
                # the n-gram comparison scores whole responses: those with a gap in their kept states sit it out
                if sample.heldout and len(group[i]) > 1 and completion.hidden_start == 0:
                    self.fresh_heldout.append((sample, prompt, group, i))

    def fresh_batch(self) -> tuple[PackedBatch, TargetCache] | None:
        """The newest step's held-out responses, packed (prompts no drafter has trained on), with a target side
        that the comparison and the published round's judge share; None without any. Built once a step, dropped
        when the step's drafter work is done."""
        if self._fresh is None and self.fresh_heldout:
            self._fresh = (pack([s.window(a, b) for s, *_ in self.fresh_heldout
                                 for _, a, b in self.buffer.windows_of(s)], self.cfg.batch_tokens), TargetCache())
        return self._fresh

    def compare_drafters(self) -> dict[str, float]:
        """Accept-length proxy of the online, frozen warm-start and n-gram drafters on this step's held-out
        responses, before the drafter trains on the step (tlt.drafter_train.compare)."""
        t0 = time.perf_counter()
        batch, targets = self.fresh_batch()  # one target side for the drafters (and the published round's judge)
        online = self.trainer.evaluate(batch, targets=targets)
        frozen = self.frozen.evaluate(batch, targets=targets)
        ngram = torch.cat([compare.accept_from_hits(compare.ngram_hits(
            prompt, group, i, compare.target_top1(s.hidden, self.drafter.target.lm_head_weight)))
            for s, prompt, group, i in self.fresh_heldout])
        return {"drafter/compare/rl_step": float(self.last_step),
                "drafter/compare/online": online["accept_proxy"], "drafter/compare/frozen": frozen["accept_proxy"],
                "drafter/compare/ngram": float(ngram.float().mean()), "drafter/compare/tokens": float(ngram.numel()),
                "drafter/compare/time_s": time.perf_counter() - t0}

    def _drafters(self) -> list[Drafter]:
        return [self.drafter] + ([self.frozen.drafter] if self.frozen is not None else [])

    def _due(self, step: int) -> bool:
        """Whether the round on the steps through `step` runs now; called once a step (before_rollout with spot,
        else after_rollout): every every_k_steps steps, once new data arrived and the buffer holds
        min_buffer_tokens."""
        if step <= 0 or step % self.cfg.every_k_steps:
            return False
        return self.new_tokens > 0 and self.buffer.num_train_tokens() >= self.cfg.min_buffer_tokens

    def _compare_due(self) -> bool:
        return self.frozen is not None and bool(self.fresh_heldout)

    def session_steps(self) -> int:
        steps = max(1, math.ceil(self.new_tokens / self.cfg.batch_tokens))
        return min(steps, self.max_steps) if self.max_steps is not None else steps

    def train_session(self, step: int) -> dict[str, float]:
        """Train, evaluate old vs new on the held-out slice, publish or roll back. Returns drafter/* metrics."""
        return self._finish(step, *self._train(step))

    def _train(self, step: int, pause: threading.Event | None = None):
        """The round's work on the training copy (a spot thread runs this): train on the buffer as it is. With
        `pause`, each drafter step first waits until it is set (the trainer's update runs meanwhile); no drafter
        step starts after max_seconds. A round that took no step is not evaluated again."""
        t0 = time.perf_counter()
        last_gain = self.last_round_gain()
        if last_gain is not None and last_gain < 0:  # the last published round lost where the drafter is used:
            self.drafter.load_state_dict(self._before_last, strict=False)  # this one trains from the weights before it
        heldout = self.heldout()
        targets = TargetCache()  # before and after share the target's side (recomputed if the update ran between)
        old = self.trainer.evaluate(heldout, targets=targets) if heldout is not None else None
        snapshot = {k: v.clone() for k, v in self.drafter.trainable_state_dict().items()}
        deadline = t0 + self.max_seconds if self.max_seconds is not None else None
        steps, self.new_tokens = self.session_steps(), 0
        def stop() -> bool:  # checked before every drafter step
            nonlocal deadline
            if pause is not None and not pause.is_set():
                waited = time.perf_counter()
                self._paused.set()
                pause.wait()
                self._paused.clear()
                if deadline is not None:  # the pause does not count against max_seconds
                    deadline += time.perf_counter() - waited
            return deadline is not None and time.perf_counter() > deadline
        stats = self.trainer.train_steps(self.buffer, steps, step=step, stop_flag=stop)
        new = self.trainer.evaluate(heldout, targets=targets) if heldout is not None and stats.steps else None
        return stats, old, new, snapshot, time.perf_counter() - t0, last_gain

    def last_round_gain(self) -> float | None:
        """What the last published round bought where it is used: the accept-length proxy of the published drafter
        over the weights that round started from, on the newest step's held-out responses (before training on
        them), as a fraction; None without a published round to judge or fresh responses."""
        fresh = self.fresh_batch() if self._before_last is not None else None
        if fresh is None:
            return None
        batch, targets = fresh
        now = self.trainer.evaluate(batch, targets=targets)["accept_proxy"]
        published = {k: v.clone() for k, v in self.drafter.trainable_state_dict().items()}
        self.drafter.load_state_dict(self._before_last, strict=False)
        try:
            before = self.trainer.evaluate(batch, targets=targets)["accept_proxy"]
        finally:
            self.drafter.load_state_dict(published, strict=False)
        return now / before - 1

    def _finish(self, step: int, stats, old, new, snapshot, seconds: float,
                last_gain: float | None = None) -> dict[str, float]:
        """Publish into the engine or roll back (main thread) during RL step `step`. Returns drafter/* metrics."""
        publish = stats.steps > 0 and (new is None or should_publish(new, old))
        # the last published round was judged worse on fresh responses: _train started this one from the weights
        # before it (snapshot), which the engine gets back if this round is refused
        reverted = last_gain is not None and last_gain < 0
        # the gain the policy was handed for the engine's weights over the snapshot's (the undone round's), so that
        # the gains it multiplies up stay measured one way: each round's own held-out slice
        credited = self._published_gain if reverted else 0.0
        if publish:  # with the gain on the held-out slice: parked drafter arms get a trial only where it could pay
            gain = held_out_gain(old, new)
            if gain is not None:  # over the engine's weights, not the snapshot's
                gain = None if credited is None else (1 + gain) / (1 + credited) - 1
            self._publish(step, self.drafter.trainable_state_dict(), gain)
        else:
            self.drafter.load_state_dict(snapshot, strict=False)  # refused: keep training from the published one
            if reverted:  # the engine goes back to the weights before the undone round
                self._publish(step, snapshot, None if credited is None else 1 / (1 + credited) - 1)
        out = {"drafter/steps": float(stats.steps), "drafter/published": float(publish),
               "drafter/reverted": float(reverted), "drafter/train_time_s": seconds}
        if last_gain is not None:  # the last published round, judged on responses to prompts it never saw
            out["drafter/last_round_gain"] = last_gain
        if reverted and not publish:  # the engine is back on the weights before the judged round: nothing to judge
            self._before_last = None
        if publish:  # a refused round leaves the published weights, and the judge
            self._before_last = snapshot
        if stats.last is not None:
            self.last_train = {"drafter/loss": stats.last.loss, "drafter/acc": stats.last.acc}
        if new is not None:
            self.last_train |= {"drafter/eval_acc": new["acc"], "drafter/accept_proxy": new["accept_proxy"],
                                "drafter/eval_acc_old": old["acc"], "drafter/accept_proxy_old": old["accept_proxy"]}
        return out

    def _publish(self, step: int, state: dict[str, torch.Tensor], gain: float | None) -> None:
        """Into the engine (main thread), with its gain in accept length over the weights there (None: unknown)."""
        self.spec.load_drafter_state(state, gain=gain)
        fault_point("publish", step)
        self.version += 1
        self._published_gain = gain

    def heldout(self) -> PackedBatch | None:
        return self.buffer.heldout_batch(self.cfg.batch_tokens, HELDOUT_BATCHES * self.cfg.batch_tokens)

    # ---- checkpoints --------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Published drafter weights, optimiser, generator, counters and (save_buffer) the buffer."""
        self.trainer.checkpointer.wait()
        published = {k: v.detach().to("cpu", copy=True) for k, v in self.spec.drafter.trainable_state_dict().items()}
        return {"drafter": published, "optimizer": self.trainer.opt.state_dict(), "version": self.version,
                "drafter_steps": self.trainer.total_steps, "generator": self.trainer.generator.get_state(),
                "last_train": dict(self.last_train), "new_tokens": self.new_tokens, "last_step": self.last_step,
                "published_gain": self._published_gain,
                "before_last": None if self._before_last is None else {k: v.detach().to("cpu", copy=True) for k, v
                                                                       in self._before_last.items()},
                "buffer": self.buffer.state_dict() if self.save_buffer else None,
                "frozen": None if self.frozen is None else {k: v.detach().to("cpu", copy=True) for k, v in
                                                            self.frozen.drafter.trainable_state_dict().items()}}

    def export(self, out_dir: Path) -> None:
        """The drafter the engine uses, in tlt.speculative.drafter_io's layout (tlt.export converts it for
        serving)."""
        save_drafter(self.spec.drafter, out_dir, extra={"version": self.version,
                                                        "drafter_steps": self.trainer.total_steps})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        self.drafter.load_state_dict(state["drafter"], strict=False)
        self.spec.load_drafter_state(state["drafter"])
        self.trainer.opt.load_state_dict(state["optimizer"])
        self.trainer.generator.set_state(state["generator"])
        self.version, self.trainer.total_steps = state["version"], state["drafter_steps"]
        self.last_train = dict(state["last_train"])
        if state.get("buffer") is not None:  # left out by trainer.save_drafter_buffer=false: refills from rollouts
            self.buffer.load_state_dict(state["buffer"])
        self.new_tokens, self.last_step = int(state.get("new_tokens", 0)), int(state.get("last_step", 0))
        self._published_gain = state.get("published_gain")
        before = state.get("before_last")
        self._before_last = None if before is None else {k: v.to(self.drafter.fc.weight.device) for k, v in
                                                         before.items()}
        if self.frozen is not None and state.get("frozen") is not None:  # the run's warm start, not the resumed one
            self.frozen.drafter.load_state_dict(state["frozen"], strict=False)


class TargetSnapshot:
    """A copy of what a drafter reads of its target (the embedding and the LM head, tied or not, and the config):
    a spot round attaches to it, so the policy update running meanwhile changes nothing the round computes."""

    def __init__(self, target):
        with torch.inference_mode(False), torch.no_grad():
            self.cfg = target.cfg
            embed = target.embed_tokens.weight.detach().clone()
            self.embed_tokens = torch.nn.Embedding.from_pretrained(embed, freeze=True)
            head = target.lm_head_weight
            self.lm_head_weight = embed if head is target.embed_tokens.weight else head.detach().clone()


def training_copy(engine_drafter: Drafter) -> Drafter:
    """An fp32 copy of the engine's drafter sharing the target's frozen embedding and LM head, and its draft
    vocabulary: what a drafter round trains (here, and on a Ray replica)."""
    d = Drafter(engine_drafter.cfg, fc_bias=engine_drafter.fc_bias).attach(engine_drafter.target)
    d.to(next(engine_drafter.parameters()).device, torch.float32)
    d.load_state_dict(engine_drafter.state_dict(), strict=False)
    d.d2t = engine_drafter.d2t  # reduced draft vocabulary (not in the state dict)
    return d
