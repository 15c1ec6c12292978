"""The paper-scale recipes, planned by `tlt plan` from the shipped architecture descriptions (configs/models/*/
config.json) without any weights: configs/qwen7b_8gpu.yaml (torchrun) fits 80 GB GPUs; configs/qwen32b_32gpu.yaml
(disaggregated) fits 141 GB GPUs in both roles, a trainer GPU and a rollout GPU. Controls: the 32B recipe on 80 GB
GPUs, or with many running sequences, or on 8 GPUs without FSDP, and the 7B one at 32k-token responses, do not
fit and name the role and key."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tlt.models.decoder import Decoder
from tlt.models.loader import read_config
from tlt.plan import main

ROOT = Path(__file__).resolve().parent.parent
H100 = "80GB"  # 80e9 bytes: below an H100's 85.5e9 (79.6 GiB) reported by CUDA
H200 = "141GB"  # 141e9 bytes: below an H200's 150.1e9 (139.8 GiB) reported by CUDA
RECIPES = [("qwen7b_8gpu.yaml", "deepseek-r1-distill-qwen-7b", 8), ("qwen32b_32gpu.yaml", "qwen2.5-32b-instruct", 32)]


def plan(capsys, recipe: str, arch: str, *extra: str, memory: str = H100) -> tuple[int, str, str]:
    rc = main([str(ROOT / "configs" / recipe), "--model-config", str(ROOT / "configs" / "models" / arch),
               "--device-memory", memory, *extra])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("arch, params", [("deepseek-r1-distill-qwen-7b", 7_615_616_512),
                                          ("qwen2.5-32b-instruct", 32_763_876_352)])
def test_architecture_descriptions_have_the_published_size(arch, params):
    with torch.device("meta"):
        model = Decoder(read_config(ROOT / "configs" / "models" / arch))
    assert sum(p.numel() for p in model.parameters()) == params


def _totals_mib(out: str) -> list[float]:
    return [float(x) for x in re.findall(r"^total\s+([0-9.]+)$", out, re.M)]


def test_32b_recipe_fits_in_both_roles(capsys):
    """A trainer GPU without any engine rows, a rollout GPU with the model, KV cache and drafter; both fit."""
    rc, out, err = plan(capsys, "qwen32b_32gpu.yaml", "qwen2.5-32b-instruct", memory=H200)
    assert rc == 0, err
    trainer, rollout = out.split("rollout GPU:")
    assert "trainer GPU: actor.strategy=fsdp, 16 rank(s), no engine" in trainer
    assert not re.search(r"^(rollout weights|kv cache|drafter)", trainer, re.M)
    assert "one of 16 replica(s), 32 responses each" in rollout
    for row in ("rollout weights", "kv cache", "drafter training"):
        assert re.search(rf"^{row}\s+[1-9]", rollout, re.M), row
    assert not re.search(r"^(optimizer|activations)", rollout, re.M)
    totals = _totals_mib(out)
    assert len(totals) == 2 and all(0 < t * 2**20 <= 141e9 for t in totals)
    assert totals[0] * 2**20 <= 80e9 < totals[1] * 2**20  # the trainer side would fit an 80 GB GPU; a replica not


def test_32b_recipe_on_80gb_gpus_fails_naming_the_rollout_role(capsys):
    rc, _, err = plan(capsys, "qwen32b_32gpu.yaml", "qwen2.5-32b-instruct")
    assert rc == 2 and "per rollout GPU does not fit" in err and "per trainer GPU" not in err
    assert "largest part is rollout weights" in err


def test_32b_recipe_with_many_running_sequences_fails_naming_the_key(capsys):
    rc, _, err = plan(capsys, "qwen32b_32gpu.yaml", "qwen2.5-32b-instruct", "rollout.max_num_seqs=32", memory=H200)
    assert rc == 2 and "per rollout GPU does not fit" in err and "change rollout.max_num_seqs" in err
    assert "per trainer GPU" not in err


def test_32b_on_4_trainer_gpus_fails_naming_the_trainer_role(capsys):
    rc, out, err = plan(capsys, "qwen32b_32gpu.yaml", "qwen2.5-32b-instruct", "trainer.n_gpus_per_node=5",
                        memory=H200)  # 20 GPUs: 4 trainer ranks, the same 16 replicas
    assert "trainer GPU: actor.strategy=fsdp, 4 rank(s)" in out
    assert rc == 2 and "per trainer GPU does not fit" in err and "per rollout GPU" not in err
    assert "change more trainer GPUs (trainer.rollout_gpus, trainer.nnodes)" in err


@pytest.mark.parametrize("recipe, arch, ranks", RECIPES[:1])
def test_recipe_fits_80gb_per_device(capsys, recipe, arch, ranks):
    rc, out, err = plan(capsys, recipe, arch)
    assert rc == 0, err
    assert f"actor.strategy=fsdp, {ranks} rank(s)" in out  # torchrun ranks: trainer.nnodes x n_gpus_per_node
    total_mib = float(re.search(r"^total\s+([0-9.]+)$", out, re.M).group(1))
    assert 0 < total_mib * 2**20 <= 80e9
    assert re.search(r"^kv cache\s+[1-9]", out, re.M) and re.search(r"^drafter\s+[1-9]", out, re.M)


def test_32b_on_8_gpus_without_fsdp_fails_naming_the_key(capsys):
    rc, _, err = plan(capsys, "qwen32b_32gpu.yaml", "qwen2.5-32b-instruct", "actor.strategy=ddp",
                      "trainer.nnodes=1", "trainer.n_gpus_per_node=8", "trainer.placement=none",
                      "trainer.rollout_gpus=null")
    assert rc == 2 and "does not fit" in err and "change actor.strategy=fsdp" in err


def test_7b_at_32k_responses_needs_chunked_log_probs(capsys):
    """The recipe's 32k responses fit because the LM head runs 2048 tokens at a time; all at once they do not."""
    rc, _, err = plan(capsys, "qwen7b_8gpu.yaml", "deepseek-r1-distill-qwen-7b", "actor.logprob_chunk_tokens=null",
                      "rollout.max_num_seqs=1")
    assert rc == 2 and "largest part is activations" in err and "actor.logprob_chunk_tokens" in err


def test_launch_shape_is_checked_before_any_work():
    """Under torchrun the ranks must be what trainer.nnodes x n_gpus_per_node says (what `tlt plan` planned), and a
    placement (which launches the ranks itself) is refused; one plain process with the defaults passes."""
    from tlt.config import load_config
    from tlt.rl.trainer import check_launch
    from tlt.schema import ConfigError
    recipe = load_config(str(ROOT / "configs" / "qwen7b_8gpu.yaml"))
    check_launch(recipe.trainer, 8)
    with pytest.raises(ConfigError, match="--nnodes 1 --nproc_per_node 8"):
        check_launch(recipe.trainer, 4)
    check_launch(load_config(None).trainer, 1)
    placed = load_config(None, ["trainer.placement=colocated", "trainer.n_gpus_per_node=2",
                                "data.train_batch_size=2"])
    check_launch(placed.trainer, 1)
    with pytest.raises(ConfigError, match="drop torchrun and run `tlt train CONFIG trainer.placement=colocated"):
        check_launch(placed.trainer, 2)
    check_launch(placed.trainer, 2, placed=True)  # the ranks that placement launched
