"""The test vector written with every export: a token sequence, the target hidden states tlt fed the drafter, and
the drafter's top-1 drafts, so any engine's integration of the drafter can be checked in seconds.

Layout (FILE, in a folder of its own: vLLM loads every *.safetensors file beside config.json as weights; fp32 /
int64; the json metadata says the same):
  input_ids          [T + 1]  x_0..x_T: a prompt and the target's greedy continuation (x_T: its token after h_{T-1})
  hidden_states      [T, H]   h_0..h_{T-1}: the target's last hidden state (after its final norm, what enters its
                              LM head) at each position
  first_draft_ids    [T]      row t pairs (h_t, x_{t+1}) and the drafter, attending causally over rows 0..t, drafts
                              this target id for x_{t+2} (its top-1 over its draft vocabulary)
  chain_draft_ids    [k]      the k-token chain after x_T: d_1 = first_draft_ids[T - 1]; row T - 1 + j pairs the
                              drafter's own output of the row before (pre-norm hidden state) with d_j: d_{j+1}
  *_margin                    top-1 minus top-2 draft logit of each draft (how far it is from a tie)
Row t sits at position t in vLLM's data flow and at t + 1 in tlt's (the position of its token): RoPE attention sees
only position differences, so both give the same drafts.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from tlt.models.decoder import Decoder
from tlt.models.loader import write_safetensors
from tlt.speculative.drafter import Drafter

FILE = "test_vector/test_vector.safetensors"
NUM_CHAIN = 3  # vLLM's num_speculative_tokens in the README's serve command


@dataclass
class TestVector:
    __test__ = False  # a data class, not a pytest test class
    input_ids: torch.Tensor           # [T + 1] long
    hidden_states: torch.Tensor       # [T, H] fp32
    first_draft_ids: torch.Tensor     # [T] long, target ids
    first_draft_margin: torch.Tensor  # [T] fp32
    chain_draft_ids: torch.Tensor     # [k] long, target ids
    chain_draft_margin: torch.Tensor  # [k] fp32

    def save(self, path: str | Path) -> None:
        meta = {"layout": __doc__.split("\n\n")[1], "num_positions": str(self.hidden_states.shape[0]),
                "num_chain": str(self.chain_draft_ids.numel())}
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        write_safetensors({k: v.contiguous().cpu() for k, v in self.__dict__.items()}, path, metadata=meta)

    @classmethod
    def load(cls, path: str | Path) -> "TestVector":
        with safe_open(str(path), framework="pt") as f:
            return cls(**{k: f.get_tensor(k) for k in cls.__dataclass_fields__})


@torch.no_grad()
def greedy_continuation(target: Decoder, prompt_ids: list[int], num_tokens: int) -> list[int]:
    """prompt_ids and the target's num_tokens greedy tokens after it (a plain forward a token: a few dozen)."""
    ids = list(prompt_ids)
    for _ in range(num_tokens):
        hidden = target(torch.tensor([ids]))
        ids.append(int(target.logits(hidden[:, -1]).argmax(-1)))
    return ids


def _top2(drafter: Drafter, pred: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """pred [N, H] -> (top-1 target ids [N], top-1 minus top-2 logit [N])."""
    top = drafter.logits(pred).topk(2, dim=-1)
    return drafter.to_target_ids(top.indices[:, 0]), top.values[:, 0] - top.values[:, 1]


@torch.no_grad()
def make_test_vector(drafter: Drafter, target: Decoder, ids: list[int], num_chain: int = NUM_CHAIN) -> TestVector:
    """The vector of `ids` (x_0..x_T, T >= 1) for `drafter` attached to `target`, both fp32: tlt's drafter forward
    (positions t + 1, as tlt.speculative.spec_decoder feeds it) over the rows, causal."""
    x = torch.tensor(ids)
    T = x.numel() - 1
    hidden = target(x[None, :T])[0]                                   # [T, H] h_0..h_{T-1}
    rows_h, rows_x = hidden, x[1:]                                   # row t: (h_t, x_{t+1})
    pos = torch.arange(1, T + 1)
    pred = drafter(rows_h[None], rows_x[None], pos[None])[0]         # [T, H]
    first, first_margin = _top2(drafter, pred)
    chain, margins = [first[-1]], [first_margin[-1]]
    last = pred[-1]
    for j in range(1, num_chain):  # append (own prediction, own draft) at the next position, attend causally
        rows_h = torch.cat([rows_h, last[None]])
        rows_x = torch.cat([rows_x, chain[-1][None]])
        pos = torch.arange(1, T + j + 1)
        last = drafter(rows_h[None], rows_x[None], pos[None])[0, -1]
        d, m = _top2(drafter, last[None])
        chain.append(d[0]); margins.append(m[0])
    return TestVector(x, hidden.float(), first, first_margin.float(), torch.stack(chain), torch.stack(margins).float())


def describe(vector: TestVector) -> str:
    return json.dumps({"positions": vector.hidden_states.shape[0], "chain": vector.chain_draft_ids.tolist(),
                       "min_margin": round(float(torch.cat([vector.first_draft_margin,
                                                            vector.chain_draft_margin]).min()), 5)})
