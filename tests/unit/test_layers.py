"""The package's layers (DESIGN.md section 3), checked on the import statements of every module.

Floors, bottom up: config and topology (pure value objects), cost and graph (pure models), comm (the
backend), device (the virtual GPU, the memory tracker, the op clock), runtime (the rank process) beside launch
(the parent process: preflight, spawn, watch), adapters (the only code that imports Megatron or DeepSpeed), then
recipes and programs, and on top the cli (user-facing). An import may run sideways or down, never up; config does not
import topology, cost does not import graph, and no two modules outside an adapter import each other in a
circle. Every import counts, also one inside a function or under ``TYPE_CHECKING``: each is an arrow a
reader follows.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "prism_plugin"

FLOOR = {
    "config": 0, "topology": 0, "cost": 1, "graph": 1, "comm": 2, "device": 3, "runtime": 4, "launch": 4,
    "adapters": 5, "megatron": 5, "deepspeed": 5,  # prism_plugin.megatron / .deepspeed: the adapters' entry points
    "startup": 5,  # prism_plugin.startup: the interpreter-start hook, which hands DeepSpeed to its adapter
    "recipes": 6, "programs": 6, "cli": 7,
}
"""Layer of each top-level room of the package (module or folder)."""
ALLOWED_SIDEWAYS = {("topology", "config"), ("graph", "cost"), ("megatron", "adapters"), ("deepspeed", "adapters"),
                    ("startup", "adapters")}
"""Same-floor imports that run one way only: topology may use config's errors, graph the cost model, the
framework entry points (`prism_plugin.megatron`, `prism_plugin.deepspeed`) and the startup hook their adapter."""
PURE = ("config", "topology", "cost", "graph")
FRAMEWORKS = ("megatron", "deepspeed", "transformer_engine", "apex")


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(path: Path, name: str) -> set[str]:
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}  # `from pkg import module`
    return found


MODULES = _modules()
IMPORTS = {name: _imports(path, name) for name, path in MODULES.items()}


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "prism_plugin" else None


def _ours(name: str) -> set[str]:
    return {m for m in IMPORTS[name] if m in MODULES and m != name}


def test_every_module_sits_in_a_layer() -> None:
    rooms = {_room(m) for m in MODULES} - {None}
    assert rooms <= set(FLOOR), f"modules outside every layer: {sorted(rooms - set(FLOOR))}"


def test_no_import_runs_up_a_floor() -> None:
    upward = []
    for name in MODULES:
        here = _room(name)
        if here is None:
            continue
        for target in _ours(name):
            there = _room(target)
            if there is None or there == here:
                continue
            if FLOOR[there] > FLOOR[here] or (FLOOR[there] == FLOOR[here] and (here, there) not in ALLOWED_SIDEWAYS):
                upward.append(f"{name} -> {target}")
    assert not upward, "imports that run up (or sideways the wrong way):\n" + "\n".join(sorted(upward))


def test_pure_layers_import_no_torch_and_no_framework() -> None:
    bad = []
    for name in MODULES:
        if _room(name) in PURE:
            for target in IMPORTS[name]:
                if target.split(".")[0] in ("torch", *FRAMEWORKS):
                    bad.append(f"{name} -> {target}")
    assert not bad, "\n".join(bad)


def test_only_adapters_and_programs_import_the_frameworks() -> None:
    bad = []
    for name in MODULES:
        if _room(name) in ("adapters", "programs"):
            continue
        for target in IMPORTS[name]:
            if target.split(".")[0] in FRAMEWORKS:
                bad.append(f"{name} -> {target}")
    assert not bad, "\n".join(bad)


def test_no_import_circle_outside_an_adapter() -> None:
    graph = {n: {t for t in _ours(n) if _room(t) != "adapters"} for n in MODULES if _room(n) != "adapters"}
    # a package's __init__ that re-exports its modules is not a circle with them
    for n in graph:
        graph[n] = {t for t in graph[n] if not (MODULES[t].name == "__init__.py" and n.startswith(t + "."))}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


def test_the_layer_check_sees_a_violation() -> None:
    """The checks above read real imports: comm's backend imports config, and the CLI imports runtime."""
    assert "prism_plugin.config.kinds" in _ours("prism_plugin.comm.collectives")
    assert any(_room(t) == "runtime" for t in _ours("prism_plugin.cli.main"))
