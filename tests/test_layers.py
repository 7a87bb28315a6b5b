"""The import structure of fusedopt/: no cycle between its modules (imports inside functions
counted), kernels/ imports no backend, and the leaf modules import nothing of fusedopt."""
import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "fusedopt"


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Each module of fusedopt/ and the modules of fusedopt/ it imports, at any depth of its code."""
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1])
                    base += f".{node.module}" if node.module else ""
                else:
                    base = node.module or ""
                for alias in node.names:
                    found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in paths else base)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
        graph[name] = {m for m in found if m in paths and m != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
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
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_imports():
    graph = import_graph()
    assert "fusedopt.optim" in graph["fusedopt"]
    assert "fusedopt._errors" in graph["fusedopt.kernels.tables"]  # an import inside the package
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_kernels_import_no_backend():
    graph = import_graph()
    kernels = [m for m in graph if m.startswith("fusedopt.kernels")]
    assert kernels
    assert {m: sorted(d for d in graph[m] if d.startswith("fusedopt.backends"))
            for m in kernels} == {m: [] for m in kernels}


@pytest.mark.parametrize("leaf", ["fusedopt._errors", "fusedopt._adapters"])
def test_leaf_modules_import_nothing_of_fusedopt(leaf):
    assert import_graph()[leaf] == set()
