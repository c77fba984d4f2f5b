"""How easymats is put together: no import cycles, and the agent never loads the runtime's writer.

Imports are read from the source (every ``import`` statement, at module level or inside a
function: a lazy import is still a dependency), so the checks see what a reader of the tree sees.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "easymats")


def _modules() -> dict[str, str]:
    """easymats module name -> source path."""
    out = {}
    for dirpath, _, files in os.walk(PACKAGE):
        for f in files:
            if not f.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, f), ROOT)[:-3].replace(os.sep, ".")
            out[rel.removesuffix(".__init__")] = os.path.join(dirpath, f)
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> easymats modules it imports (anywhere in its source)."""
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1])
                    module = f"{base}.{node.module}" if node.module else base
                else:
                    module = node.module or ""
                deps.add(module)
                deps.update(f"{module}.{a.name}" for a in node.names)  # `from . import x`
        graph[name] = {d for d in deps if d in mods and d != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles_in_easymats():
    assert cycles(import_graph()) == []


def test_writer_and_reader_share_the_layout_not_each_other():
    graph = import_graph()
    assert "easymats.segment" not in graph["easymats.telemetry"], "the writer must not import the reader"
    assert "easymats.telemetry" not in graph["easymats.segment"]
    assert "easymats.layout" in graph["easymats.telemetry"] and "easymats.layout" in graph["easymats.segment"]
    assert "easymats.control" in graph["easymats.telemetry"]  # the runtime's poll/ack side


def test_agent_side_never_imports_the_runtime_writer():
    """The agent, webhook, CLI and `recalibrate` write control requests through easymats.control."""
    graph = import_graph()
    agent_side = ("easymats.agent", "easymats.webhook", "easymats.cli", "easymats.exporter",
                  "easymats.targets", "easymats.ls", "easymats.usage")
    seen, todo = set(), list(agent_side)
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(graph[m])
    assert "easymats.telemetry" not in seen
    # And at run time, in a fresh interpreter.
    code = ("import sys, easymats.agent, easymats.webhook, easymats.cli, easymats.control; "
            "print(sorted(m for m in sys.modules if m in ('easymats.telemetry', 'torch', 'transformers', 'triton')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
