"""TRL's GRPOTrainer vs tlt on the same model, prompts and GRPO settings: seconds per RL step on CPU.

    tlt bench trl [CONFIG] [--steps 3] [--threads 1] [--quick] [key=value ...]
    (needs `pip install trl`, the `bench` extra; `tlt bench trl_grpo` is the same benchmark)

The tlt config (CONFIG, else tlt train's, tlt/configs/default.yaml) is the single source
of settings; TRL gets the translation: the same model directory, the same train rows in file order (shuffling off
on both sides), group size rollout.n, data.train_batch_size prompts per step, max_response_length, temperature /
top_p / top_k, AdamW lr / betas / weight decay / grad clip, constant lr, clip ratios, token-mean loss ("dapo"),
KL coefficient (0 unless actor.use_kl_loss) and the same reward (tlt's RewardManager on tlt's parsed rows). Gradient
checkpointing off; fp32 weights, with bf16 autocast exactly where tlt's actor uses it (actor.bf16_autocast on a CPU
with native bf16), so both trainers run the same precision. One RL step in TRL is generation_batch_size completions
and the same number of optimiser steps as tlt's mini-batches; its time is measured by a callback around those
steps. tlt runs first (SD off and adaptive, interleaved per step, as in `tlt bench e2e`), then TRL. Prints a
table, then one JSON line; if TRL cannot be imported or run, the reason is printed and nothing is timed for it.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
import traceback
from pathlib import Path

from tlt.bench.common import print_json_line, print_table
from tlt.bench.e2e import QUICK_OVERRIDES, base_config, mode_config, resolve_drafter, run_interleaved, step_seconds

SPEEDUP_GOAL = 5.0
LOSS_TYPES = {"token-mean": "dapo", "seq-mean-token-mean": "grpo", "seq-mean-token-sum": "dr_grpo"}


def seconds_per_ktok(step_s: list[float], resp_len: list[float | None], responses_per_step: int) -> float | None:
    """Median over steps of the step time per 1000 response tokens sampled in it (None without lengths)."""
    vals = [t / (n * responses_per_step / 1000) for t, n in zip(step_s, resp_len) if n]
    return statistics.median(vals) if vals else None


def run_trl(cfg, steps: int, out: Path) -> dict:
    """TRL GRPO for `steps` RL steps; {"step_s": [...]} or {"error": why}."""
    try:
        import torch
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as e:
        return {"error": f"trl is not importable ({e}); install the bench extra: pip install 'tlt[bench]'"}
    from tlt.device import cpu_has_fast_bf16
    from tlt.prompts import load_examples
    from tlt.rl.rewards import RewardManager

    d, r, a = cfg.data, cfg.rollout, cfg.actor
    tok = AutoTokenizer.from_pretrained(cfg.model.path)
    # tlt's own reader and reward manager: the same rows, filtering and reward function as tlt's trainer
    examples = load_examples(d.train_files, tok, d.prompt_key, d.max_prompt_length, d.filter_overlong_prompts)[0]
    rows = [{"prompt": ex.messages, "example": i} for i, ex in enumerate(examples)]
    rewards = RewardManager(cfg.reward)
    num_mini = d.train_batch_size // (a.ppo_mini_batch_size or d.train_batch_size)
    completions_per_step = d.train_batch_size * r.n

    def reward(prompts, completions, example, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        scores = rewards.score([examples[i] for i in example], texts).scores
        return [0.0 if x is None else float(x) for x in scores]

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times: list[float] = []

        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self.t0)

    try:
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32)
        args = GRPOConfig(
            output_dir=str(out / "trl"), use_cpu=True, bf16=bool(a.bf16_autocast and cpu_has_fast_bf16()),
            seed=cfg.trainer.seed, max_steps=steps * num_mini,
            per_device_train_batch_size=completions_per_step // num_mini, steps_per_generation=num_mini,
            gradient_accumulation_steps=1, num_generations=r.n, max_completion_length=d.max_response_length,
            temperature=r.temperature, top_p=r.top_p, top_k=max(r.top_k, 0), learning_rate=a.lr,
            lr_scheduler_type="constant", adam_beta1=a.betas[0], adam_beta2=a.betas[1], weight_decay=a.weight_decay,
            max_grad_norm=a.grad_clip, epsilon=a.clip_ratio_low, epsilon_high=a.clip_ratio_high,
            loss_type=LOSS_TYPES[a.loss_agg_mode], beta=a.kl_loss_coef if a.use_kl_loss else 0.0,
            scale_rewards="group" if cfg.algorithm.norm_adv_by_std_in_grpo else "none",
            num_iterations=a.ppo_epochs, shuffle_dataset=False, gradient_checkpointing=False, logging_steps=1,
            save_strategy="no", report_to=[], disable_tqdm=True, dataloader_num_workers=0)
        timer = StepTimer()
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=Dataset.from_list(rows),
                              processing_class=tok, callbacks=[timer])
        trainer.train()
    except Exception as e:  # report why TRL could not run, with no number for it
        return {"error": f"TRL GRPOTrainer failed: {type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    per_step = [sum(timer.times[i:i + num_mini]) for i in range(0, len(timer.times), num_mini)]
    logs = [h for h in trainer.state.log_history if "reward" in h]
    return {"step_s": per_step, "reward": [h["reward"] for h in logs],
            "resp_len": [h.get("completions/mean_length") for h in logs]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tlt bench trl", description=__doc__.split("\n\n")[0])
    ap.add_argument("config", nargs="?", default=None)
    ap.add_argument("overrides", nargs="*", help="dotted key=value config overrides")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (both trainers)")
    ap.add_argument("--out", default="runs/bench_trl")
    ap.add_argument("--skip-tlt", action="store_true", help="time TRL only")
    ap.add_argument("--quick", action="store_true", help="2 steps at tiny sizes")
    a = ap.parse_intermixed_args(argv)
    if a.config and "=" in a.config:
        a.overrides, a.config = [a.config, *a.overrides], None
    steps = 2 if a.quick else a.steps
    overrides = (QUICK_OVERRIDES if a.quick else []) + a.overrides + [f"trainer.total_steps={steps}",
                                                                      "data.shuffle=false"]
    os.environ["OMP_NUM_THREADS"] = str(a.threads)
    import torch
    torch.set_num_threads(a.threads)
    cfg, config_path = base_config(a.config, overrides)
    out = Path(a.out)
    res: dict[str, dict] = {}
    if not a.skip_tlt:
        method, drafter, note = resolve_drafter(cfg)
        cfgs = {m: mode_config(cfg, m, method, drafter, out) for m in ("off", "adaptive")}
        records = run_interleaved(cfgs, steps, a.threads)
        for d in out.glob("bench_e2e/*/global_step_*"):  # the trainer's forced final checkpoint
            shutil.rmtree(d, ignore_errors=True)
        for m, recs in records.items():
            res[f"tlt_{m}"] = {"step_s": [step_seconds(x["metrics"]) for x in recs],
                               "reward": [x["metrics"]["critic/score/mean"] for x in recs],
                               "resp_len": [x["metrics"]["response_length/mean"] for x in recs]}
        res["tlt_adaptive"]["note"] = f"SD {method}: {note}"
    res["trl"] = run_trl(cfg, steps, out)

    d, r = cfg.data, cfg.rollout
    print(f"config={config_path} model={cfg.model.path}")
    print(f"steps={steps} prompts/step={d.train_batch_size} n={r.n} max_response={d.max_response_length} "
          f"lr={cfg.actor.lr} threads={a.threads}; step time: median over steps (min-max), first step included")
    trl_med = statistics.median(res["trl"]["step_s"]) if res["trl"].get("step_s") else None
    per_step = d.train_batch_size * r.n
    trl_ktok = seconds_per_ktok(res["trl"].get("step_s", []), res["trl"].get("resp_len", []), per_step)
    rows = []
    for name, v in res.items():
        if "step_s" not in v:
            continue
        med = statistics.median(v["step_s"])
        ktok = seconds_per_ktok(v["step_s"], v["resp_len"], per_step)
        v.update(median_step_s=med, speedup_vs_trl=trl_med / med if trl_med else None, s_per_ktok=ktok,
                 per_token_speedup_vs_trl=trl_ktok / ktok if trl_ktok and ktok else None)
        rows.append({"trainer": name, "step_s": med, "spread": f"{min(v['step_s']):.2f}-{max(v['step_s']):.2f}",
                     "x_vs_trl": v["speedup_vs_trl"], "reward": statistics.mean(v["reward"]) if v["reward"] else None,
                     "resp_len": statistics.mean(x for x in v["resp_len"] if x is not None) if v["resp_len"] else None,
                     "s_per_ktok": ktok, "x_per_tok": v["per_token_speedup_vs_trl"]})
    print_table(rows, ["trainer", "step_s", "spread", "x_vs_trl", "reward", "resp_len", "s_per_ktok", "x_per_tok"])
    print("s_per_ktok: step time per 1000 sampled response tokens (median over steps): each trainer samples its own "
          "responses, so their lengths, and the work of a step, differ by chance")
    if "error" in res["trl"]:
        print(f"TRL not timed: {res['trl']['error']}")
    best = max((v.get("speedup_vs_trl") or 0.0 for k, v in res.items() if k.startswith("tlt")), default=0.0)
    print(f"goal: tlt >= {SPEEDUP_GOAL}x faster per step than TRL; best here "
          f"{best:.2f}x ({'met' if best >= SPEEDUP_GOAL else 'not met'})" if trl_med and not a.skip_tlt
          else "goal: not measurable here (TRL or tlt not timed)")
    res["trl"].pop("traceback", None)
    print_json_line("trl_grpo", {"config": config_path, "model": cfg.model.path, "steps": steps, "threads": a.threads,
                                 "train_batch_size": d.train_batch_size, "n": r.n,
                                 "max_response_length": d.max_response_length, "results": res,
                                 "goal": {"speedup": SPEEDUP_GOAL, "best": best, "met": best >= SPEEDUP_GOAL}})
    return 0
