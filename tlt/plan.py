"""Per-device memory plan of a training config, before any weights load.

    tlt plan [CONFIG.yaml] [key=value ...] [--world-size N] [--device-memory 80GiB] [--model-config DIR]

Prints the bytes one device holds for the actor strategy (actor.strategy) at N ranks: parameters, gradients and
AdamW state (exact: counted from the model's shapes, FSDP2's dim-0 shards padded as fully_shard pads them), the
reference model, activations of one micro-batch and FSDP's gathered layers (estimates), the rollout KV cache and
the drafter. Exits 2, naming the key to change, when the total exceeds --device-memory (default: the CUDA
device's memory when there is one; no check otherwise). --model-config plans from an architecture alone (a directory
with an HF config.json, e.g. configs/models/qwen2.5-32b-instruct) instead of model.path; --world-size defaults to
WORLD_SIZE, else to the trainer ranks of trainer.placement (placement=none: trainer.nnodes x n_gpus_per_node).
"""
from __future__ import annotations

import argparse
import math
import os
import re
import sys
from dataclasses import dataclass

import torch

from tlt.config import Config, ConfigError, load_config
from tlt.models.config import ModelConfig
from tlt.models.decoder import Decoder

ADAM_STATES = 2  # exp_avg, exp_avg_sq (fp32-like, the parameter's dtype); the step counters are scalars
UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6,
         "gb": 10**9, "tb": 10**12}


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in UNITS:
        raise ValueError(f"--device-memory {text!r}: expected a size such as 80GiB, 24GB or 512MiB")
    return int(float(m.group(1)) * UNITS[m.group(2).lower()])


def local_numel(shape: torch.Size, world: int) -> int:
    """Elements of the largest FSDP2 shard of a tensor: dim 0 split in ceil(dim0 / world) rows (rank 0's)."""
    rows = math.ceil(shape[0] / world) if world > 1 else shape[0]
    return rows * math.prod(shape[1:])


@dataclass
class Plan:
    rows: list[tuple[str, int, str]]   # (component, bytes on one device, the key that changes it)

    @property
    def total(self) -> int:
        return sum(b for _, b, _ in self.rows)

    def bytes(self, name: str) -> int:
        return next(b for n, b, _ in self.rows if n == name)

    def table(self) -> str:
        lines = [f"{'component':<22}{'MiB':>12}  key to change"]
        lines += [f"{n:<22}{b / 2**20:>12.2f}  {k}" for n, b, k in self.rows]
        lines.append(f"{'total':<22}{self.total / 2**20:>12.2f}")
        return "\n".join(lines)


def memory_plan(cfg: Config, model_cfg: ModelConfig, world: int) -> Plan:
    a = cfg.actor
    fsdp = a.strategy == "fsdp"
    with torch.device("meta"):
        shapes = [p.shape for p in Decoder(model_cfg).parameters()]
        layer_numel = sum(p.numel() for p in Decoder(model_cfg).layers[0].parameters())
    numel = sum(local_numel(s, world) if fsdp else math.prod(s) for s in shapes)
    width = 2 if cfg.policy_dtype() == "bfloat16" else 4
    compute = 2 if a.bf16_autocast and cfg.model.device != "cpu" else width
    shard_key = "actor.strategy=fsdp" if not fsdp else "more ranks (--world-size)"
    rows = [("parameters", numel * width, shard_key), ("gradients", numel * width, shard_key),
            ("optimizer", ADAM_STATES * numel * width, shard_key)]
    if a.use_kl_loss:
        rows.append(("reference model", numel * width, "actor.use_kl_loss"))
    if fsdp:  # a layer's gathered weights, and the next one's prefetched, in the compute dtype
        rows.append(("fsdp gathered layers", 2 * layer_numel * compute, "actor.strategy"))
    m = model_cfg
    # a micro-batch holds at least one whole row, so the longest prompt + response bounds it from below
    T = max(a.ppo_max_token_len, cfg.data.max_prompt_length + cfg.data.max_response_length)
    H, inter = m.hidden_size, m.intermediate_size
    qkv = (m.num_heads + 2 * m.num_kv_heads) * m.head_dim
    # saved per token and layer for the backward: norm inputs/outputs, q/k/v, attention out, MLP in, gate/up, act
    per_layer = (4 * H + 2 * qkv + 3 * inter) * compute
    kept = m.num_layers * (H * compute if a.gradient_checkpointing else per_layer) + \
        (per_layer if a.gradient_checkpointing else 0)
    # fp32 logits, log-softmax and its gradient per response token: for one chunk at a time with
    # actor.logprob_chunk_tokens (plus a log-prob and its gradient per token)
    vocab = 3 * m.vocab_size * 4
    chunk = min(T, a.logprob_chunk_tokens or T)
    rows.append(("activations", T * kept + chunk * vocab + T * 8 * (chunk < T),
                 "actor.logprob_chunk_tokens, actor.ppo_max_token_len or data.max_response_length "
                 "(or actor.gradient_checkpointing)"))
    kv_width = 2 if cfg.rollout_dtype() == "bfloat16" else 4
    max_len = cfg.data.max_prompt_length + cfg.data.max_response_length
    kv = cfg.rollout.max_num_seqs * max_len * m.num_layers * 2 * m.num_kv_heads * m.head_dim * kv_width
    rows.append(("kv cache", kv, "rollout.max_num_seqs"))
    s = cfg.speculative
    if s.enabled and s.method == "eagle":  # one decoder layer and the fc fusing (embedding, hidden state)
        drafter = layer_numel + 2 * H * H
        per = 4 * (1 + 1 + ADAM_STATES) if cfg.drafter_train.enabled else kv_width
        rows.append(("drafter", drafter * per, "speculative.enabled"))
    return Plan(rows)


def _model_config(cfg: Config, architecture: str | None = None) -> ModelConfig:
    from tlt.models.loader import read_config
    path = architecture or cfg.model.path
    if path == "tiny-random":
        from tlt.rl.tiny_model import tiny_random_model_path
        path = str(tiny_random_model_path())
    elif path is None:
        from tlt.models.smollm import default_model_path
        path = str(default_model_path())
    return read_config(path)


def _default_world(cfg: Config) -> int:
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    t = cfg.trainer
    if t.placement == "none":  # torchrun ranks, as verl's keys describe them
        return t.nnodes * t.n_gpus_per_node
    from tlt.workers.bundles import assign_bundles  # pure arithmetic, no Ray
    return len(assign_bundles(t.placement, t.nnodes, t.n_gpus_per_node, t.rollout_gpus).trainer_bundles)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tlt plan", description=__doc__.split("\n\n")[0])
    p.add_argument("args", nargs="*", help="[CONFIG.yaml] then key=value overrides")
    p.add_argument("--world-size", type=int, default=None,
                   help="trainer ranks; default: WORLD_SIZE, else trainer.placement's trainer ranks, else 1")
    p.add_argument("--model-config", default=None, metavar="DIR",
                   help="plan this architecture (a directory with an HF config.json) instead of model.path's")
    p.add_argument("--device-memory", default=None, help="e.g. 80GiB; default: the CUDA device's, if any")
    ns = p.parse_intermixed_args(argv)
    yaml_path = ns.args[0] if ns.args and "=" not in ns.args[0] else None
    overrides = ns.args[1:] if yaml_path else ns.args
    try:
        cfg = load_config(yaml_path, overrides)
        world = ns.world_size or _default_world(cfg)
        if world < 1:
            raise ValueError(f"--world-size {world}: must be >= 1")
        model_cfg = _model_config(cfg, ns.model_config)
        limit = parse_bytes(ns.device_memory) if ns.device_memory else None
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"tlt plan: {e}", file=sys.stderr)
        return 2
    if limit is None and torch.cuda.is_available():
        limit = torch.cuda.get_device_properties(0).total_memory
    plan = memory_plan(cfg, model_cfg, world)
    print(f"actor.strategy={cfg.actor.strategy}, {world} rank(s), per device:")
    print(plan.table())
    if limit is not None and plan.total > limit:
        name, size, key = max(plan.rows, key=lambda r: r[1])
        print(f"tlt plan: {plan.total / 2**30:.2f} GiB per device does not fit {limit / 2**30:.2f} GiB; the "
              f"largest part is {name} ({size / 2**30:.2f} GiB): change {key}", file=sys.stderr)
        return 2
    return 0
