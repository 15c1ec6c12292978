"""The one logit transform used by plain sampling AND speculative verification (exactness depends on it).

Order as in vLLM/HF: temperature, then top-k, then top-p. Rows with temperature 0 become a one-hot at the
argmax, so greedy decoding and greedy verification are the same rule as sampling (u never exceeds 1).
Sampling is by inverse CDF from a uniform draw per row, so a request's seeded generator alone decides its
tokens, whatever else is in the batch, and whether speculative decoding is on (tlt.speculative.verify draws the
same way; docs/design.md §7). A plain step's sampling reads nothing from the device before its one read of the
sampled ids and log-probs (`sample` with static, `read_sampled`): the rows' facts come from the host (HostRows), their
parameters and uniforms go to the device in one non-blocking copy (`rows_on_device`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tlt.device import host_tensor
from tlt.models.kernels import greedy_logprobs, token_logprobs


@dataclass(frozen=True)
class HostRows:
    """What transform_logits reads from the device, known on the host from the rows' parameters: the top-k width
    (None: no row uses top-k), whether any row uses top-p, whether any row is greedy."""
    top_k_width: int | None
    nucleus: bool
    greedy: bool

    @classmethod
    def of(cls, temperature: list[float], top_k: list[int], top_p: list[float], vocab_size: int) -> "HostRows":
        width = max(min(k if k > 0 else vocab_size, vocab_size) for k in top_k) if any(k > 0 for k in top_k) else None
        return cls(width, any(p < 1 for p in top_p), any(t <= 0 for t in temperature))


@dataclass(frozen=True)
class DeviceRows:
    """The rows' sampling parameters on the device, in the dtypes torch.tensor gives their host lists."""
    temperature: torch.Tensor  # [N] fp32 (0 = greedy)
    top_k: torch.Tensor        # [N] int64 (<= 0 = off)
    top_p: torch.Tensor        # [N] fp32 (1 = off)
    u: torch.Tensor            # [N] fp32 the rows' uniform draws


def rows_on_device(temperature: list[float], top_k: list[int], top_p: list[float], u: torch.Tensor,
                   vocab_size: int, device, packed: bool | None = None) -> DeviceRows:
    """The rows' parameters and uniforms u [N] fp32 (host) -> DeviceRows, top_k clamped to the vocabulary (as
    transform_logits clamps it). packed (default: off the CPU, where there is a copy to make): in one host-to-device
    copy, pinned and non-blocking on CUDA (tlt.device.host_tensor), as fp64, which holds every value exactly, cast
    back on the device. Either way the values four torch.tensor calls give."""
    top_k = [min(k, vocab_size) for k in top_k]
    if not (torch.device(device).type != "cpu" if packed is None else packed):
        return DeviceRows(torch.tensor(temperature), torch.tensor(top_k), torch.tensor(top_p), u)
    both = torch.empty(4, len(temperature), dtype=torch.float64)
    both[:3] = torch.tensor([temperature, top_k, top_p], dtype=torch.float64)
    both[3] = u
    t, k, p, x = host_tensor(both, device).unbind(0)
    return DeviceRows(t.float(), k.long(), p.float(), x.float())


def sample(logits: torch.Tensor, rows: DeviceRows, host: HostRows,
           static: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One token a row from logits [N, V] fp32 -> (ids [N], their target log-probs [N]) on the logits' device:
    transform_logits, the inverse-CDF draw at rows.u, target_logprobs. static: nothing read from the device (off the
    CPU a read waits for every queued kernel); the same ids and log-probs."""
    probs = transform_logits(logits, rows.temperature, rows.top_k, rows.top_p, host)
    ids = sample_from(probs, rows.u, static)
    return ids, target_logprobs(logits, rows.temperature, ids, static)


def read_sampled(ids: torch.Tensor, logprobs: torch.Tensor,
                 packed: bool | None = None) -> tuple[list[int], list[float]]:
    """ids [N] and their log-probs [N] -> host lists. packed (default: off the CPU, where a read waits for the
    device): in one read (the step's only one), both as fp64, which holds them exactly."""
    if not (ids.device.type != "cpu" if packed is None else packed):
        return ids.tolist(), logprobs.tolist()
    both = torch.stack([ids.to(torch.float64), logprobs.to(torch.float64)]).tolist()
    return [int(t) for t in both[0]], both[1]


def transform_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                     top_p: torch.Tensor, host: HostRows | None = None) -> torch.Tensor:
    """logits [N, V] fp32; temperature [N] (0 = greedy); top_k [N] (<=0 = off); top_p [N] (1 = off) -> probs [N, V].
    host: the same facts from the host, so nothing here reads the device (the same probs)."""
    greedy = temperature <= 0
    scaled = logits / torch.where(greedy, 1.0, temperature)[:, None]
    if bool((top_k > 0).any()) if host is None else host.top_k_width is not None:
        k = torch.where(top_k > 0, top_k, logits.shape[-1]).clamp(max=logits.shape[-1])
        width = int(k.max()) if host is None else host.top_k_width
        kth = scaled.topk(width, dim=-1).values.gather(1, (k - 1)[:, None])
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = scaled.softmax(dim=-1)
    nucleus = top_p < 1
    if bool(nucleus.any()) if host is None else host.nucleus:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_p.cumsum(-1) - sorted_p
        drop_sorted = mass_before > top_p[:, None]  # keep the smallest prefix whose mass reaches top_p
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        kept = probs.masked_fill(drop, 0.0)
        # only the nucleus rows change: a top_p = 1 row keeps its softmax bit for bit in any batch, so a seeded
        # request draws the same token whoever shares its batch (plain or speculative step)
        probs = torch.where(nucleus[:, None], kept / kept.sum(-1, keepdim=True), probs)
    if bool(greedy.any()) if host is None else host.greedy:
        onehot = torch.zeros_like(probs).scatter_(1, argmax(logits)[:, None], 1.0)
        probs = torch.where(greedy[:, None], onehot, probs)
    return probs


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [N, V] -> the index of each row's first maximum, as `logits.argmax(-1)`, ~10x faster on CPU for a large
    vocabulary: block maxima (a vectorised reduction) pick the first block holding the maximum, then the argmax
    inside that block. torch's CPU argmax is not vectorised (3.8 ms for 64 x 49152 fp32 on one EPYC core)."""
    N, V = logits.shape
    block = next((b for b in (256, 128, 64) if V % b == 0 and V > b), None)
    if block is None or logits.device.type != "cpu":
        return logits.argmax(-1)
    blocks = logits.reshape(N, V // block, block)
    first = blocks.amax(-1).argmax(-1)
    return first * block + blocks[torch.arange(N, device=logits.device), first].argmax(-1)


def greedy(logits: torch.Tensor, static: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy rows: (argmax(logits), target_logprobs(logits, 0, those ids)), in one kernel call on CPU. static:
    nothing read from the device."""
    fast = greedy_logprobs(logits)
    if fast is not None:
        return fast
    ids = argmax(logits)
    return ids, target_logprobs(logits, torch.zeros(logits.shape[0], device=logits.device), ids, static)


def sample_from(probs: torch.Tensor, u: torch.Tensor, static: bool = False) -> torch.Tensor:
    """Inverse-CDF draw in vocabulary order: probs [N, V] (unnormalised weights are fine), u [N] in [0, 1) -> token
    ids [N], the i with cdf[i-1] <= u * total < cdf[i]. Never a zero-probability token. Plain decoding and
    speculative verification both draw with this function, so a row's u yields the same token in either.
    static: the same ids without reading the device on the host (inside a CUDA graph; a little more work)."""
    cdf = probs.cumsum(-1)
    ids = torch.searchsorted(cdf, (u.to(cdf.dtype) * cdf[:, -1])[:, None], right=True)[:, 0]
    over = ids >= probs.shape[-1]
    if static or bool(over.any()):  # u * total rounded up to the total: take the last token with positive weight
        last = probs.shape[-1] - 1 - (probs > 0).flip(-1).to(torch.int8).argmax(-1)
        ids = torch.where(over, last, ids)
    return ids


def target_logprobs(logits: torch.Tensor, temperature: torch.Tensor, ids: torch.Tensor,
                    static: bool = False) -> torch.Tensor:
    """Log-prob of `ids` under softmax(logits / T) (raw softmax at T = 0), before top-k/top-p: the quantity an RL
    trainer recomputes as the old policy's log-prob (verl divides logits by the rollout temperature likewise).
    On CPU in fp32: tlt's kernel (no [N, V] log_softmax output), else torch. static: divide every row without
    reading the device first (x / 1 is x, so the same values)."""
    fast = token_logprobs(logits, temperature, ids)
    if fast is not None:
        return fast
    if static or bool(((temperature > 0) & (temperature != 1)).any()):
        logits = logits / torch.where(temperature <= 0, 1.0, temperature)[:, None]
    return logits.log_softmax(-1).gather(1, ids[:, None])[:, 0]
