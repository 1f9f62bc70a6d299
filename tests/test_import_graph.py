"""kerasmp's own modules import each other without cycles.

An AST scan of every module under `kerasmp/` (imports inside functions
count too: a cycle closed by a late import is still a cycle) builds the
graph of kerasmp -> kerasmp imports and fails naming each cycle it finds.
Importing `kerasmp.a.b` runs the package `kerasmp.a` first, so that import
is an edge to `kerasmp.a` too (unless the importer lives in `kerasmp.a`):
a package whose `__init__` re-exports its modules sits above them.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "kerasmp"


def _module_name(path, root):
    name = ".".join(path.relative_to(root.parent).with_suffix("").parts)
    return name.removesuffix(".__init__")


def import_graph(root=ROOT):
    """`{module: set of kerasmp modules it imports}`, from the source."""
    modules = {_module_name(p, root): p for p in root.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = set()
        package = name
        if path.name != "__init__.py":
            package = name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    parts = parts[: len(parts) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                for a in node.names:
                    full = f"{base}.{a.name}"
                    targets.add(full if full in modules else base)
        for t in list(targets):
            parts = t.split(".")
            for k in range(2, len(parts)):
                parent = ".".join(parts[:k])
                if not (name == parent or name.startswith(parent + ".")):
                    targets.add(parent)
        graph[name] = {
            t for t in targets if t in modules and t not in (name, "kerasmp")
        }
    return graph


def find_cycles(graph):
    """Every elementary cycle's lowest-named entry point, as module lists
    (one per strongly connected component with more than one module, or a
    module importing itself)."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_find_cycles_sees_a_cycle_closed_inside_a_function(tmp_path):
    package = tmp_path / "kerasmp"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from kerasmp import b\n")
    (package / "b.py").write_text("def f():\n    from kerasmp.c import x\n")
    (package / "c.py").write_text("import kerasmp.a\n")
    (package / "d.py").write_text("from . import a\n")
    (package / "p").mkdir()
    (package / "p" / "__init__.py").write_text("from kerasmp.p import q\n")
    (package / "p" / "q.py").write_text("from kerasmp.p import r\n")
    (package / "p" / "r.py").write_text("")
    (package / "e.py").write_text("from kerasmp.p.r import x\n")
    graph = import_graph(package)
    assert graph["kerasmp.d"] == {"kerasmp.a"}
    # A module inside a package imports its siblings without an edge to
    # the package; from outside, the package runs first.
    assert graph["kerasmp.p.q"] == {"kerasmp.p.r"}
    assert graph["kerasmp.e"] == {"kerasmp.p", "kerasmp.p.r"}
    assert find_cycles(graph) == [["kerasmp.a", "kerasmp.b", "kerasmp.c"]]


def test_kerasmp_has_no_import_cycles():
    graph = import_graph()
    assert "kerasmp._patches" in graph and "kerasmp.policy" in graph
    cycles = find_cycles(graph)
    assert not cycles, "import cycles inside kerasmp/: " + "; ".join(
        " -> ".join(c) for c in cycles
    )
