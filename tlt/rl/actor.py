"""The actor: log-probs and entropy of (prompt + response) rows through the Decoder, and the policy update.

Rows are right padded (see `ActorBatch`). They are cut into micro-batches whose padded size (rows x longest row)
stays within `actor.ppo_max_token_len`; gradients accumulate over the micro-batches of a mini-batch, and each
micro-batch loss is normalised by the token (or sequence) count of the WHOLE mini-batch summed over all
data-parallel ranks, so the accumulated, all-reduced (summed) gradient equals the full-batch gradient whatever
the micro-batch split or the number of ranks.
"""
from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from typing import Iterator

import torch
import torch.distributed as dist

from tlt.config import ActorConfig
from tlt.device import cpu_has_fast_bf16
from tlt.models.decoder import Decoder
from tlt.rl.losses import compute_actor_loss, entropy_from_log_probs
from tlt.rl.rollout import ActorBatch

CHUNK_COST = 8  # tokens: what one more micro-batch forward costs beyond its tokens (see micro_batches)


def micro_batches(seq_lens: list[int], max_token_len: int) -> list[list[int]]:
    """Row chunks whose padded size len(chunk) * max(seq_lens[chunk]) <= max_token_len (>= 1 row each), with the
    least padding: rows sorted longest first, then split into consecutive runs by dynamic programming.

    Rows are right padded to the longest in their micro-batch, so a long-tail batch (most responses short, a few at
    the cap) cut in arrival order pads most rows to the cap. The gradient is the same whatever the split (losses
    are normalised by whole-mini-batch counts), so choosing it is free. Each chunk also costs CHUNK_COST tokens
    (per-forward overhead), which breaks ties towards fewer, fuller micro-batches.
    """
    order = sorted(range(len(seq_lens)), key=lambda i: -seq_lens[i])  # stable: equal lengths keep their order
    lens = [seq_lens[i] for i in order]
    n = len(lens)
    best = [0.0] + [math.inf] * n  # best[j]: least cost of the first j sorted rows
    cut = [0] * (n + 1)
    for i in range(n):  # a chunk starting at i is padded to lens[i], its longest
        room = max(1, max_token_len // max(lens[i], 1))
        for j in range(i + 1, min(n, i + room) + 1):
            cost = best[i] + (j - i) * lens[i] + CHUNK_COST
            if cost < best[j]:
                best[j], cut[j] = cost, i
    chunks, j = [], n
    while j > 0:
        chunks.append(order[cut[j]:j])
        j = cut[j]
    return chunks[::-1]


def split_groups(group_ids: list[int], num_chunks: int) -> list[list[int]]:
    """Row indices of `num_chunks` mini-batches made of whole groups (some may be empty on a small rank)."""
    groups: dict[int, list[int]] = defaultdict(list)
    for i, g in enumerate(group_ids):
        groups[g].append(i)
    order = list(groups.values())
    bounds = [round(k * len(order) / num_chunks) for k in range(num_chunks + 1)]
    return [[i for grp in order[bounds[k]:bounds[k + 1]] for i in grp] for k in range(num_chunks)]


def response_log_probs(model: Decoder, batch: ActorBatch, with_entropy: bool = False, entropy_grad: bool = True
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / T) of each response token -> ([n, R], entropy [n, R] or None).

    The logit at position t predicts token t + 1, so response token j of row b (at position p_b + j) is scored by
    the hidden state at p_b + j - 1. Only those R hidden states go through the LM head ([n, R, V], not [n, T, V]).
    Memory: [n, R, V] fp32 tensors dominate the update, so one log-softmax serves both outputs, the temperature is
    divided in place, and with entropy_grad=False (entropy only as a metric) the entropy keeps no graph.
    """
    n, r = batch.response_mask.shape
    hidden = model(batch.input_ids)  # [n, T, H]; causal, right padding needs no mask
    offsets = torch.arange(r, device=hidden.device)
    src = (batch.prompt_lens[:, None] - 1 + offsets).clamp(max=hidden.shape[1] - 1)  # [n, R]
    tgt = (batch.prompt_lens[:, None] + offsets).clamp(max=batch.input_ids.shape[1] - 1)  # [n, R]
    h = hidden.gather(1, src[..., None].expand(n, r, hidden.shape[-1]))  # [n, R, H]
    t = batch.temperature if batch.temperature > 0 else 1.0
    logits = model.logits(h)  # [n, R, V] fp32, a fresh tensor: safe to scale in place
    if t != 1.0:
        logits.div_(t)
    logp = logits.log_softmax(-1)
    del logits
    log_probs = logp.gather(-1, batch.input_ids.gather(1, tgt)[..., None])[..., 0]
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = entropy_from_log_probs(logp)
    valid = offsets[None] < batch.response_lens[:, None]
    return log_probs * valid, None if entropy is None else entropy * valid


class Actor:
    """Owns the optimiser and LR schedule of `model` (the very Decoder the rollout engine reads)."""

    def __init__(self, model: Decoder, cfg: ActorConfig, total_steps: int):
        self.model, self.cfg = model, cfg
        self.device = next(model.parameters()).device
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, betas=tuple(cfg.betas),
                                           weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor(total_steps))
        fast_bf16 = self.device.type == "cuda" or cpu_has_fast_bf16()
        self.use_autocast = cfg.bf16_autocast and fast_bf16 and next(model.parameters()).dtype == torch.float32

    def _lr_factor(self, total_steps: int):
        warmup, cosine = self.cfg.warmup_steps, self.cfg.lr_scheduler == "cosine"

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / (warmup + 1)
            if not cosine:
                return 1.0
            progress = (step - warmup) / max(total_steps - warmup, 1)
            return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        return factor

    def autocast(self) -> contextlib.AbstractContextManager:
        if not self.use_autocast:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def _micro(self, batch: ActorBatch, rows: list[int]) -> Iterator[tuple[list[int], ActorBatch]]:
        """(row indices into `rows`, micro-batch) pairs covering `rows` (see `micro_batches`)."""
        sub = batch.rows(rows)
        seq_lens = (sub.prompt_lens + sub.response_lens).tolist()
        for chunk in micro_batches(seq_lens, self.cfg.ppo_max_token_len):
            yield chunk, sub.rows(chunk)

    @torch.no_grad()
    def compute_log_probs(self, batch: ActorBatch, model: Decoder | None = None) -> torch.Tensor:
        """[N, R] log-probs of the batch's responses under `model` (default: the policy), micro-batched."""
        model = model or self.model
        out = batch.old_log_probs.new_zeros(batch.old_log_probs.shape)
        with self.autocast():
            for chunk, mb in self._micro(batch, list(range(len(batch)))):
                lp = response_log_probs(model, mb)[0].float()
                out[chunk, :lp.shape[1]] = lp
        return out

    def update(self, batch: ActorBatch, num_mini_batches: int) -> dict[str, float]:
        """actor.ppo_epochs passes x num_mini_batches optimiser steps; the LR schedule steps once per call."""
        self.model.train()
        sums: dict[str, float] = defaultdict(float)
        counts: dict[str, int] = defaultdict(int)
        world = dist.get_world_size() if dist.is_initialized() else 1
        for _ in range(self.cfg.ppo_epochs):
            for rows in split_groups(batch.group_ids.tolist(), num_mini_batches):
                metrics = self._optimizer_step(batch, rows, world)
                for k, v in metrics.items():
                    sums[k] += v
                    counts[k] += 1
        self.scheduler.step()
        self.model.eval()
        out = {k: sums[k] / counts[k] for k in sums}
        out["actor/lr"] = self.scheduler.get_last_lr()[0]
        return out

    def _optimizer_step(self, batch: ActorBatch, rows: list[int], world: int) -> dict[str, float]:
        mask = batch.response_mask[rows] if rows else batch.response_mask[:0]
        # Global normalisers: tokens and non-empty sequences of this mini-batch over all ranks.
        totals = torch.tensor([float(mask.sum()), float((mask.sum(-1) > 0).sum())], dtype=torch.float64)
        if world > 1:
            dist.all_reduce(totals)
        num_tokens, num_seqs = float(totals[0]), float(totals[1])
        self.optimizer.zero_grad(set_to_none=False)
        sums: dict[str, float] = defaultdict(float)
        num_micro = 0
        for _, mb in self._micro(batch, rows) if rows else []:
            with self.autocast():
                log_probs, entropy = response_log_probs(self.model, mb, with_entropy=True,
                                                        entropy_grad=bool(self.cfg.entropy_coeff))
            loss, metrics = compute_actor_loss(
                log_probs.float(), mb.old_log_probs, mb.advantages, mb.response_mask, self.cfg,
                ref_log_probs=mb.ref_log_probs, entropy=entropy, global_num_tokens=num_tokens,
                global_num_seqs=num_seqs)
            loss.backward()
            for k, v in metrics.items():
                sums[k] += v
            num_micro += 1
        if world > 1:
            self._all_reduce_grads()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip))
        # No tokens anywhere (e.g. every group dropped): no step, or Adam's momentum alone would move the weights.
        stepped = math.isfinite(grad_norm) and num_tokens > 0
        if stepped:
            self.optimizer.step()
        out = {k: v / max(num_micro, 1) for k, v in sums.items()}
        out["actor/grad_norm"] = grad_norm
        out["actor/num_skipped_steps"] = 0.0 if stepped else 1.0
        return out

    def _all_reduce_grads(self) -> None:
        """Sum gradients over ranks in one flat buffer (losses are already globally normalised)."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        offset = 0
        for p, g in zip(self.params, grads):
            n = g.numel()
            p.grad = flat[offset:offset + n].view_as(g)
            offset += n

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
