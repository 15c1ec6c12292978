"""The package's shape, checked from its source: every module has a layer and imports only its own and lower ones,
no module imports another that imports it back, nothing below the Ray wrappers imports Ray, and speculative
decoding drives the engine only through its public decode-step interface (tlt.engine.llm_engine.LLMEngine).

Imports inside functions count as module-level ones do, so a function-local import cannot hide a back-up import
(the layer check) or a cycle within a layer (the cycle check); only an `if __name__ == "__main__":` block, which
runs when the file is the script and never on import, is left out.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "tlt"
# every module's layer, lowest first: a module may import its own layer and the ones before it, never a later one
# (a name covers the module and, for a package, every module in it; "tlt" is the package's own __init__ only)
LAYERS = (
    ("tlt.schema", "tlt.faults", "tlt.registry", "tlt.cache", "tlt.device", "tlt.integrity"),  # every layer's helpers
    ("tlt.models",),
    ("tlt.engine",),
    ("tlt.speculative",),
    ("tlt", "tlt.llm", "tlt.config", "tlt.bundles", "tlt.prompts", "tlt.tasks"),  # public API and a run's inputs
    ("tlt.drafter_train",),
    ("tlt.workers",),  # Ray actors around the pieces below
    ("tlt.rl", "tlt.report", "tlt.plan"),  # the RL run, its report and its memory plan
    ("tlt.bench", "tlt.cli", "tlt.__main__", "tlt.export"),  # commands that drive the rest
    ("tlt.vllm_plugin",),  # loaded by vLLM alone (its `vllm.general_plugins` entry point), imported by none
)
VLLM_PLUGIN = "tlt.vllm_plugin"  # the only package that imports vllm


def _modules() -> dict[str, Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = path
    return mods


MODULES = _modules()
SOURCES = {m: p.read_text() for m, p in MODULES.items()}


def _is_main_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and ast.unparse(node.test).replace("'", '"') == '__name__ == "__main__"'


def _imported_names(source: str) -> list[tuple[str, int]]:
    """Every absolute import in the source, at module level or inside functions, except in the `__main__` block:
    (dotted name, line)."""
    tree = ast.parse(source)
    nodes = [n for top in tree.body if not _is_main_block(top) for n in ast.walk(top)]
    out = []
    for node in nodes:
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, node.lineno))
            out += [(f"{node.module}.{a.name}", node.lineno) for a in node.names]
    return out


def _resolve(name: str, modules) -> str | None:
    """The tlt module a dotted name refers to (a module, or a name inside one), or None outside tlt."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    return {m: {t for n, _ in _imported_names(src) if (t := _resolve(n, sources)) and t != m}
            for m, src in sources.items()}


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


def layer_of(module: str) -> int | None:
    return next((i for i, names in enumerate(LAYERS)
                 if any(module == n or (n != "tlt" and module.startswith(n + ".")) for n in names)), None)


def imports_up_the_layers(sources: dict[str, str]) -> list[str]:
    """`module:line imports target` for every import of a later layer's module."""
    wrong = []
    for m, src in sources.items():
        for name, line in _imported_names(src):
            t = _resolve(name, sources)
            if t is not None and t != m and None not in (layer_of(m), layer_of(t)) and layer_of(t) > layer_of(m):
                wrong.append(f"{m}:{line} (layer {layer_of(m)}) imports {t} (layer {layer_of(t)})")
    return list(dict.fromkeys(wrong))  # `from a import b` names a and a.b: one line each


def test_every_module_has_a_layer():
    missing = sorted(m for m in MODULES if layer_of(m) is None)
    assert not missing, "modules with no layer (add each to LAYERS in tests/test_architecture.py): " + \
        ", ".join(missing)


def test_imports_point_down_the_layers():
    wrong = imports_up_the_layers(SOURCES)
    assert not wrong, "imports up the layers (move the shared piece down to a layer both may import):\n" + \
        "\n".join(wrong)


def test_the_layer_check_can_fail():
    """Control: an import of a later layer fails, at module level or inside a function; a `__main__` block's and an
    import of an earlier layer pass."""
    back_up = {"tlt.drafter_train.offline": "def f():\n    from tlt.rl.data import PromptDataset\n",
               "tlt.config": "from tlt.workers.spot import x\n", "tlt.rl.data": "", "tlt.workers.spot": ""}
    assert imports_up_the_layers(back_up) == ["tlt.drafter_train.offline:2 (layer 5) imports tlt.rl.data (layer 7)",
                                              "tlt.config:1 (layer 4) imports tlt.workers.spot (layer 6)"]
    fine = {"tlt.rl.trainer": 'from tlt.prompts import a\nif __name__ == "__main__":\n    from tlt.cli import main\n',
            "tlt.prompts": "", "tlt.cli": ""}
    assert imports_up_the_layers(fine) == []


def test_no_import_cycles():
    cycle = find_cycle(import_graph(SOURCES))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    """Control: the check above can fail, also when a function-local import closes the cycle."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    lazy = {"tlt.rl.x": "from tlt.rl.y import f\n", "tlt.rl.y": "def g():\n    from tlt.rl.x import h\n"}
    assert find_cycle(import_graph(lazy)) == ["tlt.rl.x", "tlt.rl.y", "tlt.rl.x"]


def test_only_the_workers_import_ray():
    wrong = [f"{p.relative_to(ROOT.parent)}:{line}" for m, p in MODULES.items()
             if not m.startswith("tlt.workers") for n, line in _imported_names(SOURCES[m]) if n.split(".")[0] == "ray"]
    assert not wrong, "Ray imported below tlt/workers: " + ", ".join(wrong)


def vllm_plugin_misuse(sources: dict[str, str]) -> list[str]:
    """Imports of vllm outside the plugin, and of the plugin from anywhere else in tlt."""
    wrong = []
    for m, src in sources.items():
        inside = m == VLLM_PLUGIN or m.startswith(VLLM_PLUGIN + ".")
        for n, line in _imported_names(src):
            if (n.split(".")[0] == "vllm" or n.startswith(VLLM_PLUGIN)) and not inside:
                wrong.append(f"{m}:{line} imports {n}")
    return wrong


def test_only_the_vllm_plugin_imports_vllm_and_nothing_imports_it():
    assert not vllm_plugin_misuse(SOURCES), "\n".join(vllm_plugin_misuse(SOURCES))


def test_the_vllm_plugin_check_can_fail():
    """Control: a core module importing the plugin, and one importing vllm, are both reported."""
    core = "from tlt.vllm_plugin import register\nimport vllm.config\n"
    wrong = vllm_plugin_misuse({"tlt.speculative.core": core})
    assert any(w.endswith("imports tlt.vllm_plugin") for w in wrong) and any(w.endswith("vllm.config") for w in wrong)
    assert not vllm_plugin_misuse({VLLM_PLUGIN + ".eagle": core})  # inside the plugin: allowed


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
