"""The package's shape, checked from its source: imports point one way, no module imports another that imports it
back, nothing below the Ray wrappers imports Ray, and speculative decoding drives the engine only through its
public decode-step interface (tlt.engine.llm_engine.LLMEngine)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "tlt"
# the data path, lowest first: a module may import its own layer and the ones before it, never a later one
LAYERS = ("tlt.models", "tlt.engine", "tlt.speculative", "tlt.drafter_train")
ABOVE_THE_DATA_PATH = ("tlt.rl", "tlt.workers", "tlt.bench", "tlt.cli", "tlt.tasks", "tlt.report", "tlt.export")
# loaded by vLLM alone (its `vllm.general_plugins` entry point): the only package that imports vllm, imported by none
VLLM_PLUGIN = "tlt.vllm_plugin"
# commands that live beside the layer they drive and read prompts as `tlt train` does (inside the command only)
COMMANDS = {"tlt.drafter_train.offline": "`tlt train-drafter`: prompts from data files or the default task"}


def _modules() -> dict[str, Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = path
    return mods


MODULES = _modules()


def _imported_names(path: Path) -> list[tuple[str, int]]:
    """Every absolute import in the file, at module level or inside functions: (dotted name, line)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, node.lineno))
            out += [(f"{node.module}.{a.name}", node.lineno) for a in node.names]
    return out


def _resolve(name: str) -> str | None:
    """The tlt module a dotted name refers to (a module, or a name inside one), or None outside tlt."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    return {m: {t for n, _ in _imported_names(p) if (t := _resolve(n)) and t != m} for m, p in MODULES.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                return path[path.index(t):] + [t]
            if t not in state and (cycle := visit(t)):
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def _layer(module: str) -> int | None:
    return next((i for i, p in enumerate(LAYERS) if module == p or module.startswith(p + ".")), None)


def test_the_data_path_imports_point_one_way():
    wrong = []
    for m, path in MODULES.items():
        lm = _layer(m)
        if lm is None or m in COMMANDS:
            continue
        for name, line in _imported_names(path):
            t = _resolve(name)
            if t is None:
                continue
            lt = _layer(t)
            if (lt is not None and lt > lm) or t.startswith(ABOVE_THE_DATA_PATH):
                wrong.append(f"{path.relative_to(ROOT.parent)}:{line} ({LAYERS[lm]}) imports {t}")
    assert not wrong, "imports against the data path (models <- engine <- speculative <- drafter_train):\n" + \
        "\n".join(wrong)


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    """Control: the check above can fail."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_only_the_workers_import_ray():
    wrong = [f"{p.relative_to(ROOT.parent)}:{line}" for m, p in MODULES.items()
             if not m.startswith("tlt.workers") for n, line in _imported_names(p) if n.split(".")[0] == "ray"]
    assert not wrong, "Ray imported below tlt/workers: " + ", ".join(wrong)


def vllm_plugin_misuse(modules: dict[str, Path]) -> list[str]:
    """Imports of vllm outside the plugin, and of the plugin from anywhere else in tlt."""
    wrong = []
    for m, p in modules.items():
        inside = m == VLLM_PLUGIN or m.startswith(VLLM_PLUGIN + ".")
        for n, line in _imported_names(p):
            if (n.split(".")[0] == "vllm" and not inside) or (n.startswith(VLLM_PLUGIN) and not inside):
                wrong.append(f"{m}:{line} imports {n}")
    return wrong


def test_only_the_vllm_plugin_imports_vllm_and_nothing_imports_it():
    assert not vllm_plugin_misuse(MODULES), "\n".join(vllm_plugin_misuse(MODULES))


def test_the_vllm_plugin_check_can_fail(tmp_path):
    """Control: a core module importing the plugin, and one importing vllm, are both reported."""
    (tmp_path / "core.py").write_text("from tlt.vllm_plugin import register\nimport vllm.config\n")
    wrong = vllm_plugin_misuse({"tlt.speculative.core": tmp_path / "core.py"})
    assert any(w.endswith("imports tlt.vllm_plugin") for w in wrong) and any(w.endswith("vllm.config") for w in wrong)
    assert not vllm_plugin_misuse({VLLM_PLUGIN + ".eagle": tmp_path / "core.py"})  # inside the plugin: allowed


# an engine's internals reached from outside tlt/engine: its private members, or its scheduler, runner or cache
_ENGINE_INTERNALS = re.compile(r"\bengine\.(_\w+|scheduler|runner|kv)\b")


def _attribute_chains(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            yield node.lineno, ast.unparse(node)


def engine_internals_used(source: str) -> list[tuple[int, str]]:
    return sorted({(line, chain) for line, chain in _attribute_chains(ast.parse(source))
                   if _ENGINE_INTERNALS.search(chain)})


def test_speculation_drives_the_engine_through_its_public_interface():
    wrong = []
    for m, path in MODULES.items():
        if m.startswith("tlt.engine"):
            continue
        wrong += [f"{path.relative_to(ROOT.parent)}:{line} {chain}"
                  for line, chain in engine_internals_used(path.read_text())]
    assert not wrong, "engine internals used outside tlt/engine:\n" + "\n".join(wrong)


@pytest.mark.parametrize("source,found", [("self.engine._append_sampled(s)", True),
                                          ("self.engine.scheduler.extra.append(c)", True),
                                          ("eng = x.engine.runner", True),
                                          ("self.engine.sample_and_append(s)", False),
                                          ("self.engine.num_graph_captures", False)])
def test_the_engine_interface_check_can_fail(source, found):
    assert bool(engine_internals_used(source)) is found
