"""Drafter training data: the target's hidden states kept from rollout (docs/design.md §3-§4).

The rollout engine already computed h_t (last-layer, post-norm: the tensor entering the LM head) for every
position it decoded; we keep them in bf16 on the host instead of running another forward pass.

Pairing, by TRUE position t in the unpadded sequence: input (h_t, x_{t+1}) at drafter position t+1, targets
h_{t+1} and softmax(lm_head(h_{t+1})). A pair exists where h_t, h_{t+1} and x_{t+1} all exist; it carries loss
only when x_{t+1} is a response token (t+1 >= response_start), matching inference, where the drafter first runs
on (h_{P-1}, x_P). Prompt pairs, when the engine kept them, are context only.

Sampling ("one-step offset", section 4): a spot session early in step s sees only the short responses that
finished first, so each batch mixes the current step's responses with the LONG responses of step s-1.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass

import torch

from tlt.drafter_train.packing import PackedBatch, Window, pack


@dataclass
class DrafterSample:
    token_ids: torch.Tensor  # [L] long, prompt + response, no padding
    hidden: torch.Tensor     # [N, H] bf16 on host; hidden[i] = h_{hidden_start + i}
    response_start: int      # true position of the first response token (= prompt length)
    rl_step: int             # RL step whose rollout produced it
    hidden_start: int = 0    # true position of hidden[0] (engine may keep only response positions: P - 1)
    heldout: bool = False    # reserved for evaluation, never trained on

    @property
    def length(self) -> int:
        return self.token_ids.shape[0]

    @property
    def response_len(self) -> int:
        return self.length - self.response_start

    @property
    def pair_range(self) -> tuple[int, int]:
        """[t_lo, t_hi) of pair positions t: needs h_t, h_{t+1} and x_{t+1}."""
        return self.hidden_start, min(self.hidden_start + self.hidden.shape[0], self.length) - 1

    @property
    def loss_pairs(self) -> int:
        """Pairs whose target is a response token (what training learns from)."""
        t_lo, t_hi = self.pair_range
        return t_hi - max(t_lo, self.response_start - 1)

    def window(self, t0: int, t1: int) -> Window:
        """Pairs t in [t0, t1) as views into this sample's storage."""
        h0 = t0 - self.hidden_start
        pos = torch.arange(t0 + 1, t1 + 1)
        return Window(hidden_in=self.hidden[h0:h0 + t1 - t0], next_ids=self.token_ids[t0 + 1:t1 + 1],
                      positions=pos, target_hidden=self.hidden[h0 + 1:h0 + 1 + t1 - t0],
                      loss_mask=pos >= self.response_start)


class DrafterBuffer:
    """FIFO of DrafterSamples bounded by `max_tokens` stored hidden rows (oldest samples evicted first)."""

    def __init__(self, max_tokens: int, window_len: int = 512, offset_frac: float = 0.5,
                 long_quantile: float = 0.5, holdout_every: int = 0, dtype: torch.dtype = torch.bfloat16):
        self.max_tokens = max_tokens
        self.window_len = window_len
        self.offset_frac = offset_frac        # share of each batch drawn from the previous step's long responses
        self.long_quantile = long_quantile    # "long" = response length >= this quantile of its step's lengths
        self.holdout_every = holdout_every    # every k-th sample is held out for evaluation (0 = none)
        self.dtype = dtype
        self.samples: collections.deque[DrafterSample] = collections.deque()
        self.num_tokens = 0                   # stored hidden rows
        self._num_added = 0

    def __len__(self) -> int:
        return len(self.samples)

    # ---- filling -------------------------------------------------------------------------------------------
    def add(self, token_ids, hidden: torch.Tensor, response_start: int, rl_step: int,
            hidden_start: int = 0) -> DrafterSample | None:
        """One unpadded sequence: token_ids [L], hidden [N, H] with hidden[i] = h_{hidden_start + i}."""
        token_ids = torch.as_tensor(token_ids, dtype=torch.long).flatten().to("cpu", copy=True)
        L, N = token_ids.shape[0], hidden.shape[0]
        if hidden.dim() != 2 or hidden_start < 0 or hidden_start + N > L:
            raise ValueError(f"hidden must be [N, H] with hidden_start + N <= L; got {tuple(hidden.shape)}, "
                             f"hidden_start={hidden_start}, L={L}")
        if not 0 < response_start <= L:
            raise ValueError(f"response_start={response_start} outside (0, {L}]")
        s = DrafterSample(token_ids, hidden.detach().to("cpu", self.dtype, copy=True), int(response_start),
                          int(rl_step), int(hidden_start))
        if s.loss_pairs <= 0:
            return None  # no pair with a response target: nothing to learn from
        self._num_added += 1
        s.heldout = self.holdout_every > 0 and self._num_added % self.holdout_every == 0
        self.samples.append(s)
        self.num_tokens += N
        while self.num_tokens > self.max_tokens and len(self.samples) > 1:
            self.num_tokens -= self.samples.popleft().hidden.shape[0]
        return s

    def add_response(self, prompt_ids, output_ids, hidden: torch.Tensor, rl_step: int,
                     output_start: int = 0) -> DrafterSample | None:
        """One generated response with the engine's kept states: hidden[i] produced output token output_start + i,
        i.e. it is h at true position P - 1 + output_start + i (CompletionOutput.hidden_start is output_start)."""
        P = len(prompt_ids)
        return self.add(list(prompt_ids) + list(output_ids), hidden, response_start=P, rl_step=rl_step,
                        hidden_start=P - 1 + output_start)

    def add_padded_batch(self, ids: torch.Tensor, hidden: torch.Tensor, attention_mask: torch.Tensor,
                         response_start: int | torch.Tensor, step: int) -> int:
        """ids [B, L], hidden [B, L, H], attention_mask [B, L] (1 = real token; left and/or right padding),
        response_start: column (padded coordinates) of the first response token, int or [B].

        Padding is stripped per row so pairs are formed by TRUE position: hidden[b, j] is h at true position
        j - (left padding of row b), never shifted by the padding. Returns the number of samples added."""
        B = ids.shape[0]
        starts = torch.as_tensor(response_start).expand(B)
        added = 0
        for b in range(B):
            cols = attention_mask[b].nonzero().flatten()
            if cols.numel() == 0:
                continue
            lo, hi = int(cols[0]), int(cols[-1]) + 1
            if cols.numel() != hi - lo:
                raise ValueError(f"row {b}: attention_mask has holes; expected one contiguous run of real tokens")
            if self.add(ids[b, lo:hi], hidden[b, lo:hi], int(starts[b]) - lo, step) is not None:
                added += 1
        return added

    # ---- checkpoints ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The samples (tensors and ints: torch.load(weights_only=True) reads them) and counters."""
        return {"samples": [{"token_ids": s.token_ids, "hidden": s.hidden, "response_start": s.response_start,
                             "rl_step": s.rl_step, "hidden_start": s.hidden_start, "heldout": s.heldout}
                            for s in self.samples],
                "num_tokens": self.num_tokens, "num_added": self._num_added}

    @staticmethod
    def state_problem(state: dict, hidden_size: int) -> str | None:
        """What makes a saved `state_dict()` unfit for a target of `hidden_size` (None when it fits): checked
        before a resume loads it, from the tensors' shapes only."""
        try:
            for i, s in enumerate(state["samples"]):
                ids, hidden = s["token_ids"], s["hidden"]
                if ids.dim() != 1 or hidden.dim() != 2 or hidden.shape[1] != hidden_size:
                    return (f"drafter buffer sample {i} holds token ids {list(ids.shape)} and hidden states "
                            f"{list(hidden.shape)}, where [L] and [N, {hidden_size}] are expected")
                if not 0 <= s["hidden_start"] <= s["hidden_start"] + hidden.shape[0] <= ids.shape[0] or \
                        not 0 < s["response_start"] <= ids.shape[0]:
                    return f"drafter buffer sample {i} has positions outside its {ids.shape[0]} tokens"
            int(state["num_tokens"]), int(state["num_added"])
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            return f"the drafter buffer is not a DrafterBuffer state ({type(e).__name__}: {e})"
        return None

    def load_state_dict(self, state: dict) -> None:
        self.samples = collections.deque(DrafterSample(**s) for s in state["samples"])
        self.num_tokens, self._num_added = int(state["num_tokens"]), int(state["num_added"])

    # ---- sampling ------------------------------------------------------------------------------------------
    @property
    def latest_step(self) -> int:
        return max((s.rl_step for s in self.samples), default=-1)

    def num_train_tokens(self, heldout: bool = False) -> int:
        """Loss-carrying pairs available for training (or held out)."""
        return sum(s.loss_pairs for s in self.samples if s.heldout == heldout)

    def windows_of(self, s: DrafterSample) -> list[tuple[DrafterSample, int, int]]:
        """Cut a sample's loss-carrying pairs into windows of window_len, each keeping its true positions."""
        t_lo, t_hi = s.pair_range
        t0 = max(t_lo, s.response_start - 1)
        return [(s, a, min(a + self.window_len, t_hi)) for a in range(t0, t_hi, self.window_len)]

    def long_samples(self, step: int) -> list[DrafterSample]:
        pool = [s for s in self.samples if s.rl_step == step and not s.heldout]
        if not pool:
            return []
        lens = torch.tensor([float(s.response_len) for s in pool])
        cut = float(torch.quantile(lens, self.long_quantile))
        return [s for s in pool if s.response_len >= cut]

    def _draw(self, pool: list[DrafterSample], budget: int, gen: torch.Generator | None) -> list[Window]:
        wins = [w for s in pool for w in self.windows_of(s)]
        out, used = [], 0
        for i in torch.randperm(len(wins), generator=gen).tolist():
            s, a, b = wins[i]
            if out and used + (b - a) > budget:
                continue
            out.append(s.window(a, b))
            used += b - a
            if used >= budget:
                break
        return out

    def sample_windows(self, max_tokens: int, step: int | None = None,
                       generator: torch.Generator | None = None) -> list[Window]:
        """About `max_tokens` tokens of windows: step `step`'s responses mixed with step-1's long responses.

        Falls back to whatever one side has when the other is empty, and to the whole buffer when both are."""
        step = self.latest_step if step is None else step
        current = [s for s in self.samples if s.rl_step == step and not s.heldout]
        previous = self.long_samples(step - 1)
        if not current and not previous:
            return self._draw([s for s in self.samples if not s.heldout], max_tokens, generator)
        if not previous:
            return self._draw(current, max_tokens, generator)
        if not current:
            return self._draw(previous, max_tokens, generator)
        prev_budget = int(round(self.offset_frac * max_tokens))
        return (self._draw(previous, prev_budget, generator)
                + self._draw(current, max_tokens - prev_budget, generator))

    def sample_batch(self, num_rows: int, batch_tokens: int, step: int | None = None,
                     generator: torch.Generator | None = None) -> PackedBatch:
        """Windows for about num_rows x batch_tokens tokens, packed (first-fit may need a row more)."""
        return pack(self.sample_windows(num_rows * batch_tokens, step, generator), batch_tokens)

    def heldout_batch(self, batch_tokens: int, max_tokens: int) -> PackedBatch | None:
        """The newest held-out samples' windows (deterministic order), or None if nothing is held out."""
        out, used = [], 0
        for s in reversed(self.samples):
            if not s.heldout:
                continue
            for _, a, b in self.windows_of(s):
                if used + (b - a) > max_tokens and out:
                    return pack(out, batch_tokens)
                out.append(s.window(a, b))
                used += b - a
        return pack(out, batch_tokens) if out else None
