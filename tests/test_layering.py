"""The layering the project states, checked on the source: `spot/` is the algorithm (torch and
the standard library; no Ray, Arrow, YAML, click, pydantic, pipeline or factory), `spot/models`
scores states and knows no drafter, tree, budget or decode loop, a job never imports the asset
factory, the benchmarks import no command-line module, and no project modules import each
other in a cycle.

Every module is parsed with `ast`, and an import anywhere in it counts: one inside a function
runs as soon as the function does, and one under `if TYPE_CHECKING:` still ties the two modules
together (the job and the tensor-parallel target once imported each other that way).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ("spot", "pipeline", "spot_factory", "bench")


@dataclass
class Module:
    name: str  # dotted, e.g. "spot.models.loading" ("bench.speculative" for a script)
    path: Path
    imports: set[str] = field(default_factory=set)  # every import, wherever it is


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _names(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> set[str]:
    """Modules an import statement names: `from a import b` names a and, if it is one, a.b."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names}
    base = node.module or ""
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join([*package, base] if base else package)
    return {base} | {f"{base}.{alias.name}" for alias in node.names}


@cache
def project_modules() -> dict[str, Module]:
    modules = {}
    for package in PROJECT:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = _module_name(path)
            tree = ast.parse(path.read_text(), str(path))
            is_package = path.name == "__init__.py"
            module = Module(name, path)
            for node in ast.walk(tree):
                if isinstance(node, ast.Import | ast.ImportFrom):
                    module.imports |= _names(node, name, is_package)
            modules[name] = module
    return modules


def _project(names: set[str]) -> set[str]:
    """The project modules among imported names (packages included)."""
    modules = project_modules()
    return {n for n in names if n in modules}


def _top(name: str) -> str:
    return name.split(".")[0]


def _under(prefix: str) -> list[Module]:
    return [m for n, m in project_modules().items() if n == prefix or n.startswith(prefix + ".")]


def _reach(start: str) -> set[str]:
    """Project modules `start` imports, directly or through others."""
    modules = project_modules()
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo += _project(modules[name].imports)
    return seen


def test_the_module_graph_is_read():
    modules = project_modules()
    assert {"spot.decode", "spot.models.loading", "pipeline.job", "pipeline.engine"} <= set(modules)
    assert "spot.models.registry" in modules["spot.models.loading"].imports
    assert "spot.models.hub" in modules["spot.models.loading"].imports  # from pkg import mod
    assert "spot.models.tensor_parallel" in modules["pipeline.engine"].imports  # in a function


SPOT_FORBIDDEN = ("ray", "pyarrow", "yaml", "click", "pydantic", "pipeline", "spot_factory")


def test_spot_imports_no_pipeline_or_service_library():
    found = [
        f"{m.name} imports {name}"
        for m in _under("spot")
        for name in sorted(m.imports)
        if _top(name) in SPOT_FORBIDDEN
    ]
    assert not found, "\n".join(found)


MODELS_FORBIDDEN = ("spot.drafters", "spot.drafting", "spot.tree", "spot.budget", "spot.decode")


def test_spot_models_know_no_drafter_tree_budget_or_decode_loop():
    """Not directly, nor through the project modules they import."""
    found = []
    for module in _under("spot.models"):
        for name in sorted(_reach(module.name)):
            if any(name == f or name.startswith(f + ".") for f in MODELS_FORBIDDEN):
                found.append(f"{module.name} reaches {name}")
    assert not found, "\n".join(found)


def test_a_job_never_imports_the_asset_factory():
    if not (ROOT / "spot_factory").is_dir():
        pytest.skip("no spot_factory package in this checkout")
    code = (
        "import sys; import pipeline.runner, pipeline.job, pipeline.engine; "
        "found = sorted(m for m in sys.modules if m.split('.')[0] == 'spot_factory'); "
        "assert not found, found"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-3000:]


def test_the_benchmarks_import_nothing_that_imports_click():
    """Commands (click) stay in the CLI: a benchmark shares plain modules with them."""
    modules = project_modules()
    found = []
    for bench in _under("bench"):
        for name in sorted(_reach(bench.name)):
            if any(_top(i) == "click" for i in modules[name].imports):
                found.append(f"{bench.name} reaches {name}, which imports click")
    assert not found, "\n".join(found)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module, or a module importing
    itself (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for child in sorted(graph[node]):
            if child not in index:
                visit(child)
                low[node] = min(low[node], low[child])
            elif child in on_stack:
                low[node] = min(low[node], index[child])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph[node]:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert _cycles(graph) == [["a", "b", "c"], ["e"]]


def test_no_import_cycles_among_project_modules():
    graph = {name: _project(m.imports) - {name} for name, m in project_modules().items()}
    cycles = _cycles(graph)
    assert not cycles, "\n".join(" <-> ".join(c) for c in cycles)
