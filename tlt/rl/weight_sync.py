"""Weight sync from the trained policy (FSDP shards or a full replica) into the rollout engine's own copy.

The engine decodes an un-sharded Decoder in rollout.dtype. Under actor.strategy=fsdp the policy's parameters are
DTensor shards, so after each update `stream_state` gathers them one FSDP unit at a time (each decoder layer, then
the root's embedding, final norm and LM head), casts them to the rollout dtype and yields that unit's dict; the
gathered full tensors are dropped before the next unit is gathered, so the whole model never exists in fp32 at
once (docs/design.md §12). Every rank takes part in every gather (they are collectives) and fills its own engine.
`rollout_copy` builds that engine copy the same way, from the shards, on the meta device first.

`sync_weights` copies the stream into an in-process engine's model; the Ray replicas receive the same per-unit
dicts, merged into one rollout-dtype state dict for the object store (tlt.rl.trainer). `SyncStats` records the
bytes written into the engine's copy and the seconds taken (weight_sync/* metrics); an engine that shares the
policy's own parameters moves nothing and reports 0 bytes.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

from tlt.models.decoder import Decoder, Rotary


@dataclass
class SyncStats:
    bytes: int = 0
    seconds: float = 0.0

    def __add__(self, other: "SyncStats") -> "SyncStats":
        return SyncStats(self.bytes + other.bytes, self.seconds + other.seconds)

    def metrics(self) -> dict[str, float]:
        gb_per_s = self.bytes / 1e9 / self.seconds if self.seconds > 0 else 0.0
        return {"weight_sync/bytes": float(self.bytes), "weight_sync/time_s": self.seconds,
                "weight_sync/gb_per_s": gb_per_s}


def full_tensor(param: torch.Tensor) -> torch.Tensor:
    """The whole tensor: all-gathered from the ranks' shards when `param` is a DTensor (collective), on its mesh's
    device (under actor.fsdp_offload a shard lives in host memory: its gather then runs on NCCL, not on gloo)."""
    if not hasattr(param, "full_tensor"):
        return param
    if param.device.type != param.device_mesh.device_type:
        param = param.to(param.device_mesh.device_type)
    return param.full_tensor()


def sync_units(model: Decoder) -> list[tuple[str, list[tuple[str, nn.Parameter]]]]:
    """(unit prefix, [(parameter name in the model, parameter)]) per FSDP unit: decoder layers, then the root."""
    units = [(f"layers.{i}.", [(f"layers.{i}.{n}", p) for n, p in layer.named_parameters()])
             for i, layer in enumerate(model.layers)]
    root = [(n, p) for n, p in model.named_parameters() if not n.startswith("layers.")]
    return units + [("", root)]


@torch.no_grad()
def stream_state(model: Decoder, dtype: torch.dtype, device: torch.device | str | None = None,
                 skip_units: frozenset[int] = frozenset()) -> Iterator[dict[str, torch.Tensor]]:
    """The policy's parameters as one {name: full tensor in `dtype`} dict per FSDP unit, in unit order.
    `skip_units` (unit indices) are gathered but not yielded: a test control for a sync that misses a layer."""
    for index, (_, params) in enumerate(sync_units(model)):
        unit = {name: full_tensor(p.detach()).to(dtype=dtype, device=device) for name, p in params}
        if index not in skip_units:
            yield unit
        del unit


@torch.no_grad()
def sync_weights(policy: Decoder, engine_model: Decoder, skip_units: frozenset[int] = frozenset()) -> SyncStats:
    """Copy `policy` (sharded or not) into `engine_model`, unit by unit, cast to the engine's dtype. Each copy bumps
    the weight's version, so the engine's packed weights are packed again before the next rollout. An engine that
    shares the policy's parameters moves nothing (0 bytes)."""
    if engine_model is policy:
        return SyncStats()
    start = time.perf_counter()
    targets = dict(engine_model.named_parameters())
    dtype, device = next(engine_model.parameters()).dtype, next(engine_model.parameters()).device
    moved = 0
    for unit in stream_state(policy, dtype, device, skip_units):
        for name, value in unit.items():
            targets[name].copy_(value)
            moved += value.numel() * value.element_size()
    return SyncStats(moved, time.perf_counter() - start)


@torch.no_grad()
def rollout_copy(policy: Decoder, dtype: torch.dtype, device: torch.device | str) -> Decoder:
    """A frozen, un-sharded Decoder in `dtype` on `device` with `policy`'s weights, built on the meta device and
    filled by `sync_weights` one FSDP unit at a time (collective under FSDP): no whole copy of the policy in its own
    dtype ever exists. Its rotary buffers are rebuilt in `dtype`, as a cast copy of the policy would hold them."""
    with torch.device("meta"):
        twin = Decoder(policy.cfg).to(dtype)
    twin.to_empty(device=device)
    twin.rotary = Rotary(policy.cfg).to(device=device, dtype=dtype)
    twin.requires_grad_(False).eval()
    sync_weights(policy, twin)
    return twin


def rollout_state_dict(policy: Decoder, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], SyncStats]:
    """The whole policy in `dtype` on the CPU, assembled from the per-unit stream (for Ray replicas, whose state
    goes through the object store as one dict), with the bytes and seconds it took."""
    start = time.perf_counter()
    state: dict[str, torch.Tensor] = {}
    for unit in stream_state(policy, dtype, "cpu"):
        state.update(unit)
    moved = sum(v.numel() * v.element_size() for v in state.values())
    return state, SyncStats(moved, time.perf_counter() - start)
