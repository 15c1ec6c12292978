"""Test helpers: a drafter trained in seconds on a tiny target's own samples, so drafts get accepted; a virtual
clock that prices a tiny model's forwards as a real model's on a given device."""
from __future__ import annotations

import torch

import tlt
from tlt.drafter_train.buffer import DrafterBuffer
from tlt.drafter_train.trainer import DrafterTrainer
from tlt.engine.clock import VirtualClock
from tlt.engine.cost_model import CostModel
from tlt.models.config import ModelConfig
from tlt.speculative.drafter import Drafter

# SmolLM2-135M-Instruct's architecture, the default model's: what a virtual clock prices a tiny model's forwards as
SMOLLM2 = ModelConfig(family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                      num_heads=9, num_kv_heads=3, head_dim=64, tie_word_embeddings=True)


def virtual_clock(profile: str = "h100", shape: ModelConfig = SMOLLM2, draft_vocab: int | None = 8192) -> VirtualClock:
    return VirtualClock(CostModel.named(profile, shape, draft_vocab))


def quick_drafter(model, steps: int = 150, num_prompts: int = 24, max_tokens: int = 48, seed: int = 0,
                  temperature: float = 0.7) -> Drafter:
    g = torch.Generator().manual_seed(seed)
    V = model.cfg.vocab_size
    prompts = [torch.randint(1, V, (int(n),), generator=g).tolist() for n in torch.randint(3, 10, (num_prompts,), generator=g)]
    llm = tlt.LLM(model, max_num_seqs=32)
    outs = llm.generate(prompts, tlt.SamplingParams(n=2, temperature=temperature, max_tokens=max_tokens, seed=seed,
                                                    return_hidden_states=True))
    buf = DrafterBuffer(max_tokens=10**6, window_len=64)
    for p, o in zip(prompts, outs):
        for c in o.outputs:
            buf.add(p + c.token_ids, c.hidden_states, response_start=len(p), rl_step=0, hidden_start=len(p) - 1)
    torch.manual_seed(seed)
    drafter = Drafter(model.cfg).attach(model)
    DrafterTrainer(drafter, lr=3e-3, batch_tokens=512, amp_dtype=None).train_steps(buf, steps)
    return drafter.eval()
