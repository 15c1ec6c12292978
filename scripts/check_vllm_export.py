"""The steps of scripts/check_vllm_export.sh (which runs them; see there), one subcommand each:

    prompts TARGET OUT.json [--num N]        the default task's held-out prompts and generic chat prompts, token ids
    tlt TARGET DRAFTER PROMPTS OUT.json      tlt's acceptance on them (fixed chain of K drafts, greedy, fp32)
    vllm TARGET EXPORT PROMPTS OUT.json      vLLM's (in vLLM's environment; tlt only for its plugin), and the test
                                             vector through the drafter modules vLLM loaded
    report TLT.json VLLM.json                the table, then one JSON line; exit 1 when held-out acceptance is off

Acceptance is counted per draft attempt (a request's verify step with K drafts) on both sides: at position d, the
share of attempts whose first d drafts were all accepted; mean acceptance length = 1 + accepted drafts / attempts.
vLLM: vllm:spec_decode_num_accepted_tokens_per_pos[d - 1] / vllm:spec_decode_num_drafts, and 1 +
num_accepted_tokens / num_drafts. tlt: spec_accept_rate_by_position[d] and spec_accept_length, whose denominators
are its verify steps a row, the same attempts (SD on from the first decode step: bs_threshold=null).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

CHAT = ["What is the capital of France?", "Write a haiku about autumn leaves.",
        "Explain what a hash table is in two sentences.", "Give me three tips for sleeping better.",
        "Translate 'good morning, how are you?' into Spanish.", "What causes the seasons on Earth?",
        "Write a short thank-you note to a colleague.", "How do I boil an egg?",
        "Name five animals that live in the ocean.", "What is the difference between weather and climate?",
        "Suggest a name for a bakery.", "Why is the sky blue?", "Summarize the plot of Cinderella.",
        "What is photosynthesis?", "List three uses of a paperclip.", "How many legs does a spider have?",
        "Describe a sunset in one sentence.", "What is a prime number?", "Recommend a hobby for a rainy day.",
        "What does a computer's CPU do?", "Write a limerick about a cat.", "What is the boiling point of water?",
        "How do plants drink water?", "Give an example of a simile.", "What is gravity?",
        "Tell me a fun fact about honeybees.", "What is the tallest mountain in the world?",
        "How should I start learning to cook?", "What is an atom made of?", "Write a riddle and its answer.",
        "What is the purpose of a bridge's expansion joints?", "Why do we have leap years?"]
K = 3            # num_speculative_tokens on both sides
MAX_TOKENS = 128


def cmd_prompts(a) -> dict:
    from tlt.models.loader import load_tokenizer
    from tlt.rl.launch import DEFAULT_VAL_SIZE
    from tlt.tasks.default_task import make_examples
    tok = load_tokenizer(a.target)

    def ids(messages):
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tok(text, add_special_tokens=False)["input_ids"]
    held_out = [ids(row["prompt"]) for row in list(make_examples("val", DEFAULT_VAL_SIZE, 0))[:a.num]]
    chat = [ids([{"role": "user", "content": q}]) for q in CHAT[:a.num_chat or a.num]]
    return {"held_out": held_out, "chat": chat}


def cmd_tlt(a) -> dict:
    import torch
    import tlt
    torch.set_num_threads(a.threads or torch.get_num_threads())
    prompts = json.loads(Path(a.prompts).read_text())
    spec = {"method": "eagle", "model": a.drafter, "adaptive": False, "num_speculative_tokens": K,
            "bs_threshold": None}
    llm = tlt.LLM(model=a.target, dtype="float32", max_num_seqs=max(map(len, prompts.values())), seed=0,
                  speculative_config=spec)
    out = {}
    for name, ids in prompts.items():
        llm.spec.reset_stats()
        t0 = time.perf_counter()
        res = llm.generate(prompt_token_ids=ids, sampling_params=tlt.SamplingParams(temperature=0,
                                                                                  max_tokens=MAX_TOKENS))
        s = llm.stats()
        out[name] = {"attempts": llm.spec.st["verify_steps"],
                     "accept_rate_by_pos": [s["spec_accept_rate_by_position"][d] for d in range(1, K + 1)],
                     "accept_length": s["spec_accept_length"], "seconds": time.perf_counter() - t0,
                     "outputs": [r.outputs[0].token_ids for r in res]}
    return out


def _vllm_counts(llm) -> dict:
    c = {}
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            c["per_pos"] = list(m.values)
        elif m.name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens"):
            c[m.name.rsplit("_num_", 1)[1]] = m.value
    return c


def _vector_through_vllm(worker, vector_path: str) -> dict:
    """The test vector through the drafter modules vLLM loaded (fc, the layer's projections, rotary, norm and MLP,
    compute_logits: the plugin's masking included), with torch's causal attention standing in for vLLM's paged
    kernel, which needs a scheduled batch. Run on the worker (LLM.collective_rpc)."""
    import torch
    import torch.nn.functional as F
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    v = load_file(vector_path)
    model = worker.model_runner.drafter.model
    inner, layer = model.model, model.model.layers[0]
    attn = layer.self_attn

    def rows(hidden, ids, pos):  # vLLM's EAGLE-1 step over rows attending causally: (pred hidden, logits)
        x = inner.fc(torch.cat([inner.embed_tokens(ids), hidden], -1))
        qkv, _ = attn.qkv_proj(x)
        q, k, val = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q, k = attn.rotary_emb(pos, q, k)
        n, d = x.shape[0], attn.head_dim
        o = F.scaled_dot_product_attention(q.view(n, -1, d).transpose(0, 1), k.view(n, -1, d).transpose(0, 1),
                                           val.view(n, -1, d).transpose(0, 1), is_causal=True, enable_gqa=True,
                                           scale=attn.scaling)
        o, _ = attn.o_proj(o.transpose(0, 1).reshape(n, -1))
        h, residual = layer.post_attention_layernorm(o.clone(), x.clone())
        pred = layer.mlp(h) + residual
        return pred, model.compute_logits(pred)

    with set_current_vllm_config(worker.vllm_config), torch.inference_mode():
        ids, hidden = v["input_ids"], v["hidden_states"].to(inner.fc.weight.dtype)
        T = hidden.shape[0]
        pred, logits = rows(hidden, ids[1:], torch.arange(T))
        first = logits.argmax(-1)
        chain, h, x = [int(first[-1])], hidden, ids[1:]
        last = pred[-1:]
        for j in range(1, v["chain_draft_ids"].numel()):
            h, x = torch.cat([h, last]), torch.cat([x, torch.tensor([chain[-1]])])
            pred, logits = rows(h, x, torch.arange(T + j))
            last = pred[-1:]
            chain.append(int(logits[-1].argmax()))
    fc_bias = inner.fc.bias
    return {"first_draft_matches": int((first == v["first_draft_ids"]).sum()), "positions": T,
            "chain": chain, "chain_expected": v["chain_draft_ids"].tolist(),
            "drafter_class": type(model).__name__,
            "fc_bias_loaded": None if fc_bias is None else float(fc_bias.detach().abs().sum()),
            "draft_vocab_size": None if getattr(model, "draft_vocab_ids", None) is None
            else int(model.draft_vocab_ids.numel())}


def cmd_vllm(a) -> dict:
    from vllm import LLM, SamplingParams
    prompts = json.loads(Path(a.prompts).read_text())
    t0 = time.perf_counter()
    llm = LLM(model=a.target, dtype="float32", seed=0, max_model_len=2048, enforce_eager=False,
              max_num_seqs=max(map(len, prompts.values())), kv_cache_memory_bytes=1 << 30,
              disable_log_stats=False,
              speculative_config={"method": "eagle", "model": a.export, "num_speculative_tokens": K})
    out = {"init_seconds": time.perf_counter() - t0,
           "vector": llm.collective_rpc(_vector_through_vllm,
                                        args=(str(Path(a.export) / "test_vector" / "test_vector.safetensors"),))[0]}
    for name, ids in prompts.items():
        before = _vllm_counts(llm)
        t0 = time.perf_counter()
        res = llm.generate([{"prompt_token_ids": p} for p in ids], SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
        after = _vllm_counts(llm)
        drafts = after["drafts"] - before.get("drafts", 0)
        accepted = after["accepted_tokens"] - before.get("accepted_tokens", 0)
        per_pos = [x - y for x, y in zip(after["per_pos"], before.get("per_pos", [0] * K))]
        out[name] = {"attempts": drafts, "accept_rate_by_pos": [p / drafts for p in per_pos],
                     "accept_length": 1 + accepted / drafts, "seconds": time.perf_counter() - t0,
                     "outputs": [list(r.outputs[0].token_ids) for r in res]}
    return out


def cmd_report(a) -> int:
    t, v = json.loads(Path(a.tlt).read_text()), json.loads(Path(a.vllm).read_text())
    vec = v["vector"]
    print(f"test vector through vLLM's loaded {vec['drafter_class']}: first drafts {vec['first_draft_matches']}/"
          f"{vec['positions']} as tlt's, chain {vec['chain']} (tlt {vec['chain_expected']}); fc bias loaded: "
          f"{vec['fc_bias_loaded']} (sum |b|); draft vocabulary: {vec['draft_vocab_size']}")
    head = f"{'prompts':9s} {'side':5s} {'attempts':>8s} " + " ".join(f"{'pos' + str(d):>6s}" for d in range(1, K + 1))
    print(head + f" {'accept len':>10s} {'seconds':>8s}")
    summary = {"vector_ok": vec["first_draft_matches"] == vec["positions"] and vec["chain"] == vec["chain_expected"]}
    for name in ("held_out", "chat"):
        for side, r in (("tlt", t[name]), ("vllm", v[name])):
            print(f"{name:9s} {side:5s} {r['attempts']:8d} " + " ".join(f"{x:6.3f}" for x in r["accept_rate_by_pos"])
                  + f" {r['accept_length']:10.3f} {r['seconds']:8.1f}")
        rel = [abs(x - y) / y if y else float(x != y) for x, y in
               zip(v[name]["accept_rate_by_pos"] + [v[name]["accept_length"]],
                   t[name]["accept_rate_by_pos"] + [t[name]["accept_length"]])]
        same = sum(x == y for x, y in zip(t[name]["outputs"], v[name]["outputs"]))
        print(f"{name:9s} vLLM vs tlt, relative: " + " ".join(f"{x:.1%}" for x in rel)
              + f"; identical outputs {same}/{len(t[name]['outputs'])}")
        summary[name] = {"max_rel_diff": max(rel), "identical_outputs": same, "num_prompts": len(t[name]["outputs"]),
                         "tlt": {k: t[name][k] for k in ("accept_rate_by_pos", "accept_length", "attempts")},
                         "vllm": {k: v[name][k] for k in ("accept_rate_by_pos", "accept_length", "attempts")}}
    summary["vllm_init_seconds"] = v["init_seconds"]
    summary["ok"] = summary["vector_ok"] and summary["held_out"]["max_rel_diff"] <= 0.05
    print(json.dumps(summary))
    return 0 if summary["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("prompts"); s.add_argument("target"); s.add_argument("out")
    s.add_argument("--num", type=int, default=16, help="held-out prompts (the default task's val split)")
    s.add_argument("--num-chat", type=int, default=0, help="chat prompts (0: as many as --num)")
    s = sub.add_parser("tlt"); s.add_argument("target"); s.add_argument("drafter"); s.add_argument("prompts")
    s.add_argument("out"); s.add_argument("--threads", type=int, default=0)
    s = sub.add_parser("vllm"); s.add_argument("target"); s.add_argument("export"); s.add_argument("prompts")
    s.add_argument("out")
    s = sub.add_parser("report"); s.add_argument("tlt"); s.add_argument("vllm")
    a = p.parse_args(argv)
    if a.cmd == "report":
        return cmd_report(a)
    result = {"prompts": cmd_prompts, "tlt": cmd_tlt, "vllm": cmd_vllm}[a.cmd](a)
    Path(a.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
