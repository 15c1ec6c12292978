"""Speculative-decoding benchmark: SD vs our plain decoding per strategy and batch size (temperature 1 unless told).

    tlt bench spec [--drafter DIR] [--batch-sizes 1,2,4,8,16,32] [--max-tokens 128] [--repeats 3] [--quick]
                   [--prompts 64] [--temperature 1.0] [--stop-at-eos] [--device auto|cpu|cuda]
                   [--dtype auto|float32|bfloat16] [--sd-eager-too]
                   [--strategies ngram,eagle_chain,eagle_tree,adaptive,plain_control]

Strategies: each fixed arm (EAGLE chain, EAGLE tree, n-gram) and the adaptive policy (the policy over the arm table,
SD gated by batch size). Prompts are the default task's chat prompts, a pool of --prompts: each round decodes the
next bs of them (the same batch for every configuration), so a small batch's median covers many prompts; every
configuration samples with the same seeds. Every row decodes --max-tokens tokens, past its EOS, so a batch size's
cost holds through a round; `--stop-at-eos` ends rows at EOS as rollouts do (the tokens past EOS are text no drafter
was trained on, so SD accepts less there). Also, at batch size 1, transformers' assisted generation (a 4-layer
truncation of the target as the assistant: SmolLM2-135M is the smallest of its family) and prompt-lookup decoding,
against transformers' plain `generate`. Configurations run round-robin, the order rotated every round; each speedup
is the median over rounds of plain's time over the strategy's, with a distribution-free ~95% interval for that
median (`ci`: where it excludes 1.00 the difference is more than the machine's noise; `plain_control`, a second plain
engine, shows that noise directly). Prints a table, a verdict on the adaptive policy's goal (never below 0.98x
plain) and a final JSON line.
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch

import tlt
from tlt.bench.common import (TASKS, default_task_prompt_ids, interleaved_times, median_ci, median_time, paired_ratios,
                              print_json_line, print_table, sign_test_rank)
from tlt.device import resolve_device, resolve_dtype


def strategies(drafter: str | None, depth: int, sd_eager: bool = False,
               wanted: list[str] | None = None) -> dict[str, dict | None]:
    """Each strategy's speculative_config, plain first; sd_eager adds "<name>/sd_eager", the same with the
    speculator's CUDA graphs off (the target's stay on); wanted: only these besides plain (None: all)."""
    s = {name: spec for name, spec in _strategies(drafter, depth).items()
         if name == "plain" or (name in wanted if wanted is not None else name != "plain_control")}
    if sd_eager:
        s.update({f"{name}/sd_eager": spec for name, spec in list(s.items()) if spec is not None})
    return s


ADAPTIVE_GOAL = 0.98  # adaptive SD's promise: at least this share of plain decoding's speed at every batch size


def _strategies(drafter: str | None, depth: int) -> dict[str, dict | None]:
    s: dict[str, dict | None] = {"plain": None,
                                 "plain_control": None,  # a second plain engine: the machine's noise (opt-in)
                                 "ngram": dict(method="ngram", bs_threshold=None, adaptive=False,
                                               num_speculative_tokens=depth)}
    if drafter:
        s["eagle_chain"] = dict(method="eagle", model=drafter, bs_threshold=None, adaptive=False,
                                num_speculative_tokens=depth)
        s["eagle_tree"] = dict(method="eagle", model=drafter, bs_threshold=None, adaptive=False,
                               num_speculative_tokens=depth, draft_topk=2, num_draft_tokens=2 * depth)
        s["adaptive"] = dict(method="eagle", model=drafter)
    return s


def run_ours(model, tok, prompts, bs, specs: dict[str, dict | None], max_tokens, repeats, seed, temperature=1.0,
             stop_at_eos: bool = False):
    """All strategies at one batch size, timed interleaved; speedup = median over rounds of plain / strategy.
    Round j (0: the warm-up) decodes the next bs prompts of `prompts` (wrapping), the same batch for every strategy,
    so the ratios pair like with like while a small batch's median covers many prompts, not the one or two
    `prompts[:bs]` would be. Every row decodes max_tokens, past its EOS (the batch size holds), unless
    `stop_at_eos`: then a row ends at its EOS as in a rollout, and the batch shrinks as rows end. Returns the rows
    and plain decoding's (prompt, response) pairs of the last round."""
    params = tlt.SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed, ignore_eos=not stop_at_eos)
    batches = [[prompts[(j * bs + i) % len(prompts)] for i in range(bs)] for j in range(repeats + 1)]
    llms = {name: tlt.LLM(model, tokenizer=tok, max_num_seqs=max(bs, 1), speculative_config=spec)
            for name, spec in specs.items()}
    for name, llm in llms.items():
        if name.endswith("/sd_eager"):
            llm.spec.disable_graphs()

    # CUDA graphs captured in each round (the first is the warm-up), and the seconds it took
    captures = {name: [] for name in llms}
    capture_s = {name: [] for name in llms}
    tokens = {name: [] for name in llms}  # tokens decoded in each round, the warm-up's first

    def runner(name, llm):
        def go():
            batch = batches[len(tokens[name])]
            if llm.spec is not None:
                llm.spec.reset_stats()
                # a round may decode seeded requests an earlier one did (the pool wraps): the n-gram drafter's
                # history of earlier responses to these prompts would hold the very responses it is about to draft
                llm.spec.ngram.clear_history()
            before, before_s = llm.engine.num_graph_captures, llm.engine.graph_capture_time_s
            out = llm.generate(batch, params)
            captures[name].append(llm.engine.num_graph_captures - before)
            capture_s[name].append(llm.engine.graph_capture_time_s - before_s)
            tokens[name].append(sum(len(o.outputs[0].token_ids) for o in out))
            return out
        return go
    timed = interleaved_times({name: runner(name, llm) for name, llm in llms.items()}, repeats)
    ratios = {name: paired_ratios(timed["plain"]["times"], t["times"]) for name, t in timed.items()}
    rows = []
    for name, t in timed.items():
        stats = llms[name].stats()
        # SD steps are timed against plain decoding only where the policy also decodes plainly (adaptive)
        priced = specs[name] is not None and specs[name].get("adaptive", True)
        tok_s = statistics.median(n / dt for n, dt in zip(tokens[name][1:], t["times"]))
        rows.append({"strategy": name, "bs": bs, "tok_s": tok_s, "time_s": t["median"],
                     "speedup": statistics.median(ratios[name]), **_ci(ratios[name]),
                     "spread": f"{t['min']:.2f}-{t['max']:.2f}", "accept_len": stats.get("spec_accept_length"),
                     "sd_on": stats.get("spec_on_fraction"), "captures": sum(captures[name][1:]),
                     "capture_s": sum(capture_s[name][1:]),
                     # the last round's seconds in SD steps, and plain decoding's estimated seconds for their
                     # tokens less those (the policy's prices; negative: SD steps cost time)
                     "sd_s": stats.get("spec_step_time_s") if priced else None,
                     "sd_saved_s": stats.get("spec_net_saved_s") if priced else None})
    return rows, [(p, o.outputs[0].token_ids) for p, o in zip(batches[-1], timed["plain"]["result"])]


def _ci(ratios: list[float]) -> dict:
    lo, hi, _ = median_ci(ratios)
    return {"ci_low": lo, "ci_high": hi, "ci": f"{lo:.2f}-{hi:.2f}"}


def run_hf_assisted(model_dir, prompt, max_tokens, repeats, dtype, device, temperature=1.0):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    assistant = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, num_hidden_layers=4).to(device).eval()
    ids = torch.tensor([prompt], device=device)
    kw = dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=True, temperature=temperature, top_k=0)
    out = {}
    with torch.inference_mode():
        for name, extra in (("hf_plain", {}), ("hf_assisted_4layer", {"assistant_model": assistant}),
                            ("hf_prompt_lookup", {"prompt_lookup_num_tokens": 4})):
            med, lo, hi, _ = median_time(lambda: hf.generate(ids, **kw, **extra), repeats)
            out[name] = {"tok_s": max_tokens / med, "time_s": med, "spread": f"{lo:.2f}-{hi:.2f}"}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tlt bench spec", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="HF model dir (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--drafter", default=None, help="drafter dir (default: the default model's cached drafter)")
    ap.add_argument("--no-drafter", action="store_true", help="n-gram only")
    ap.add_argument("--batch-sizes", default="1,2,4,8,16,32")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (> 0)")
    ap.add_argument("--stop-at-eos", action="store_true",
                    help="end each row at its EOS as a rollout does (the batch shrinks as rows end: bs is the batch "
                         "a round starts with); default: every row decodes --max-tokens, past its EOS, so the batch "
                         "size holds, and the tokens past EOS are text the drafter was not trained on")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=64,
                    help="prompt pool: each round at a batch size decodes the next bs prompts of it, wrapping (at "
                         "least the largest batch size is drawn)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="auto", help="auto (cuda if available), cpu or cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--task", default="default", choices=TASKS,
                    help="prompt set: default (the default task) or longtail (tlt.tasks.longtail_sort)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--sd-eager-too", action="store_true",
                    help="also each SD strategy with the speculator's CUDA graphs off (the target's stay on)")
    ap.add_argument("--strategies", default=None,
                    help="comma list of the strategies to time against plain decoding (default: all of "
                         "ngram, eagle_chain, eagle_tree, adaptive; the EAGLE ones need a drafter); "
                         "plain_control, a second plain engine, shows the machine's noise")
    ap.add_argument("--quick", action="store_true", help="tiny settings for a smoke run")
    a = ap.parse_args(argv)
    if a.quick:
        a.batch_sizes, a.max_tokens, a.repeats, a.skip_hf = "1,2", 16, 1, True
    if a.prompts < 1:
        ap.error(f"--prompts {a.prompts}: must be >= 1")
    if not a.temperature > 0:
        ap.error(f"--temperature {a.temperature}: must be > 0 (the benchmark samples, and the oracle "
                 "bound divides the logits by it)")
    wanted = None if a.strategies is None else [x.strip() for x in a.strategies.split(",") if x.strip()]
    known = list(_strategies("drafter", a.depth))
    if wanted is not None:
        bad = [x for x in wanted if x not in known or x == "plain"]
        if bad or not wanted:
            ap.error(f"--strategies {a.strategies!r}: choose from {', '.join(known[1:])} (plain is always timed)")
        if a.no_drafter and any(x not in ("ngram", "plain_control") for x in wanted):
            ap.error(f"--strategies {a.strategies!r} with --no-drafter: only ngram runs without a drafter")
    from tlt.models import load_model, load_tokenizer
    from tlt.models.smollm import default_model_path
    model_dir = a.model or str(default_model_path())
    device = resolve_device(a.device)
    dtype = resolve_dtype(a.dtype, device)
    model, tok = load_model(model_dir, dtype=dtype, device=str(device)), load_tokenizer(model_dir)
    drafter = None
    if not a.no_drafter:
        if a.drafter:
            drafter = a.drafter
        else:
            from tlt.drafter_train.offline import default_drafter_path
            drafter = str(default_drafter_path(model_dir))
    sizes = [int(x) for x in a.batch_sizes.split(",")]
    prompts = default_task_prompt_ids(tok, max(max(sizes), a.prompts), seed=a.seed + 1000, task=a.task)
    rows, results, pairs = [], {}, []
    for bs in sizes:
        bs_rows, bs_pairs = run_ours(model, tok, prompts, bs, strategies(drafter, a.depth, a.sd_eager_too, wanted),
                                     a.max_tokens, a.repeats, a.seed, a.temperature, a.stop_at_eos)
        if bs == max(sizes):
            pairs = bs_pairs  # plain decoding's responses at the largest batch size: the oracle bound's sample
        for r in bs_rows:
            print(f"  bs {bs} {r['strategy']}: {r['tok_s']:.1f} tok/s ({r['speedup']:.2f}x)", file=sys.stderr,
                  flush=True)
            rows.append(r)
            results[f"bs{bs}/{r['strategy']}"] = {k: r[k] for k in ("tok_s", "speedup", "ci_low", "ci_high",
                                                                    "accept_len", "sd_on", "captures", "capture_s",
                                                                    "sd_s", "sd_saved_s")}
    eos = "rows stop at EOS" if a.stop_at_eos else "every row decodes them, past EOS"
    print(f"model={model_dir} dtype={dtype} max_tokens={a.max_tokens} ({eos}) prompts={len(prompts)} (each round "
          f"the next bs) temperature={a.temperature} "
          f"repeats={a.repeats} interleaved (median; speedup = median over rounds of plain/strategy time) "
          f"threads={torch.get_num_threads()}")
    print_table(rows, ["bs", "strategy", "tok_s", "speedup", "ci", "accept_len", "sd_on", "spread", "captures",
                       "capture_s", "sd_s", "sd_saved_s"])
    print(f"ci: {sign_test_rank(a.repeats)[1]:.0%} interval of the median speedup over {a.repeats} rounds; "
          "spread: the strategy's fastest-slowest round in seconds; captures / capture_s: CUDA graphs captured in the "
          "timed rounds and their seconds (each costs many steps, once); sd_s / sd_saved_s (adaptive): the last "
          "round's seconds in SD steps, and plain decoding's estimated seconds for their tokens less those")
    verdict = adaptive_verdict(rows)
    if verdict:
        print(verdict)
    bound = {d: oracle_accept_bound(model, pairs, d, temperature=a.temperature)
             for d in sorted({a.depth, 2 * a.depth})}
    print(f"\naccept length an oracle drafter could reach on plain decoding's {len(pairs)} responses (estimate; the "
          f"target-only rule accepts at most the children's target mass):")
    print_table([{"depth": d, **{f"top{k}": v for k, v in b.items()}} for d, b in bound.items()],
                ["depth", "top1", "top2", "top4"])
    results["oracle_accept_bound"] = {f"depth{d}/top{k}": v for d, b in bound.items() for k, v in b.items()}
    if not a.skip_hf:
        hf = run_hf_assisted(model_dir, prompts[0], a.max_tokens, a.repeats, dtype, device, a.temperature)
        print(f"\ntransformers at bs 1 (same prompt, temperature {a.temperature}):")
        print_table([{"strategy": k, **v} for k, v in hf.items()], ["strategy", "tok_s", "spread"])
        results.update({f"bs1/{k}": v["tok_s"] for k, v in hf.items()})
    print_json_line("spec", {"model": model_dir, "dtype": str(dtype), "max_tokens": a.max_tokens,
                              "stop_at_eos": a.stop_at_eos, "prompts": len(prompts),
                              "temperature": a.temperature, "results": results})
    return 0


def adaptive_verdict(rows: list[dict], goal: float = ADAPTIVE_GOAL) -> str | None:
    """The adaptive policy's goal (never slower than plain decoding, within `goal`) judged on the median speedups,
    naming the batch sizes where the interval lies wholly below it (slower beyond the noise)."""
    adaptive = [r for r in rows if r["strategy"] == "adaptive"]
    if not adaptive:
        return None
    below = [r["bs"] for r in adaptive if round(r["speedup"], 2) < goal]  # as the table prints it
    sure = [r["bs"] for r in adaptive if round(r["ci_high"], 2) < goal]
    worst = min(adaptive, key=lambda r: r["speedup"])
    return (f"goal: adaptive >= {goal:.2f}x plain at every batch size; "
            + ("met" if not below else f"not met at bs {', '.join(map(str, below))}")
            + f" (lowest {worst['speedup']:.2f}x at bs {worst['bs']}, interval {worst['ci']}); "
            + (f"interval wholly below {goal:.2f} at bs {', '.join(map(str, sure))}" if sure
               else f"no interval lies wholly below {goal:.2f}"))


@torch.inference_mode()
def oracle_accept_bound(model, pairs: list[tuple[list[int], list[int]]], depth: int,
                        topks: tuple[int, ...] = (1, 2, 4), temperature: float = 1.0) -> dict[int, float]:
    """Estimated accept length an oracle drafter could reach on these responses, sampled at `temperature`.

    Under the target-only rule a node's children are accepted with probability at most their target mass: at most
    p_max for a chain, at most the top-k mass m_k for a tree with k children per node. Along each response,
    bound(t) = 1 + sum_{d=1..depth} prod_{j<d} m_k(t + j) (positions past the end contribute 0). It is an estimate
    (the masses are read along the sampled path, not the drafted one), and it bounds any drafter, however trained.
    """
    sums = {k: [] for k in topks}
    for prompt, resp in pairs:
        if not resp:
            continue
        ids = torch.tensor([prompt + resp], device=next(model.parameters()).device)
        logits = model.logits(model(ids)[0, len(prompt) - 1:-1])              # [n, V]: predicts each response token
        probs = (logits.float() / temperature).softmax(-1)
        top = probs.topk(max(topks), dim=-1).values.cumsum(-1)   # [n, K] top-k mass
        n = len(resp)
        for k in topks:
            m = top[:, k - 1].double()
            acc, prod = torch.ones(n, dtype=torch.double), torch.ones(n, dtype=torch.double)
            for d in range(min(depth, n)):
                nxt = torch.zeros(n, dtype=torch.double)
                nxt[:n - d] = m[d:]
                prod = prod * nxt
                acc += prod
            sums[k].append(acc)
    return {k: float(torch.cat(v).mean()) if v else float("nan") for k, v in sums.items()}
