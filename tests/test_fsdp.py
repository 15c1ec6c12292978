"""FSDP2 sharded training (actor.strategy=fsdp): 2 gloo ranks give the weights of 1 process on the whole batch."""
from __future__ import annotations

import contextlib
import os
import socket
import sys

import pytest
import torch
import torch.multiprocessing as mp

from tlt.config import ActorConfig
from tlt.models import load_model
from tlt.rl.actor import Actor, micro_batches, split_groups
from tlt.rl.rollout import ActorBatch
from tlt.rl.sharded_checkpoint import export_hf, full_state_dict, load_sharded, save_sharded

NUM_UPDATES = 3
# Small micro-batches, one response a row: rank 0 runs one micro-batch a mini-batch, rank 1 two, so the idle
# forwards that keep FSDP's collectives in step run too. No clipping: the control must change the update's direction.
CFG = dict(lr=1e-3, bf16_autocast=False, ppo_max_token_len=24, share_prompt=False, grad_clip=1e9)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_batch(step: int) -> ActorBatch:
    """8 responses in 4 groups of 2 sharing a prompt; groups 1 and 3 are much longer than 0 and 2."""
    g = torch.Generator().manual_seed(100 + step)
    plens = torch.tensor([5, 5, 9, 9, 4, 4, 8, 8])
    resp = torch.tensor([3, 6, 20, 14, 2, 5, 18, 21])
    N, T, R = len(plens), int((plens + resp).max()), int(resp.max())
    ids = torch.randint(1, 100, (N, T), generator=g)
    for a in range(0, N, 2):
        ids[a + 1, :plens[a]] = ids[a, :plens[a]]
    for i in range(N):
        ids[i, plens[i] + resp[i]:] = 0
    mask = (torch.arange(R)[None] < resp[:, None]).float()
    return ActorBatch(ids, plens, resp, mask, -torch.rand(N, R, generator=g),
                      torch.randn(N, 1, generator=g) * mask, torch.arange(N) // 2, 1.0)


def rank_rows(rank: int, world: int) -> list[int]:
    """Rank r takes groups r, r + world, ...: local mini-batch k of every rank together make the whole batch's
    mini-batch k (split_groups cuts whole groups in order)."""
    return [i for i in range(8) if (i // 2) % world == rank]


class LocalNormActor(Actor):
    """Negative control: normalises each rank's loss by its own token count, not the count over all ranks."""

    @staticmethod
    def _loss_normalisers(mask, world):
        return Actor._loss_normalisers(mask, 1)


def train(model_dir: str, world: int = 1, rank: int = 0, local_norm: bool = False, steps=range(NUM_UPDATES),
          load: str | None = None, save: str | None = None, **cfg) -> dict[str, torch.Tensor]:
    """Actor updates `steps` (2 mini-batches each) on this rank's rows, after resuming from the sharded checkpoint
    `load` and before saving one to `save` -> the full weights afterwards."""
    torch.manual_seed(0)
    model = load_model(model_dir, dtype=torch.float32, device="cpu")
    actor = (LocalNormActor if local_norm else Actor)(model, ActorConfig(**CFG, **cfg), total_steps=NUM_UPDATES)
    if load:
        load_sharded(actor, load)
    for step in steps:
        batch = make_batch(step).rows(rank_rows(rank, world))
        actor.update(batch, num_mini_batches=2)
    if save:
        save_sharded(actor, save)
    return {k: v.detach().clone() for k, v in full_state_dict(model).items()}


@contextlib.contextmanager
def gloo_rank(rank: int, world: int, port: int, init=None):
    """One spawned rank of a gloo group (torchrun's environment, one thread), joined by `init()` (default: gloo's
    init_process_group). After the body the ranks leave together (rank 0 may still be writing), and the group is
    torn down whatever happened."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if init is None:
        torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    else:
        init()
    try:
        yield
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()
    # done: leave without the interpreter's teardown, where a finished rank's gloo threads once aborted it
    # ("terminate called without an active exception"); a rank that failed raised above and never gets here
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _worker(rank: int, world: int, port: int, model_dir: str, out: str, kwargs: dict) -> None:
    with gloo_rank(rank, world, port):
        weights = train(model_dir, world, rank, strategy="fsdp", **kwargs)
        if rank == 0:
            torch.save(weights, out)


def train_fsdp(tmp_path, model_dir: str, world: int = 2, **kwargs) -> dict[str, torch.Tensor]:
    out = str(tmp_path / "fsdp_weights.pt")
    mp.spawn(_worker, args=(world, _free_port(), model_dir, out, kwargs), nprocs=world, join=True)
    return torch.load(out)


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir):
    return tiny_llama_dir


@pytest.fixture(scope="module")
def single(model_dir):
    return train(model_dir)


def test_two_ranks_fsdp_equal_one_process(tmp_path, model_dir, single):
    counts = []
    for rank in range(2):
        b = make_batch(0).rows(rank_rows(rank, 2))
        counts.append([len(micro_batches((mb.prompt_lens + mb.response_lens).tolist(), CFG["ppo_max_token_len"]))
                       for mb in map(b.rows, split_groups(b.group_ids.tolist(), 2))])
    assert counts[0] != counts[1]  # the idle micro-batches run
    start = load_model(model_dir).state_dict()
    assert _max_diff(single, start) > 1e-3  # the updates moved the weights
    sharded = train_fsdp(tmp_path, model_dir, gradient_checkpointing=True)
    assert sharded.keys() == single.keys()
    for k in single:
        torch.testing.assert_close(sharded[k], single[k], atol=2e-5, rtol=0, msg=k)
    # control: per-rank normalisation weighs the short and the long rank's tokens alike -> another update
    broken = train_fsdp(tmp_path, model_dir, local_norm=True)
    assert _max_diff(broken, single) > 1e-3


def test_gradient_checkpointing_same_update(model_dir, single):
    ckpt = train(model_dir, gradient_checkpointing=True)
    for k in single:
        torch.testing.assert_close(ckpt[k], single[k], atol=1e-6, rtol=0, msg=k)


def test_fsdp_errors_before_work(model_dir):
    model = load_model(model_dir)
    with pytest.raises(ValueError, match="actor.fsdp_offload=false"):
        Actor(model, ActorConfig(strategy="fsdp", fsdp_offload=True), total_steps=1)
    with pytest.raises(ValueError, match="actor.strategy=ddp"):
        Actor(model, ActorConfig(strategy="fsdp"), total_steps=1)


@pytest.mark.parametrize("save_world, resume_world", [(2, 1), (1, 2)])
def test_sharded_checkpoint_resumes_at_another_rank_count(tmp_path, model_dir, single, save_world, resume_world):
    """Save after 1 update, resume for the other 2 at another rank count (DCP reshards): the uninterrupted
    run's weights. The control resumes without loading (fresh AdamW state and weights): it differs."""
    ckpt = str(tmp_path / "ckpt")

    def run(world, **kwargs):
        return train_fsdp(tmp_path, model_dir, world, **kwargs) if world > 1 else train(model_dir, **kwargs)
    run(save_world, steps=range(1), save=ckpt)
    resumed = run(resume_world, steps=range(1, NUM_UPDATES), load=ckpt)
    for k in single:
        torch.testing.assert_close(resumed[k], single[k], atol=2e-5, rtol=0, msg=k)
    not_loaded = run(resume_world, steps=range(1, NUM_UPDATES))
    assert _max_diff(not_loaded, single) > 1e-3


def _export_worker(rank: int, world: int, port: int, model_dir: str, out_dir: str) -> None:
    with gloo_rank(rank, world, port):
        model = load_model(model_dir)
        actor = Actor(model, ActorConfig(**CFG, strategy="fsdp"), total_steps=1)
        actor.update(make_batch(0).rows(rank_rows(rank, world)), num_mini_batches=1)
        export_hf(model, out_dir, model_dir)
        weights = full_state_dict(model)
        if rank == 0:
            torch.save(weights, os.path.join(out_dir, "tlt_weights.pt"))


def test_export_hf_from_shards_loads_in_transformers(tmp_path, model_dir):
    from transformers import AutoModelForCausalLM
    out = tmp_path / "export"
    mp.spawn(_export_worker, args=(2, _free_port(), model_dir, str(out)), nprocs=2, join=True)
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ours = load_model(model_dir)
    ours.load_state_dict(torch.load(out / "tlt_weights.pt"))
    assert _max_diff(ours.state_dict(), load_model(model_dir).state_dict()) > 1e-4  # trained, not the start
    ids = make_batch(0).input_ids[:2]
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours.logits(ours(ids)), atol=1e-4, rtol=1e-4)
        start = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        assert not torch.allclose(start(ids).logits, hf(ids).logits, atol=1e-4)


def test_tied_embeddings_two_ranks_equal_one_process(tmp_path):
    """A tied LM head (Qwen3): the embedding's gradient from the lookup and from the head (called outside the
    root forward) both reach FSDP's reduce-scatter."""
    from tests.conftest import make_tiny_checkpoint
    model_dir = make_tiny_checkpoint(tmp_path / "qwen3", "qwen3", tie=True)
    single = train(model_dir, steps=range(2))
    sharded = train_fsdp(tmp_path, model_dir, steps=range(2))
    for k in single:
        torch.testing.assert_close(sharded[k], single[k], atol=2e-5, rtol=0, msg=k)
