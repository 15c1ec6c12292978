"""Typed configuration for tlt: one dataclass per section, loaded from YAML plus dotted overrides.

    cfg = load_config("configs/gsm8k.yaml", ["trainer.total_steps=20", "rollout.n=8"])
    print(format_config(cfg))

Key names follow verl where the meaning matches (data.train_batch_size, rollout.n, actor.clip_ratio_low, ...).
Every field carries a one-line help string in its metadata; `config_reference_markdown()` renders them for the
README. Validation happens at load: unknown keys, wrong types and out-of-range values raise `ConfigError` with
a message that says what is allowed.
"""

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

import yaml

from tlt.bundles import assign_bundles, check_divides
from tlt.device import resolve_device, resolve_dtype
from tlt.schema import ConfigError, close_matches_hint, option, set_option, type_name
from tlt.speculative.config import SpecConfig

# the config `tlt train` runs with no CONFIG (the benchmarks too), shipped in the package
DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "default.yaml"

_f = option  # every field below: a default, a help string, optional bounds
__all__ = ["Config", "ConfigError", "SpecConfig", "load_config", "format_config", "save_config", "config_to_dict",
           "config_reference_markdown"]


@dataclass
class ModelConfig:
    path: str | None = _f(None, "HF model directory or hub-cache path; null = the embedded default model")
    dtype: Literal["auto", "float32", "bfloat16"] = _f("auto", "weight dtype; auto = bfloat16 on GPU, float32 on CPU")
    device: Literal["auto", "cpu", "cuda"] = _f("auto", "auto = cuda if available, else cpu")


@dataclass
class DataConfig:
    train_files: list[str] = _f([], "parquet/jsonl files with training prompts (verl schema or {prompt, answer})")
    val_files: list[str] = _f([], "parquet/jsonl files with validation prompts")
    prompt_key: str = _f("prompt", "column holding the prompt (chat messages or a string)")
    max_prompt_length: int = _f(512, "max prompt tokens after the chat template", ge=1)
    max_response_length: int = _f(256, "max generated tokens per response", ge=1)
    train_batch_size: int = _f(8, "prompts per RL step (each sampled rollout.n times)", ge=1)
    val_batch_size: int | None = _f(None, "prompts per validation batch; null = the whole validation set", ge=1)
    shuffle: bool = _f(True, "shuffle training prompts each epoch")
    seed: int = _f(0, "seed of the per-epoch shuffle")
    filter_overlong_prompts: bool = _f(True, "drop prompts longer than max_prompt_length (count is logged)")


@dataclass
class RolloutConfig:
    n: int = _f(4, "responses per prompt (GRPO group size)", ge=1)
    temperature: float = _f(1.0, "sampling temperature; 0 = greedy", ge=0)
    top_p: float = _f(1.0, "nucleus sampling mass, in (0, 1]", gt=0, le=1)
    top_k: int = _f(-1, "top-k sampling; -1 = off", ge=-1)
    max_num_seqs: int = _f(64, "max sequences decoded together per rollout worker", ge=1)
    recompute_logprobs: bool = _f(False, "recompute old log-probs with the trainer model instead of the engine's")
    dtype: Literal["auto", "float32", "bfloat16"] = _f(
        "auto", "weights the rollout engine decodes: bfloat16 with an fp32 policy = a bf16 copy refreshed after "
                "each update, old log-probs the trainer's (verl's bf16 rollouts of fp32 master weights; 1.6-2.2x "
                "faster decoding on CPUs with avx512_bf16); the policy's own dtype = the policy itself, shared; "
                "auto = bfloat16 where bf16 is fast (GPU, avx512_bf16/AMX CPUs), else the policy's own. Ray "
                "rollout workers decode in it too")
    enforce_eager: bool = _f(False, "on CUDA, run decode and verification forwards eagerly instead of replaying "
                                    "captured CUDA graphs (vLLM's switch; no effect on CPU)")
    free_cache_engine: bool | None = _f(
        None, "trainer.placement=colocated: true = after each rollout a replica frees its KV caches, and the CUDA "
              "graphs that read them, for the update's memory (verl's key), capturing them again at the next "
              "rollout; false keeps them; null = keep them where the GPU's memory holds the memory plan (tlt plan, "
              "which counts the KV cache in every phase), else free them")
    attention: Literal["auto", "sdpa", "flex"] = _f(
        "auto", "attention of decode and verification forwards: sdpa = over the KV cache's capacity (or the longest "
                "row) under a mask; flex = PyTorch FlexAttention with a block mask over each row's own cached keys "
                "(compiled on CUDA; eager and slow on CPU; opt-in); auto = sdpa. Captured CUDA graphs use flex only "
                "where a start-up probe over several shapes captures it, else sdpa")
    dynamic_sampling: bool = _f(False, "DAPO: drop groups whose rewards are all equal")
    overlong_filter: bool = _f(False, "mask out responses truncated at max_response_length from the loss")
    replica_timeout_s: float | None = _f(None, "Ray rollout replicas: seconds one generate call may run before its "
                                               "replica is treated as dead (killed; its prompts rerun elsewhere); "
                                               "null = wait forever", gt=0)


@dataclass
class ActorConfig:
    lr: float = _f(1e-6, "policy learning rate", ge=0)
    weight_decay: float = _f(0.0, "AdamW weight decay", ge=0)
    betas: list[float] = _f([0.9, 0.999], "AdamW betas [beta1, beta2]")
    warmup_steps: int = _f(0, "linear lr warm-up steps", ge=0)
    lr_scheduler: Literal["constant", "cosine"] = _f("constant", "lr schedule after warm-up")
    policy_loss: str = _f("vanilla", "registered policy loss (tlt.rl.losses): vanilla = PPO's clipped surrogate per "
                                     "token; gspo = one clipped ratio per response (GSPO; aggregated per response; "
                                     "use clip ratios ~3e-4 / 4e-4)")
    clip_ratio_low: float = _f(0.2, "PPO clip: ratio >= 1 - clip_ratio_low", ge=0)
    clip_ratio_high: float = _f(0.28, "PPO clip: ratio <= 1 + clip_ratio_high (DAPO clip-higher)", ge=0)
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = _f(
        "token-mean", "how token losses are averaged (verl agg_loss)")
    use_kl_loss: bool = _f(False, "add a KL-to-reference loss term")
    kl_loss_coef: float = _f(0.001, "weight of the KL loss", ge=0)
    kl_loss_type: Literal["k1", "k2", "k3", "low_var_kl"] = _f("k3", "KL estimator; k3 = low_var_kl")
    entropy_coeff: float = _f(0.0, "entropy bonus weight (loss -= entropy_coeff * entropy)", ge=0)
    grad_clip: float = _f(1.0, "max global grad norm", gt=0)
    ppo_epochs: int = _f(1, "passes over each step's rollouts", ge=1)
    ppo_mini_batch_size: int | None = _f(None, "prompts per optimiser step; null = train_batch_size", ge=1)
    ppo_max_token_len: int = _f(4096, "token budget of one micro-batch (gradient accumulation); rows are sorted by "
                                          "length and split with the least padding", ge=1)
    share_prompt: bool = _f(True, "update: forward a group's prompt once for several of its responses (packed rows, "
                                  "each response sees the prompt and itself; exact)")
    bf16_autocast: bool = _f(True, "bf16 autocast for the policy forward/backward where bf16 is fast (GPU, "
                                   "avx512_bf16/AMX CPUs)")
    strategy: Literal["ddp", "fsdp"] = _f("ddp", "data parallelism: ddp = full replicas, gradients all-reduced; fsdp = "
                                                "FSDP2 shards (parameters, gradients, optimiser state split over "
                                                "ranks; launch with torchrun; the rollout engine keeps a full "
                                                "copy, synced from the shards)")
    gradient_checkpointing: bool = _f(False, "recompute each decoder layer's activations in the backward (less memory, "
                                             "~1 more forward)")
    logprob_chunk_tokens: int | None = _f(None, "run the LM head and log-softmax on this many response tokens at a "
                                                "time, recomputed in the backward: one chunk's [tokens, vocab] fp32 "
                                                "tensors instead of the micro-batch's (long responses); null = all "
                                                "at once", ge=1)
    fsdp_offload: bool = _f(False, "strategy=fsdp: keep parameter, gradient and optimiser shards in CPU memory "
                                   "(FSDP2 CPUOffloadPolicy; CUDA only)")
    on_policy_logprobs: bool = _f(True, "the first mini-batch of the first epoch (the whole update when ppo_epochs=1 "
                                        "and one mini-batch) takes its old log-probs from its own forward, detached: "
                                        "the ratio is exactly 1 there and no separate old-log-prob pass runs for it "
                                        "(as verl's on-policy path and TRL's GRPOTrainer); false = the engine's or a "
                                        "recompute pass's")


@dataclass
class AlgorithmConfig:
    adv_estimator: str = _f("grpo", "registered advantage estimator (tlt.rl.advantages): grpo, rloo")
    norm_adv_by_std_in_grpo: bool = _f(True, "divide GRPO advantages by the group std (false = Dr.GRPO)")


@dataclass
class RewardConfig:
    format_weight: float = _f(0.0, "weight of the answer-format reward added to the task reward")
    timeout_s: float = _f(5.0, "hard timeout of a reward function per response (its worker process is killed); a "
                               "timeout scores 0", gt=0)
    num_workers: int = _f(4, "reward worker processes (started at the first step, reused); 0 = score in the "
                             "trainer's process, where a hung scorer cannot be killed and a crash ends the run", ge=0)
    custom_function: str | None = _f(None, "path/to/file.py:function used for every data_source")
    errors_fatal: bool = _f(False, "raise on a reward-function error instead of scoring 0")


@dataclass
class DrafterTrainConfig:
    enabled: bool = _f(True, "train the drafter online on idle rollout workers")
    lr: float = _f(3e-4, "drafter learning rate", ge=0)
    every_k_steps: int = _f(1, "train the drafter every k RL steps", ge=1)
    min_buffer_tokens: int = _f(4096, "buffered tokens needed before the drafter trains", ge=0)
    buffer_max_tokens: int = _f(2_000_000, "FIFO cap of the hidden-state buffer, in tokens", ge=1)
    window_len: int = _f(512, "training window length over long responses", ge=1)
    batch_tokens: int = _f(8192, "tokens per packed drafter batch", ge=1)
    ttt_steps: int = _f(1, "unrolled passes a drafter training step, online and in the warm-up (training-time test: "
                           "pass k feeds the drafter its own features, as drafting depth k does); a step costs "
                           "3.4x a teacher-forced one at 3 and its masks grow as (K x batch_tokens)^2 bytes: lower "
                           "batch_tokens with it; K > 1 builds its own warm-up drafter once; 1 = teacher-forced "
                           "only (docs/design.md §2)", ge=1)
    ckpt_every: int = _f(50, "checkpoint trainable drafter params every N drafter steps", ge=1)
    offset_sampling: bool = _f(True, "mix the previous step's long responses into training (one-step offset)")
    holdout_fraction: float = _f(0.05, "fraction of samples held out for acceptance metrics", ge=0, le=0.5)
    compare_drafters: bool = _f(True, "score online vs frozen warm-start vs n-gram drafters on each step's "
                                      "held-out responses (drafter/compare/*)")
    warmup_num_prompts: int = _f(256, "warm-up drafter (built once and cached when speculative.model is null with "
                                      "the default model): training prompts, the first N of the run's train file "
                                      "(the default task's for the default data)", ge=1)
    warmup_samples_per_prompt: int = _f(1, "warm-up drafter: the target's samples per prompt and temperature", ge=1)
    warmup_max_tokens: int = _f(128, "warm-up drafter: max tokens per sample", ge=1)
    warmup_steps: int = _f(200, "warm-up drafter: optimiser steps", ge=1)
    warmup_temperatures: list[float] | None = _f(None, "warm-up drafter: sampling temperatures; null = the run's "
                                                       "rollout.temperature, the law its drafts must hold")
    spot: bool | None = _f(
        None, "in-process runs: true = train the drafter on the steps so far in a thread alongside the next rollout, "
                "on compute the rollout leaves idle (TLT's spot training; published after that rollout, so drafts "
                "lag one more step); false = after the policy update, paid on top of the step; null = true when the "
                "model is on CPU and the processes' torch threads leave a core idle")


@dataclass
class TrainerConfig:
    total_steps: int = _f(20, "RL steps to run", ge=1)
    save_freq: int = _f(10, "checkpoint every N steps; -1 = only at the end", ge=-1)
    save_drafter_buffer: bool = _f(True, "save the online drafter's hidden-state buffer with each checkpoint, so "
                                         "a resumed run trains the very drafter an uninterrupted one would (size: "
                                         "buffered tokens x hidden size x 2 bytes); false = it refills after a resume")
    max_ckpt_to_keep: int | None = _f(None, "keep the newest N checkpoints that verify (older ones that verify are "
                                            "deleted once a new one is complete; damaged ones are kept, uncounted); "
                                            "null = keep all", ge=1)
    test_freq: int = _f(10, "validate every N steps; -1 = never", ge=-1)
    project_name: str = _f("tlt", "project name for loggers")
    experiment_name: str = _f("default", "run name; outputs go to default_local_dir/experiment_name")
    default_local_dir: str = _f("runs", "root directory of run outputs")
    logger: list[Literal["console", "jsonl", "tensorboard", "wandb"]] = _f(
        ["console", "jsonl"], "metric sinks")
    resume: str = _f("auto", "disable | auto (the newest checkpoint in the run dir that verifies; newer damaged "
                             "ones are skipped with a warning) | a checkpoint path (verified: a damaged one is an error)")
    seed: int = _f(0, "global seed (torch, sampling)")
    num_rollout_workers: int = _f(1, "rollout replicas", ge=1)
    use_ray: bool = _f(False, "run rollout workers as Ray actors")
    placement: Literal["none", "colocated", "disaggregated"] = _f(
        "none", "GPU placement of the trainer ranks and Ray rollout replicas (one Ray placement group of nnodes * "
                "n_gpus_per_node one-GPU bundles; `tlt train` launches the trainer ranks as Ray actors, without "
                "torchrun): colocated = a trainer rank and a replica on every GPU (half each; the replica frees its "
                "KV cache between rollouts); disaggregated = replicas (and their spot drafter training) on the last "
                "rollout_gpus GPUs, trainer ranks on the rest; none = no placement group (torchrun launches the "
                "ranks; num_rollout_workers replicas, one GPU each on CUDA)")
    nnodes: int = _f(1, "nodes: of the Ray cluster the placement group spans; placement=none: of the torchrun "
                        "launch (checked against WORLD_SIZE when > 1 GPU; verl's trainer.nnodes)", ge=1)
    n_gpus_per_node: int = _f(1, "GPUs used on each node: bundles of the placement group, or torchrun's "
                                 "--nproc_per_node with placement=none (verl's trainer.n_gpus_per_node)", ge=1)
    rollout_gpus: int | None = _f(None, "placement=disaggregated: GPUs for rollout replicas; null = half", ge=1)
    retain_freed_memory: bool | None = _f(
        None, "keep host memory the policy update frees in the trainer process for reuse (glibc: large blocks from "
              "the heap, never trimmed) instead of page-faulting GBs back from the OS every micro-batch, and back "
              "tensors of 2 MiB or more with transparent huge pages (THP_MEM_ALLOC_ENABLE, unless set); resident "
              "memory stays near the largest peak so far, plus fragmentation; null = true when the policy is on CPU "
              "(docs/design.md §10)")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    speculative: SpecConfig = field(default_factory=SpecConfig)  # tlt.speculative.config
    drafter_train: DrafterTrainConfig = field(default_factory=DrafterTrainConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    def engine_args(self) -> dict[str, Any]:
        """tlt.LLM's engine arguments for an engine that samples this config's rollouts (the trainer's, the
        run summary's plain twin, `tlt eval`'s, the Ray replicas')."""
        return {"max_num_seqs": self.rollout.max_num_seqs,
                "max_model_len": self.data.max_prompt_length + self.data.max_response_length,
                "seed": self.trainer.seed, "enforce_eager": self.rollout.enforce_eager,
                "attention": self.rollout.attention}

    def policy_dtype(self) -> str:
        """The trainer's weights: fp32 master weights unless model.dtype=bfloat16 (model.dtype=auto means fp32
        for training, where tlt.LLM would pick bf16 on bf16-capable hardware: AdamW's ~1e-6 updates vanish in bf16)."""
        return "bfloat16" if self.model.dtype == "bfloat16" else "float32"

    def rollout_dtype(self) -> str:
        """The weights the rollout engine (in process or on Ray workers) decodes: rollout.dtype; auto = bf16 where
        bf16 is fast on model.device (GPU, CPUs with avx512_bf16/AMX), as verl rolls out fp32 master weights in
        bf16, else the policy's own."""
        if self.rollout.dtype != "auto":
            return self.rollout.dtype
        fast_bf16 = resolve_dtype("auto", resolve_device(self.model.device)) == torch.bfloat16
        return "bfloat16" if fast_bf16 else self.policy_dtype()


SECTIONS: dict[str, type] = {f.name: f.type for f in dataclasses.fields(Config)}


def _unknown_key(name: str, valid: list[str], where: str, source: str) -> ConfigError:
    hint = close_matches_hint(name, valid)
    elsewhere = [s for s, cls in SECTIONS.items() if name in {f.name for f in dataclasses.fields(cls)}]
    if elsewhere and where != "top level":
        hint += f" '{name}' exists in section(s): {', '.join(elsewhere)}."
    return ConfigError(f"unknown config key '{name}' in {where} ({source}).{hint} Valid keys: {', '.join(valid)}")


def _set(cfg: Config, key: str, value: Any, source: str) -> None:
    """Set cfg.<section>.<name> = value after checking the key, the type and the range."""
    parts = key.split(".")
    section_name = parts[0]
    if section_name not in SECTIONS:
        raise _unknown_key(section_name, list(SECTIONS), "top level", source)
    section = getattr(cfg, section_name)
    fields = {f.name: f for f in dataclasses.fields(section)}
    if len(parts) != 2:
        raise ConfigError(f"config key '{key}' ({source}) must be <section>.<key>, e.g. "
                          f"{section_name}.{next(iter(fields))}; valid keys: {', '.join(fields)}")
    if parts[1] not in fields:
        raise _unknown_key(parts[1], list(fields), f"section '{section_name}'", source)
    set_option(section, key, value, source)


def _validate(cfg: Config) -> None:
    """Checks that involve several keys."""
    d, a, s = cfg.data, cfg.actor, cfg.speculative
    if a.ppo_mini_batch_size is not None and d.train_batch_size % a.ppo_mini_batch_size != 0:
        raise ConfigError(f"actor.ppo_mini_batch_size={a.ppo_mini_batch_size} must divide "
                          f"data.train_batch_size={d.train_batch_size}")
    if len(a.betas) != 2 or not all(0 <= b < 1 for b in a.betas):
        raise ConfigError(f"actor.betas={a.betas} must be two numbers in [0, 1), e.g. [0.9, 0.999]")
    temps = cfg.drafter_train.warmup_temperatures
    if temps is not None and (not temps or not all(t >= 0 for t in temps)):
        raise ConfigError(f"drafter_train.warmup_temperatures={temps} must be a non-empty list of temperatures >= 0 "
                          "(0 = greedy, as rollout.temperature), e.g. [1.0]")
    if s.enabled:
        s.validate(prefix="speculative.")
        if s.seed != 0:
            raise ConfigError(f"speculative.seed={s.seed}: a run seeds speculative decoding from trainer.seed; set "
                              "trainer.seed instead")
    if cfg.trainer.placement != "none":
        _validate_placement(cfg)
    fn = cfg.reward.custom_function
    if fn is not None and (":" not in fn or not fn.rsplit(":", 1)[0].endswith(".py")):
        raise ConfigError(f"reward.custom_function={fn!r} must look like 'path/to/file.py:function_name'")


def _validate_placement(cfg: Config) -> None:
    t = cfg.trainer
    a = assign_bundles(t.placement, t.nnodes, t.n_gpus_per_node, t.rollout_gpus)
    if t.num_rollout_workers not in (1, len(a.rollout_bundles)):
        raise ConfigError(f"trainer.num_rollout_workers={t.num_rollout_workers} but trainer.placement={t.placement} "
                          f"runs one replica per rollout GPU ({len(a.rollout_bundles)}): leave it at 1")
    check_divides(a, cfg.data.train_batch_size, cfg.rollout.n)


# ---------------------------------------------------------------- public API


def load_config(yaml_path: str | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults <- YAML file <- `section.key=value` overrides (values parsed as YAML scalars/lists)."""
    cfg = Config()
    if yaml_path is not None:
        try:
            with open(yaml_path) as fh:
                raw = yaml.safe_load(fh) or {}
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {yaml_path}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {yaml_path} is not valid YAML: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {yaml_path} must be a mapping of sections, got {type(raw).__name__}")
        for section_name, values in raw.items():
            if section_name not in SECTIONS:
                raise _unknown_key(str(section_name), list(SECTIONS), "top level", yaml_path)
            if values is None:
                continue
            if not isinstance(values, dict):
                raise ConfigError(f"section '{section_name}' in {yaml_path} must be a mapping of key: value")
            for name, value in values.items():
                _set(cfg, f"{section_name}.{name}", value, yaml_path)
    for item in overrides or []:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override '{item}' must look like section.key=value, e.g. rollout.n=8")
        try:
            value = yaml.safe_load(text) if text.strip() else ""
        except yaml.YAMLError:
            value = text  # not YAML: keep the raw string and let the type check decide
        _set(cfg, key.strip(), value, f"override '{item}'")
    _validate(cfg)
    return cfg


def config_to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    return dataclasses.asdict(cfg)


def format_config(cfg: Config) -> str:
    """The resolved config as YAML text: one line per key, sections in declaration order."""
    lines = []
    for section_name, values in config_to_dict(cfg).items():
        lines.append(f"{section_name}:")
        for key, value in values.items():
            text = yaml.safe_dump({key: value}, default_flow_style=True, width=10_000).strip()
            lines.append(f"  {text[1:-1]}")  # strip the braces of the one-key flow mapping
    return "\n".join(lines) + "\n"


def save_config(cfg: Config, path: str) -> None:
    with open(path, "w") as fh:
        fh.write(format_config(cfg))


def config_reference_markdown() -> str:
    """A markdown table per section: key, type, default, description (from field metadata)."""
    lines = []
    for section_name, cls in SECTIONS.items():
        lines += [f"### `{section_name}`", "", "| key | type | default | description |", "|---|---|---|---|"]
        defaults = cls()
        for f in dataclasses.fields(cls):
            default = yaml.safe_dump(getattr(defaults, f.name), default_flow_style=True).strip()
            default = default.removesuffix("...").strip()
            shown_type = type_name(f.type).replace("|", "\\|")
            lines.append(f"| `{section_name}.{f.name}` | {shown_type} | `{default}` | {f.metadata['help']} |")
        lines.append("")
    return "\n".join(lines)
