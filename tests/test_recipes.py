"""The paper-scale recipes, planned by `tlt plan` from the shipped architecture descriptions (configs/models/*/
config.json) without any weights: configs/qwen7b_8gpu.yaml fits 80 GB GPUs; configs/qwen32b_32gpu.yaml does not
(every rank's engine holds a full bf16 copy of the 32B model) and the plan names the engine's copy; controls: the
32B recipe on 8 GPUs without FSDP, and the 7B one at 32k-token responses, do not fit and name the key."""
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
RECIPES = [("qwen7b_8gpu.yaml", "deepseek-r1-distill-qwen-7b", 8), ("qwen32b_32gpu.yaml", "qwen2.5-32b-instruct", 32)]


def plan(capsys, recipe: str, arch: str, *extra: str) -> tuple[int, str, str]:
    rc = main([str(ROOT / "configs" / recipe), "--model-config", str(ROOT / "configs" / "models" / arch),
               "--device-memory", H100, *extra])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("arch, params", [("deepseek-r1-distill-qwen-7b", 7_615_616_512),
                                          ("qwen2.5-32b-instruct", 32_763_876_352)])
def test_architecture_descriptions_have_the_published_size(arch, params):
    with torch.device("meta"):
        model = Decoder(read_config(ROOT / "configs" / "models" / arch))
    assert sum(p.numel() for p in model.parameters()) == params


def test_32b_recipe_does_not_fit_colocated(capsys):
    rc, out, err = plan(capsys, "qwen32b_32gpu.yaml", "qwen2.5-32b-instruct")
    assert rc == 2 and "largest part is rollout weights" in err and "change rollout.dtype" in err
    assert "actor.strategy=fsdp, 32 rank(s)" in out


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
                      "trainer.nnodes=1", "trainer.n_gpus_per_node=8")
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
