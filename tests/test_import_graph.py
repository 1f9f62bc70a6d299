"""kerasmp's own modules import each other without cycles.

An AST scan of every module under `kerasmp/` (imports inside functions
count too: a cycle closed by a late import is still a cycle) builds the
graph of kerasmp -> kerasmp imports and fails naming each cycle it finds.
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
                targets.add(base)
                targets.update(f"{base}.{a.name}" for a in node.names)
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
    graph = import_graph(package)
    assert graph["kerasmp.d"] == {"kerasmp.a"}
    assert find_cycles(graph) == [["kerasmp.a", "kerasmp.b", "kerasmp.c"]]


def test_kerasmp_has_no_import_cycles():
    graph = import_graph()
    assert "kerasmp._compile" in graph and "kerasmp.policy" in graph
    cycles = find_cycles(graph)
    assert not cycles, "import cycles inside kerasmp/: " + "; ".join(
        " -> ".join(c) for c in cycles
    )
