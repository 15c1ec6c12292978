"""RolloutReplica: one rollout worker (engine + drafter buffer + drafter trainer), plain Python, no Ray.

A replica generates the prompt groups it is given with its own tlt.LLM (adaptive speculative decoding), keeps the
target hidden states of every response in its DrafterBuffer (docs/design.md §3), and, when the driver's
SpotCoordinator says it is idle, trains its copy of the drafter on that buffer (section 5). Drivers:
tlt.workers.spot.LocalSpotRollout (one in-process replica) and tlt.workers.ray_rollout.SpotRollout (Ray actors
wrapping this class; every method here is callable from another thread while `generate_groups` or
`train_drafter` runs, which is what a threaded Ray actor does).

Two drafters per replica, the same architecture: the ENGINE's (inference mode, drafts tokens; replaced between
engine steps by `set_drafter`, so a new version lands mid-rollout) and the TRAINING copy (fp32 master weights +
AdamW state, local to the replica). Speculation is exact, so the engine's drafter may change at any time.
Locks: `_step_lock` (held per engine step; weight loads wait for a step boundary), `_gen_lock` (one rollout per
engine at a time; a second call, e.g. re-queued groups, waits), `_buffer_lock` (held by a whole training session
and by recording a rollout, so the buffer never changes under the trainer). A drafter published during a rollout
waits in a one-slot mailbox (`_pending_lock`) that the rollout's step loop empties at its next step boundary: the
loop retakes `_step_lock` at once after each step, so a publisher waiting on that lock could starve until the
rollout ended.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from tlt.device import resolve_device, resolve_dtype
from tlt.drafter_train.buffer import DrafterBuffer
from tlt.drafter_train.online import training_copy
from tlt.drafter_train.trainer import DrafterTrainer, held_out_gain, should_publish
from tlt.engine.outputs import CompletionOutput, RequestOutput
from tlt.engine.params import SamplingParams
from tlt.engine.sequence import Sequence as Seq
from tlt.llm import LLM
from tlt.models.config import ModelConfig
from tlt.models.decoder import Decoder
from tlt.speculative.config import SpecConfig
from tlt.speculative.drafter import Drafter
from tlt.speculative.drafter_io import load_drafter
from tlt.speculative.spec_decoder import SpecDecoder

Group = tuple[int, list[int]]  # (group_id, prompt_ids)


@dataclass
class ReplicaConfig:
    speculative: dict | None = None  # tlt.LLM speculative_config; eagle without "model" = fresh seeded drafter
    max_num_seqs: int = 64
    max_model_len: int | None = None
    device: str = "auto"
    dtype: str = "auto"
    enforce_eager: bool = False      # no CUDA graphs (see tlt.engine.cuda_graph)
    attention: str = "auto"          # decode / verify attention backend (tlt.models.flex)
    seed: int = 0                    # engine seed and fresh-drafter init (equal on every replica: one drafter)
    train_drafter: bool = True       # record hidden states and train the drafter (needs an eagle drafter)
    drafter_lr: float = 3e-4
    batch_tokens: int = 2048         # tokens per packed drafter batch row
    ttt_steps: int = 1               # unrolled passes a drafter step (tlt.drafter_train.trainer)
    buffer_max_tokens: int = 2_000_000
    window_len: int = 512
    holdout_every: int = 10          # every k-th response is held out for the publish gate (0 = no gate)
    eval_tokens: int = 4096          # held-out tokens evaluated before and after a session
    publish_tol: float = 0.0         # refuse a session whose held-out top-1 acc drops by more than this

    @classmethod
    def from_config(cls, cfg) -> "ReplicaConfig":
        """From a tlt.config.Config (sections model, data, rollout, speculative, drafter_train, trainer)."""
        s, d = cfg.speculative, cfg.drafter_train
        return cls(speculative=s.engine_config(cfg.trainer.seed), **cfg.engine_args(), device=cfg.model.device,
                   dtype=cfg.rollout_dtype(), train_drafter=d.enabled and s.enabled and s.method == "eagle",
                   drafter_lr=d.lr, ttt_steps=d.ttt_steps,
                   batch_tokens=d.batch_tokens, buffer_max_tokens=d.buffer_max_tokens, window_len=d.window_len,
                   holdout_every=round(1 / d.holdout_fraction) if d.holdout_fraction > 0 else 0)


@dataclass
class GroupsResult:
    replica: int
    outputs: list[RequestOutput]  # one per group given, same order; hidden states only if the params asked
    train_tokens: int             # loss-carrying pairs in this replica's buffer after recording this rollout
    stats: dict                   # llm.stats() for this RL step so far (spec_accept_length, ...), with the CUDA
                                  # graphs captured in it (step_graph_captures, step_graph_capture_time_s)
    seconds: float


@dataclass
class TrainResult:
    replica: int
    steps: int
    seconds: float
    mean_step_s: float
    preempted: bool                 # stopped by the flag before max_steps
    publish: bool                   # steps > 0 and the held-out gate accepted the new weights
    eval_before: dict | None = None  # DrafterTrainer.evaluate on the held-out slice (None: nothing held out)
    eval_after: dict | None = None
    loss: float | None = None        # last step's loss

    @property
    def gain(self) -> float | None:
        """The session's held-out gain in accept length (None: nothing held out)."""
        return held_out_gain(self.eval_before, self.eval_after)


def build_decoder(model: str | Path | Decoder | ModelConfig, device: str, dtype: str) -> Decoder | str:
    """A Decoder, or the path for tlt.LLM to load. A ModelConfig gives a randomly initialised Decoder whose
    weights are expected from set_policy_weights (the driver sends the trainer's state dict)."""
    if isinstance(model, ModelConfig):
        dev = resolve_device(device)
        return Decoder(model).to(device=dev, dtype=resolve_dtype(dtype, dev)).eval()
    return model if isinstance(model, Decoder) else str(model)


class RolloutReplica:
    def __init__(self, model: str | Path | Decoder | ModelConfig, replica_id: int = 0,
                 cfg: ReplicaConfig | None = None, tokenizer=None):
        self.replica_id, self.cfg = replica_id, cfg or ReplicaConfig()
        c = self.cfg
        self.llm = LLM(model=build_decoder(model, c.device, c.dtype), tokenizer=tokenizer, dtype=c.dtype,
                       device=c.device, max_num_seqs=c.max_num_seqs, max_model_len=c.max_model_len, seed=c.seed,
                       enforce_eager=c.enforce_eager, attention=c.attention)
        self.model = self.llm.model
        self.spec = self._build_spec(c.speculative) if c.speculative else None
        self.llm.spec = self.spec
        self.drafter_version = 0
        self.policy_version = 0
        self.buffer, self.trainer, self.train_copy = None, None, None
        if c.train_drafter and self.spec is not None and self.spec.drafter is not None:
            self.train_copy = training_copy(self.spec.drafter)  # with the draft vocabulary the engine drafts with
            self.buffer = DrafterBuffer(c.buffer_max_tokens, c.window_len, holdout_every=c.holdout_every)
            self.trainer = DrafterTrainer(self.train_copy, lr=c.drafter_lr, batch_tokens=c.batch_tokens,
                                          seed=c.seed + replica_id, ttt_steps=c.ttt_steps)
        self._step_lock, self._gen_lock, self._buffer_lock = threading.Lock(), threading.Lock(), threading.Lock()
        self._pending_lock = threading.Lock()
        self._pending_drafter: tuple[dict, float | None] | None = None  # published (state, gain), not in the engine
        self._flags: dict[int, threading.Event] = {}
        self._flags_lock = threading.Lock()
        self._generating = self._training = False
        self._deferred_train_state: dict | None = None
        self._stats_step: int | None = None
        self._captures_before = (0, 0.0)  # _captures() when this RL step's first generate began

    def _build_spec(self, spec: dict) -> SpecDecoder:
        cfg = SpecConfig.from_dict(spec)
        drafter = None
        if cfg.method == "eagle":
            if spec.get("model"):
                drafter = load_drafter(spec["model"])
            else:  # seeded: every replica starts from the same weights (one logical drafter, version 0)
                with torch.random.fork_rng():
                    torch.manual_seed(self.cfg.seed)
                    drafter = Drafter(self.model.cfg)
        return SpecDecoder(self.llm.engine, cfg, drafter)

    # ---- weights -------------------------------------------------------------------------------------------
    def set_policy_weights(self, state: Mapping[str, torch.Tensor], version: int | None = None) -> int:
        """Load the trainer's Decoder state dict (tlt keys). Through Ray, pass an ObjectRef from ray.put as the
        argument: Ray resolves it, so N replicas share one copy in the object store."""
        if self._generating:
            raise RuntimeError("set_policy_weights during a rollout would mix two policies in one response")
        with self._step_lock:
            self.model.load_state_dict(dict(state), strict=True)
        self.policy_version = self.policy_version + 1 if version is None else version
        return self.policy_version

    def set_drafter(self, state: Mapping[str, torch.Tensor], version: int, gain: float | None = None) -> bool:
        """Make `state` (trainable drafter weights) drafter `version` here, with `gain` its accept length over the
        previous version's, less 1 (None: unknown; the policy re-tries every parked drafter arm). The engine drafts
        with it from its next step boundary (a running rollout picks it up between two steps; otherwise it is
        loaded before this returns); the training copy takes it now, or after a running session. Stale -> False."""
        if self.spec is None or self.spec.drafter is None:
            return False
        state = dict(state)
        with self._pending_lock:
            if version <= self.drafter_version:
                return False
            if version != self.drafter_version + 1:  # versions this replica never had: their gains are unknown
                gain = None
            if self._pending_drafter is not None:  # replaces one not yet in the engine: the gains compose
                last = self._pending_drafter[1]
                gain = None if gain is None or last is None else (1 + last) * (1 + gain) - 1
            self._pending_drafter, self.drafter_version = (state, gain), version
        if self._gen_lock.acquire(blocking=False):  # no rollout: nothing else would load it
            try:
                with self._step_lock:
                    self._load_pending_drafter()
            finally:
                self._gen_lock.release()
        # else the rollout holding _gen_lock loads it at its next step boundary, or as it ends
        if self.train_copy is not None:
            with self._flags_lock:
                if self._training:
                    self._deferred_train_state = state
                else:
                    self.train_copy.load_state_dict(state, strict=False)
        return True

    def _load_pending_drafter(self) -> None:
        """Load the last drafter published since the previous call, if any (the caller holds _step_lock)."""
        with self._pending_lock:
            pending, self._pending_drafter = self._pending_drafter, None
        if pending is not None:
            self.spec.load_drafter_state(pending[0], gain=pending[1])

    def drafter_state(self) -> dict[str, torch.Tensor]:
        """The training copy's trainable weights (CPU), i.e. what the last accepted session produced."""
        src = self.train_copy if self.train_copy is not None else getattr(self.spec, "drafter", None)
        if src is None:
            return {}
        return {k: v.detach().to("cpu", copy=True) for k, v in src.trainable_state_dict().items()}

    # ---- rollout -------------------------------------------------------------------------------------------
    def generate_groups(self, groups: Sequence[Group], params: SamplingParams | Sequence[SamplingParams],
                        rl_step: int) -> GroupsResult:
        """Generate every group to completion; record the responses' hidden states into the buffer."""
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(groups)
        if len(params) != len(groups):
            raise ValueError(f"got {len(params)} SamplingParams for {len(groups)} groups")
        t0 = time.perf_counter()
        with self._gen_lock:
            self._generating = True
            try:
                if rl_step != self._stats_step:
                    if self.spec is not None:
                        self.spec.reset_stats()  # accept-length figures per RL step, not cumulative
                    self._captures_before = self._captures()
                self._stats_step = rl_step
                record = self.buffer is not None
                engine, requests = self.llm.engine, []
                for (gid, prompt), p in zip(groups, params):
                    run_p = dataclasses.replace(p, return_hidden_states=True) if record else p
                    requests.append(engine.add_request(list(prompt), run_p, gid))
                while engine.has_unfinished():
                    with self._step_lock:  # drafter / weight loads happen between steps
                        self._load_pending_drafter()
                        engine.step()
            finally:
                self._generating = False
                with self._step_lock:  # one published after the last step boundary
                    self._load_pending_drafter()
        outputs = [self._output(seqs, list(prompt), p.return_hidden_states)
                   for seqs, (_, prompt), p in zip(requests, groups, params)]
        tokens = self._record(requests, rl_step) if record else 0
        captures, capture_s = (now - before for now, before in zip(self._captures(), self._captures_before))
        stats = self.llm.stats() | {"step_graph_captures": captures, "step_graph_capture_time_s": capture_s}
        return GroupsResult(self.replica_id, outputs, tokens, stats, time.perf_counter() - t0)

    def _captures(self) -> tuple[int, float]:
        """CUDA graphs this replica's engine has captured, and their seconds (llm.stats() counts them since start)."""
        return self.llm.engine.num_graph_captures, self.llm.engine.graph_capture_time_s

    def _output(self, seqs: list[Seq], prompt: list[int], keep_hidden: bool) -> RequestOutput:
        tok = self.llm.tokenizer
        outs = [CompletionOutput(s.sample_index, tok.decode(s.output_ids, skip_special_tokens=True) if tok else "",
                                 list(s.output_ids), list(s.logprobs), s.finish_reason, float(sum(s.logprobs)),
                                 torch.stack(s.hidden) if keep_hidden and s.hidden else None, s.hidden_start)
                for s in seqs]
        return RequestOutput(seqs[0].request_id, None, prompt, outs, seqs[0].group_id)

    def _record(self, requests: list[list[Seq]], rl_step: int) -> int:
        """Buffer (prompt + response, h_{P-1..L-2}) per response; the driver never sees the hidden states."""
        with self._buffer_lock:
            for seqs in requests:
                for s in seqs:
                    if s.hidden:
                        self.buffer.add_response(s.prompt_ids, s.output_ids, torch.stack(s.hidden), rl_step,
                                                 s.hidden_start)
                    s.hidden = []
            return self.buffer.num_train_tokens()

    # ---- drafter training ----------------------------------------------------------------------------------
    def _flag(self, session: int) -> threading.Event:
        with self._flags_lock:
            return self._flags.setdefault(session, threading.Event())

    def stop_training(self, session: int = 0) -> None:
        """Preempt session `session` after its current drafter step (also if it has not started yet)."""
        self._flag(session).set()

    def train_drafter(self, max_steps: int, rl_step: int, stop_flag: threading.Event | None = None,
                      session: int = 0) -> TrainResult:
        """Up to max_steps drafter steps on this replica's buffer, preemptible between steps by `stop_flag` (or
        by stop_training(session)). Weights that lower held-out top-1 accuracy are rolled back, publish=False."""
        flag = stop_flag if stop_flag is not None else self._flag(session)
        t0 = time.perf_counter()
        if self.trainer is None:
            return TrainResult(self.replica_id, 0, 0.0, 0.0, flag.is_set(), False)
        with self._buffer_lock:
            with self._flags_lock:
                self._training = True
            try:
                return self._session(max_steps, rl_step, flag, t0)
            except Exception:  # a crashed session leaves no half-trained weights behind: back to the published
                if self.spec is not None and self.spec.drafter is not None:
                    self.train_copy.load_state_dict(self.spec.drafter.trainable_state_dict(), strict=False)
                raise
            finally:
                with self._flags_lock:
                    self._training = False
                    self._flags.pop(session, None)
                    if self._deferred_train_state is not None:
                        self.train_copy.load_state_dict(self._deferred_train_state, strict=False)
                        self._deferred_train_state = None

    def _session(self, max_steps: int, rl_step: int, flag: threading.Event, t0: float) -> TrainResult:
        if self.buffer.num_train_tokens() == 0:
            return TrainResult(self.replica_id, 0, 0.0, 0.0, flag.is_set(), False)
        heldout = self.buffer.heldout_batch(self.cfg.batch_tokens, self.cfg.eval_tokens)
        before = self.trainer.evaluate(heldout) if heldout is not None else None
        snapshot = {k: v.clone() for k, v in self.train_copy.trainable_state_dict().items()}
        st = self.trainer.train_steps(self.buffer, max_steps, flag, step=rl_step)
        after = self.trainer.evaluate(heldout) if heldout is not None and st.steps else None
        publish = st.steps > 0 and (before is None or should_publish(after, before, self.cfg.publish_tol))
        if st.steps and not publish:  # the drafter in use stays; so do this replica's master weights
            self.train_copy.load_state_dict(snapshot, strict=False)
        return TrainResult(self.replica_id, st.steps, time.perf_counter() - t0, st.mean_step_s, st.preempted,
                           publish, before, after, st.last.loss if st.last else None)

    # ---- colocated placement (docs/design.md §13) --------------------------------------------------------
    def sleep(self) -> int:
        """Free the engine's KV caches while the trainer on the same GPU updates; returns the bytes freed."""
        with self._step_lock:
            return self.llm.engine.sleep()

    def wake(self) -> None:
        self.llm.engine.wake()

    # ---- queries -------------------------------------------------------------------------------------------
    def num_train_tokens(self) -> int:
        return self.buffer.num_train_tokens() if self.buffer is not None else 0

    def stats(self) -> dict:
        return {**self.llm.stats(), "drafter_version": self.drafter_version, "policy_version": self.policy_version,
                "buffer_samples": len(self.buffer) if self.buffer is not None else 0}

    def ping(self) -> int:
        return self.replica_id
