"""The import graph between fp4offload's packages and top-level modules: layered, with no circle.

Every ``import`` (at module level or inside a function) of one unit by another must point to the same layer or one
below (docs/design.md, "Layout"), and the graph must have no cycle. So the optimizer knows nothing of the engines
that drive it, and storage nothing of the optimizer.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "fp4offload"

#: lowest first; a unit may import its own layer (acyclically) and those below
LAYERS = [
    ("errors", "_config", "_switches", "_jsonfile", "_autochoice", "_announce", "_machine", "_oneline", "_keep_bf16",
     "_metrics"),  # the vocabulary, the switches, the process
    ("formats", "_ops", "host_allocator", "_codec", "_dtensor", "_store"),  # codecs, kernels, DTensors, storage
    ("_optim", "_offload"),  # FP4AdamW, the saved activations
    ("_memory",),  # the host-memory model
    ("_fsdp", "_deepspeed"),  # the engines
    ("_planner",),  # what reads the machine and the models
    ("cli", "fsdp", "deepspeed", "__init__", "_doctor"),  # the entry points
]
LAYER = {u: i for i, units in enumerate(LAYERS) for u in units}


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _module_of(path: Path) -> tuple[str, str]:
    """(dotted module name, the package its relative imports resolve against)."""
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
        return ".".join(parts), ".".join(parts)
    return ".".join(parts), ".".join(parts[:-1])


def _targets(node: ast.AST, package: str) -> list[str]:
    """The fp4offload modules an import statement reads (``from X import name`` reads X, or X.name when X is a
    package and name one of its modules)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "fp4offload"]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        base = package.split(".")[: len(package.split(".")) - node.level + 1]
        module = ".".join(base + ([node.module] if node.module else []))
    else:
        module = node.module or ""
    if module.split(".")[0] != "fp4offload":
        return []
    if module == "fp4offload":  # from fp4offload import X: module X when it is one, else the top package
        return [f"fp4offload.{a.name}" if (PKG / a.name).is_dir() or (PKG / f"{a.name}.py").is_file()
                else "fp4offload" for a in node.names]
    return [module]


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in sorted(PKG.rglob("*.py")):
        module, package = _module_of(path)
        src = _unit(module)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for t in _targets(node, package):
                dst = _unit(t)
                if dst != src:
                    graph.setdefault(src, set()).add(dst)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(u: str) -> list[str] | None:
        state[u] = 1
        stack.append(u)
        for v in sorted(graph.get(u, ())):
            if state.get(v) == 1:
                return stack[stack.index(v):] + [v]
            if v not in state and (found := visit(v)):
                return found
        stack.pop()
        state[u] = 2
        return None

    for u in sorted(graph):
        if u not in state and (found := visit(u)):
            return found
    return None


def test_every_unit_has_a_layer():
    units = {p.stem if p.is_file() else p.name for p in PKG.iterdir()
             if (p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists()))}
    assert units - set(LAYER) == set(), "give each new package or module a layer in LAYERS (and in docs/design.md)"


def test_no_import_points_up_a_layer():
    up = sorted(f"{a} (layer {LAYER[a]}) imports {b} (layer {LAYER[b]})"
                for a, bs in import_graph().items() for b in bs if LAYER[b] > LAYER[a])
    assert up == []


def test_the_import_graph_has_no_circle():
    assert _cycle(import_graph()) is None


def test_the_optimizer_imports_nothing_of_the_engines():
    assert import_graph()["_optim"].isdisjoint({"_fsdp", "_deepspeed", "_planner", "__init__"})


@pytest.mark.parametrize("graph, cycle", [({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
                                          ({"a": {"b"}, "b": set()}, None)])
def test_the_cycle_finder_finds_a_cycle(graph, cycle):
    assert _cycle(graph) == cycle


def test_the_graph_reads_relative_absolute_and_lazy_imports():
    g = import_graph()
    assert "_optim" in g["_fsdp"]  # from .._optim.shards import ... (relative, module level)
    assert "_switches" in g["_deepspeed"]  # from fp4offload import _switches (absolute: the module, not __init__)
    assert "_dtensor" in g["_optim"]


def test_fp4adamw_is_one_class_with_its_own_signature():
    """No __new__ that turns it into another class: help() and editors show its real arguments."""
    import inspect

    from fp4offload import FP4AdamW

    assert "__new__" not in vars(FP4AdamW)
    params = inspect.signature(FP4AdamW).parameters
    assert {"params", "lr", "betas", "master", "state_device", "state_format"} <= set(params)
