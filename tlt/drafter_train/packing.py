"""Pack drafter training windows into fixed-width rows with a block-diagonal causal mask.

A `Window` is one contiguous run of training pairs from one sequence: input (h_t, x_{t+1}) at drafter position
t+1, target h_{t+1}. Several windows share a row of `batch_tokens`; each keeps its own TRUE positions (RoPE sees
the same offsets as at inference) and attends only to earlier tokens of itself. Samples never see each other
(fastrl's packing lets them: a bug). Padding tokens form their own segment and attend to earlier padding, so no
query row is fully masked (SDPA returns NaN for those) and no real token ever attends to padding.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Window:
    """One training window; tensors are views into the buffer's storage (no copies)."""
    hidden_in: torch.Tensor      # [n, H] target's h_t
    next_ids: torch.Tensor       # [n] long, x_{t+1}
    positions: torch.Tensor      # [n] long, t+1 (true position of x_{t+1} in its sequence)
    target_hidden: torch.Tensor  # [n, H] target's h_{t+1}
    loss_mask: torch.Tensor      # [n] bool, True where x_{t+1} is a response token

    def __len__(self) -> int:
        return self.next_ids.shape[0]


@dataclass
class PackedBatch:
    hidden_in: torch.Tensor      # [B, T, H] h_t (buffer dtype, bf16 by default); 0 on padding
    next_ids: torch.Tensor       # [B, T] long, x_{t+1}; 0 on padding
    positions: torch.Tensor      # [B, T] long, restarts per window at its true position; 0 on padding
    attn_mask: torch.Tensor      # [B, T, T] bool, True = may attend; block-diagonal causal
    target_hidden: torch.Tensor  # [B, T, H] h_{t+1}; 0 on padding
    loss_mask: torch.Tensor      # [B, T] bool, response tokens of real windows only
    seg_ids: torch.Tensor        # [B, T] long, window index within its row; -1 on padding

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def to(self, device: torch.device | str) -> "PackedBatch":
        return PackedBatch(**{k: v.to(device, non_blocking=True) for k, v in vars(self).items()})


def block_causal_mask(seg_ids: torch.Tensor) -> torch.Tensor:
    """seg_ids [B, T] -> [B, T, T] bool: query i may attend key j iff same segment and j <= i.

    Padding (-1) is one segment of its own, so a padding query always sees at least itself (no NaN rows)."""
    T = seg_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=seg_ids.device).tril()
    return (seg_ids[:, :, None] == seg_ids[:, None, :]) & causal


def assign_rows(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """First-fit decreasing bin packing: window indices per row, each row holding <= batch_tokens tokens."""
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if lengths[i] > batch_tokens:
            raise ValueError(f"window of {lengths[i]} tokens exceeds batch_tokens={batch_tokens}: "
                             f"set window_len <= batch_tokens")
        r = next((r for r, f in enumerate(free) if f >= lengths[i]), None)
        if r is None:
            rows.append([])
            free.append(batch_tokens)
            r = len(rows) - 1
        rows[r].append(i)
        free[r] -= lengths[i]
    return rows


def pack(windows: list[Window], batch_tokens: int) -> PackedBatch:
    """Pack windows into as many rows of width `batch_tokens` as first-fit decreasing needs."""
    if not windows:
        raise ValueError("pack() got no windows: the drafter buffer is empty for this request")
    rows = assign_rows([len(w) for w in windows], batch_tokens)
    B, T, H = len(rows), batch_tokens, windows[0].hidden_in.shape[-1]
    dtype = windows[0].hidden_in.dtype
    hidden_in = torch.zeros(B, T, H, dtype=dtype)
    target_hidden = torch.zeros(B, T, H, dtype=dtype)
    next_ids = torch.zeros(B, T, dtype=torch.long)
    positions = torch.zeros(B, T, dtype=torch.long)
    loss_mask = torch.zeros(B, T, dtype=torch.bool)
    seg_ids = torch.full((B, T), -1, dtype=torch.long)
    for b, idx in enumerate(rows):
        off = 0
        for seg, i in enumerate(idx):
            w, n = windows[i], len(windows[i])
            sl = slice(off, off + n)
            hidden_in[b, sl] = w.hidden_in
            target_hidden[b, sl] = w.target_hidden
            next_ids[b, sl] = w.next_ids
            positions[b, sl] = w.positions
            loss_mask[b, sl] = w.loss_mask
            seg_ids[b, sl] = seg
            off += n
    return PackedBatch(hidden_in, next_ids, positions, block_causal_mask(seg_ids), target_hidden, loss_mask, seg_ids)
