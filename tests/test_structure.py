"""How the code is put together: no import cycles (easymats, and the runtime with its kernels), the
agent never loads the runtime's writer, and modules and functions stay small enough to read.

Imports are read from the source (every ``import`` statement, at module level or inside a
function: a lazy import is still a dependency; only ``if TYPE_CHECKING:`` imports are left out),
so the checks see what a reader of the tree sees.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "easymats")


# package directory -> the import name it installs as (pyproject's package-dir)
PACKAGES = {"easymats": "easymats", "runtime": "hi_sparse", "kernels": "hi_sparse.kernels"}


def _modules(dirs: tuple[str, ...] = ("easymats",)) -> dict[str, str]:
    """Module name -> source path, for the packages in ``dirs`` (keys of PACKAGES)."""
    out = {}
    for top in dirs:
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                if not f.endswith(".py"):
                    continue
                rel = os.path.relpath(os.path.join(dirpath, f), os.path.join(ROOT, top))[:-3]
                name = ".".join([PACKAGES[top]] + rel.split(os.sep)).removesuffix(".__init__")
                out[name] = os.path.join(dirpath, f)
    return out


def _runtime_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node but those under ``if TYPE_CHECKING:`` (imports for annotations only: they never
    run, so they make no cycle)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                todo.extend(child.orelse)
            else:
                todo.append(child)


def import_graph(dirs: tuple[str, ...] = ("easymats",)) -> dict[str, set[str]]:
    """module -> modules of the same packages it imports (anywhere in its source)."""
    mods = _modules(dirs)
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in _runtime_nodes(tree):
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


def test_no_import_cycles_in_the_runtime_and_its_kernels():
    graph = import_graph(("runtime", "kernels"))
    assert "hi_sparse.engine" in graph and "hi_sparse.kernels.quant" in graph  # the names resolve
    assert cycles(graph) == []


# docs/architecture.md: no module over ~450 lines and no function over ~60 without a reason
# written next to it (a comment right above the def, or above its decorators).
MAX_MODULE_LINES = 480
MAX_FUNCTION_LINES = 60


def _long_functions(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        src = f.read()
    lines = src.splitlines()
    out = []
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            if length > MAX_FUNCTION_LINES and not lines[first - 2].lstrip().startswith("#"):
                out.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} {node.name} ({length} lines)")
    return out


def test_modules_and_functions_stay_small():
    mods = _modules(("easymats", "runtime"))
    too_long = [f"{os.path.relpath(p, ROOT)} ({n} lines)" for p in mods.values()
                if (n := sum(1 for _ in open(p, encoding="utf-8"))) > MAX_MODULE_LINES]
    assert not too_long, f"modules over {MAX_MODULE_LINES} lines: split them"
    long_functions = [f for p in mods.values() for f in _long_functions(p)]
    assert not long_functions, (f"functions over {MAX_FUNCTION_LINES} lines without a reason in a "
                                f"comment above them: {long_functions}")


def test_the_size_check_finds_a_long_function(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    path = tmp_path / "m.py"
    path.write_text(f"def long():\n{body}\n\n# a reason\ndef explained():\n{body}")
    assert [f.split()[1] for f in _long_functions(str(path))] == ["long"]


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
