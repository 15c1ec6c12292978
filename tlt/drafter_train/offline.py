"""Offline drafter warm-up: sample with the target, keep its hidden states, train the drafter, save it.

The same pieces as online training (DrafterBuffer -> pack -> DrafterTrainer); only the data source differs: the
target generates responses to a prompt set here (return_hidden_states=True) instead of an RL rollout. Every
response becomes one buffer sample (prompt + response ids, hidden rows h_{P-1..}, response_start=P,
hidden_start=P-1); every `holdout_every`-th sample is held out and scored before and after training (top-1
accuracy and the teacher-forced accept-length proxy). The output directory holds the drafter (drafter_io
format, with the reduced draft vocabulary when asked) and provenance.json.

    tlt train-drafter --out runs/drafter                       # SmolLM2-135M-Instruct on the default task
    tlt train-drafter out=runs/drafter steps=200 draft_vocab=8192 temperatures=1.0,0.7
    tlt train-drafter out=runs/plain fc_bias=false                  # vLLM's stock EAGLE-1 shape (full vocabulary)
    tlt train-drafter --model path/to/hf --data prompts.parquet --out runs/drafter
    tlt train-drafter --help                                   # every option with its default

Options are the fields of OfflineConfig, as `--num-prompts 64` or `num_prompts=64` (both spellings work).
`default_drafter_path()` builds (once) and caches the drafter that `tlt` uses for the default model.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

import tlt
from tlt.cache import build_atomically, cache_root
from tlt.config import RolloutConfig
from tlt.device import idle_cpu_cores
from tlt.drafter_train.buffer import DrafterBuffer
from tlt.drafter_train.trainer import DrafterTrainer
from tlt.models.smollm import default_model_path
from tlt.prompts import load_examples
from tlt.speculative.drafter import Drafter
from tlt.speculative.drafter_io import build_draft_vocab, check_drafter_dir, save_drafter
from tlt.tasks.default_task import make_examples


def _opt(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass
class OfflineConfig:
    out: str | None = _opt(None, "output directory (required on the command line)")
    model: str | None = _opt(None, "target HF model directory; default: SmolLM2-135M-Instruct (default_model_path)")
    data: str | None = _opt(None, "verl-schema parquet/jsonl (chat `prompt`) or jsonl of {prompt_token_ids: [...]}; "
                                  "default: the default task's train split")
    num_prompts: int = _opt(48, "prompts to sample from (the first N of the data)")
    n: int = _opt(1, "responses per prompt and temperature")
    temperatures: str = _opt(",".join(map(str, sorted({1.0, RolloutConfig().temperature}))),
                             "comma-separated sampling temperatures (1.0 and the rollout temperature)")
    max_tokens: int = _opt(128, "max response tokens per sample")
    dtype: str = _opt("auto", "target dtype for generation: auto | float32 | bfloat16")
    max_num_seqs: int = _opt(64, "sequences decoded together")
    steps: int = _opt(40, "drafter optimiser steps")
    lr: float = _opt(1e-3, "drafter learning rate (short warm-ups need a larger one than long runs' 5e-5)")
    batch_tokens: int = _opt(1024, "tokens per packed row")
    num_rows: int = _opt(1, "packed rows per step")
    window_len: int = _opt(256, "training window length (<= batch_tokens)")
    holdout_every: int = _opt(8, "every k-th sample is held out for evaluation")
    draft_vocab: int = _opt(0, "reduced draft vocabulary size from generated-token counts; 0 = the full vocabulary")
    fc_bias: bool = _opt(True, "the drafter's fc has a bias; false with draft_vocab=0 = vLLM's stock EAGLE-1 drafter "
                               "(`tlt export-drafter` then writes plain EAGLE-1 weights, no plugin)")
    ttt_steps: int = _opt(1, "unrolled passes a training step (training-time test: pass k feeds the drafter its own "
                             "pass k-1 features, as drafting depth k does); 1 = teacher-forced only")
    amp: str = _opt("auto", "autocast dtype for training: auto | none | bfloat16")
    threads: int = _opt(0, "torch intra-op threads; 0 = the cores other processes leave idle when the build starts "
                           "(at least 1, at most torch's default): threads on a core another process holds made a "
                           "build up to 5x slower")
    seed: int = _opt(0, "seed for data order, sampling and drafter init")
    log_every: int = _opt(10, "print training metrics every k steps")


def _parse_bool(text: str) -> bool:
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def parse_args(argv: list[str]) -> OfflineConfig:
    """argparse over OfflineConfig's fields; `key=value` tokens are read as `--key value`."""
    ap = argparse.ArgumentParser(prog="tlt train-drafter", description=__doc__.split("\n")[0])
    for f in dataclasses.fields(OfflineConfig):
        typ = {"int": int, "float": float, "bool": _parse_bool}.get(str(f.type), str)
        ap.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=typ, default=f.default,
                        help=f"{f.metadata['help']} (default: {f.default})")
    flat: list[str] = []
    for a in argv:
        if not a.startswith("-") and "=" in a:
            key, value = a.split("=", 1)
            flat += ["--" + key.replace("_", "-"), value]
        else:
            flat.append(a)
    return OfflineConfig(**vars(ap.parse_args(flat)))


def load_prompts(cfg: OfflineConfig, tokenizer) -> tuple[list[list[int]], str]:
    """(prompt token ids, data-source description): chat-templated text prompts or raw token-id prompts."""
    if cfg.data is None:
        messages = [row["prompt"] for row in make_examples("train", cfg.num_prompts, cfg.seed)]
        source = f"tlt default task (train split, seed {cfg.seed})"
    else:
        rows = ([json.loads(x) for x in Path(cfg.data).read_text().splitlines() if x.strip()]
                if cfg.data.endswith(".jsonl") else None)
        if rows and "prompt_token_ids" in rows[0]:
            return [list(map(int, r["prompt_token_ids"])) for r in rows[:cfg.num_prompts]], cfg.data
        messages = [ex.messages for ex in load_examples([cfg.data], None)[0][:cfg.num_prompts]]
        source = cfg.data
    if tokenizer is None:
        raise ValueError(f"{source} has text prompts but the model has no tokenizer files: add them or give a jsonl "
                         "of {prompt_token_ids: [...]} rows")
    texts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in messages]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts], source


def generate_into(buffer: DrafterBuffer, llm: tlt.LLM, prompts: list[list[int]], cfg: OfflineConfig,
                  counts: torch.Tensor) -> int:
    """Sample every prompt at every temperature, add each response to `buffer`, count tokens into `counts` [V];
    returns the number of response tokens generated."""
    temps = [float(t) for t in cfg.temperatures.split(",")]
    ids = [p for _ in temps for p in prompts]
    temp_of_request = [t for t in temps for _ in prompts]
    params = [tlt.SamplingParams(n=cfg.n, temperature=t, max_tokens=cfg.max_tokens, seed=cfg.seed * 100_003 + i,
                                 return_hidden_states=True) for i, t in enumerate(temp_of_request)]
    num_tokens = 0
    for req in llm.generate(prompt_token_ids=ids, sampling_params=params):
        counts += torch.bincount(torch.tensor(req.prompt_token_ids), minlength=counts.numel())
        for out in req.outputs:
            buffer.add_response(req.prompt_token_ids, out.token_ids, out.hidden_states, rl_step=0)
            counts += torch.bincount(torch.tensor(out.token_ids), minlength=counts.numel())
            num_tokens += len(out.token_ids)
    return num_tokens


def config_sha256(model_dir: Path) -> str:
    return hashlib.sha256((model_dir / "config.json").read_bytes()).hexdigest()


def train_drafter(cfg: OfflineConfig, command: str | None = None) -> dict:
    """Generate, train, evaluate and save into cfg.out; returns the provenance dict (also written there).
    `command` is recorded in provenance.json (default: this process's command line)."""
    if cfg.out is None:
        raise ValueError("no output directory: pass --out DIR (or out=DIR)")
    if cfg.window_len > cfg.batch_tokens:
        raise ValueError(f"window_len={cfg.window_len} > batch_tokens={cfg.batch_tokens}: lower window_len")
    if cfg.model is None:
        cfg = dataclasses.replace(cfg, model=str(default_model_path()))
    model_dir = Path(cfg.model)
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads or build_threads(threads))
    try:
        return _train_drafter(cfg, model_dir, command)
    finally:
        torch.set_num_threads(threads)  # the setting is process-wide: give the caller its own back


def build_threads(most: int) -> int:
    """threads=0: the cores other processes leave idle now (tlt.device.idle_cpu_cores), at least 1 and at most
    `most`; `most` where that cannot be read."""
    idle = idle_cpu_cores()
    return most if idle is None else max(1, min(most, int(idle + 0.5)))


def _train_drafter(cfg: OfflineConfig, model_dir: Path, command: str | None) -> dict:
    t0 = time.perf_counter()
    llm = tlt.LLM(model=model_dir, dtype=cfg.dtype, max_num_seqs=cfg.max_num_seqs, seed=cfg.seed)
    target = llm.model
    prompts, source = load_prompts(cfg, llm.tokenizer)
    buffer = DrafterBuffer(max_tokens=1 << 40, window_len=cfg.window_len, holdout_every=cfg.holdout_every)
    counts = torch.zeros(target.cfg.vocab_size, dtype=torch.long)
    num_gen = generate_into(buffer, llm, prompts, cfg, counts)
    gen_s = time.perf_counter() - t0
    print(f"generated {num_gen} tokens for {len(prompts)} prompts in {gen_s:.1f} s "
          f"({buffer.num_train_tokens()} train / {buffer.num_train_tokens(heldout=True)} held-out pairs; "
          f"{torch.get_num_threads()} threads)")

    torch.manual_seed(cfg.seed)
    drafter = Drafter(target.cfg, fc_bias=cfg.fc_bias).to(next(target.parameters()).device).attach(target)
    if cfg.draft_vocab:
        drafter.d2t = build_draft_vocab(counts, cfg.draft_vocab).to(drafter.fc.weight.device)
        covered = float(counts[drafter.d2t.cpu()].sum() / counts.sum())
        print(f"draft vocabulary: {cfg.draft_vocab} of {counts.numel()} ids, covering {covered:.1%} of tokens seen")
    amp = {"auto": "auto", "none": None, "bfloat16": torch.bfloat16}[cfg.amp]
    trainer = DrafterTrainer(drafter, lr=cfg.lr, batch_tokens=cfg.batch_tokens, num_rows=cfg.num_rows,
                             seed=cfg.seed, amp_dtype=amp, ttt_steps=cfg.ttt_steps)
    heldout = buffer.heldout_batch(cfg.batch_tokens, 8 * cfg.batch_tokens)
    before = trainer.evaluate(heldout) if heldout is not None else {}
    t1, done = time.perf_counter(), 0
    while done < cfg.steps:
        stats = trainer.train_steps(buffer, max_steps=min(cfg.log_every, cfg.steps - done))
        done += stats.steps
        m = stats.last
        print(f"step {done:5d}  loss {m.loss:.4f}  hidden {m.hidden_loss:.4f}  ce {m.ce:.3f}  acc {m.acc:.3f}  "
              f"{stats.mean_step_s:.2f} s/step")
    train_s = time.perf_counter() - t1
    after = trainer.evaluate(heldout) if heldout is not None else {}
    print(_metrics_table(before, after))

    out = Path(cfg.out)
    save_drafter(drafter, out, extra={"offline_steps": cfg.steps})
    prov = {"command": command or shlex.join(sys.argv),
            "config": dataclasses.asdict(cfg), "target_model": str(model_dir.resolve()),
            "target_config_sha256": config_sha256(model_dir), "data": source, "num_prompts": len(prompts),
            "num_samples": len(buffer), "num_response_tokens": num_gen,
            "num_train_pairs": buffer.num_train_tokens(), "num_heldout_pairs": buffer.num_train_tokens(heldout=True),
            "steps": cfg.steps, "draft_vocab": cfg.draft_vocab, "metrics_before": before, "metrics": after,
            "train_loss_last": dataclasses.asdict(m) if m else None, "generate_s": round(gen_s, 2),
            "train_s": round(train_s, 2), "total_s": round(time.perf_counter() - t0, 2),
            "threads": torch.get_num_threads(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "tlt_version": tlt.__version__}
    (out / "provenance.json").write_text(json.dumps(prov, indent=2) + "\n")
    print(f"saved drafter to {out} ({prov['total_s']:.0f} s in all)")
    return prov


def _metrics_table(before: dict, after: dict) -> str:
    if not after:
        return "no held-out samples (holdout_every=0 or too few prompts): nothing evaluated"
    rows = [f"{'held-out':12s} {'before':>9s} {'after':>9s}"]
    rows += [f"{k:12s} {before[k]:9.4f} {after[k]:9.4f}" for k in ("loss", "hidden_loss", "ce", "acc", "accept_proxy")]
    return "\n".join(rows)


# ---- the cached drafter for the default model -----------------------------------------------------------------
# The default run's rollout temperature (tlt/configs/default.yaml): the law the default drafter's drafts must hold.
DEFAULT_TEMPERATURE = 0.6
# Sized to build in about three minutes on 2 CPU cores (measured: see provenance.json's generate_s / train_s), at
# the temperature the drafter will serve: 64 prompts at 1.0 and 80 steps overfit (held-out top-1 0.33, training
# 0.66) and accepted 1.51 tokens a depth-4 chain at 0.6; this build 1.79 (docs/design.md §2). Threads: the cores
# idle when it starts (threads=0), so that none contends with another process for a core (on a shared machine
# that made the same build 5x slower); on an idle 2-core AVX2 CPU two threads built it in 164 s against one
# thread's 268 s, the same drafter bit for bit there.
DEFAULT_BUILD = dict(num_prompts=256, max_tokens=128, steps=200, draft_vocab=8192, threads=0,
                     temperatures=str(DEFAULT_TEMPERATURE))


def warmup_build(dt, data: str | None, temperature: float) -> dict:
    """OfflineConfig fields of the warm-up drafter that a DrafterTrainConfig's warmup_* keys ask for, on `data`
    (None: the default task), sampled at `temperature` (the run's rollout temperature) unless warmup_temperatures
    names others. The keys' defaults at the default config's temperature give DEFAULT_BUILD; larger values give a
    stronger drafter (more of the target's own samples, longer responses, more steps)."""
    temps = dt.warmup_temperatures or [temperature]  # one spelling a temperature: 1 and 1.0 are one build
    build = dict(DEFAULT_BUILD, num_prompts=dt.warmup_num_prompts, n=dt.warmup_samples_per_prompt,
                 max_tokens=dt.warmup_max_tokens, steps=dt.warmup_steps, ttt_steps=dt.ttt_steps,
                 temperatures=",".join(str(float(t)) for t in temps))
    return build | ({"data": data} if data else {})


# the keys that change how a build runs, not what it builds, at the values every build had while they were part of
# a build's identity (its cache directory's name)
_RUN_ONLY = {"threads": 1, "log_every": 10}


def drafter_cache_dir(model_path: str | Path, build: dict | None = None) -> Path:
    """The default build's drafter is <cache>/drafters/<model name>; any other build's gets a suffix of its own,
    which covers the prompt file's content (an edited file is another build), not only its path."""
    name = Path(model_path).name
    if build is not None and _canonical(build) != _canonical(DEFAULT_BUILD):
        # the run-only keys at the values every warm-up build had while they named builds: cached drafters keep
        # their directories
        key = _canonical(build) | _RUN_ONLY
        if key.get("data"):
            key["data_sha256"] = hashlib.sha256(Path(key["data"]).read_bytes()).hexdigest()
        name += "-" + hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]
    return cache_root() / "drafters" / name


# keys added after builds were named, at the value every build had before: left out, so those keep their names
_ADDED_LATER = {"fc_bias": True}


def _canonical(build: dict) -> dict:
    """A build with OfflineConfig's defaults filled in, so that equal builds compare equal however spelled; without
    the keys that change how it runs, not what it builds (threads, logging)."""
    return {k: v for k, v in dataclasses.asdict(OfflineConfig(**build)).items()
            if k not in ("out", "model", *_RUN_ONLY) and not (k in _ADDED_LATER and v == _ADDED_LATER[k])}


def default_drafter_path(model_path: str | Path | None = None, build: dict | None = None) -> Path:
    """Directory of the cached warm-up drafter for `model_path` (default: SmolLM2-135M-Instruct) built with
    `build` (OfflineConfig fields; default DEFAULT_BUILD); built on the first call (temp dir + rename, so a crash
    or a concurrent builder never leaves a half-written drafter)."""
    if model_path is None:
        model_path = default_model_path()
    model_path = Path(model_path)
    build = DEFAULT_BUILD if build is None else build
    out = drafter_cache_dir(model_path, build)

    def complete(path: Path) -> bool:  # a drafter of this build (the default's directory may hold an older one)
        try:
            return _built_as(json.loads((path / "provenance.json").read_text()), build)
        except (OSError, ValueError):  # none, or one that does not read: not this build's
            return False

    if out.exists() and not complete(out):
        print(f"the cached warm-up drafter {out} was built with other settings than this version's: rebuilding it")

    def build_into(tmp: Path) -> None:
        print(f"building the warm-up drafter for {model_path.name} into {out} (once; the default build takes about "
              f"three minutes on CPU)")
        train_drafter(OfflineConfig(out=str(tmp), model=str(model_path), **build),
                      command=f"tlt.drafter_train.offline.default_drafter_path({str(model_path)!r}, {build!r})")
    build_atomically(out, build_into, complete, verify=check_drafter_dir)  # a damaged one is rebuilt
    _check_same_target(out, model_path)
    return out


def _built_as(provenance: dict, build: dict) -> bool:
    """Whether a drafter's provenance records this build (keys later versions added take their defaults)."""
    names = {f.name for f in dataclasses.fields(OfflineConfig)}
    built = {k: v for k, v in provenance.get("config", {}).items() if k in names}
    return _canonical(built) == _canonical(build)


def _check_same_target(drafter_dir: Path, model_path: Path) -> None:
    prov = json.loads((drafter_dir / "provenance.json").read_text())
    if prov.get("target_config_sha256") != config_sha256(model_path):
        raise ValueError(f"the cached drafter {drafter_dir} was trained for another model ({prov.get('target_model')})"
                         f" than {model_path}: delete {drafter_dir} or set TLT_CACHE to another directory")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cfg = parse_args(argv)
    if cfg.out is None:
        print("tlt train-drafter: --out DIR (or out=DIR) is required; see --help", file=sys.stderr)
        return 2
    train_drafter(cfg, shlex.join(["tlt", "train-drafter", *argv]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
