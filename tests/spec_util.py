"""Test helper: a drafter trained in seconds on a tiny target's own samples, so drafts get accepted."""
from __future__ import annotations

import torch

import tlt
from tlt.drafter_train.buffer import DrafterBuffer
from tlt.drafter_train.trainer import DrafterTrainer
from tlt.speculative.drafter import Drafter


def quick_drafter(model, steps: int = 150, num_prompts: int = 24, max_tokens: int = 48, seed: int = 0) -> Drafter:
    g = torch.Generator().manual_seed(seed)
    V = model.cfg.vocab_size
    prompts = [torch.randint(1, V, (int(n),), generator=g).tolist() for n in torch.randint(3, 10, (num_prompts,), generator=g)]
    llm = tlt.LLM(model, max_num_seqs=32)
    outs = llm.generate(prompts, tlt.SamplingParams(n=2, temperature=0.7, max_tokens=max_tokens, seed=seed,
                                                    return_hidden_states=True))
    buf = DrafterBuffer(max_tokens=10**6, window_len=64)
    for p, o in zip(prompts, outs):
        for c in o.outputs:
            buf.add(p + c.token_ids, c.hidden_states, response_start=len(p), rl_step=0, hidden_start=len(p) - 1)
    torch.manual_seed(seed)
    drafter = Drafter(model.cfg).attach(model)
    DrafterTrainer(drafter, lr=3e-3, batch_tokens=512, amp_dtype=None).train_steps(buf, steps)
    return drafter.eval()
