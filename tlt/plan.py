"""Per-device memory plan of a training config, before any weights load.

    tlt plan [CONFIG.yaml] [key=value ...] [--world-size N] [--device-memory 80GiB] [--model-config DIR]

Prints the bytes one device holds for the actor strategy (actor.strategy) at N ranks, per component and the phases
it is live in (docs/design.md §16: loading, then those of the RL step): parameters, gradients and AdamW state
(exact: counted from the model's shapes, FSDP2's dim-0 shards padded as fully_shard pads them), the reference model,
the engine's weight copy, the largest micro-batch's activations and logits, FSDP's gathered layers, the rollout KV
cache, the speculator's hidden-state records, CPU packed weights and the drafter (estimates; `tlt bench memory`
measures them). The peak is the largest phase. Exits 2,
naming the key to change, when the peak exceeds --device-memory (default: the CUDA
device's memory when there is one; no check otherwise). --model-config plans from an architecture alone (a directory
with an HF config.json, e.g. configs/models/qwen2.5-32b-instruct) instead of model.path; --world-size defaults to
WORLD_SIZE, else to the trainer ranks of trainer.placement (placement=none: trainer.nnodes x n_gpus_per_node).
With trainer.placement=disaggregated it prints and checks two plans, a trainer GPU and a rollout GPU (role_plans).
"""
from __future__ import annotations

import argparse
import math
import os
import re
import sys
from dataclasses import dataclass

import torch

from tlt.bundles import assign_bundles
from tlt.config import Config, ConfigError, load_config
from tlt.device import cpu_has_fast_bf16
from tlt.engine.cuda_graph import ROUND, bucket
from tlt.models.config import ModelConfig
from tlt.models.decoder import Decoder
from tlt.models.kernels import keeps_packed_copy
from tlt.models.loader import read_config
from tlt.models.smollm import default_model_path
from tlt.rl.tiny_model import tiny_random_model_path

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


# "load": building the trainer (the policy's and reference's shards, the engine's copy filled from them)
ALL_PHASES = ("load", "rollout", "old_log_prob", "ref_log_prob", "update", "weight_sync", "drafter")
STEP_PHASES = ALL_PHASES[1:]
FORWARD_PHASES = ("old_log_prob", "ref_log_prob")


@dataclass
class Row:
    name: str
    bytes: int
    key: str                                  # the config key that changes it
    phases: tuple[str, ...] = ALL_PHASES      # the RL step's phases during which it is live
    where: str = "device"                     # "host": offloaded (actor.fsdp_offload), not on the device


@dataclass
class Plan:
    rows: list[Row]

    @property
    def total(self) -> int:
        """The device's peak: the largest phase (what must fit)."""
        return max(self.phase_bytes(p) for p in ALL_PHASES)

    def phase_bytes(self, phase: str) -> int:
        return sum(r.bytes for r in self.rows if phase in r.phases and r.where == "device")

    def bytes(self, name: str) -> int:
        return next(r.bytes for r in self.rows if r.name == name)

    def table(self) -> str:
        lines = [f"{'component':<22}{'MiB':>12}  key to change"]
        lines += [f"{r.name:<22}{r.bytes / 2**20:>12.2f}  {r.key}" + ("  (host memory)" if r.where == "host" else "")
                  for r in self.rows]
        peak = max(ALL_PHASES, key=self.phase_bytes)
        lines.append(f"{'total':<22}{self.total / 2**20:>12.2f}")
        lines.append(f"(the peak phase, {peak}; every phase: " +
                     ", ".join(f"{p} {self.phase_bytes(p) / 2**20:.2f}" for p in ALL_PHASES) + ")")
        return "\n".join(lines)


def _kv_bytes(cfg: Config, m: ModelConfig, responses: int, capacity: int, layers: int, graphs: bool = False) -> int:
    """The engine's slot KV cache at its largest (tlt.engine.kv_cache) for an engine that decodes `responses`:
    slots rounded up to 8 for the sequences running at once; with CUDA graphs for their batch bucket's rows (padding
    rows write into free slots, tlt.engine.cuda_graph)."""
    running = min(cfg.rollout.max_num_seqs, responses)
    if graphs:
        running = bucket(running, cfg.rollout.max_num_seqs)
    slots = min(-(-running // 8) * 8, cfg.rollout.max_num_seqs)
    width = 2 if cfg.rollout_dtype() == "bfloat16" else 4
    return slots * capacity * layers * 2 * m.num_kv_heads * m.head_dim * width


def largest_micro_batch(cfg: Config, groups: int, prompt_len: int) -> tuple[int, int]:
    """(padded tokens, response tokens) of the largest micro-batch of `groups` prompt groups whose prompts and
    responses are all at their longest: the actor's own packing (actor.share_prompt) and split
    (actor.ppo_max_token_len)."""
    from tlt.rl.actor import _pack_cost, micro_batches
    n, R, a = cfg.rollout.n, cfg.data.max_response_length, cfg.actor
    if a.share_prompt:  # share_prompts' choice for equal lengths: m packs minimising the cost
        m = min(range(1, n + 1), key=lambda k: sum(_pack_cost(prompt_len + len(range(j, n, k)) * R) for j in range(k)))
        sizes = [len(range(j, n, m)) for j in range(m)] * groups
    else:
        sizes = [1] * (n * groups)
    lens = [prompt_len + k * R for k in sizes]
    best = (0, 0)
    for chunk in micro_batches(lens, a.ppo_max_token_len):
        padded = len(chunk) * max(lens[c] for c in chunk)
        best = max(best, (padded, sum(sizes[c] for c in chunk) * R))
    return best


def memory_plan(cfg: Config, model_cfg: ModelConfig, world: int, prompts_per_rank: int | None = None,
                prompt_len: int | None = None, responses: int | None = None) -> Plan:
    """Bytes one device holds, per component and RL-step phase (docs/design.md §16). prompts_per_rank defaults to
    data.train_batch_size / world; prompt_len (the longest prompt) to data.max_prompt_length; responses (those
    this device's engine decodes) to prompts_per_rank * rollout.n."""
    a, m = cfg.actor, model_cfg
    fsdp = a.strategy == "fsdp"
    prompts_per_rank = prompts_per_rank or max(cfg.data.train_batch_size // world, 1)
    responses = responses or prompts_per_rank * cfg.rollout.n
    P = prompt_len or cfg.data.max_prompt_length
    R = cfg.data.max_response_length
    with torch.device("meta"):
        model = Decoder(model_cfg)
        shapes = [p.shape for p in model.parameters()]
        layer_numel = sum(p.numel() for p in model.layers[0].parameters())
        full_numel = sum(p.numel() for p in model.parameters())
    numel = sum(local_numel(s, world) if fsdp else math.prod(s) for s in shapes)
    width = 2 if cfg.policy_dtype() == "bfloat16" else 4
    on_cuda = cfg.model.device.startswith("cuda") or (cfg.model.device == "auto" and torch.cuda.is_available())
    autocast = a.bf16_autocast and width == 4 and (on_cuda or cpu_has_fast_bf16())
    compute = 2 if autocast else width
    shard_key = "actor.strategy=fsdp" if not fsdp else "more ranks (--world-size)"
    where = "host" if fsdp and a.fsdp_offload else "device"
    update, forward = ("update",), FORWARD_PHASES
    # loading allocates only the parameters: under FSDP each rank's shard, filled from its rows of the checkpoint
    # (tlt.rl.fsdp.load_sharded_model); gradients and AdamW state appear at the first update
    rows = [Row("parameters", numel * width, shard_key, where=where),
            Row("gradients", numel * width, shard_key, phases=STEP_PHASES, where=where),
            Row("optimizer", ADAM_STATES * numel * width, shard_key, phases=STEP_PHASES, where=where)]
    if a.use_kl_loss:
        rows.append(Row("reference model", numel * width, "actor.use_kl_loss", where=where))
    rollout_width = 2 if cfg.rollout_dtype() == "bfloat16" else 4
    copy = cfg.rollout_dtype() != cfg.policy_dtype() or fsdp  # the engine decodes its own full copy
    if copy:
        rows.append(Row("rollout weights", full_numel * rollout_width, "rollout.dtype"))
    if cfg.trainer.placement == "colocated":  # the GPU's rollout replica, a process of its own, has its own copy
        rows.append(Row("replica weights", full_numel * rollout_width, "trainer.placement=disaggregated"))
    if fsdp:  # a layer's gathered weights, and the next one's prefetched, in FSDP's param dtype (tlt.rl.fsdp)
        gathered = 2 if a.bf16_autocast and on_cuda else width
        rows.append(Row("fsdp gathered layers", 2 * layer_numel * gathered, "actor.strategy",
                        phases=forward + update))
        # the root unit (embedding, final norm, LM head): FSDP2 keeps it gathered after its forward
        root_numel = full_numel - m.num_layers * layer_numel
        rows.append(Row("fsdp gathered root", root_numel * gathered, "actor.strategy", phases=STEP_PHASES))
        # the engine's refresh gathers one unit at a time (tlt.rl.weight_sync): the full tensors and the
        # all-gather's buffer, for the largest unit; its copy is first filled so, while the trainer is built
        rows.append(Row("weight sync gather", 2 * max(layer_numel, root_numel) * width, "actor.strategy",
                        phases=("load", "weight_sync")))
    H, inter = m.hidden_size, m.intermediate_size
    qkv = (m.num_heads + 2 * m.num_kv_heads) * m.head_dim
    # saved per token and layer for the backward: norm inputs/outputs, q/k/v, attention out, MLP in, gate/up, act
    per_layer = (4 * H + 2 * qkv + 3 * inter) * compute
    tokens, resp = largest_micro_batch(cfg, max(prompts_per_rank // _num_mini_batches(cfg), 1), P)
    kept = m.num_layers * (H * compute if a.gradient_checkpointing else per_layer) + \
        (per_layer if a.gradient_checkpointing else 0)
    # fp32 [M, V] tensors per response token at the update's forward peak: the logits (and their bf16 matmul
    # output), the log-softmax, and exp, clamp and their product for the entropy metric: 6 measured on CPU (tlt
    # bench memory); one chunk at a time with actor.logprob_chunk_tokens. Autocast keeps a bf16 copy of every
    # fp32 weight a matmul reads for the whole forward and backward.
    V = m.vocab_size
    chunk = min(resp, a.logprob_chunk_tokens or resp)
    linear_numel = full_numel - _non_linear_numel(model)
    weight_cache = linear_numel * 2 if autocast and not (fsdp and on_cuda) else 0
    rows.append(Row("activations", tokens * kept + 6 * chunk * V * 4 + resp * 8 * (chunk < resp) + weight_cache,
                    "actor.logprob_chunk_tokens, actor.ppo_max_token_len or data.max_response_length "
                    "(or actor.gradient_checkpointing)", phases=update))
    # no graph: one layer's transients, then the logits and their log-softmax. The old log-probs are recomputed
    # where the engine decodes its own copy or rollout.recompute_logprobs asks (GRPOTrainer.old_log_probs), for the
    # rows after the first mini-batch (its own come from the update: actor.on_policy_logprobs)
    first = prompts_per_rank // _num_mini_batches(cfg) if a.on_policy_logprobs else 0
    forwards = [("old_log_prob", prompts_per_rank - first)] if copy or cfg.rollout.recompute_logprobs else []
    for phase, groups in forwards + [("ref_log_prob", prompts_per_rank)] * a.use_kl_loss:
        f_tokens, f_resp = largest_micro_batch(cfg, max(groups, 1), P)
        f_chunk = min(f_resp, a.logprob_chunk_tokens or f_resp)
        rows.append(Row(f"{phase.split('_')[0]} log-prob forward", f_tokens * per_layer + 2 * f_chunk * V * 4,
                        "actor.logprob_chunk_tokens", phases=(phase,)))
    # capacity: rounded up to 32 positions, or with CUDA graphs to ROUND, with the speculator's headroom (a verified
    # draft tree past a row's end), reserved at admission (LLMEngine.attach_speculator)
    graphs = on_cuda and not cfg.rollout.enforce_eager
    step = ROUND if graphs else 32
    headroom = cfg.speculative.cache_headroom() if cfg.speculative.enabled else 0
    capacity = -(-(P + R + headroom) // step) * step
    kv = _kv_bytes(cfg, m, responses, capacity, m.num_layers, graphs)
    rows.append(Row("kv cache", kv, "rollout.max_num_seqs", phases=STEP_PHASES))
    # growing the cache copies it: the last growth holds the old cache (one rounding step shorter) beside the new
    rows.append(Row("kv cache growth", kv * (capacity - step) // capacity, "rollout.max_num_seqs",
                    phases=("rollout",)))
    # tlt.models.kernels: on CPU, a packed copy of each weight an inference matmul reads, where its path packs
    running = min(cfg.rollout.max_num_seqs, responses)
    decode_packs = not on_cuda and keeps_packed_copy(getattr(torch, cfg.rollout_dtype()), running)
    if not on_cuda:
        packed = linear_numel * rollout_width * decode_packs  # the engine's decode
        recompute = (copy or cfg.rollout.recompute_logprobs) and \
            (_num_mini_batches(cfg) > 1 or not a.on_policy_logprobs or a.ppo_epochs > 1)
        # the trainer's no-graph forwards (old log-probs, the reference model) pack full weights: under FSDP the
        # gathered ones, whose parameter objects outlive each gather; a micro-batch's tokens are its rows
        packed += linear_numel * width * (int(recompute) + int(a.use_kl_loss)) * \
            keeps_packed_copy(getattr(torch, cfg.policy_dtype()), tokens)
        rows.append(Row("packed weight copies", packed, "model.device (CPU inference kernels)", phases=STEP_PHASES))
    s = cfg.speculative
    if s.enabled and s.method == "eagle":  # one decoder layer and the fc fusing (embedding, hidden state)
        drafter = layer_numel + 2 * H * H
        per = 4 * (1 + 1 + ADAM_STATES) if cfg.drafter_train.enabled else rollout_width
        draft_kv = _kv_bytes(cfg, m, responses, capacity, 1, graphs)  # its own one-layer cache, the target's length
        rows.append(Row("drafter", drafter * per + draft_kv + drafter * rollout_width * decode_packs,
                        "speculative.enabled"))
        # the speculator's record of the target's hidden states, per running row its whole length with the headroom
        # in the engine's dtype (Sequence.hidden_record, kept by the engine for its drafter), held while the rows decode
        rows.append(Row("hidden-state records", running * (P + R + headroom) * H * rollout_width,
                        "rollout.max_num_seqs or data.max_response_length", phases=("rollout",)))
        if cfg.drafter_train.enabled:  # hidden states kept from the rollout (bf16), FIFO-capped
            # a training batch's loss (tlt.drafter_train.trainer): the target's logits and softmax, fp32 [N, V]
            # each; per unrolled pass the drafter's logits, their log-softmax, the soft cross-entropy's product and
            # a gradient; pass a runs a passes laid end to end, with an [aT, aT] bool mask kept for the backward
            T, K = cfg.drafter_train.batch_tokens, cfg.drafter_train.ttt_steps
            train = T * ((2 + 4 * K) * V * 4 + per_layer * K * (K + 1) // 2)
            train += sum((a * T) ** 2 for a in range(2, K + 1))
            rows.append(Row("drafter training", train, "drafter_train.batch_tokens", phases=("drafter",)))
            steps = cfg.trainer.total_steps
            tokens = min(cfg.drafter_train.buffer_max_tokens, steps * responses * (R + 1))
            rows.append(Row("drafter buffer", tokens * H * 2, "drafter_train.buffer_max_tokens", phases=STEP_PHASES,
                            where="host" if on_cuda else "device"))  # kept on the host (tlt.drafter_train.buffer)
    return Plan(rows)


ENGINE_ROWS = ("rollout weights", "kv cache", "kv cache growth", "drafter", "drafter training", "drafter buffer",
               "hidden-state records")


def role_plans(cfg: Config, model_cfg: ModelConfig, trainer_ranks: int, replicas: int) -> dict[str, Plan]:
    """trainer.placement=disaggregated: {"trainer": one trainer GPU, "rollout": one rollout GPU} (docs/design.md
    §16). A trainer GPU holds memory_plan's rows at trainer_ranks without the engine's (its engine copy is in host
    memory, docs/design.md §13); a rollout GPU holds the replica's full copy in rollout.dtype, the KV cache of the
    data.train_batch_size * rollout.n / replicas responses it decodes, and the drafter with its training, which runs
    on a replica beside its KV cache (spot training while others decode; a disaggregated replica never sleeps)."""
    full = memory_plan(cfg, model_cfg, trainer_ranks)
    trainer = Plan([r for r in full.rows if r.name not in ENGINE_ROWS])
    for r in trainer.rows:
        if r.key == "more ranks (--world-size)":
            r.key = "more trainer GPUs (trainer.rollout_gpus, trainer.nnodes)"
    responses = -(-cfg.data.train_batch_size * cfg.rollout.n // replicas)
    with torch.device("meta"):
        numel = sum(p.numel() for p in Decoder(model_cfg).parameters())
    width = 2 if cfg.rollout_dtype() == "bfloat16" else 4
    engine = [r for r in memory_plan(cfg, model_cfg, 1, responses=responses).rows if r.name in ENGINE_ROWS[1:]]
    for r in engine:
        if r.name == "drafter training":
            r.phases = ("rollout", "drafter")
    key = "rollout.dtype=bfloat16" if width == 4 else "rollout.dtype (bfloat16 already: GPUs of more memory)"
    rollout = Plan([Row("rollout weights", numel * width, key)] + engine)
    return {"trainer": trainer, "rollout": rollout}


def _non_linear_numel(model: Decoder) -> int:
    """Parameters no matmul reads: norms, and the embedding when the LM head is its own matrix."""
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    return norms + (model.embed_tokens.weight.numel() if model.lm_head is not None else 0)


def _num_mini_batches(cfg: Config) -> int:
    return cfg.data.train_batch_size // (cfg.actor.ppo_mini_batch_size or cfg.data.train_batch_size)


def _model_config(cfg: Config, architecture: str | None = None) -> ModelConfig:
    path = architecture or cfg.model.path
    if path == "tiny-random":
        path = str(tiny_random_model_path())
    elif path is None:
        path = str(default_model_path())
    return read_config(path)


def _default_world(cfg: Config) -> int:
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    t = cfg.trainer
    if t.placement == "none":  # torchrun ranks, as verl's keys describe them
        return t.nnodes * t.n_gpus_per_node
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
    t = cfg.trainer
    if t.placement == "disaggregated":
        replicas = len(assign_bundles(t.placement, t.nnodes, t.n_gpus_per_node, t.rollout_gpus).rollout_bundles)
        plans = role_plans(cfg, model_cfg, world, replicas)
        heads = {"trainer": f"trainer GPU: actor.strategy={cfg.actor.strategy}, {world} rank(s), no engine",
                 "rollout": f"rollout GPU: one of {replicas} replica(s), "
                            f"{-(-cfg.data.train_batch_size * cfg.rollout.n // replicas)} responses each"}
    else:
        plans = {"device": memory_plan(cfg, model_cfg, world)}
        heads = {"device": f"actor.strategy={cfg.actor.strategy}, {world} rank(s), per device"}
    failed = []
    for role, plan in plans.items():
        print(f"{heads[role]}:")
        print(plan.table())
        if limit is not None and plan.total > limit:
            failed.append(_does_not_fit(role, plan, limit))
    for line in failed:
        print(line, file=sys.stderr)
    return 2 if failed else 0


def keeps_engine_caches(cfg: Config, device_memory: int | None) -> bool:
    """Whether a colocated replica keeps its KV caches and CUDA graphs between rollouts (rollout.free_cache_engine):
    as set, or where unset, where the device's memory (None: unknown) holds this config's memory plan, which counts
    the KV cache in every phase, the update's included."""
    setting = cfg.rollout.free_cache_engine
    if setting is not None:
        return not setting
    if device_memory is None:
        return False
    return memory_plan(cfg, _model_config(cfg), _default_world(cfg)).total <= device_memory


def _does_not_fit(role: str, plan: Plan, limit: int) -> str:
    peak = max(ALL_PHASES, key=plan.phase_bytes)
    big = max((r for r in plan.rows if r.where == "device" and peak in r.phases), key=lambda r: r.bytes)
    where = "per device" if role == "device" else f"per {role} GPU"
    return (f"tlt plan: {plan.total / 2**30:.2f} GiB {where} does not fit {limit / 2**30:.2f} GiB; the largest "
            f"part is {big.name} ({big.bytes / 2**30:.2f} GiB): change {big.key}")
