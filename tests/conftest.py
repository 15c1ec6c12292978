"""Shared fixtures: tiny random HF checkpoints built locally (no downloads), one per model family."""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# torch's default CPU allocator throughout (a trainer process asks for huge pages: tlt.device), so that the tests
# that run a trainer in this process leave no setting behind for the processes later tests start
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "0")

# Tests run tiny models, which gain nothing from intra-op threads; on a shared 2-core machine OpenMP threads
# contending with other processes slow small ops down by 10-100x. One thread keeps the suite fast and steady.
torch.set_num_threads(1)

FAMILIES = ("llama", "qwen2", "qwen3")


def pytest_runtest_setup(item):
    """@pytest.mark.needs("math_verify", ...): the test skips, naming them, where one of these modules of tlt's
    dependencies cannot be imported (a benchmark machine that has only torch, transformers and tlt's core needs:
    scripts/gpu_bench.sh runs the suite there); where tlt is installed whole, as in CI, it runs."""
    import importlib.util
    for mark in item.iter_markers("needs"):
        missing = []
        for name in mark.args:
            try:
                found = importlib.util.find_spec(name) is not None
            except ImportError:
                found = False
            if not found:
                missing.append(name)
        if missing:
            pytest.skip(f"needs {', '.join(missing)}, not installed here")


def no_avx512_bf16(what: str) -> str:
    """The skip reason of a test of tlt's bf16 CPU paths where tlt.device.cpu_has_avx512_bf16() is false: which of its
    two causes holds, and what is not checked here (`pytest -rs` lists it)."""
    from tlt.device import _cpu_flags, cpu_capability
    cause = ("this CPU has no avx512_bf16" if "avx512_bf16" not in _cpu_flags() else
             f"torch runs {cpu_capability()} kernels here, not AVX512 (ATEN_CPU_CAPABILITY), so no avx512_bf16")
    return f"{cause}: {what} not checked on this machine"


def make_tiny_checkpoint(path, family: str = "llama", vocab_size: int = 128, hidden_size: int = 64,
                         num_layers: int = 2, tie: bool = False, seed: int = 0, **extra) -> str:
    """Save a tiny random transformers model of `family` to `path` and return the path."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config
    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                  num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, tie_word_embeddings=tie, bos_token_id=None, eos_token_id=None,
                  pad_token_id=0)
    if family == "llama":
        cfg = LlamaConfig(**common, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                          **extra)
    elif family == "qwen2":
        cfg = Qwen2Config(**common, **extra)
    elif family == "qwen3":
        cfg = Qwen3Config(**common, head_dim=16, **extra)
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    model.save_pretrained(str(path))
    return str(path)


def checkpoint_parts(model_dir, step: int):
    """(write_model, TrainerState) for CheckpointManager.save: the tiny model `model_dir` before its first update
    (an empty AdamW state over its parameters), whole, so that the checkpoint verifies (tlt.rl.checkpoint_verify)."""
    import shutil
    from pathlib import Path

    from tlt.models.decoder import Decoder
    from tlt.models.loader import read_config
    from tlt.rl.checkpoint import TrainerState, capture_rng_state

    def write_model(path: Path) -> None:
        for name in ("config.json", "model.safetensors"):
            shutil.copy(Path(model_dir) / name, path / name)
    with torch.device("meta"):
        num_params = len(list(Decoder(read_config(model_dir)).parameters()))
    optimizer = {"state": {}, "param_groups": [{"lr": 0.1, "params": list(range(num_params))}]}
    state = TrainerState(step=step, actor={"optimizer": optimizer, "scheduler": {}}, rng=capture_rng_state(),
                         data={"index": step})
    return write_model, state


@pytest.fixture(scope="session", params=FAMILIES)
def tiny_family_dir(request, tmp_path_factory):
    """(family, path) of a tiny random checkpoint, for each supported family."""
    path = tmp_path_factory.mktemp(f"tiny_{request.param}")
    return request.param, make_tiny_checkpoint(path, request.param, tie=request.param == "qwen3")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="module")
def ray_fake_gpus():
    """A local Ray cluster with 4 fake GPUs (placement tests on a CPU machine), one per test module."""
    ray = pytest.importorskip("ray", reason="ray is not installed")
    if ray.is_initialized():
        ray.shutdown()
    try:
        ray.init(num_cpus=4, num_gpus=4, include_dashboard=False, log_to_driver=False)
    except (RuntimeError, OSError, ConnectionError, ValueError) as e:
        pytest.skip(f"ray cannot start here: {e}")
    yield
    ray.shutdown()
