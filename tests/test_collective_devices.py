"""Every collective tlt issues runs on a device its process group's backend accepts (tlt.rl.launch).

On CUDA torch.distributed is initialised by `init_distributed("cuda")`; here, with no GPU, that very call runs with
`torch.cuda.set_device` stubbed and the group it asks for recorded, then built with gloo. A dispatch mode sees every
c10d collective op (tlt's own all-reduces, FSDP2's all-gathers and reduce-scatters, DTensor's, DCP's) and checks
the device of each tensor against the device types the recorded backend string maps (torch's own parser): an
NCCL-only group accepts CUDA tensors alone, so a host scalar all-reduced there fails ("No backend type associated
with device type cpu"). Object collectives and barriers are exempt: torch picks their device from the group.
Run over two gloo ranks: a GRPO step with actor.strategy=fsdp (KL reference, checkpoint, weight sync) and a ddp
update. On this CPU every tensor is a host tensor, so the check proves the group serves the host as well as the GPU.
"""
from __future__ import annotations

import contextlib
from collections import Counter
from unittest import mock

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.distributed_c10d import BackendConfig
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tests.test_fsdp import CFG, _free_port, gloo_rank, make_batch, rank_rows
from tests.test_fsdp_train import train_overrides
from tlt.config import ActorConfig, load_config
from tlt.models import load_model
from tlt.rl.actor import Actor
from tlt.rl.launch import init_distributed
from tlt.rl.tiny_model import build_tiny_model
from tlt.rl.trainer import GRPOTrainer

COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")
OBJECT_COLLECTIVES = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
                      "barrier", "monitored_barrier")


class DeviceChecker(TorchDispatchMode):
    """Counts every collective op, and records those with a tensor on a device type `accepted` lacks."""

    def __init__(self, accepted: set[str]):
        super().__init__()
        self.accepted, self.exempt = accepted, 0
        self.seen: Counter = Counter()
        self.wrong: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        if any(t is DTensor for t in types):
            # as torch's CommDebugMode does: let DTensor run first, so that the collectives it lowers to (a
            # redistribution's all-reduce, say) come back through this mode rather than run unseen inside it
            return NotImplemented
        if func.namespace in COLLECTIVE_NAMESPACES and not self.exempt:
            name = f"{func.namespace}.{func._opname}"
            devices = {t.device.type for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            self.seen[name] += 1
            for device in devices - self.accepted:
                self.wrong[f"{name} on {device}"] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def exempt_object_collectives(checker: DeviceChecker):
    """Object collectives and barriers choose their tensors' device from the group itself: not checked."""
    def wrap(fn):
        def inner(*args, **kwargs):
            checker.exempt += 1
            try:
                return fn(*args, **kwargs)
            finally:
                checker.exempt -= 1
        return inner
    with contextlib.ExitStack() as stack:
        for name in OBJECT_COLLECTIVES:
            stack.enter_context(mock.patch.object(dist, name, wrap(getattr(dist, name))))
        yield


def cuda_group_as_gloo(requested: list[str]):
    """init_distributed("cuda") as it runs on a GPU, but the group it asks for recorded and made with gloo."""
    real_init = dist.init_process_group

    def init_as_gloo(backend=None, **kwargs):
        requested.append(str(backend))
        real_init("gloo", **kwargs)

    def init():
        with mock.patch.object(torch.cuda, "set_device", lambda device: None), \
                mock.patch.object(dist, "init_process_group", init_as_gloo):
            init_distributed("cuda")
    return init


def _worker(rank: int, world: int, port: int, overrides: list[str], model_dir: str, out: str) -> None:
    requested: list[str] = []
    with gloo_rank(rank, world, port, init=cuda_group_as_gloo(requested)):
        accepted = set(BackendConfig(dist.Backend(requested[0])).get_device_backend_map())
        checker = DeviceChecker(accepted)
        with checker, exempt_object_collectives(checker):
            GRPOTrainer(load_config(None, overrides)).fit()  # fsdp: the trainer's, the actor's, FSDP's, DCP's
            ddp = ActorConfig(**(CFG | {"grad_clip": 1.0}), strategy="ddp")
            actor = Actor(load_model(model_dir), ddp, total_steps=1)
            actor.update(make_batch(0).rows(rank_rows(rank, world)), num_mini_batches=2)  # ddp's all-reduces
        if rank == 0:
            torch.save({"requested": requested[0], "accepted": accepted, "seen": checker.seen,
                        "wrong": checker.wrong}, out)


def test_every_collective_runs_on_a_device_its_group_accepts(tmp_path):
    tiny = build_tiny_model(tmp_path / "tiny")
    # 2 mini-batches (the second's old log-probs recomputed through the shards), a KL reference, a checkpoint at the
    # step (DCP shards, the consolidated weights, the disk-space agreement), clipping and the weight sync
    overrides = train_overrides(tmp_path, tiny, **{
        "actor.strategy": "fsdp", "trainer.total_steps": 1, "trainer.save_freq": 1, "data.train_batch_size": 4,
        "actor.ppo_mini_batch_size": 2, "actor.grad_clip": 1.0, "rollout.n": 2, "data.max_response_length": 8,
        "reward.num_workers": 0})
    out = tmp_path / "checked.pt"
    mp.spawn(_worker, args=(2, _free_port(), overrides, tiny, str(out)), nprocs=2, join=True)
    res = torch.load(out, weights_only=False)
    seen = res["seen"]
    # the check saw the collectives it is about: host scalars and DDP's gradients (all-reduce), FSDP's gathers and
    # reduce-scatters, and the DTensor gathers of the weight sync and the gradient norm
    assert seen["c10d.allreduce_"] > 0 and seen["c10d.reduce_scatter_tensor_coalesced_"] + \
        seen["c10d._reduce_scatter_base_"] > 0, seen
    assert sum(n for k, n in seen.items() if "all_gather" in k or "allgather" in k) > 0, seen
    assert sum(n for k, n in seen.items() if k.startswith("_c10d_functional.")) > 0, seen
    assert not res["wrong"], (res["requested"], res["wrong"])
    assert {"cpu", "cuda"} <= res["accepted"], res["requested"]


def test_the_checker_refuses_a_host_scalar_on_an_nccl_only_group():
    """Control for the checker: tlt's host-scalar all-reduce (max_over_ranks) on a one-process group is refused by
    the devices an NCCL-only group maps (what tlt asked for before) and accepted by those of tlt's group."""
    from tlt.rl import fsdp
    from tlt.rl.launch import process_group_backend
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        verdicts = {}
        for backend in ("nccl", process_group_backend("cuda")):
            checker = DeviceChecker(set(BackendConfig(dist.Backend(backend)).get_device_backend_map()))
            with checker:
                assert fsdp.max_over_ranks(3) == 3
            verdicts[backend] = dict(checker.wrong)
    finally:
        dist.destroy_process_group()
    assert verdicts == {"nccl": {"c10d.allreduce_ on cpu": 1}, "cpu:gloo,cuda:nccl": {}}


def test_the_idle_micro_batch_runs_on_the_compute_device():
    """Under actor.fsdp_offload the shards live in host memory while the model computes on the GPU: the idle forward's
    input goes to the compute device (meta stands in for it here), not to where the parameters are."""
    from tlt.rl import fsdp
    seen = []

    class Stub(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))  # on the host

        def forward(self, ids):
            seen.append(ids.device.type)
            return torch.zeros(1, 1, 1, device=ids.device)

        def logits(self, hidden):
            return hidden

    fsdp.idle_micro_batch(Stub(), torch.device("meta"), backward=False)
    assert seen == ["meta"]
