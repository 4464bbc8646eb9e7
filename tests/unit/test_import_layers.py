"""The package's import graph: no cycle, and no module imports a module of a
higher layer.  Every import counts, wherever it is written (module level,
inside a function, under TYPE_CHECKING), and the Cython modules' too.  A
module missing from LAYERS fails the test: a new module is placed on
purpose."""

from __future__ import annotations

import ast
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SRC = os.path.join(ROOT, "src")

# Lowest first.  A module may import modules of its own layer or lower ones.
LAYERS: list[tuple[str, set[str]]] = [
    ("foundations: no dfccl imports but these", {
        "dfccl.errors", "dfccl._deprecated", "dfccl.processes", "dfccl.shared_files", "dfccl.termination",
        "dfccl.policy", "dfccl.kernel_image", "dfccl.launch", "dfccl.staging", "dfccl.store", "dfccl.streams",
        "dfccl.net", "dfccl.net.host", "dfccl.net._build", "dfccl.net.link", "dfccl.net.hop_trace",
        "dfccl.net.__main__", "dfccl.host_arena"}),
    ("native runtime (Cython)", {
        "dfccl._native", "dfccl._native.layout", "dfccl._native.array_view", "dfccl._native.device",
        "dfccl._native.work", "dfccl._native.tag_instances", "dfccl._native.tag_table", "dfccl._native.descriptor", "dfccl._native.launch",
        "dfccl._native.hotpath", "dfccl._native.completion", "dfccl._native.retire", "dfccl._native.inspection", "dfccl._native.endpoints", "dfccl._native.graphs", "dfccl._native.daemon_memory",
        "dfccl._native.progress", "dfccl._native.daemon", "dfccl._native.capi", "dfccl._native.sim_device",
        "dfccl._native.cuda_driver", "dfccl._native.cuda_device", "dfccl._native.abi", "dfccl._native.core"}),
    ("values and planning", {
        "dfccl.types", "dfccl.options", "dfccl.planning", "dfccl.tags", "dfccl.point_to_point", "dfccl.flight",
        "dfccl.status_page", "dfccl.unique_id"}),
    ("one rank's machinery", {
        "dfccl.runtime", "dfccl.buffers", "dfccl.endpoint", "dfccl.diagnostics", "dfccl.rank_state",
        "dfccl.liveness", "dfccl.bootstrap", "dfccl.local_group", "dfccl.registration", "dfccl.split",
        "dfccl.arguments", "dfccl.sharing", "dfccl.submission", "dfccl.hierarchy"}),
    ("the API", {"dfccl.communicator", "dfccl.plans", "dfccl.environment", "dfccl.capi", "dfccl.trace"}),
    ("the package", {"dfccl"}),
    ("tools and integrations", {
        "dfccl.info", "dfccl.net.hops", "dfccl.demo", "dfccl.scenarios", "dfccl.bench", "dfccl.bench.config",
        "dfccl.bench.harness",
        "dfccl.bench.baselines", "dfccl.bench.report", "dfccl.bench.floor", "dfccl.bench.arrays",
        "dfccl.bench.runner", "dfccl.torch", "dfccl.torch._build", "dfccl.torch._common", "dfccl.torch._group",
        "dfccl.torch._hook", "dfccl.torch.__main__"}),
    ("the command line", {"dfccl.cli", "dfccl.__main__"}),
]

_LAYER_OF = {mod: i for i, (_, mods) in enumerate(LAYERS) for mod in mods}


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, SRC)
    name = rel.rsplit(".", 1)[0].replace(os.sep, ".")
    return name[:-len(".__init__")] if name.endswith(".__init__") else name


def _package_modules() -> dict[str, list[str]]:
    """Module name -> its source files (a Cython module's .pyx and .pxd)."""
    found: dict[str, list[str]] = {}
    for dirpath, _dirs, files in os.walk(os.path.join(SRC, "dfccl")):
        for f in sorted(files):
            if f.endswith((".py", ".pyx", ".pxd")):
                found.setdefault(_module_name(os.path.join(dirpath, f)), []).append(os.path.join(dirpath, f))
    return found


def _resolve(name: str, modules) -> str | None:
    """The package module an imported name lives in (``dfccl.x.y`` may be a
    name y of module dfccl.x)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports_of(path: str, this: str, modules) -> set[str]:
    names: set[str] = set()
    text = open(path).read()
    if path.endswith(".py"):
        package = this if path.endswith("__init__.py") else this.rpartition(".")[0]
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
                names.update(f"{base}.{a.name}" for a in node.names)
    else:   # Cython: import, cimport and from-imports, wherever they are
        names.update(m.group(1) for m in re.finditer(r"^\s*(?:from|c?import)\s+(dfccl[\w.]*)", text, re.M))
    found = {_resolve(n, modules) for n in names if n == "dfccl" or n.startswith("dfccl.")}
    return {m for m in found if m is not None and m != this}


def _graph() -> dict[str, set[str]]:
    modules = _package_modules()
    return {mod: set().union(*(_imports_of(p, mod, modules) for p in paths)) for mod, paths in modules.items()}


def test_every_module_has_a_layer():
    missing = sorted(set(_graph()) - set(_LAYER_OF))
    assert not missing, f"place these modules in LAYERS: {missing}"


def test_no_upward_import():
    upward = sorted(f"{mod} ({LAYERS[_LAYER_OF[mod]][0]}) imports {dep} ({LAYERS[_LAYER_OF[dep]][0]})"
                    for mod, deps in _graph().items() if mod in _LAYER_OF
                    for dep in deps if dep in _LAYER_OF and _LAYER_OF[dep] > _LAYER_OF[mod])
    assert not upward, "\n".join(upward)


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph``, or None."""
    state: dict[str, int] = {}   # 1: on the current path, 2: done
    path: list[str] = []

    def visit(mod: str) -> list[str] | None:
        state[mod] = 1
        path.append(mod)
        for dep in sorted(graph.get(mod, ())):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state:
                found = visit(dep)
                if found:
                    return found
        path.pop()
        state[mod] = 2
        return None

    for mod in sorted(graph):
        if mod not in state:
            found = visit(mod)
            if found:
                return found
    return None


def test_no_import_cycle():
    cycle = _cycle(_graph())
    assert cycle is None, " -> ".join(cycle)


@pytest.mark.parametrize("graph, cyclic", [
    ({"a": {"b"}, "b": {"c"}, "c": set()}, False),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, True),
    ({"a": {"a2"}, "a2": set(), "b": {"b"}}, True),
])
def test_the_cycle_finder_finds_cycles(graph, cyclic):
    assert (_cycle(graph) is not None) == cyclic


def test_function_level_imports_count(tmp_path):
    """An import inside a function is an edge like any other."""
    pkg = tmp_path / "dfccl"
    pkg.mkdir()
    (pkg / "low.py").write_text("def f():\n    from dfccl.high import g\n    return g\n")
    modules = {"dfccl.low": [str(pkg / "low.py")], "dfccl.high": [str(pkg / "high.py")]}
    assert _imports_of(str(pkg / "low.py"), "dfccl.low", modules) == {"dfccl.high"}
