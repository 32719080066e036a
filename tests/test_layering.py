"""The layering the project states, checked on the source.

- `spot/` is the algorithm: it imports the standard library, torch, safetensors and numpy,
  and nothing else but the named exceptions, each in its one module (an allowlist);
- its core (`spot/*.py`, `spot/drafters`, `spot/builtin`) never reaches `spot.models`, and
  `spot/models` scores states and knows no drafter, tree, budget or decode loop;
- `spot_common/` lies below `pipeline/` and `spot_factory/`, which never import each other;
  a job never imports the asset factory; the benchmarks import no command-line module; no
  project modules import each other in a cycle.

Every module is parsed with `ast`, and an import anywhere in it counts: one inside a function
runs as soon as the function does, and one under `if TYPE_CHECKING:` still ties the two modules
together (the job and the tensor-parallel target once imported each other that way). For the
rules on what a package may use, so does a module-level string naming a project module, alone
or as "module:attribute": what `importlib` resolves from a registry or a command table
(`spot.models.family_index.FAMILY_INDEX`, `pipeline.cli.COMMANDS`, the drafter kinds) is
imported all the same, only later. Not for cycles: a table names its entries by string so that
they may import it (to register, to take its helpers), the one-way reference a plugin needs.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ("spot", "spot_common", "pipeline", "spot_factory", "bench")
# a string constant that may name a module, alone or as "module:attribute"
MODULE_STRING = re.compile(r"^([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(?::[A-Za-z_]\w*)?$")


@dataclass
class Module:
    name: str  # dotted, e.g. "spot.models.loading" ("bench.speculative" for a script)
    path: Path
    imports: set[str] = field(default_factory=set)  # every import statement, wherever it is
    at_top: set[str] = field(default_factory=set)  # those that run when it is imported
    targets: set[str] = field(default_factory=set)  # project modules its tables name

    @property
    def uses(self) -> set[str]:
        """What it imports, now or through importlib."""
        return self.imports | self.targets


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


def _statements(tree: ast.Module, module: str, is_package: bool) -> tuple[set[str], set[str]]:
    """Names the module's import statements name: all of them, and those outside functions."""
    everywhere: set[str] = set()
    at_top: set[str] = set()

    def visit(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = _names(node, module, is_package)
            everywhere.update(names)
            if not in_function:
                at_top.update(names)
        inside = in_function or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        for child in ast.iter_child_nodes(node):
            visit(child, inside)

    visit(tree, False)
    return everywhere, at_top


def _strings(tree: ast.Module) -> set[str]:
    """Module names that module-level string constants may hold ("a.b", "a.b:attribute"): the
    tables of importlib targets (a string built in a function is a command line or a message,
    e.g. the `python -m pipeline.cli` a Ray job runs in its own process)."""
    found = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            return
        is_string = isinstance(node, ast.Constant) and isinstance(node.value, str)
        if is_string and (match := MODULE_STRING.match(node.value)):
            found.add(match.group(1))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


@cache
def project_modules() -> dict[str, Module]:
    modules = {}
    strings = {}
    for package in PROJECT:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = _module_name(path)
            tree = ast.parse(path.read_text(), str(path))
            module = Module(name, path)
            module.imports, module.at_top = _statements(tree, name, path.name == "__init__.py")
            strings[name] = _strings(tree)
            modules[name] = module
    for name, module in modules.items():
        module.targets = {s for s in strings[name] if s in modules and s != name}
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
    """Project modules `start` uses, directly or through others."""
    modules = project_modules()
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo += _project(modules[name].uses)
    return seen


def test_the_module_graph_is_read():
    modules = project_modules()
    assert {"spot.decode", "spot.models.loading", "pipeline.job", "pipeline.engine"} <= set(modules)
    assert "spot.models.registry" in modules["spot.models.loading"].imports
    assert "spot.models.hub" in modules["spot.models.loading"].imports  # from pkg import mod
    assert "spot.models.tensor_parallel" in modules["pipeline.engine"].imports  # in a function
    assert "spot.models.tensor_parallel" not in modules["pipeline.engine"].at_top
    # importlib targets: a family module list, a command table, a drafter class
    assert "spot.models.llada2" in modules["spot.models.family_index"].targets
    assert "pipeline.report" in modules["pipeline.cli"].targets
    assert "spot.drafters.spot" in modules["spot.drafters.registry"].targets
    assert "pipeline.cli" not in modules["pipeline.runner"].targets  # a Ray job's command


# what `spot` imports besides the standard library and itself
SPOT_LIBRARIES = ("torch", "safetensors", "numpy")
# each other library `spot` may use, and the one module that may import it, inside functions
# only (so importing that module, or anything else of `spot`, never imports the library)
SPOT_EXCEPTIONS = {
    # sharding through DeepSpeed's public init_inference (model.tensor_parallel > 1)
    "deepspeed": "spot.models.tensor_parallel",
    # a checkpoint named by a hub id: found in the local cache or downloaded, never run
    "huggingface_hub": "spot.models.hub",
}


def spot_import_problems(modules: dict[str, Module]) -> list[str]:
    """What modules of `spot` import outside the allowlist (empty when nothing)."""
    allowed = set(sys.stdlib_module_names) | {"spot", *SPOT_LIBRARIES}
    found = []
    for module in modules.values():
        if _top(module.name) != "spot":
            continue
        for name in sorted(module.uses):
            top = _top(name)
            home = SPOT_EXCEPTIONS.get(top)
            if top in allowed or (home == module.name and name not in module.at_top):
                continue
            where = f" (only {home} may, inside functions)" if home else ""
            found.append(f"{module.name} imports {name}{where}")
    return found


def test_spot_imports_only_its_allowlist():
    found = spot_import_problems(project_modules())
    assert not found, "\n".join(found)


def test_the_allowlist_check_names_each_way_to_break_it():
    """A library off the list, an exception outside its module, an exception imported with
    its module, a package above `spot` (imported, or named for importlib)."""
    modules = {
        "spot.tree": Module("spot.tree", ROOT, {"torch", "collections.abc", "ray.data"}),
        "spot.drafters.x": Module("spot.drafters.x", ROOT, {"deepspeed"}),
        "spot.models.hub": Module(
            "spot.models.hub", ROOT, {"huggingface_hub"}, at_top={"huggingface_hub"}
        ),
        "spot.models.tensor_parallel": Module(
            "spot.models.tensor_parallel", ROOT, {"deepspeed.accelerator", "spot_common.cli"}
        ),
        "spot.decode": Module("spot.decode", ROOT, targets={"pipeline.cli"}),
        "pipeline.job": Module("pipeline.job", ROOT, {"ray", "yaml"}),
    }
    assert spot_import_problems(modules) == [
        "spot.tree imports ray.data",
        "spot.drafters.x imports deepspeed (only spot.models.tensor_parallel may, inside "
        "functions)",
        "spot.models.hub imports huggingface_hub (only spot.models.hub may, inside functions)",
        "spot.models.tensor_parallel imports spot_common.cli",
        "spot.decode imports pipeline.cli",
    ]


def _is_models(name: str) -> bool:
    return name == "spot.models" or name.startswith("spot.models.")


def test_the_spot_core_never_reaches_the_models():
    """The decode loop, trees, drafters and the bundled assets work on any `Target`: none of
    them imports the models package, directly or through the modules it imports."""
    found = [
        f"{module.name} reaches {name}"
        for module in _under("spot")
        if not _is_models(module.name)
        for name in sorted(_reach(module.name))
        if _is_models(name)
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


def test_the_pipeline_and_the_asset_factory_never_import_each_other():
    """What both need lies below them, in `spot_common` (or in `spot`), which imports
    neither."""
    found = [
        f"{m.name} imports {name}"
        for above, other in (("pipeline", "spot_factory"), ("spot_factory", "pipeline"))
        for m in _under(above)
        for name in sorted(m.uses)
        if _top(name) == other
    ]
    found += [
        f"{m.name} imports {name}"
        for m in _under("spot_common")
        for name in sorted(m.uses)
        if _top(name) in ("pipeline", "spot_factory", "bench")
    ]
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
