"""The package's folders follow the data flow: each module imports only its own layer or the ones below it,
and no module imports itself round a cycle (function-level imports included)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "mlautotune"
# Lowest first: a module may import from its own layer and the layers before it.
LAYERS = [
    ("base", ["mlautotune", "mlautotune.errors", "mlautotune.files", "mlautotune.console", "mlautotune.redact", "mlautotune.workloads"]),
    ("inputs", ["mlautotune.inputs"]),
    ("run", ["mlautotune.run"]),
    ("search", ["mlautotune.search"]),
    ("track", ["mlautotune.track"]),
    ("app", ["mlautotune.session", "mlautotune.commands", "mlautotune.worker"]),
    ("cli", ["mlautotune.cli", "mlautotune.deepspeed_cli", "mlautotune.mlproject", "mlautotune.__main__"]),
]


def modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        yield ".".join(parts[:-1] if parts[-1] == "__init__" else parts), path


def layer(name: str) -> int:
    best = None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (name == p or name.startswith(p + ".")) and (best is None or len(p) > best[1]):
                best = (i, len(p))
    assert best is not None, f"{name} belongs to no layer of tests/test_layout.py"
    return best[0]


def imports(name: str, path: Path) -> set:
    """The package's modules that `name` imports anywhere in its body (a package's own __init__ excluded)."""
    known = {m for m, _ in modules()}
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t.startswith("mlautotune") and t != name and not name.startswith(t + "."):
                found.add(t)
    return found


GRAPH = {name: imports(name, path) for name, path in modules()}


def test_imports_point_down_the_layers():
    up = [f"{a} ({LAYERS[layer(a)][0]}) imports {b} ({LAYERS[layer(b)][0]})" for a, bs in GRAPH.items() for b in bs if layer(b) > layer(a)]
    assert not up, "\n".join(up)


def test_there_are_no_import_cycles():
    state, cycles = {}, []

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(GRAPH.get(node, set())):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]) if nxt in stack else f"{node} -> {nxt}")
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for name in sorted(GRAPH):
        if name not in state:
            visit(name, [name])
    assert not cycles, "\n".join(cycles)


@pytest.mark.parametrize("name", sorted(GRAPH))
def test_each_module_imports_alone(name):
    done = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
