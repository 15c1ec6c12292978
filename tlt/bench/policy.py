"""What the speculation policy does on a given device: the real engine and drafter decode on this machine while a
virtual clock charges every forward from a device profile (tlt.engine.clock, tlt.engine.cost_model).

    tlt bench policy [--profile h100] [--model DIR] [--drafter DIR] [--shape DIR] [--batch-sizes 1,4,16,64]
                     [--max-tokens 128] [--rounds 3] [--temperature 0] [--arm-table auto|cpu|gpu]

For each batch size: plain decoding, every arm of the policy's table as a fixed strategy, and the adaptive policy
decode the same prompts (`--rounds` batches in one engine each, so the policy carries what it learned from one batch
to the next, as across RL steps). SD is exact, so every configuration emits the same tokens, and their virtual
decode times compare directly: the table gives each one's speedup over plain decoding and the best fixed arm,
then the policy's record (`AdaptivePolicy.explain`). The costs are the profile's for `--shape` (default: the model's
own architecture); acceptance is this model's and drafter's on these prompts. A planning tool: will SD pay here?
Defaults: the default model, its warm-up drafter and the default task's prompts. Prints a table and a JSON line.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass


import tlt
from tlt.bench.common import print_json_line, print_table
from tlt.engine.clock import VirtualClock
from tlt.engine.cost_model import CostModel, load_profiles
from tlt.models.config import ModelConfig
from tlt.speculative.config import SpecConfig
from tlt.speculative.policy import Arm


@dataclass
class Run:
    decode_s: float          # virtual seconds of the decode steps
    tokens: int              # tokens emitted
    stats: dict              # tlt.LLM.stats() at the end
    explain: dict | None     # the adaptive policy's record (None without one)


Batch = tuple[list[list[int]], list[tlt.SamplingParams]]  # prompts and their sampling params (lengths may differ)


def long_tail(prompts: list[list[int]], max_tokens: int, temperature: float = 0.0, seed: int = 0) -> Batch:
    """The prompts with a rollout's long tail of lengths: row i of n stops after max_tokens * ((i + 1) / n) ** 2
    tokens (at least 1, ignore_eos), so the batch shrinks through every size below its start, most rows short."""
    n = len(prompts)
    return prompts, [tlt.SamplingParams(temperature=temperature, max_tokens=max(1, round(max_tokens * ((i + 1) / n)
                                                                                          ** 2)),
                                        ignore_eos=True, seed=seed + i) for i in range(n)]


def decode(model, spec: dict | None, costs: CostModel, batches: list[Batch], policy=None,
           max_num_seqs: int | None = None) -> Run:
    """Decode each batch in turn on one engine timed by a VirtualClock of `costs`, at most max_num_seqs rows at once
    (default: a whole batch; fewer, and the rest wait for slots, which holds the batch size); policy: a function
    that returns the engine's policy changed (the tests' controls), or None."""
    llm = tlt.LLM(model, max_num_seqs=max_num_seqs or max(len(p) for p, _ in batches), speculative_config=spec,
                  clock=VirtualClock(costs))
    if policy is not None and llm.spec is not None:
        llm.spec.policy = policy(llm.spec.policy)
    tokens = 0
    for prompts, params in batches:
        outs = llm.generate(prompts, params)
        tokens += sum(len(c.token_ids) for o in outs for c in o.outputs)
    st = llm.stats()
    return Run(st["decode_time_s"], tokens, st, llm.spec.policy.explain() if llm.spec is not None else None)


def fixed(arm: Arm, drafter: str | None) -> dict:
    """The speculative_config that runs `arm` at every batch size."""
    if arm.method == "ngram":
        return dict(method="ngram", adaptive=False, bs_threshold=None, num_speculative_tokens=arm.num_draft_tokens)
    return dict(method="eagle", model=drafter, adaptive=False, bs_threshold=None, num_speculative_tokens=arm.depth,
                draft_topk=arm.topk, num_draft_tokens=arm.num_draft_tokens)


def compare(model, drafter: str | None, costs: CostModel, batches: list[Batch], arm_table: str = "auto",
            policy=None, arms: int = 0, bs_threshold: int | None = None, max_num_seqs: int | None = None) -> dict:
    """Plain decoding and the adaptive policy on the batches, and each arm of the bucket of max_num_seqs (or the first
    batch's size) fixed, on the first `arms` batches -> {"plain": Run, "adaptive": Run, "arms": {name: Run},
    "plain_first": Run (plain decoding of those batches, what the arms compare with)}."""
    adaptive = dict(method="eagle" if drafter else "ngram", model=drafter, bs_threshold=bs_threshold,
                    arm_table=arm_table)
    out = {"plain": decode(model, None, costs, batches, max_num_seqs=max_num_seqs),
           "adaptive": decode(model, adaptive, costs, batches, policy, max_num_seqs), "arms": {}}
    if arms:
        first = batches[:arms]
        out["plain_first"] = decode(model, None, costs, first, max_num_seqs=max_num_seqs)
        table = SpecConfig.from_dict(adaptive).policy(has_drafter=drafter is not None, device_type="cpu")
        for rec in table.bucket(max_num_seqs or len(batches[0][0])).arms:
            if rec.arm.method != "off":
                out["arms"][rec.arm.name] = decode(model, fixed(rec.arm, drafter), costs, first,
                                                   max_num_seqs=max_num_seqs)
    return out


def speedups(result: dict, bs: int | None = None) -> dict[str, float]:
    """Each configuration's speed over plain decoding's on the same batches: their virtual decode times' ratio (the
    same tokens: SD is exact), or with bs, their tokens per virtual second at exactly that batch size (a bucket's
    own throughput, where requests waiting held the batch there)."""
    def speed(run):
        if bs is None:
            return 1.0 / run.decode_s
        steps, tokens, seconds = run.stats["decode_by_bs"][bs]
        return tokens / seconds
    out = {"adaptive": speed(result["adaptive"]) / speed(result["plain"])}
    for name, run in result["arms"].items():
        out[name] = speed(run) / speed(result["plain_first"])
    return out


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="tlt bench policy", description=__doc__.split("\n")[0])
    ap.add_argument("--profile", default="h100", help="a device profile's name (tlt/engine/device_profiles.json)")
    ap.add_argument("--profiles", default=None, help="another profiles file (e.g. `tlt bench profile --out`)")
    ap.add_argument("--model", default=None, help="target HF directory (default: the default model)")
    ap.add_argument("--drafter", default=None, help="drafter directory (default: the default model's warm-up one)")
    ap.add_argument("--shape", default=None, help="an HF directory whose config.json the costs are for "
                                                  "(default: the model's)")
    ap.add_argument("--batch-sizes", default="1,4,16,64")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3, help="batches decoded in turn by one engine")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--long-tail", action="store_true",
                    help="rows of a batch stop at lengths spread up to --max-tokens (the batch shrinks to 1)")
    ap.add_argument("--arm-table", default="auto", choices=("auto", "cpu", "gpu"),
                    help="auto: gpu for a roofline profile, cpu for a table one")
    args = ap.parse_args(argv)
    args.batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    profiles = load_profiles(args.profiles)
    if args.profile not in profiles:
        ap.error(f"unknown profile {args.profile!r}: choose one of {', '.join(sorted(profiles))}")
    if min(args.batch_sizes) < 1 or args.rounds < 1 or args.max_tokens < 1:
        ap.error("--batch-sizes, --rounds and --max-tokens must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    import json
    from pathlib import Path
    from tlt.bench.common import default_task_prompt_ids
    args = parse_args(list(argv or []))
    if args.model is None:
        from tlt.models.smollm import default_model_path
        from tlt.drafter_train.offline import default_drafter_path
        args.model = str(default_model_path())
        args.drafter = args.drafter or str(default_drafter_path())
    llm = tlt.LLM(args.model, dtype="float32")
    shape = ModelConfig.from_hf(json.loads((Path(args.shape or args.model) / "config.json").read_text()))
    profile = load_profiles(args.profiles)[args.profile]
    table = args.arm_table if args.arm_table != "auto" else ("gpu" if profile["kind"] == "roofline" else "cpu")
    draft_vocab = None
    if args.drafter:
        from tlt.speculative.drafter_io import load_drafter
        d2t = load_drafter(args.drafter).d2t
        draft_vocab = None if d2t is None else int(d2t.numel())
    costs = CostModel(profile, shape, draft_vocab)
    pool = default_task_prompt_ids(llm.tokenizer, max(args.batch_sizes) * args.rounds)
    rows, record = [], {}
    for bs in args.batch_sizes:
        batches = [long_tail(pool[i * bs:(i + 1) * bs], args.max_tokens, args.temperature, seed=i * bs)
                   for i in range(args.rounds)] if args.long_tail else \
            [(pool[i * bs:(i + 1) * bs], [tlt.SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                                                             ignore_eos=True, seed=i * bs + j) for j in range(bs)])
             for i in range(args.rounds)]
        result = compare(llm.model, args.drafter, costs, batches, table, arms=args.rounds)
        ups = speedups(result)
        best = max((k for k in ups if k != "adaptive"), key=ups.get, default=None)
        st = result["adaptive"].stats
        rows.append({"bs": bs, "plain_tok_s": result["plain"].tokens / result["plain"].decode_s,
                     "adaptive": ups["adaptive"], "best_arm": best, "best": ups.get(best),
                     "vs_best": ups["adaptive"] / max(ups.get(best) or 1.0, 1.0),
                     "accept_len": st.get("spec_accept_length"), "sd_on": st.get("spec_on_fraction"),
                     **{k: v for k, v in ups.items() if k != "adaptive"}})
        record[bs] = result["adaptive"].explain
    print(f"profile {args.profile} for {Path(args.shape or args.model).name}; model {args.model}; drafter "
          f"{args.drafter}; {args.rounds} rounds of {args.max_tokens} tokens at temperature {args.temperature}")
    columns = ["bs", "plain_tok_s", "adaptive", "best_arm", "best", "vs_best", "accept_len", "sd_on"]
    print_table(rows, columns)
    for bs, explain in record.items():
        print(f"policy at bs {bs}: " + "; ".join(
            f"{bucket}: " + ", ".join(f"{a} {r['value']}x/{r['chosen']} ({r['state']})" for a, r in arms.items())
            for bucket, arms in explain.items() if any(r["chosen"] for r in arms.values())))
    print_json_line("policy", {"profile": args.profile, "rows": rows, "policy": record,
                               "args": {k: v for k, v in vars(args).items()}})
    return 0


