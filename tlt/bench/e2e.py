"""End-to-end RL step time with speculative decoding off, always on and adaptive, runs interleaved per step.

    tlt bench e2e [CONFIG] [--steps N] [--modes off,always,adaptive] [--threads 1] [--quick] [key=value ...]
    tlt bench e2e configs/smoke.yaml --quick                       # seconds, tiny random model

One GRPOTrainer per mode, each in its own process and run directory, all from the same config and seeds (CONFIG,
else the one `tlt train` runs, tlt/configs/default.yaml). The modes differ only in the speculative section:
    off       speculative.enabled=false
    always    SD at every batch size with one fixed EAGLE chain (bs_threshold=null, adaptive=false)
    adaptive  SD gated on the running batch (speculative.bs_threshold) with the adaptive policy over the arm table
    adaptive_rej, frozen, ngram (on request): rejection sampling, the warm-started drafter never trained, n-gram only
    off_control (on request): SD off again in its own process, the noise every other mode's ratios carry
Drafter: speculative.model, else the model's cached warm-up drafter; without one the SD modes use n-gram drafts,
and the output says so. The processes take turns one RL step at a time, in an order rotated every step, so drift of
a shared machine hits every mode alike; a waiting process is blocked on a pipe and uses no CPU. Timing is the
trainer's own (timing_s/gen, timing_s/step without validation).
step_speedup: the median over steps of off's step time over the mode's; run_speedup: the whole run's;
step1_speedup and later_step_speedup apart (in step 1 the process that runs second pays more for its first
update's page faults); sd_step_speedup: the median step ratio with the mode's rollout and drafter round put into
off's step, which drops the other phases' noise where they do the same work (docs/design.md §11).
Learning must not change: `same_resp` is the fraction of responses equal to off's, token for token (1.0 where the
forwards round alike: the modes then run one training run at different speeds). Where they can part (bf16, GPU),
per-response rewards and lengths are compared (Mann-Whitney U, Kolmogorov-Smirnov) and the per-step mean-reward
difference gets a bootstrap 95% CI. Curves go to <out>/e2e_curves.png. Prints a table, then one JSON line.
"""
from __future__ import annotations

import argparse
import copy
import math
import multiprocessing as mp
import os
import shutil
import statistics
import traceback
from pathlib import Path

import numpy as np

from tlt.bench.common import print_json_line, print_table
from tlt.config import DEFAULT_CONFIG  # tlt train's config; a repository's configs/ holds a copy
from tlt.device import trim_host_memory
from tlt.engine.llm_engine import SMALL_BATCHES

# adaptive_rej: acceptance=rejection; off_control: a second SD-off process, whose ratios to off are the machine's
MODES = ("off", "always", "adaptive", "adaptive_rej", "frozen", "ngram", "off_control")
SD_OFF_MODES = ("off", "off_control")
DEFAULT_MODES = ("off", "always", "adaptive")  # each mode is a whole trainer process: ~5 GB for the default model
# off: no SD; always: one fixed EAGLE chain at every batch size; adaptive: gate + policy, drafter trained online;
# frozen: adaptive with the warm-started drafter never trained; ngram: adaptive with model-free drafts only.
STEP_SPEEDUP_GOAL = 1.7  # the paper's end-to-end headline (docs/design.md §11)
QUICK_OVERRIDES = ["data.train_batch_size=2", "rollout.n=4", "data.max_response_length=16"]


# ---------------------------------------------------------------- configs per mode


def base_config(config_path: str | None, overrides: list[str]):
    """The shared config with model, data and drafter resolved once (so every mode sees the same files)."""
    from tlt.config import load_config
    from tlt.rl.trainer import DistInfo, prepare_config
    config_path = config_path or str(DEFAULT_CONFIG)
    cfg = load_config(config_path, overrides)
    wanted_sd = cfg.speculative.enabled
    cfg.speculative.enabled = False  # resolve the drafter here, without building one inside prepare_config
    prepare_config(cfg, DistInfo())
    cfg.speculative.enabled = wanted_sd
    return cfg, config_path


def resolve_drafter(cfg) -> tuple[str, str | None, str]:
    """(method, drafter dir or None, note) for the SD modes; n-gram when no drafter is available."""
    s = cfg.speculative
    if s.method == "ngram":
        return "ngram", None, "speculative.method=ngram"
    if s.model:
        return "eagle", s.model, f"drafter {s.model}"
    try:
        from tlt.drafter_train.offline import drafter_cache_dir
    except ImportError:
        return "ngram", None, "no warm-up drafter builder (tlt.drafter_train.offline): n-gram drafts instead"
    cached = drafter_cache_dir(cfg.model.path)
    if (cached / "provenance.json").is_file():
        return "eagle", str(cached), f"cached warm-up drafter {cached}"
    return "ngram", None, (f"no warm-up drafter at {cached}: n-gram drafts instead (build it with "
                           f"`python -c 'from tlt.drafter_train.offline import default_drafter_path as d; d()'`)")


def mode_config(cfg, mode: str, method: str, drafter: str | None, out: Path):
    c = copy.deepcopy(cfg)
    s, t = c.speculative, c.trainer
    s.enabled = mode not in SD_OFF_MODES
    s.method, s.model = method, drafter
    if mode == "always":
        s.bs_threshold, s.adaptive = None, False
    elif mode == "adaptive_rej":  # sampled chain drafts, rejection sampling: SD off's law, not its samples
        s.acceptance = "rejection"
    elif mode == "frozen":
        c.drafter_train.enabled = False
    elif mode == "ngram":
        s.method, s.model = "ngram", None
    t.default_local_dir, t.project_name, t.experiment_name = str(out), "bench_e2e", mode
    t.resume, t.logger, t.save_freq, t.test_freq = "disable", ["jsonl"], -1, -1
    return c


# ---------------------------------------------------------------- one process per mode


class RecordingHook:
    """Wraps the trainer's drafter hook: keeps the step's per-response rewards, lengths and a hash of each response's
    tokens (to compare the modes' samples one by one), then delegates."""

    def __init__(self, inner):
        self.inner = inner
        self.wants_hidden_states = inner.wants_hidden_states
        self.scores: list[float] = []
        self.lengths: list[int] = []
        self.responses: list[int] = []

    def after_rollout(self, step, rollout, outputs):
        self.scores = [0.0 if s is None else float(s) for s in rollout.scores]
        self.lengths = list(rollout.response_lengths)
        self.responses = [hash(tuple(c.token_ids)) for o in outputs for c in o.outputs]
        return self.inner.after_rollout(step, rollout, outputs)

    def __getattr__(self, name):  # state_dict, load_state_dict, ...: the wrapped hook's
        return getattr(self.inner, name)


def _memory_short(meminfo: str = "/proc/meminfo", cgroup: str = "/sys/fs/cgroup") -> bool:
    """Whether less than a third of the memory this process may use is available: the machine's (MemAvailable of
    MemTotal) or, when tighter, its cgroup's (memory.max less memory.current); False where neither can be read."""
    fractions = []
    try:
        with open(meminfo) as f:
            info = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f)}
        fractions.append(info["MemAvailable"] / info["MemTotal"])
    except (OSError, KeyError, ValueError, ZeroDivisionError):
        pass
    try:
        with open(f"{cgroup}/memory.max") as f, open(f"{cgroup}/memory.current") as g:
            limit, used = f.read().strip(), int(g.read())
        if limit != "max":
            fractions.append((int(limit) - used) / int(limit))
    except (OSError, ValueError, ZeroDivisionError):
        pass
    return bool(fractions) and min(fractions) < 1 / 3


def _release_free_memory() -> None:
    """Hand a waiting mode's freed memory back to the OS, but only when memory is short: a trainer keeps its
    update's freed memory for the next update (trainer.retain_freed_memory), and trimming it would charge the
    bench's modes page faults a real run does not pay."""
    if _memory_short():
        trim_host_memory()


class TurnLogger:
    """Wraps the trainer's logger: after each step report to the parent and wait for this mode's next turn."""

    def __init__(self, inner, hook: RecordingHook, conn):
        self.inner, self.hook, self.conn = inner, hook, conn

    def log(self, step, metrics):
        self.inner.log(step, metrics)
        self.conn.send(("step", {"step": step, "metrics": dict(metrics), "scores": self.hook.scores,
                                 "lengths": self.hook.lengths, "responses": self.hook.responses}))
        _release_free_memory()  # when memory is short, the waiting modes should not sit on their freed peak
        self.conn.recv()  # blocked (no CPU) until the parent says go

    def __getattr__(self, name):  # everything else the trainer calls (close, ...) goes to the real logger
        return getattr(self.inner, name)


def _worker(cfg, threads: int, conn) -> None:
    try:
        import torch
        torch.set_num_threads(threads)
        from tlt.rl.trainer import GRPOTrainer, retain_freed_memory_for
        retain_freed_memory_for(cfg)
        trainer = GRPOTrainer(cfg)
        hook = RecordingHook(trainer.drafter_hook)
        trainer.drafter_hook = hook
        trainer.logger = TurnLogger(trainer.logger, hook, conn)
        conn.send(("ready", None))
        conn.recv()
        conn.send(("done", trainer.fit()))
    except Exception:  # the parent prints it and stops the other modes
        conn.send(("error", traceback.format_exc()))


def run_interleaved(cfgs: dict, steps: int, threads: int) -> dict[str, list[dict]]:
    """{mode: [per-step record]}: each mode's trainer takes one step in turn, order rotated every step."""
    ctx = mp.get_context("spawn")
    procs, conns = {}, {}
    for mode, c in cfgs.items():
        parent, child = ctx.Pipe()
        procs[mode] = ctx.Process(target=_worker, args=(c, threads, child), daemon=True)
        procs[mode].start()
        conns[mode] = parent
    try:
        for mode in cfgs:
            _expect(conns[mode], "ready", mode)
        records: dict[str, list[dict]] = {m: [] for m in cfgs}
        order = list(cfgs)
        for step in range(steps):
            for mode in order[step % len(order):] + order[:step % len(order)]:
                conns[mode].send("go")
                records[mode].append(_expect(conns[mode], "step", mode))
        for mode in cfgs:
            conns[mode].send("go")
            _expect(conns[mode], "done", mode)
        return records
    finally:
        for p in procs.values():
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()


def _expect(conn, kind: str, mode: str):
    got, payload = conn.recv()
    if got == "error":
        raise RuntimeError(f"mode {mode!r} failed:\n{payload}")
    if got != kind:
        raise RuntimeError(f"mode {mode!r}: expected {kind!r}, got {got!r}")
    return payload


# ---------------------------------------------------------------- analysis


def step_seconds(m: dict) -> float:
    """The RL step without validation (off here anyway); checkpoints are saved outside the step's timer."""
    return m["timing_s/step"] - m.get("timing_s/testing", 0.0)


def spread(xs: list[float]) -> str:
    return f"{min(xs):.2f}-{max(xs):.2f}"


def bootstrap_step_diff(a_steps: list[list[float]], b_steps: list[list[float]], num: int = 2000,
                        seed: int = 0) -> tuple[float, float, float]:
    """Mean over steps of (mean b - mean a) and its 95% CI, resampling responses within each step and mode."""
    rng = np.random.default_rng(seed)
    point = float(np.mean([np.mean(b) - np.mean(a) for a, b in zip(a_steps, b_steps)]))
    draws = np.zeros(num)
    for a, b in zip(a_steps, b_steps):
        a, b = np.asarray(a, float), np.asarray(b, float)
        draws += rng.choice(b, (num, len(b))).mean(1) - rng.choice(a, (num, len(a))).mean(1)
    draws /= len(a_steps)
    lo, hi = np.percentile(draws, [2.5, 97.5])
    return point, float(lo), float(hi)


def _same_law_p(a: list[float], b: list[float]) -> tuple[float, float]:
    """(Mann-Whitney U p, Kolmogorov-Smirnov p) of two samples; 1.0 where both are one repeated value."""
    from scipy.stats import ks_2samp, mannwhitneyu
    if len(set(a) | set(b)) <= 1:  # the tests are undefined on one repeated value
        return 1.0, 1.0
    return float(mannwhitneyu(a, b, alternative="two-sided").pvalue), float(ks_2samp(a, b).pvalue)


def compare_learning(off: list[dict], other: list[dict]) -> dict:
    """Off vs an SD mode: the same responses, and rewards and lengths drawn from the same law?

    With drafter-invariant verification a mode samples SD off's very responses (seeds are per step and response),
    so `same_responses` (the fraction equal token for token, pooled over steps) is 1.0 and the runs are one and the
    same training run, where the verify and decode forwards round alike (the fp32 CPU path). Elsewhere a response
    can part from off's at a rounding-sized CDF boundary, and from then on the policies drift apart by chance. The
    law tests cover that case: step 1 samples from identical weights in every mode, so there a difference can
    only come from the sampler (`step1_*`); the pooled tests mix in the drift of later steps."""
    pairs = [(a, b) for r, o in zip(off, other) for a, b in zip(r.get("responses", []), o.get("responses", []))]
    out = {"same_responses": sum(a == b for a, b in pairs) / len(pairs) if pairs else None}
    for key in ("scores", "lengths"):
        out[f"{key}_mwu_p"], out[f"{key}_ks_p"] = _same_law_p([x for r in off for x in r[key]],
                                                              [x for r in other for x in r[key]])
        out[f"step1_{key}_mwu_p"], out[f"step1_{key}_ks_p"] = _same_law_p(off[0][key], other[0][key])
    d, lo, hi = bootstrap_step_diff([r["scores"] for r in off], [r["scores"] for r in other])
    out.update(reward_diff=d, reward_diff_ci=[lo, hi])
    return out


def _sd_phases(rec: dict) -> float:
    """Seconds of the phases speculative decoding and the drafter change: the rollout, the drafter round, and the
    wait for a spot round's step in flight when the rollout ends (outside the phase timers)."""
    m = rec["metrics"]
    return m["timing_s/gen"] + m.get("timing_s/drafter", 0.0) + m.get("drafter/spot_yield_s", 0.0)


def summarize(records: dict[str, list[dict]]) -> dict[str, dict]:
    off = records.get("off")
    res = {}
    for mode, recs in records.items():
        gen = [r["metrics"]["timing_s/gen"] for r in recs]
        step = [step_seconds(r["metrics"]) for r in recs]
        gen_tok_s = [sum(r["lengths"]) / g for r, g in zip(recs, gen)]
        m = {"gen_s": statistics.median(gen), "gen_spread": spread(gen), "gen_tok_s": statistics.median(gen_tok_s),
             "step_s": statistics.median(step), "step_spread": spread(step),
             "gen_share": statistics.median(g / t for g, t in zip(gen, step)),
             "free_rollout_bound": statistics.median(t / max(t - g, 1e-9) for g, t in zip(gen, step)),
             "reward": float(np.mean([x for r in recs for x in r["scores"]])),
             "resp_len": float(np.mean([x for r in recs for x in r["lengths"]])),
             "accept_len": _median_metric(recs, "rollout/spec_accept_length"),
             "sd_on": _median_metric(recs, "rollout/spec_on_fraction"),
             "drafter_train_s": _median_metric(recs, "drafter/train_time_s"),
             # the tail: decode time while at most k sequences ran (where SD can pay on a CPU, docs/design.md §11)
             "tail_decode_s": {k: _median_metric(recs, f"rollout/decode_time_upto_bs/{k}") for k in TAIL_BATCHES},
             "per_step": [{"gen_s": g, "step_s": s, "drafter_s": r["metrics"].get("timing_s/drafter", 0.0),
                           "reward": r["metrics"].get("critic/score/mean"),
                           "resp_len": r["metrics"].get("response_length/mean")}
                          for g, s, r in zip(gen, step, recs)]}
        if off is not None and mode != "off":
            gen_x = [a["metrics"]["timing_s/gen"] / g for a, g in zip(off, gen)]
            step_x = [step_seconds(a["metrics"]) / s for a, s in zip(off, step)]
            m.update(gen_speedup=statistics.median(gen_x), gen_speedup_spread=spread(gen_x),
                     step_speedup=statistics.median(step_x), step_speedup_spread=spread(step_x),
                     # the whole run's time, and the steps after the first: in step 1 the mode that runs second
                     # faults its first update's memory in at ~2.4x the kernel time (the module doc)
                     run_speedup=sum(step_seconds(a["metrics"]) for a, _ in zip(off, step)) / sum(step),
                     step1_speedup=step_x[0],
                     later_step_speedup=statistics.median(step_x[1:]) if len(step_x) > 1 else None,
                     # SD's own effect: off's step with this mode's rollout and drafter round in place of off's. The
                     # other phases (reward, log-probs, update) do the same work in every mode when same_resp is 1.0,
                     # so their differences are the machine's noise (docs/design.md §11)
                     sd_step_speedup=statistics.median(
                         step_seconds(a["metrics"]) / (step_seconds(a["metrics"]) + _sd_phases(r) - _sd_phases(a))
                         for a, r in zip(off, recs)))
            m.update(compare_learning(off, recs))
        res[mode] = m
    return res


TAIL_BATCHES = tuple(map(str, SMALL_BATCHES))  # as llm.stats() names them


# what each part of a step costs, per mode (median seconds a step): the trainer's phases, then what speculative
# decoding and online drafter training add (docs/design.md §6); spec_net_saved < 0 means SD steps cost time
COSTS = {"rollout": "timing_s/gen", "reward": "timing_s/reward", "old_logp": "timing_s/old_log_prob",
         "update": "timing_s/update_actor", "drafter": "timing_s/drafter", "draft": "rollout/sd_propose_time_s",
         "verify": "rollout/sd_verify_time_s", "commit": "rollout/sd_commit_time_s",
         "spec_net_saved": "rollout/spec_net_saved_s",
         "copy_hidden": "rollout/hidden_copy_time_s", "buffer": "drafter/buffer_time_s",
         "train_drafter": "drafter/train_time_s", "spot_wait": "drafter/spot_wait_s",
         "spot_beside": "drafter/spot_overlap_s", "compare": "drafter/compare/time_s",
         "capture": "rollout/graph_capture_time_s"}


def cost_table(res_records: dict[str, list[dict]]) -> list[dict]:
    return [{"mode": mode, **{name: _median_metric(recs, key) for name, key in COSTS.items()}}
            for mode, recs in res_records.items()]


def _median_metric(recs: list[dict], key: str) -> float | None:
    """The median over the steps that have the metric: a step without one logs None or NaN (no SD step ran)."""
    xs = [x for r in recs if (x := r["metrics"].get(key)) is not None and math.isfinite(x)]
    return statistics.median(xs) if xs else None


def plot_curves(records: dict[str, list[dict]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator
    fig, axes = plt.subplots(1, 4, figsize=(20, 4))
    color = {mode: f"C{i}" for i, mode in enumerate(records)}  # one colour per mode in every panel
    panels = (("critic/score/mean", "reward (mean per step)"), ("response_length/mean", "response length (mean)"),
              (None, "step time s (no save/validation)"),
              ("rollout/spec_accept_length", "accept length (tokens per verify step)"))
    for ax, (key, title) in zip(axes, panels):
        for mode, recs in records.items():
            pts = [(r["step"], step_seconds(r["metrics"]) if key is None else r["metrics"].get(key)) for r in recs]
            pts = [(x, y) for x, y in pts if y is not None]
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=mode, color=color[mode])
        ax.set_title(title)
        ax.set_xlabel("RL step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if ax.get_legend_handles_labels()[0]:  # the accept-length panel is empty when only SD off ran
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tlt bench e2e", description=__doc__.split("\n\n")[0])
    ap.add_argument("config", nargs="?", default=None,
                    help="YAML config (default: tlt train's, tlt/configs/default.yaml)")
    ap.add_argument("overrides", nargs="*", help="dotted key=value config overrides")
    ap.add_argument("--steps", type=int, default=None, help="RL steps per mode (default: trainer.total_steps)")
    ap.add_argument("--modes", default=",".join(DEFAULT_MODES),
                    help=f"comma-separated, from {','.join(MODES)}; each runs in its own process (memory adds up)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads per process")
    ap.add_argument("--out", default="runs/bench_e2e", help="run directories, metrics.jsonl and the PNG")
    ap.add_argument("--keep-checkpoints", action="store_true", help="keep the final-step checkpoints")
    ap.add_argument("--quick", action="store_true", help="2 steps at tiny sizes (smoke run)")
    a = ap.parse_intermixed_args(argv)
    if a.config and "=" in a.config:
        a.overrides, a.config = [a.config, *a.overrides], None
    modes = [m for m in a.modes.split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown or not modes:
        ap.error(f"--modes takes a comma list of {', '.join(MODES)}; got {a.modes!r}")
    overrides = (QUICK_OVERRIDES if a.quick else []) + a.overrides
    steps = a.steps or (2 if a.quick else None)
    if steps:
        overrides.append(f"trainer.total_steps={steps}")
    os.environ["OMP_NUM_THREADS"] = str(a.threads)  # inherited by the spawned trainers

    cfg, config_path = base_config(a.config, overrides)
    steps = cfg.trainer.total_steps
    method, drafter, note = resolve_drafter(cfg)
    out = Path(a.out)
    for mode in modes:
        shutil.rmtree(out / "bench_e2e" / mode, ignore_errors=True)  # metrics.jsonl appends: start clean
    cfgs = {m: mode_config(cfg, m, method, drafter, out) for m in modes}
    records = run_interleaved(cfgs, steps, a.threads)
    if not a.keep_checkpoints:
        for mode in modes:
            for d in (out / "bench_e2e" / mode).glob("global_step_*"):
                shutil.rmtree(d, ignore_errors=True)
    res = summarize(records)
    png = out / "e2e_curves.png"
    plot_curves(records, png)

    d, r, s = cfg.data, cfg.rollout, cfg.speculative
    print(f"config={config_path} model={cfg.model.path}")
    print(f"steps={steps} prompts/step={d.train_batch_size} n={r.n} max_response={d.max_response_length} "
          f"temperature={r.temperature} threads={a.threads} (one process per mode, interleaved, order rotated)")
    print(f"SD modes: method={method} ({note}); adaptive bs_threshold={s.bs_threshold}")
    print("times: median over steps (min-max); speedup = off / mode on the same step; gen_tok_s = response tokens / "
          "rollout s")
    rows = [{"mode": m, **v} for m, v in res.items()]
    print_table(rows, ["mode", "gen_s", "gen_spread", "gen_tok_s", "step_s", "step_spread", "gen_share", "gen_speedup",
                       "gen_speedup_spread", "step_speedup", "step_speedup_spread", "accept_len", "sd_on"])
    if any("run_speedup" in v for v in res.values()):
        print("\nthe whole run (off's total step time / the mode's), step 1, the median over steps 2..N (in step 1 the "
              "mode that runs second pays more for its first update's page faults), and sd_step: the median step ratio "
              "with the phases SD does not change (reward, log-probs, update) taken from off, whose differences are "
              "the machine's noise where same_resp is 1.00:")
        print_table(rows, ["mode", "run_speedup", "step1_speedup", "later_step_speedup", "sd_step_speedup"])
    costs = cost_table(records)
    print("\nwhere the time goes (median seconds a step; draft includes catchup; spec_net_saved: plain decoding's "
          "time for the SD steps' tokens minus theirs, negative when SD cost time; capture: CUDA graph captures, "
          "inside the rollout's time):")
    print_table(costs, ["mode", *COSTS])
    if "off" in res and len(res) > 1:
        print("\nlearning vs off. same_resp: fraction of responses equal to off's, token for token (1.0: the same "
              "training run). Per-response law tests (p > 0.05 = no detectable difference); step1_*: the first step, "
              "where every mode samples from the same weights; the rest pools all steps:")
        lrows = [{"mode": m, "same_resp": v.get("same_responses"), "reward": v["reward"], "resp_len": v["resp_len"],
                  "step1_reward_p": v.get("step1_scores_mwu_p"), "step1_len_ks_p": v.get("step1_lengths_ks_p"),
                  "reward_mwu_p": v.get("scores_mwu_p"), "reward_ks_p": v.get("scores_ks_p"),
                  "len_mwu_p": v.get("lengths_mwu_p"), "len_ks_p": v.get("lengths_ks_p"),
                  "d_reward/step": v.get("reward_diff"),
                  "95%CI": "[{:.3f}, {:.3f}]".format(*v["reward_diff_ci"]) if "reward_diff_ci" in v else None}
                 for m, v in res.items()]
        print_table(lrows, ["mode", "same_resp", "reward", "resp_len", "step1_reward_p", "step1_len_ks_p",
                            "reward_mwu_p", "reward_ks_p", "len_mwu_p", "len_ks_p", "d_reward/step", "95%CI"])
    best = max((v.get("step_speedup") or 0.0 for m, v in res.items() if m not in SD_OFF_MODES), default=0.0)
    verdict = (f"best median here {best:.2f}x ({'met' if best >= STEP_SPEEDUP_GOAL else 'not met'})"
               if any(m not in SD_OFF_MODES for m in res) else "no SD mode ran (--modes)")
    print(f"\ngoal: step time >= {STEP_SPEEDUP_GOAL}x faster than SD off; {verdict}; curves: {png}")
    if "off" in res:  # Amdahl: SD speeds the rollout only, so no SD mode can beat a rollout that takes no time
        print(f"ceiling: with SD off the rollout is {res['off']['gen_share']:.0%} of a step (median), so a rollout "
              f"that took no time would make the step at most {res['off']['free_rollout_bound']:.2f}x faster")
        tail, gen = res["off"]["tail_decode_s"], res["off"]["gen_s"]
        if None not in tail.values():
            print(f"tail: with SD off, decoding with at most {' / '.join(TAIL_BATCHES)} sequences running took "
                  f"{' / '.join(f'{tail[k]:.2f}' for k in TAIL_BATCHES)} s of the rollout's {gen:.2f} s (median); "
                  f"were decoding at batch <= 4 free, the rollout would be at most "
                  f"{gen / max(gen - tail['4'], 1e-9):.2f}x faster")
    print_json_line("e2e", {"config": config_path, "model": cfg.model.path, "steps": steps, "threads": a.threads,
                            "train_batch_size": d.train_batch_size, "n": r.n,
                            "max_response_length": d.max_response_length, "sd_method": method, "drafter": drafter,
                            "drafter_note": note, "png": str(png), "modes": res,
                            "costs": {c["mode"]: {k: v for k, v in c.items() if k != "mode"} for c in costs},
                            "goal": {"step_speedup": STEP_SPEEDUP_GOAL, "best": best,
                                     "met": best >= STEP_SPEEDUP_GOAL,
                                     "free_rollout_bound": res["off"]["free_rollout_bound"] if "off" in res else None}})
    return 0
