"""GRPO-family RL trainer: rollout (tlt.LLM, optionally speculative) -> reward -> advantages -> policy update.

    tlt train                                          # the out-of-the-box run: tlt/configs/default.yaml
    tlt train configs/smoke.yaml                       # one-minute run on a tiny random model (no downloads)
    torchrun --nproc_per_node 2 -m tlt train configs/smoke.yaml      # data parallel (gloo on CPU, NCCL on GPU)
    tlt train CONFIG trainer.placement=colocated trainer.n_gpus_per_node=8   # ranks as Ray actors on a placement

One step, as `fit()` reads: take data.train_batch_size prompts (each data-parallel rank rolls out its share),
sample rollout.n responses per prompt, score them, compute advantages, take the old log-probs, run
actor.ppo_epochs x mini-batches of updates, log, validate and checkpoint when due (docs/design.md §10).
The trainer keeps fp32 master weights; the engine decodes rollout.dtype (auto: a bf16 copy where bf16 is fast,
refreshed after every update; else the very Decoder the optimiser updates). Old log-probs: the first mini-batch's
own forward, detached (actor.on_policy_logprobs); later ones recomputed when the engine decodes a copy, else the
engine's (the target's). Losses are normalised by global token counts, so N ranks take the step one process takes.
With eagle SD and one rollout worker the drafter trains online in this process (tlt.drafter_train.online).
model.path=null is the default SmolLM2 model; model.path=tiny-random builds a tiny random Llama once.
actor.strategy=fsdp: FSDP2 shards, each rank reading only its rows of the checkpoint; each rank's engine copy is
refreshed from the shards unit by unit (tlt.rl.weight_sync, §12). trainer.placement: the ranks are Ray actors and
rank 0 rolls out every rank's prompts on the placed replicas (tlt.rl.launch, tlt.workers.trainer_group, §13).
Outputs go to <trainer.default_local_dir>/<project_name>/<experiment_name>/: metrics.jsonl (step 0 = held-out
accuracy before training), response_lengths.jsonl, tensorboard/, global_step_N/ checkpoints (tlt.rl.checkpoint;
trainer.resume=auto resumes the newest complete one exactly), sd_compare.json and report.html (tlt.rl.run_summary).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from tlt.config import DEFAULT_CONFIG, Config, ConfigError, format_config, load_config
from tlt.device import DTYPES, huge_pages_for_host_tensors, retain_freed_host_memory, usable_cpus
from tlt.drafter_train.hook import DrafterHook
from tlt.engine.outputs import RequestOutput
from tlt.faults import fault_point
from tlt.prompts import load_examples
from tlt.rl.preflight import check_run, claim_run_dir
from tlt.rl import fsdp
from tlt.rl.actor import Actor
from tlt.rl.advantages import compute_advantages, groups_to_keep, keep_mask
from tlt.rl.checkpoint import (CheckpointManager, CheckpointSpaceError, TrainerState, capture_rng_state,
                               copy_hf_side_files, load_trainer_state, restore_rng_state, tensor_bytes)
from tlt.rl.data import PromptDataset
from tlt.rl.launch import (DistInfo, check_launch, check_ranks, config_device, gather, init_distributed,
                           prepare_config, train_on_placement)
from tlt.rl.logging import MetricsLogger, PhaseTimer, flat_numbers, reduce_metrics, rollout_metrics
from tlt.rl.rewards import RewardManager
from tlt.rl.rollout import ActorBatch, RolloutBatch, generate_rollouts, rollout_request
from tlt.rl.sharded_checkpoint import SHARDS_DIR, consolidated, load_sharded, save_sharded, shard_bytes
from tlt.rl.weight_sync import SyncStats, rollout_copy, rollout_state_dict, sync_weights

if TYPE_CHECKING:
    from tlt.models.decoder import Decoder

MAX_GEN_BATCHES = 4  # DAPO dynamic sampling: rollout rounds per step before training on what was kept
__all__ = ["GRPOTrainer", "DistInfo", "check_launch", "prepare_config", "spot_training", "run_rank", "main"]


class GRPOTrainer:
    phase_timer = PhaseTimer  # each step's phase timer: a benchmark may measure more per phase (tlt.bench.memory)

    def __init__(self, cfg: Config, drafter_hook: DrafterHook | None = None, placed: bool = False):
        """placed: this process is a trainer rank that trainer.placement launched (tlt.workers.trainer_group)."""
        from tlt.llm import LLM
        from tlt.models.loader import load_tokenizer

        check_run(cfg)  # every input checked before any expensive work (tlt.rl.preflight)
        device = config_device(cfg)
        self.cfg, self.dist = cfg, init_distributed(device.type, single_rank=cfg.actor.strategy == "fsdp")
        # the run directory locked (placed ranks: by their launcher), the checkpoint to resume from verified
        self.run_dir_claim = claim_run_dir(cfg, owner=self.dist.is_main and not placed)
        if cfg.actor.strategy == "fsdp" and not dist.is_initialized():
            raise ConfigError("actor.strategy=fsdp needs torch.distributed: launch with torchrun, e.g. `torchrun "
                              "--nproc_per_node 2 -m tlt train CONFIG ...`; for one plain process set "
                              "actor.strategy=ddp")
        check_launch(cfg.trainer, self.dist.world_size, placed)
        self.placed = placed
        # a disaggregated trainer rank's GPU holds no engine: the replicas decode and validate on GPUs of their own,
        # and the rank's own engine copy stays in host memory (docs/design.md §13)
        self.engine_on_host = placed and cfg.trainer.placement == "disaggregated"
        self.prompts_per_rank, self.num_mini_batches = check_ranks(cfg, self.dist.world_size)
        prepare_config(cfg, self.dist)
        if self.dist.is_main:
            print(format_config(cfg), flush=True)  # resolved: the default model, data and drafter filled in
        d, t = cfg.data, cfg.trainer
        self.device = torch.device("cuda", self.dist.local_rank) if device.type == "cuda" else device
        torch.manual_seed(t.seed)
        self.run_dir = Path(t.default_local_dir) / t.project_name / t.experiment_name
        self.ckpt = CheckpointManager(self.run_dir, t.max_ckpt_to_keep)
        resume_dir = self.run_dir_claim.resume_dir
        if resume_dir and cfg.actor.strategy == "fsdp" and not (resume_dir / SHARDS_DIR / ".metadata").is_file():
            raise ConfigError(f"trainer.resume: {resume_dir} was saved by an actor.strategy=ddp run (no sharded "
                              f"{SHARDS_DIR}/); resume it with actor.strategy=ddp, or start an fsdp run from its "
                              f"weights with model.path={resume_dir} trainer.resume=disable")
        dtype = DTYPES[cfg.policy_dtype()]

        self.tokenizer = load_tokenizer(cfg.model.path)
        self.model = self._load(resume_dir or cfg.model.path, dtype)
        # the reference policy is the initial model, also after a resume (model.path, not the checkpoint)
        self.ref_model = self._load(cfg.model.path, dtype, trainable=False) if cfg.actor.use_kl_loss else None
        self.train_data = PromptDataset.from_config(d, self.tokenizer, "train")
        self.val_examples = load_examples(d.val_files, self.tokenizer, d.prompt_key, d.max_prompt_length,
                                          d.filter_overlong_prompts)[0] if d.val_files else []
        self.rewards = RewardManager(cfg.reward)
        self.actor = Actor(self.model, cfg.actor, t.total_steps, self.device)
        self.rollout_model = self._rollout_model()  # self.model, or a copy in rollout.dtype filled from the policy
        self.step_sync = SyncStats()  # the weight syncs of the current step (engine copy and Ray replicas)
        self.llm = LLM(model=self.rollout_model, tokenizer=self.tokenizer, speculative_config=self._speculative_config(),
                       **cfg.engine_args())
        self.drafter_hook = drafter_hook or self._default_drafter_hook()
        self.rollout_engine = self._rollout_engine()  # self.llm, or rollout replicas with spot drafter training
        self.start_step = self._resume(resume_dir) if resume_dir else 0
        self.logger = MetricsLogger(t, self.run_dir, t.total_steps, self.start_step, self.dist.is_main, cfg)

    # ---------------------------------------------------------------- the loop

    def fit(self) -> dict[str, Any]:
        cfg, t = self.cfg, self.cfg.trainer
        metrics: dict[str, float] = {}
        start = time.perf_counter()
        initial_val = {}
        if self.start_step == 0 and t.test_freq > 0 and self.val_examples:  # verl's val_before_train
            initial_val = self.validate()
            self.logger.log(0, initial_val, advance=False)
        for step in range(self.start_step + 1, t.total_steps + 1):
            timer = self.phase_timer()
            with timer("step"):
                self.step_sync = SyncStats()
                self.drafter_hook.before_rollout(step)
                rollout, outputs, step_metrics = self.collect_rollouts(step, timer)
                self.drafter_hook.rollout_done(step)  # work alongside the rollout yields to the update
                fault_point("rollout", step)
                adv = compute_advantages(rollout.scores, rollout.group_ids, cfg.algorithm)
                batch = rollout.to_actor_batch(adv.values, self.loss_mask(rollout, adv.valid_mask),
                                               cfg.rollout.temperature, self.device)
                engine_log_probs = batch.old_log_probs.clone()
                with timer("old_log_prob"):
                    trainer_rows = self.old_log_probs(batch)
                if self.ref_model is not None:
                    with timer("ref"):
                        batch.ref_log_probs = self.actor.compute_log_probs(batch, self.ref_model)
                with timer("update_actor"):
                    step_metrics.update(self.actor.update(batch, self.num_mini_batches))
                with timer("weight_sync"):
                    self.sync_rollout_weights()
                step_metrics.update(self.step_sync.metrics())
                fault_point("update", step)
                step_metrics.update(self.logprob_diff(batch, engine_log_probs, trainer_rows))
                with timer("drafter"):
                    step_metrics.update(self.drafter_hook.after_rollout(step, rollout, outputs))
                if t.test_freq > 0 and self.val_examples and (step % t.test_freq == 0 or step == t.total_steps):
                    with timer("testing"):
                        step_metrics.update(self.validate())
            metrics = self.step_metrics(step_metrics, timer, rollout, adv.values)
            self.logger.log(step, metrics)
            self.logger.log_lengths(step, sum(gather(rollout.response_lengths, self.dist), []))
            # after the step's metrics are written: a kill in between re-runs the step, never loses its row
            if step == t.total_steps or (t.save_freq > 0 and step % t.save_freq == 0):
                self.save_checkpoint(step)
        self.logger.close()
        self.rewards.close()  # stops the reward worker processes
        if self.rollout_engine is not self.llm:
            self.adopt_published_drafter()
            self.rollout_engine.close()
        return {"steps": t.total_steps, "start_step": self.start_step, "wall_s": round(time.perf_counter() - start, 2),
                "final_score_mean": metrics.get("critic/score/mean"),
                "initial_val_accuracy": initial_val.get("val/accuracy"), "final_val_accuracy": metrics.get("val/accuracy"),
                "drafter_version": metrics.get("drafter/version"),
                "checkpoint": str(self.ckpt.step_dir(t.total_steps)), "run_dir": str(self.run_dir)}

    # ---------------------------------------------------------------- phases

    def collect_rollouts(self, step: int, timer: PhaseTimer
                         ) -> tuple[RolloutBatch, list[RequestOutput], dict[str, float]]:
        """This rank's share of the step's prompt groups, sampled and scored.

        With rollout.dynamic_sampling (DAPO) groups whose rewards are all equal are dropped and more prompts are
        sampled until the ranks together hold train_batch_size groups or MAX_GEN_BATCHES rounds have run.
        """
        r, rank, per = self.cfg.rollout, self.dist.rank, self.prompts_per_rank
        if self.llm.spec is not None:
            self.llm.spec.reset_stats()  # spec acceptance figures per step, not cumulative
        engine_before = self.llm.stats()
        kept: list[RolloutBatch] = []
        outputs: list[RequestOutput] = []
        reward_metrics: list[dict[str, float]] = []
        num_kept = num_dropped = attempt = 0
        while True:
            prompts, params = rollout_request(self.train_data.next_batch(), self.cfg, step, attempt, rank, per,
                                              self.drafter_hook.wants_hidden_states)
            first_group = attempt * self.cfg.data.train_batch_size + rank * per
            with timer("gen"):
                if self.rollout_engine is not self.llm:  # replicas hold their own copy of the policy
                    # once a step (DAPO's further attempts roll out the same policy), by the ranks that send it
                    # (placed: rank 0) and, under FSDP, by every rank (the gather is collective)
                    sends = self.dist.is_main or not self.placed
                    if attempt == 0 and (sends or self.cfg.actor.strategy == "fsdp"):
                        state, stats = rollout_state_dict(self.model, DTYPES[self.cfg.rollout_dtype()])
                        self.rollout_engine.set_policy_weights(state)
                        self.step_sync += stats
                    self.rollout_engine.rl_step = step
                batch, outs = generate_rollouts(self.rollout_engine, prompts, params, first_group)
                if self.rollout_engine is not self.llm:
                    reward_metrics.append(self.rollout_engine.last_report.metrics())
            with timer("reward"):
                result = self.rewards.score(batch.examples, batch.texts)
            batch.scores = result.scores
            reward_metrics.append(result.metrics)
            outputs += outs
            attempt += 1
            if not r.dynamic_sampling:
                kept.append(batch)
                break
            keep = groups_to_keep(batch.group_ids, batch.scores)
            num_dropped += len(prompts) - len(keep)
            kept.append(batch.select(keep_mask(batch.group_ids, keep).tolist()))
            num_kept += len(keep)
            total = sum(gather(min(num_kept, per), self.dist))
            if total >= self.cfg.data.train_batch_size or attempt >= MAX_GEN_BATCHES:
                break
        rollout = RolloutBatch.concat(kept).first_groups(per)
        engine_after = self.llm.stats()
        reward_totals = {"reward/total_errors": reward_metrics[-1]["reward/total_errors"]}  # a running count
        sampling = {"data/num_gen_batches": float(attempt), "data/num_dropped_groups": float(num_dropped)}
        metrics = reduce_metrics(reward_metrics) | reward_totals | sampling
        engine_before = flat_numbers("", engine_before)  # nested counters (decode_time_upto_bs/k) too
        for k, v in flat_numbers("", engine_after).items():
            before = engine_before.get(k)
            delta = isinstance(before, (int, float)) and not k.startswith("spec_")
            metrics[f"rollout/{k}"] = v - before if delta else v
        return rollout, outputs, metrics

    def loss_mask(self, rollout: RolloutBatch, valid: torch.Tensor) -> torch.Tensor:
        """[N] bool: responses that count in the loss (valid reward; not truncated under the overlong filter)."""
        if not self.cfg.rollout.overlong_filter:
            return valid
        return valid & torch.tensor([f != "length" for f in rollout.finish_reasons], dtype=torch.bool)

    def old_log_probs(self, batch: ActorBatch) -> list[int]:
        """Recompute the old log-probs the engine's cannot stand for, and return every row whose old log-probs are
        the trainer's. The engine's are the old policy's when it decodes the policy's own weights. The first
        mini-batch's come free from the update's own forward (actor.on_policy_logprobs; the ratio is exactly 1
        there, as in verl and TRL); with rollout.recompute_logprobs, or an engine copy in another dtype, the other
        rows are recomputed here."""
        on_policy = self.actor.on_policy_rows(batch, self.num_mini_batches)
        if not (self.cfg.rollout.recompute_logprobs or self.rollout_model is not self.model):
            return on_policy
        skip = set(on_policy)
        rows = [i for i in range(len(batch)) if i not in skip]
        if rows or self.actor.sharded:  # FSDP: a rank with no rows still joins the others' gathers
            sub = batch.rows(rows)
            batch.old_log_probs[rows, :sub.old_log_probs.shape[1]] = self.actor.compute_log_probs(sub)
        return sorted(on_policy + rows)

    def logprob_diff(self, batch: ActorBatch, engine: torch.Tensor, rows: list[int]) -> dict[str, float]:
        """How far the engine's log-probs are from the trainer's over `rows`, those the trainer scored (rollout vs
        training numerics: dtype, kernels, batching); call after the update, which fills the on-policy rows."""
        if not rows:
            return {}
        valid = torch.arange(batch.old_log_probs.shape[1], device=self.device)[None] < batch.response_lens[rows, None]
        diff = (batch.old_log_probs[rows] - engine[rows]).abs()[valid]
        return {"rollout/logprob_max_diff": float(diff.max()) if diff.numel() else 0.0,
                "rollout/logprob_mean_diff": float(diff.mean()) if diff.numel() else 0.0}

    def validate(self) -> dict[str, float]:
        """Greedy accuracy on the validation set (rank 0 only; other ranks return nothing)."""
        if not self.dist.is_main:
            return {}
        from tlt.rl.evaluate import evaluate
        # disaggregated: on the rollout replicas (rank 0 owns them), whose GPUs hold the current policy
        engine = self.rollout_engine.owner if self.engine_on_host else self.llm
        res = evaluate(engine, self.val_examples, self.rewards, n=1, temperature=0.0,
                       max_tokens=self.cfg.data.max_response_length, seed=self.cfg.trainer.seed,
                       batch_size=self.cfg.data.val_batch_size)
        return {"val/accuracy": res.accuracy, "val/response_length/mean": res.response_length_mean}

    def step_metrics(self, metrics: dict[str, float], timer: PhaseTimer, rollout: RolloutBatch,
                     advantages: torch.Tensor) -> dict[str, float]:
        """Reduce over ranks and add the response statistics, timings and throughput."""
        local = (rollout.scores, advantages.tolist(), rollout.response_lengths, rollout.prompt_lengths,
                 [f == "length" for f in rollout.finish_reasons])
        ranks = gather((metrics | timer.metrics(), local), self.dist)
        out = reduce_metrics([m for m, _ in ranks])
        cols = [sum((part[i] for _, part in ranks), []) for i in range(5)]
        cols[0] = [0.0 if s is None else s for s in cols[0]]
        out.update(rollout_metrics(*cols))
        num_tokens = sum(cols[2]) + sum(cols[3])
        out["throughput/tokens_per_s"] = num_tokens / max(out["timing_s/step"], 1e-9)
        out["timing_s/rollout_fraction"] = out.get("timing_s/gen", 0.0) / max(out["timing_s/step"], 1e-9)
        out["data/num_filtered_prompts"] = float(self.train_data.num_filtered)
        return out

    # ---------------------------------------------------------------- setup, checkpoints

    def _load(self, path: str | Path, dtype: torch.dtype, trainable: bool = True) -> Decoder:
        """The model at `path` on this rank's device: under actor.strategy=fsdp its shards only, each rank reading
        its rows of the checkpoint (tlt.rl.fsdp.load_sharded_model); otherwise whole. trainable=False: frozen."""
        if self.cfg.actor.strategy == "fsdp":
            return fsdp.load_sharded_model(path, dtype, self.device, self.cfg.actor, trainable)
        from tlt.models.loader import load_model
        return load_model(path, dtype=dtype, device=str(self.device)).requires_grad_(trainable)

    def _rollout_model(self) -> Decoder:
        """Config.rollout_dtype() equal to the policy's and full replicas (ddp): the policy itself, shared with the
        engine. Otherwise (e.g. auto on bf16 hardware, or actor.strategy=fsdp, whose parameters are shards) a
        copy in that dtype, on this rank's device (in host memory for a disaggregated rank), filled from the policy
        one FSDP unit at a time (tlt.rl.weight_sync.rollout_copy), which `sync_rollout_weights` refreshes after
        each update."""
        if self.cfg.rollout_dtype() == self.cfg.policy_dtype() and self.cfg.actor.strategy != "fsdp":
            return self.model
        return rollout_copy(self.model, DTYPES[self.cfg.rollout_dtype()], "cpu" if self.engine_on_host else self.device)

    def adopt_published_drafter(self) -> None:
        """Load the drafter the rollout replicas trained into this process's engine, whose final SD comparison
        (tlt.rl.run_summary) would otherwise measure the warm-up drafter. Rank 0 of a placed run owns the replicas;
        the other ranks have nothing to load."""
        owner = getattr(self.rollout_engine, "owner", self.rollout_engine)  # RankSharedRollout -> its owner
        if self.llm.spec is None or owner is None or not hasattr(owner, "drafter_state"):
            return
        state = owner.drafter_state()
        if state:
            self.llm.spec.load_drafter_state(state)

    def sync_rollout_weights(self) -> None:
        """Copy the updated policy (gathered from its FSDP shards one unit at a time, docs/design.md §12) into the
        engine's copy, rounded to its dtype; self.step_sync adds up the bytes and seconds (0 bytes when shared)."""
        self.step_sync += sync_weights(self.model, self.rollout_model)

    def _speculative_config(self) -> dict[str, Any] | None:
        spec = self.cfg.speculative.engine_config(self.cfg.trainer.seed)
        if spec is not None and spec["method"] == "eagle" and spec["model"] is None:
            spec["model"] = self._fresh_drafter()
        return spec

    def _rollout_engine(self):
        """trainer.num_rollout_workers > 1 (or use_ray): rollout replicas as Ray actors whose idle ones train the
        drafter (tlt/workers); otherwise the in-process engine over the very weights being trained."""
        t = self.cfg.trainer
        if not t.use_ray and t.num_rollout_workers <= 1 and t.placement == "none":
            return self.llm
        from tlt.workers.ray_rollout import SpotRollout
        from tlt.workers.rollout_worker import ReplicaConfig
        from tlt.workers.spot import SpotConfig
        rcfg = ReplicaConfig.from_config(self.cfg)
        rcfg.speculative = self._speculative_config()
        if t.placement != "none":  # replicas on a Ray placement group's GPU bundles (tlt/workers/placement.py)
            from tlt.plan import keeps_engine_caches
            from tlt.workers.placement import placed_rollout_from_config
            memory = torch.cuda.get_device_properties(self.device).total_memory if self.device.type == "cuda" else None
            return placed_rollout_from_config(self.cfg, self.rollout_model, rcfg, SpotConfig.from_config(self.cfg),
                                              self.tokenizer, shared_by_ranks=self.placed,
                                              free_cache_engine=not keeps_engine_caches(self.cfg, memory))
        gpu = {"num_gpus": 1} if self.device.type == "cuda" else None
        return SpotRollout(self.rollout_model, max(t.num_rollout_workers, 1), rcfg, SpotConfig.from_config(self.cfg),
                           actor_options=gpu, tokenizer=self.tokenizer)

    def _default_drafter_hook(self) -> DrafterHook:
        """Online drafter training in this process for eagle SD with one rollout worker; otherwise none (the Ray
        rollout workers of tlt.workers train it on their idle replicas)."""
        c = self.cfg
        if not (c.drafter_train.enabled and c.speculative.enabled and c.speculative.method == "eagle"
                and c.trainer.num_rollout_workers <= 1 and c.trainer.placement == "none"):
            return DrafterHook()
        from tlt.drafter_train.online import OnlineDrafterHook
        return OnlineDrafterHook(c.drafter_train, self.llm.spec, seed=c.trainer.seed + self.dist.rank,
                                 spot=spot_training(c.drafter_train.spot, self.device, self.dist.world_size),
                                 save_buffer=c.trainer.save_drafter_buffer)

    def _fresh_drafter(self) -> str:
        """speculative.model=null with eagle: a freshly initialised drafter for this policy (trained online)."""
        from tlt.speculative.drafter import Drafter
        from tlt.speculative.drafter_io import save_drafter
        with torch.random.fork_rng():
            torch.manual_seed(self.cfg.trainer.seed)
            drafter = Drafter(self.model.cfg)
        return str(save_drafter(drafter, self.run_dir / f"drafter_init_rank{self.dist.rank}"))

    def save_checkpoint(self, step: int) -> None:
        """global_step_N/ (tlt.rl.checkpoint). Under actor.strategy=fsdp every rank first writes its shards of the
        weights and AdamW state (DCP) into a staging directory that rank 0 moves into the checkpoint, and the
        consolidated HF weights are gathered for rank 0 (model.safetensors stays the deploy format)."""
        state = None
        if self.dist.is_main:
            actor_state = {"sharded": SHARDS_DIR} if self.actor.sharded else self.actor.state_dict()
            state = TrainerState(step=step, actor=actor_state, rng=capture_rng_state(),
                                 data=self.train_data.state_dict(), drafter_hook=self.drafter_hook.state_dict(),
                                 rollout_seed=self.cfg.trainer.seed)
        self._check_checkpoint_space(step, state)
        staging, plain = self.run_dir / f".shards_step_{step}", self.model
        if self.actor.sharded:
            if self.dist.is_main:
                shutil.rmtree(staging, ignore_errors=True)  # a crashed save's leftovers
            dist.barrier()
            save_sharded(self.actor, staging)
            plain = consolidated(self.model)  # collective; None on ranks other than 0
        if self.dist.is_main:
            def write_model(path: Path) -> None:
                from tlt.models.loader import save_model
                copy_hf_side_files(self.cfg.model.path, path)
                save_model(plain, path)
                if self.actor.sharded:
                    os.rename(staging, path / SHARDS_DIR)
                self.tokenizer.save_pretrained(str(path))
                self.drafter_hook.export(path / "drafter")

            self.ckpt.save(step, write_model, state, self.cfg)
        if self.dist.world_size > 1:
            dist.barrier()

    def _check_checkpoint_space(self, step: int, state: TrainerState | None) -> None:
        """Every rank's part of checkpoint `step` fits on its disk, or every rank raises CheckpointSpaceError before
        any writes (a collective when there are several ranks)."""
        need = shard_bytes(self.actor) if self.actor.sharded else 0
        if state is not None:  # the writing rank: HF weights (gathered if sharded), trainer state
            need += sum(v.numel() * v.element_size() for v in self.model.state_dict().values())
            need += tensor_bytes(state.__dict__)
        error = None
        try:
            self.ckpt.check_space(step, need, tidy=self.dist.is_main)
        except CheckpointSpaceError as e:
            error = e
        if self.dist.world_size > 1 and fsdp.max_over_ranks(error is not None) and error is None:
            error = CheckpointSpaceError(f"checkpoint step {step}: another rank's part does not fit on its disk (its "
                                         f"error says where); nothing of it was written")
        if error is not None:
            raise error

    def _resume(self, path: Path) -> int:
        """Weights were loaded from `path` already; restore the rest. Returns the step to continue after."""
        state = load_trainer_state(path)
        if state.rollout_seed != self.cfg.trainer.seed:
            raise ConfigError(f"trainer.seed={self.cfg.trainer.seed} differs from the checkpoint's "
                              f"({state.rollout_seed}): a resumed run would not sample what the original did")
        if "sharded" in state.actor:  # an fsdp run's shards: DCP reshards to this run's ranks and strategy
            load_sharded(self.actor, path / state.actor["sharded"])
            self.sync_rollout_weights()
        else:
            self.actor.load_state_dict(state.actor)
        restore_rng_state(state.rng)
        self.train_data.load_state_dict(state.data)
        self.drafter_hook.load_state_dict(state.drafter_hook)
        if self.dist.is_main:
            print(f"resumed from {path} (step {state.step})", flush=True)
        return state.step


# ---------------------------------------------------------------- command line


def spot_training(setting: bool | None, device: torch.device, world_size: int = 1) -> bool:
    """drafter_train.spot: true, false, or null = true where a CPU core is idle during the rollout (the model on
    CPU and this machine's processes using fewer torch threads in all than it has cores)."""
    if setting is not None:
        return setting
    return device.type == "cpu" and torch.get_num_threads() * world_size < len(usable_cpus())


def retains_freed_memory(setting: bool | None, device: torch.device) -> bool:
    """trainer.retain_freed_memory: true, false, or null = true where the policy is on CPU (on CUDA its tensors live
    in the CUDA caching allocator, which keeps freed blocks anyway)."""
    return device.type == "cpu" if setting is None else setting


def retain_freed_memory_for(cfg: Config) -> None:
    """Apply trainer.retain_freed_memory to this process: a trainer process's setting, called by the processes that
    run a trainer (`run_rank`, `tlt bench e2e`'s workers) before they allocate any tensor, not by GRPOTrainer, which
    may live in a caller's process. Freed blocks stay for reuse, and tensors of 2 MiB or more get transparent huge
    pages where the kernel offers them. Says so when it applies; warns when asked for and unavailable (not glibc)."""
    setting = cfg.trainer.retain_freed_memory
    if not retains_freed_memory(setting, config_device(cfg)):
        return
    huge = huge_pages_for_host_tensors()
    if retain_freed_host_memory():
        print("tlt: the policy update's freed host memory stays in this process for reuse"
              + (", in transparent huge pages" if huge else "") + " (trainer.retain_freed_memory)", flush=True)
    elif setting:
        print("tlt: trainer.retain_freed_memory=true has no effect here: it needs glibc's malloc", file=sys.stderr,
              flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    config_path = argv[0] if argv and "=" not in argv[0] else None
    overrides = argv[1:] if config_path else argv
    config_path = config_path or str(DEFAULT_CONFIG)  # no CONFIG: the out-of-the-box recipe
    cfg = load_config(config_path, overrides)
    # placement launches the ranks; under a multi-rank torchrun check_launch refuses it (a one-process world, as
    # SLURM or a job operator may set WORLD_SIZE=1, is no launch of its own)
    if cfg.trainer.placement != "none" and int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        summary = train_on_placement(cfg, run_rank)
    else:
        summary = run_rank(cfg, placed=False)
    if summary is not None:  # rank 0's
        print(json.dumps(summary), flush=True)
    return 0


def run_rank(cfg: Config, placed: bool = True) -> dict[str, Any] | None:
    """Train as this process's rank; rank 0 also writes the run report and returns the summary (others None)."""
    retain_freed_memory_for(cfg)
    trainer = GRPOTrainer(cfg, placed=placed)
    summary = trainer.fit()
    if trainer.dist.is_main:
        from tlt.rl.run_summary import finish_run
        summary = finish_run(trainer, summary)
    if dist.is_initialized():
        dist.destroy_process_group()
    return summary if trainer.dist.is_main else None


if __name__ == "__main__":
    from tlt.cli import main as cli_main  # user errors as one message and exit code 2
    sys.exit(cli_main(["train", *sys.argv[1:]]))
