"""A plain decode step reads the device once, for the sampled ids and their log-probs (tlt.engine.sampler.read_sampled):
the sampling takes the rows' facts from the host (HostRows) and sends their parameters and uniforms in one copy,
each row's uniform drawn from its own generator as before. On CPU the step is run on the meta device, which holds
no data (any read of it raises); on CUDA under torch.cuda.set_sync_debug_mode("error")."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tlt
from tlt.engine import sampler  # its module, so the first test runs (and fails for its reason) on code without it
from tlt.engine.sampler import HostRows, sample_from, target_logprobs, transform_logits
from tlt.models import kernels

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
TLT = Path(tlt.__file__).parent

MIXED = [tlt.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, seed=1),
         tlt.SamplingParams(temperature=0.7, top_k=5, max_tokens=8, ignore_eos=True, seed=2),
         tlt.SamplingParams(temperature=1.0, top_p=0.8, max_tokens=8, ignore_eos=True, seed=3),
         tlt.SamplingParams(temperature=1.3, top_k=20, top_p=0.9, max_tokens=8, ignore_eos=True, seed=4)]
GREEDY = [tlt.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)] * 4
ROWS = {"mixed": MIXED, "greedy": GREEDY}


def _running(llm: tlt.LLM, params: list[tlt.SamplingParams]):
    """The engine's rows after prefilling one prompt per params (the next step is a plain decode step)."""
    eng = llm.engine
    for i, p in enumerate(params):
        eng.add_request([3 + i, 17, 42, 9 + i], p)
    eng.step()
    return eng.scheduler.running


def _on_meta(llm: tlt.LLM, static: bool) -> None:
    """Move the engine's model, KV cache and runner to the meta device, whose tensors hold no data: any read of
    one on the host raises. static: the graphed forward's padded static code (uncaptured), else the eager one."""
    from tlt.engine.cuda_graph import GraphedForward
    eng, meta = llm.engine, torch.device("meta")
    llm.model.to(meta)
    eng.kv.k, eng.kv.v = [t.to(meta) for t in eng.kv.k], [t.to(meta) for t in eng.kv.v]
    eng.kv.device = eng.runner.device = meta
    if static:
        eng.runner.graphs = GraphedForward(llm.model, eng.kv, capture=False)


@pytest.mark.parametrize("forward", ["eager", "static"])
@pytest.mark.parametrize("rows", ROWS)
def test_plain_decode_step_reads_the_device_only_for_the_ids(tiny_llama_dir, rows, forward):
    """A plain decode step (its forward, then its sampling) run on the meta device gets as far as the final read
    of the ids: no read of the device (bool, int, item, tolist, a data-dependent shape) comes before it."""
    llm = tlt.LLM(tiny_llama_dir, dtype="float32", device="cpu", max_num_seqs=4)
    seqs = _running(llm, ROWS[rows])
    _on_meta(llm, forward == "static")
    eng = llm.engine
    with pytest.raises((RuntimeError, NotImplementedError)) as err, torch.inference_mode():
        eng.sample_and_append(seqs, *eng.runner.decode(seqs))
    frames = [e.name for e in err.traceback if Path(str(e.path)).is_relative_to(TLT)]
    assert frames[-1] == "read_sampled", f"the device was read in {frames[-1]}, before the final read"


def _batch(V: int = 300, N: int = 12):
    """Logits with ties, rows of every kind (greedy, top-k, top-p, both, k past the vocabulary), uniforms at both
    ends of [0, 1) (1 - 2^-24 makes u * total round up to the total: the last-positive-token rule)."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(N, V, generator=g) * 3
    logits[:, 10] = logits[:, 11]
    temp = [0.0, 0.7, 1.0, 1.3, 1.0, 0.5, 1.0, 0.0, 2.0, 1.0, 0.9, 1.1]
    top_k = [-1, 5, -1, 20, 1, -1, 10**12, 3, -1, 400, 50, -1]
    top_p = [1.0, 1.0, 0.8, 0.9, 1.0, 0.3, 1.0, 1.0, 0.95, 1.0, 0.6, 1.0]
    u = torch.rand(N, generator=g)
    u[0], u[1], u[2], u[3] = 0.0, 1 - 2**-24, 1 - 2**-24, 1 - 2**-24
    return logits, temp, top_k, top_p, u


@pytest.mark.parametrize("matmuls", ["auto", "torch"])  # tlt's CPU log-prob kernel, and torch's log_softmax
def test_the_read_free_path_samples_the_same_tokens(matmuls):
    """Static sampling (nothing read: every row divided and searched alike) gives the very ids and log-probs of
    sampling that reads the device, and of the transform, draw and log-prob taken with the device tensors made
    by torch.tensor from the same host lists."""
    logits, temp, top_k, top_p, u = _batch()
    V = logits.shape[-1]
    rows = sampler.rows_on_device(temp, top_k, top_p, u, V, "cpu")
    with kernels.backend(matmuls):
        host = HostRows.of(temp, top_k, top_p, V)
        got = {static: sampler.sample(logits, rows, host, static) for static in (False, True)}
        t = torch.tensor(temp)
        probs = transform_logits(logits, t, torch.tensor(top_k).clamp(max=V), torch.tensor(top_p))
        ids = sample_from(probs, u)
        ref = ids, target_logprobs(logits, t, ids)
    for ids, lps in got.values():
        assert torch.equal(ids, ref[0]) and torch.equal(lps, ref[1])
    for packed in (False, True):  # the CPU's two reads, and the one read made off the CPU
        assert sampler.read_sampled(*got[True], packed=packed) == (ref[0].tolist(), ref[1].tolist())


@pytest.mark.parametrize("packed", [False, True])  # the CPU's tensors, and the one copy made off the CPU
def test_rows_on_device_are_the_host_lists(packed):
    """The rows' tensors have the dtypes and values four torch.tensor calls give (top_k clamped to the vocabulary,
    as transform_logits clamps it): temperatures and top_p rounded once to fp32, uniforms kept bit for bit."""
    _, temp, top_k, top_p, u = _batch()
    rows = sampler.rows_on_device(temp, top_k, top_p, u, 300, "cpu", packed)
    expected = (torch.tensor(temp), torch.tensor([min(k, 300) for k in top_k]), torch.tensor(top_p), u)
    for got, want in zip((rows.temperature, rows.top_k, rows.top_p, rows.u), expected):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_each_row_draws_once_from_its_own_generator(tiny_llama_dir):
    """A decode step's sampled rows each take their own generator's next uniform: the ids equal the draw at
    `torch.rand(1, generator=...)` of a copy of each row's generator (the draw SD's verification takes), and each
    generator advanced by exactly one draw. Control: the same rows drawn with their uniforms shifted by one row give
    other ids."""
    llm = tlt.LLM(tiny_llama_dir, dtype="float32", device="cpu", max_num_seqs=4)
    seqs = _running(llm, MIXED)
    logits, _ = llm.engine.runner.decode(seqs)
    states = [s.generator.get_state() for s in seqs]
    ids, _ = llm.engine.sample(seqs, logits)
    u = torch.cat([torch.rand(1, generator=torch.Generator().set_state(st)) for st in states])
    temp, top_k, top_p = ([s.params.temperature for s in seqs], [s.params.top_k for s in seqs],
                          [s.params.top_p for s in seqs])
    probs = transform_logits(logits, torch.tensor(temp), torch.tensor(top_k), torch.tensor(top_p))
    assert torch.equal(ids, sample_from(probs, u))
    for s, st in zip(seqs, states):
        g = torch.Generator().set_state(st)
        torch.rand(1, generator=g)
        assert torch.equal(s.generator.get_state(), g.get_state())
    assert not torch.equal(sample_from(probs, u.roll(1)), ids)


@cuda
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("rows", ROWS)
def test_plain_decode_step_does_not_sync_on_gpu(tiny_llama_dir, rows, eager):
    """A plain decode step on CUDA, its forward (a replayed graph, or eager) and its sampling, makes no
    synchronising CUDA call before the read of the ids (which does, as it must: the mode's control)."""
    llm = tlt.LLM(tiny_llama_dir, dtype="float32", device="cuda", max_num_seqs=4, enforce_eager=eager)
    eng = llm.engine
    seqs = _running(llm, ROWS[rows])
    for _ in range(2):  # graphs captured (capture synchronises), pinned blocks allocated
        eng.sample_and_append(seqs, *eng.runner.decode(seqs))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        logits, hidden = eng.runner.decode(seqs)
        ids, lps = eng.sample(seqs, logits)
        with pytest.raises(RuntimeError, match="synchroniz"):
            ids.tolist()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert sampler.read_sampled(ids, lps) == (ids.tolist(), lps.tolist())
    assert all(0 <= t < llm.model.cfg.vocab_size for t in ids.tolist())
