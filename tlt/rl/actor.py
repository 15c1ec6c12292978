"""The actor: log-probs and entropy of (prompt + response) rows through the Decoder, and the policy update.

Forward layout (`Layout`): with actor.share_prompt, a group's responses are packed behind one copy of their prompt
(`share_prompts`, `pack_layout`); otherwise one right-padded row per response (see `ActorBatch`). Rows or packs
are cut into micro-batches whose padded size (rows x longest row) stays within `actor.ppo_max_token_len`, with the
least padding (`micro_batches`); gradients accumulate over the micro-batches of a mini-batch, and each
micro-batch loss is normalised by the token (or sequence) count of the WHOLE mini-batch summed over all
data-parallel ranks, so the accumulated, all-reduced (summed) gradient equals the full-batch gradient whatever
the layout, the micro-batch split or the number of ranks.

actor.strategy picks how ranks share the work: ddp keeps a full replica a rank and sums gradients in one
all-reduce; fsdp shards parameters, gradients and optimiser state with FSDP2 (tlt.rl.fsdp), which sums the
gradients in its reduce-scatters. Both sum, so both give the full-batch gradient.
"""
from __future__ import annotations

import contextlib
import math
import warnings
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from tlt.config import ActorConfig
from tlt.device import cpu_has_fast_bf16
from tlt.models.decoder import Decoder, PackedRows
from tlt.rl import fsdp
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


# Relative cost of one (query, key) pair of attention per token of a forward+backward (measured on CPU under a
# dense mask: about 0.3 ms a token and 0.14 us a pair per SmolLM2 layer). It decides how many packs a group's
# responses go into. (Per-segment attention, tlt.models.decoder.PackedRows, computes fewer pairs on CPU; there,
# packing every group into as few packs as fit the token budget measured no faster than this model's choice.)
ATTN_PAIR_COST = 4.7e-4


@dataclass
class Layout:
    """How a micro-batch's responses sit in the rows of its forward. A pack is one prompt followed by several of its
    responses; each response sees the prompt and itself only, at the positions it would have alone, so its
    hidden states (and the gradient, summed over the responses) are those of one row per response."""
    input_ids: torch.Tensor                # [B, T] packed rows, right padded
    positions: torch.Tensor | None         # [B, T]; None = 0..T-1 (one response a row)
    attn_mask: PackedRows | None           # which tokens see which (prompt, then responses); None = causal
    src: torch.Tensor                      # [n, R] flat index (row * T + col) of the state predicting each token
    tgt: torch.Tensor                      # [n, R] the response tokens


def _pack_cost(length: int) -> float:
    return length + ATTN_PAIR_COST * length * length


def share_prompts(batch: ActorBatch) -> list[list[int]]:
    """Packs of response rows (each list shares one prompt), covering every row once, in an order micro_batches
    may reorder. A group's responses go into the number of packs with the least estimated cost (tokens, plus the
    attention square that grows with the pack); rows whose prompts differ from their group's stay alone."""
    groups: dict[int, list[int]] = defaultdict(list)
    for i, g in enumerate(batch.group_ids.tolist()):
        groups[g].append(i)
    plens, rlens = batch.prompt_lens.tolist(), batch.response_lens.tolist()
    packs: list[list[int]] = []
    for rows in groups.values():
        p = plens[rows[0]]
        same = [r for r in rows if plens[r] == p and torch.equal(batch.input_ids[r, :p], batch.input_ids[rows[0], :p])]
        packs += [[r] for r in rows if r not in same]
        same.sort(key=lambda r: -rlens[r])
        best = None
        for m in range(1, len(same) + 1):  # m packs, longest responses dealt out first
            split = [same[k::m] for k in range(m)]
            cost = sum(_pack_cost(p + sum(rlens[r] for r in pk)) for pk in split)
            if best is None or cost < best[0]:
                best = (cost, split)
        if best is not None:
            packs += best[1]
    return packs


def pack_layout(batch: ActorBatch, sizes: list[int]) -> Layout:
    """The forward layout of `batch` (one micro-batch) whose rows form consecutive packs of `sizes` rows, each
    sharing the prompt of its first row (see Layout)."""
    n, R = batch.response_mask.shape
    dev = batch.input_ids.device
    offsets = torch.arange(R, device=dev)
    tgt = batch.input_ids.gather(1, (batch.prompt_lens[:, None] + offsets).clamp(max=batch.input_ids.shape[1] - 1))
    if all(size == 1 for size in sizes):  # one response a row: plain causal rows
        src = (batch.prompt_lens[:, None] - 1 + offsets).clamp(max=batch.input_ids.shape[1] - 1)
        src = src + torch.arange(n, device=dev)[:, None] * batch.input_ids.shape[1]
        return Layout(batch.input_ids, None, None, src, tgt)
    plens, rlens = batch.prompt_lens.tolist(), batch.response_lens.tolist()
    starts = [sum(sizes[:b]) for b in range(len(sizes))]
    packs = [range(start, start + size) for start, size in zip(starts, sizes)]
    T = max(plens[pk[0]] + sum(rlens[r] for r in pk) for pk in packs)
    B = len(packs)
    ids = torch.zeros(B, T, dtype=torch.long, device=dev)
    pos = torch.zeros(B, T, dtype=torch.long, device=dev)
    src = torch.zeros(n, R, dtype=torch.long, device=dev)
    for b, pk in enumerate(packs):
        p = plens[pk[0]]
        ids[b, :p] = batch.input_ids[pk[0], :p]
        pos[b, :p] = torch.arange(p, device=dev)
        col = p
        for r in pk:
            L = rlens[r]
            ids[b, col:col + L] = batch.input_ids[r, p:p + L]
            pos[b, col:col + L] = torch.arange(p, p + L, device=dev)
            # token j is predicted by the state before it: the prompt's last for j = 0, else the response's own
            s = torch.full((R,), p - 1, dtype=torch.long, device=dev)
            s[1:L] = torch.arange(col, col + L - 1, device=dev)
            src[r] = b * T + s
            col += L
    rows = PackedRows([plens[pk[0]] for pk in packs], [[rlens[r] for r in pk] for pk in packs])
    return Layout(ids, pos, rows, src, tgt)


def response_log_probs(model: Decoder, batch: ActorBatch, with_entropy: bool = False, entropy_grad: bool = True,
                       layout: Layout | None = None, chunk_tokens: int | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / T) of each response token -> ([n, R], entropy [n, R] or None).

    The logit at position t predicts token t + 1, so response token j (at position p + j) is scored by the hidden
    state at p + j - 1 (`layout.src`; default layout: one response a row). Only the states of real response
    tokens go through the LM head ([M, V] for M response tokens, no padding). Memory: [M, V] fp32 tensors dominate
    the update, so one log-softmax serves both outputs, the temperature is divided in place, and with
    entropy_grad=False (entropy only as a metric) the entropy keeps no graph. chunk_tokens (actor.
    logprob_chunk_tokens): the LM head runs on that many tokens at a time under activation checkpointing, so only
    one chunk's [C, V] tensors exist at once, in the forward and again in the backward (which recomputes them).
    """
    n, r = batch.response_mask.shape
    layout = layout or pack_layout(batch, [1] * n)
    hidden = model(layout.input_ids, layout.positions, attn_mask=layout.attn_mask)  # [B, T, H]
    valid = torch.arange(r, device=hidden.device)[None] < batch.response_lens[:, None]  # [n, R]
    # [M, H]: real response tokens only. index_select, not hidden[idx]: a pack's responses share the prompt's last
    # state (repeated indices), and the backward of advanced indexing adds repeats with atomics on CPU, in thread
    # order; index_select's backward (index_add_) sums them in a fixed order, so the update is reproducible.
    h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, layout.src[valid])
    t = batch.temperature if batch.temperature > 0 else 1.0
    tgt = layout.tgt[valid]
    entropy_grad = with_entropy and entropy_grad and torch.is_grad_enabled()
    if chunk_tokens is None or h.shape[0] <= chunk_tokens:
        lp, ent = _token_log_probs(model, h, tgt, t, with_entropy, entropy_grad)
    else:
        from torch.utils.checkpoint import checkpoint
        parts = [checkpoint(_token_log_probs, model, h[i:i + chunk_tokens], tgt[i:i + chunk_tokens], t, with_entropy,
                            entropy_grad, use_reentrant=False) for i in range(0, h.shape[0], chunk_tokens)]
        lp = torch.cat([p[0] for p in parts])
        ent = torch.cat([p[1] for p in parts]) if with_entropy else None
    log_probs = lp.new_zeros(n, r)
    log_probs[valid] = lp
    entropy = None
    if with_entropy:
        entropy = ent.new_zeros(n, r)
        entropy[valid] = ent
    return log_probs, entropy


def _token_log_probs(model: Decoder, h: torch.Tensor, tgt: torch.Tensor, temperature: float, with_entropy: bool,
                     entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """h [M, H], tgt [M] -> (log softmax(logits / T) at tgt [M], entropy [M] or None)."""
    logits = model.logits(h)  # [M, V] fp32, a fresh tensor: safe to scale in place
    if temperature != 1.0:
        logits.div_(temperature)
    logp = logits.log_softmax(-1)
    del logits
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad):
            entropy = entropy_from_log_probs(logp)
    return logp.gather(-1, tgt[:, None])[:, 0], entropy


class Actor:
    """Owns the optimiser and LR schedule of `model` (the very Decoder the rollout engine reads)."""

    def __init__(self, model: Decoder, cfg: ActorConfig, total_steps: int, device: torch.device | None = None):
        """`model`: full, or already sharded (tlt.rl.fsdp.load_sharded_model, which also checkpoints its layers).
        `device`: where it computes (default: where its parameters are; not so for host-offloaded shards)."""
        self.model, self.cfg = model, cfg
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.sharded = cfg.strategy == "fsdp"
        if cfg.gradient_checkpointing and not fsdp.is_sharded(model):
            fsdp.checkpoint_layers(model)
        if self.sharded and not fsdp.is_sharded(model):  # before the optimiser: it must hold the shards
            fsdp.shard_model(model, cfg, self.device)
        self.params = [p for p in model.parameters() if p.requires_grad]
        # Not fused=True: torch's fused AdamW updates the weights without bumping their version counters, and the
        # engine's packed weight copies (tlt.models.kernels) rely on them to notice an update.
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, betas=tuple(cfg.betas),
                                           weight_decay=cfg.weight_decay)
        # Tied: the lookup's rows join the LM head's dense gradient (no [V, H] scatter; measured on CPU). FSDP
        # reduce-scatters dense gradients only.
        if model.lm_head is None and self.device.type == "cpu" and not self.sharded:
            model.embed_tokens.sparse = True
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor(total_steps))
        fast_bf16 = self.device.type == "cuda" or cpu_has_fast_bf16()
        self.use_autocast = cfg.bf16_autocast and fast_bf16 and next(model.parameters()).dtype == torch.float32
        if self.sharded and fsdp.mixed_precision(cfg, self.device).param_dtype is not None:
            self.use_autocast = False  # FSDP's MixedPrecisionPolicy already computes in bf16

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

    def _micro(self, batch: ActorBatch, rows: list[int]) -> Iterator[tuple[list[int], ActorBatch, Layout]]:
        """(row indices into `rows`, micro-batch, its forward layout) covering `rows`: responses packed behind
        their shared prompt (actor.share_prompt), packs split by `micro_batches`."""
        if not rows:
            return
        sub = batch.rows(rows)
        packs = share_prompts(sub) if self.cfg.share_prompt else [[i] for i in range(len(sub))]
        plens, rlens = sub.prompt_lens.tolist(), sub.response_lens.tolist()
        pack_lens = [plens[pk[0]] + sum(rlens[i] for i in pk) for pk in packs]
        for chunk in micro_batches(pack_lens, self.cfg.ppo_max_token_len):
            chunk_rows = [i for c in chunk for i in packs[c]]
            mb = sub.rows(chunk_rows)
            yield chunk_rows, mb, pack_layout(mb, [len(packs[c]) for c in chunk])

    def _num_idle(self, model: Decoder, num_micro: int) -> int:
        """FSDP: the idle micro-batches this rank runs after its own to match the busiest rank (see tlt.rl.fsdp).
        Agreed on before any forward: a rank must not enter this all-reduce while another is in a layer's
        all-gather."""
        return fsdp.max_over_ranks(num_micro) - num_micro if fsdp.is_sharded(model) else 0

    @torch.no_grad()
    def compute_log_probs(self, batch: ActorBatch, model: Decoder | None = None) -> torch.Tensor:
        """[N, R] log-probs of the batch's responses under `model` (default: the policy), micro-batched."""
        model = model or self.model
        out = batch.old_log_probs.new_zeros(batch.old_log_probs.shape)
        micro = list(self._micro(batch, list(range(len(batch)))))
        num_idle = self._num_idle(model, len(micro))
        with self.autocast():
            for chunk, mb, layout in micro:
                lp = response_log_probs(model, mb, layout=layout,
                                        chunk_tokens=self.cfg.logprob_chunk_tokens)[0].float()
                out[chunk, :lp.shape[1]] = lp
            for _ in range(num_idle):
                fsdp.idle_micro_batch(model, self.device, backward=False)
        return out

    def on_policy_rows(self, batch: ActorBatch, num_mini_batches: int) -> list[int]:
        """Rows whose old log-probs `update` takes from its own forward (actor.on_policy_logprobs): those of the first
        mini-batch, which is optimised before any weight changes. Empty when the option is off."""
        if not self.cfg.on_policy_logprobs:
            return []
        return split_groups(batch.group_ids.tolist(), num_mini_batches)[0]

    def update(self, batch: ActorBatch, num_mini_batches: int) -> dict[str, float]:
        """actor.ppo_epochs passes x num_mini_batches optimiser steps; the LR schedule steps once per call.

        With actor.on_policy_logprobs the first mini-batch's old log-probs are its forward's own, detached (the
        policy has not moved yet, so they are the old policy's under the trainer's numerics; the ratio is exactly 1
        there); they are written into batch.old_log_probs, so the caller can compare them with the engine's."""
        self.model.train()
        sums: dict[str, float] = defaultdict(float)
        counts: dict[str, int] = defaultdict(int)
        world = dist.get_world_size() if dist.is_initialized() else 1
        for epoch in range(self.cfg.ppo_epochs):
            for mini, rows in enumerate(split_groups(batch.group_ids.tolist(), num_mini_batches)):
                on_policy = epoch == 0 and mini == 0 and self.cfg.on_policy_logprobs
                metrics = self._optimizer_step(batch, rows, world, on_policy)
                for k, v in metrics.items():
                    sums[k] += v
                    counts[k] += 1
        with warnings.catch_warnings():  # the schedule counts training steps, also one whose update was skipped
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
            self.scheduler.step()
        self.model.eval()
        out = {k: sums[k] / counts[k] for k in sums}
        out["actor/lr"] = self.scheduler.get_last_lr()[0]
        return out

    def _optimizer_step(self, batch: ActorBatch, rows: list[int], world: int, on_policy: bool = False
                        ) -> dict[str, float]:
        mask = batch.response_mask[rows] if rows else batch.response_mask[:0]
        num_tokens, num_seqs = self._loss_normalisers(mask, world)
        self.optimizer.zero_grad(set_to_none=False)
        sums: dict[str, float] = defaultdict(float)
        micro = list(self._micro(batch, rows))
        num_idle = self._num_idle(self.model, len(micro))
        for chunk, mb, layout in micro:
            with self.autocast():
                log_probs, entropy = response_log_probs(self.model, mb, with_entropy=True,
                                                        entropy_grad=bool(self.cfg.entropy_coeff), layout=layout,
                                                        chunk_tokens=self.cfg.logprob_chunk_tokens)
            if on_policy:
                mb.old_log_probs = log_probs.detach().float()
                batch.old_log_probs[[rows[i] for i in chunk], :mb.old_log_probs.shape[1]] = mb.old_log_probs
            loss, metrics = compute_actor_loss(
                log_probs.float(), mb.old_log_probs, mb.advantages, mb.response_mask, self.cfg,
                ref_log_probs=mb.ref_log_probs, entropy=entropy, global_num_tokens=num_tokens,
                global_num_seqs=num_seqs)
            loss.backward()
            for k, v in metrics.items():
                sums[k] += v
        for _ in range(num_idle):
            fsdp.idle_micro_batch(self.model, self.device, backward=True)
        if world > 1 and not self.sharded:  # FSDP has summed them in its reduce-scatters
            self._all_reduce_grads()
        grad_norm = fsdp.grad_norm(self.params, self.cfg.grad_clip)
        # No tokens anywhere (e.g. every group dropped): no step, or Adam's momentum alone would move the weights.
        stepped = math.isfinite(grad_norm) and num_tokens > 0
        if stepped:
            self.optimizer.step()
        out = {k: v / max(len(micro), 1) for k, v in sums.items()}
        out["actor/grad_norm"] = grad_norm
        out["actor/num_skipped_steps"] = 0.0 if stepped else 1.0
        return out

    @staticmethod
    def _loss_normalisers(mask: torch.Tensor, world: int) -> tuple[float, float]:
        """(tokens, non-empty sequences) of this mini-batch summed over all ranks: every micro-batch loss on every
        rank divides by these, so the summed gradient is the full-batch one."""
        # a host tensor (built from host floats): gloo's part of the group on CUDA (tlt.rl.launch)
        totals = torch.tensor([float(mask.sum()), float((mask.sum(-1) > 0).sum())], dtype=torch.float64)
        if world > 1:
            dist.all_reduce(totals)
        return float(totals[0]), float(totals[1])

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
