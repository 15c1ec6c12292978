"""Online drafter trainer: the step loop a spot session runs on an idle rollout replica (docs/design.md §2, §5).

loss = 1.0 * SmoothL1(pred h_{t+1}, target h_{t+1}) + 0.1 * soft-CE(softmax(lm_head(h_{t+1})), drafter logits),
both averaged over loss-mask (response) tokens. Only the drafter's fc and layer train; the target's embedding
and LM head are shared and frozen (the LM head weight is detached here so no gradient reaches the target).

With `ttt_steps` K > 1 (training-time test, as EAGLE-3 trains): pass 1 is the teacher-forced step above; pass k
feeds the drafter its own pass-(k-1) prediction of the previous position instead of the target's feature, as
drafting depth k does, and attends to what depth k attends to at inference: pass-1 keys up to k - 1 positions
back (the drafter cache, built from the target's features) and one key of each pass in between on the diagonal
(the draft chain's own entries). Pass k's loss weighs TTT_DECAY^(k-1); the weighted mean over passes is a training
step's loss. `evaluate` scores pass 1 only (teacher-forced), so held-out metrics compare across settings
(docs/design.md §2). Pass k runs the k passes laid end to end: the layer's work grows as K(K+1)/2, its attention as
the sum of k^2 (a step measured 3.4x a teacher-forced one at K = 3, batch_tokens 1024, on CPU), and each pass keeps
a [kT, kT] mask for the backward; a spot round waits as long for its step in flight.

Preemption is step-granular: the stop flag is checked between steps. Checkpoints hold the trainable params
only and are written by a background thread (temp file + os.replace, so a reader never sees half a file); a
failed write is logged there and raised in the caller's thread at the next drafter step or checkpoint, so the run
fails loudly instead of training on without its checkpoints.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from tlt.drafter_train.buffer import DrafterBuffer
from tlt.drafter_train.compare import DEPTH, accept_from_hits
from tlt.drafter_train.packing import PackedBatch
from tlt.device import cpu_has_fast_bf16
from tlt.models.loader import write_safetensors
from tlt.speculative.drafter import Drafter

logger = logging.getLogger(__name__)
HIDDEN_WEIGHT, CE_WEIGHT = 1.0, 0.1
TTT_DECAY = 0.8  # weight of each later unrolled pass relative to the one before
StopFlag = threading.Event | Callable[[], bool] | None


@dataclass
class StepMetrics:
    loss: float
    hidden_loss: float
    ce: float
    acc: float          # top-1: argmax drafter logits == argmax target logits (training batches: over the draft
                        # vocabulary's rows, EAGLE-3's training target; evaluation: over the whole vocabulary)
    tokens: int         # loss tokens in the batch


@dataclass
class TrainStats:
    steps: int = 0
    seconds: float = 0.0
    tokens: int = 0
    preempted: bool = False               # stopped by the flag before max_steps
    last: StepMetrics | None = None
    mean_step_s: float = 0.0


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """bf16 where the hardware does it natively (CUDA, or CPU with AVX512-BF16/AMX), else None (fp32)."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else None
    return torch.bfloat16 if device.type == "cpu" and cpu_has_fast_bf16() else None


class TargetCache:
    """The target's side of an evaluation (its top-1 over the whole vocabulary and its distribution over the draft
    rows), kept for the last batch evaluated, for the evaluations of one batch against one target: a round's
    drafter before and after training; on a step's fresh responses, the comparison's online and frozen drafters and
    the published round's judge (tlt.drafter_train.online.fresh_batch). That [tokens, vocab] product
    is most of an evaluation's cost on a CPU. Keyed by the batch object, the LM head's storage and version and the
    draft vocabulary, so an update of the target (an optimizer step or weight sync bumps the version) recomputes
    it. It holds the batch and a [tokens, draft vocab] fp32 tensor: make one per batch, dropped after use."""

    def __init__(self):
        self._entry: tuple[PackedBatch, tuple, tuple[torch.Tensor, torch.Tensor]] | None = None

    def get(self, batch: PackedBatch, key: tuple, compute) -> tuple[torch.Tensor, torch.Tensor]:
        if self._entry is None or self._entry[0] is not batch or self._entry[1] != key:
            self._entry = (batch, key, compute())
        return self._entry[2]


def _should_stop(flag: StopFlag) -> bool:
    if flag is None:
        return False
    return flag.is_set() if isinstance(flag, threading.Event) else bool(flag())


class AsyncCheckpointer:
    """Copy tensors to CPU now, write safetensors from a background thread; one write in flight at a time."""

    def __init__(self):
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def save(self, state: dict[str, torch.Tensor], path: str | os.PathLike, metadata: dict[str, str] | None = None):
        self.wait()
        cpu = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state.items()}
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)

        def write():
            tmp = path.with_name(path.name + f".tmp{os.getpid()}")
            try:
                write_safetensors(cpu, tmp, metadata=metadata)
                os.replace(tmp, path)  # atomic: readers see the old file or the new one, never a partial one
            except Exception as e:  # any failure, not just I/O: raised in the caller's thread by check()
                logger.exception("drafter checkpoint write to %s failed", path)
                self.error = e
                tmp.unlink(missing_ok=True)

        self._thread = threading.Thread(target=write, name="drafter-ckpt", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Join the write in flight; raise its error, if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.check()

    def check(self) -> None:
        """Raise the error of a finished write that failed (without waiting for one in flight)."""
        if self.error is not None:
            err, self.error = self.error, None
            raise RuntimeError(f"drafter checkpoint write failed: {err!r}") from err


class DrafterTrainer:
    def __init__(self, drafter: Drafter, lr: float, betas: tuple[float, float] = (0.9, 0.95),
                 weight_decay: float = 0.01, grad_clip: float = 1.0, batch_tokens: int = 2048, num_rows: int = 1,
                 ckpt_dir: str | os.PathLike | None = None, ckpt_every: int = 0, seed: int = 0,
                 amp_dtype: torch.dtype | None | str = "auto", ttt_steps: int = 1):
        if ttt_steps < 1:
            raise ValueError(f"ttt_steps={ttt_steps}: must be >= 1 (1 = teacher-forced training only)")
        self.drafter, self.ttt_steps = drafter, ttt_steps
        self.params = [p for n, p in drafter.named_parameters() if n.startswith(("fc.", "layer."))]
        for p in self.params:
            p.requires_grad_(True)
        self.opt = torch.optim.AdamW(self.params, lr=lr, betas=betas, weight_decay=weight_decay)
        self.grad_clip = grad_clip
        self.batch_tokens, self.num_rows = batch_tokens, num_rows
        self.ckpt_dir, self.ckpt_every = (Path(ckpt_dir) if ckpt_dir else None), ckpt_every
        self.device = next(drafter.parameters()).device
        self.amp_dtype = autocast_dtype(self.device) if amp_dtype == "auto" else amp_dtype
        self.generator = torch.Generator().manual_seed(seed)
        self.checkpointer = AsyncCheckpointer()
        self.total_steps = 0

    # ---- loss ------------------------------------------------------------------------------------------
    def _forward(self, batch: PackedBatch, passes: int | None = None, full_vocab_top1: bool = True,
                 targets: TargetCache | None = None) -> tuple[torch.Tensor, torch.Tensor, StepMetrics]:
        """Loss (scalar, with grad) and metrics for one packed batch, over `passes` unrolled passes (default
        ttt_steps). With a reduced draft vocabulary the loss needs the target's logits on its rows only; the exact
        top-1 hit (full_vocab_top1, what evaluation reports and the publish gate compares) needs the target's
        argmax over the whole vocabulary, a [tokens, vocab] product that costs a training step more than half its
        time on a CPU, so training steps score their top-1 within the draft vocabulary. `targets` reuses the
        target's side of an evaluation of the same batch (TargetCache)."""
        b = batch.to(self.device)
        dtype = next(self.drafter.parameters()).dtype
        amp = (torch.autocast(self.device.type, dtype=self.amp_dtype) if self.amp_dtype is not None
               else contextlib.nullcontext())
        preds = unrolled_predictions(self.drafter, b.hidden_in.to(dtype), b.next_ids, b.positions, b.attn_mask,
                                     passes or self.ttt_steps, amp)
        mask = b.loss_mask
        target = b.target_hidden[mask].float()                             # [N, H] loss tokens only
        w = self.drafter.target.lm_head_weight.detach()  # frozen, shared LM head, in its own dtype (no fp32 copy)
        w_draft = w if self.drafter.d2t is None else self.drafter.draft_head()  # cached, detached slice
        d2t = self.drafter.d2t

        @torch.no_grad()
        def target_side() -> tuple[torch.Tensor, torch.Tensor]:
            if full_vocab_top1 or d2t is None:
                target_logits = F.linear(target.to(w.dtype), w).float()     # [N, V]
                target_top1 = target_logits.argmax(-1)
                if d2t is not None:  # reduced draft vocabulary: compare on its rows
                    target_logits = target_logits[:, d2t]
            else:
                target_logits = F.linear(target.to(w.dtype), w_draft).float()  # [N, V_draft]
                target_top1 = self.drafter.to_target_ids(target_logits.argmax(-1))
            return target_top1, target_logits.softmax(-1)

        if targets is not None and full_vocab_top1:
            key = (w.data_ptr(), w._version, None if d2t is None else d2t.data_ptr())
            target_top1, target_probs = targets.get(batch, key, target_side)
        else:
            target_top1, target_probs = target_side()
        total = weights = 0.0
        for k, pred in enumerate(preds):
            # pass k + 1 exists where the k positions before t are in t's window (drafting depth k + 1 from there)
            valid = unrolled_valid(b.attn_mask, k)[mask]                   # [N] bool
            pred = pred[mask].float()
            hidden_k = F.smooth_l1_loss(pred, target, reduction="none").mean(-1)      # [N]
            logits = F.linear(pred.to(w.dtype), w_draft).float()           # [N, V_draft]
            ce_k = -(target_probs * logits.log_softmax(-1)).sum(-1)        # [N]
            if k == 0:  # the teacher-forced pass: the metrics
                hidden_loss, ce = hidden_k.mean(), ce_k.mean()
                correct = self.drafter.to_target_ids(logits.argmax(-1)) == target_top1  # [N] bool
            if k == 0 or valid.any():  # a later pass with no position deep enough in its window adds nothing
                total = total + TTT_DECAY ** k * (HIDDEN_WEIGHT * hidden_k + CE_WEIGHT * ce_k)[valid].mean()
                weights += TTT_DECAY ** k
        loss = total / weights
        m = StepMetrics(loss.item(), hidden_loss.item(), ce.item(), float(correct.float().mean()), int(mask.sum()))
        return loss, correct, m

    def train_step(self, batch: PackedBatch) -> StepMetrics:
        self.checkpointer.check()  # a failed background write stops training here, in this thread
        self.drafter.train()
        loss, _, m = self._forward(batch, full_vocab_top1=False)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
        self.opt.step()
        self.total_steps += 1
        return m

    # ---- the spot-session loop -------------------------------------------------------------------------
    def train_steps(self, buffer: DrafterBuffer, max_steps: int, stop_flag: StopFlag = None,
                    step: int | None = None) -> TrainStats:
        """Up to max_steps drafter steps on batches from `buffer` (RL step `step` for offset sampling).

        The stop flag is checked before every step, so preemption waits for at most one step."""
        stats, t0 = TrainStats(), time.perf_counter()
        while stats.steps < max_steps:
            if _should_stop(stop_flag):
                stats.preempted = True
                break
            batch = buffer.sample_batch(self.num_rows, self.batch_tokens, step, self.generator)
            stats.last = self.train_step(batch)
            stats.steps += 1
            stats.tokens += stats.last.tokens
            if self.ckpt_dir is not None and self.ckpt_every > 0 and self.total_steps % self.ckpt_every == 0:
                self.save_checkpoint()
        stats.seconds = time.perf_counter() - t0
        stats.mean_step_s = stats.seconds / max(stats.steps, 1)
        return stats

    def save_checkpoint(self, path: str | os.PathLike | None = None) -> Path:
        """Trainable params only (fc., layer.), written asynchronously; `checkpointer.wait()` to join."""
        if path is None:
            if self.ckpt_dir is None:
                raise ValueError("no checkpoint path: pass path= or construct DrafterTrainer(ckpt_dir=...)")
            path = self.ckpt_dir / "drafter.safetensors"
        self.checkpointer.save(self.drafter.trainable_state_dict(), path, {"drafter_steps": str(self.total_steps)})
        return Path(path)

    # ---- evaluation ------------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, batch: PackedBatch, depth: int = DEPTH, targets: TargetCache | None = None
                 ) -> dict[str, float]:
        """Held-out metrics of the teacher-forced pass (loss = its hidden loss + 0.1 ce, whatever ttt_steps): top-1
        accuracy and an accept-length proxy, the mean over loss tokens of the run of consecutive teacher-forced
        top-1 hits starting there (capped at depth) plus the bonus token. `targets`: a TargetCache shared by the
        evaluations of one batch."""
        self.drafter.eval()
        _, correct, m = self._forward(batch, passes=1, targets=targets)
        hit = torch.zeros_like(batch.loss_mask)
        hit[batch.loss_mask] = correct.cpu()
        accept = accept_from_hits(hit, depth, seg_ids=batch.seg_ids)[batch.loss_mask].float().mean()
        return {"acc": m.acc, "loss": m.loss, "hidden_loss": m.hidden_loss, "ce": m.ce, "accept_proxy": float(accept)}


def unrolled_valid(attn_mask: torch.Tensor, k: int) -> torch.Tensor:
    """[B, T] bool: position t has k positions before it in its own window (attn_mask [B, T, T] block-causal)."""
    B, T, _ = attn_mask.shape
    valid = torch.zeros(B, T, dtype=torch.bool, device=attn_mask.device)
    valid[:, k:] = attn_mask.diagonal(offset=-k, dim1=1, dim2=2)  # attn_mask[b, t, t - k]; k = 0: every t
    return valid


def unrolled_mask(attn_mask: torch.Tensor, passes: int) -> torch.Tensor:
    """The attention of `passes` unrolled passes laid end to end ([B, pT, pT] bool, pass-major): pass a's query at
    t attends pass 1's keys at j <= t - (a - 1) of its window and pass b's key at t - (a - b) for 1 < b <= a, what
    drafting depth a attends to at inference (the cache, then the chain's own entries)."""
    B, T, _ = attn_mask.shape
    out = torch.zeros(B, passes * T, passes * T, dtype=torch.bool, device=attn_mask.device)
    idx = torch.arange(T, device=attn_mask.device)
    for a in range(passes):
        out[:, a * T:(a + 1) * T, :T] = attn_mask & (idx[None, :] <= idx[:, None] - a)  # pass 1 keys, up to a back
        # pass b + 1's key on the diagonal a - b back, within the window; at b = a every query sees itself, so no
        # row is fully masked
        for b in range(1, a + 1):
            d = a - b
            out[:, a * T + idx[d:], b * T + idx[:T - d]] = unrolled_valid(attn_mask, d)[:, d:]
    return out


def unrolled_predictions(drafter: Drafter, hidden_in: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor,
                         attn_mask: torch.Tensor, passes: int, amp=None) -> list[torch.Tensor]:
    """The drafter's predictions [B, T, H] of each unrolled pass (module doc): pass 1 teacher-forced; pass k reads
    pass k - 1's prediction at t - 1 where the target's h_{t-1} was (zero where t starts its window). Each pass
    runs the passes so far laid end to end (unrolled_mask), so keys of earlier passes carry their gradients."""
    amp = amp if amp is not None else contextlib.nullcontext()
    with amp:
        preds = [drafter(hidden_in, next_ids, positions, attn_mask=attn_mask)]
    inputs = [hidden_in]
    for a in range(1, passes):
        prev = preds[-1]
        shifted = torch.zeros_like(prev)
        shifted[:, 1:] = prev[:, :-1] * unrolled_valid(attn_mask, 1)[:, 1:, None]
        inputs.append(shifted.to(hidden_in.dtype))
        with amp:
            out = drafter(torch.cat(inputs, 1), next_ids.repeat(1, a + 1), positions.repeat(1, a + 1),
                          attn_mask=unrolled_mask(attn_mask, a + 1))
        preds.append(out[:, a * hidden_in.shape[1]:])
    return preds


def held_out_gain(old: dict[str, float] | None, new: dict[str, float] | None) -> float | None:
    """New weights' held-out accept length (evaluate's accept_proxy) over the old's, less 1: the gain a publish hands
    the policy (AdaptivePolicy.drafter_changed); None where either was not evaluated."""
    if not old or not new or old["accept_proxy"] <= 0:
        return None
    return new["accept_proxy"] / old["accept_proxy"] - 1


def should_publish(new: dict[str, float], old: dict[str, float] | None, tol: float = 0.0) -> bool:
    """Refuse to publish a drafter whose held-out accuracy got worse than the one in use (by more than tol)."""
    return old is None or new["acc"] >= old["acc"] - tol
