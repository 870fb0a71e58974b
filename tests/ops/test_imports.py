"""The modules of punica.ops import each other without cycles: each `*_triton` module depends
only on modules below it, never back on the public module that dispatches to it."""

import ast
from pathlib import Path

import punica.ops

OPS = Path(punica.ops.__file__).parent


def ops_imports(path: Path) -> set[str]:
    """The punica.ops modules a file imports, at module level or inside a function."""
    modules = {p.stem for p in OPS.glob("*.py")}
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "punica.ops":
            found |= {alias.name for alias in node.names if alias.name in modules}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("punica.ops."):
            found.add(node.module.split(".")[2])
        elif isinstance(node, ast.Import):
            found |= {alias.name.split(".")[2] for alias in node.names if alias.name.startswith("punica.ops.")}
    return found - {path.stem}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a path of modules (first == last), or None."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(module):
        state[module] = "open"
        path.append(module)
        for dep in sorted(graph[module]):
            if state.get(dep) == "open":
                return path[path.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        state[module] = "done"
        path.pop()
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


def test_ops_modules_import_without_cycles():
    graph = {p.stem: ops_imports(p) for p in OPS.glob("*.py")}
    assert graph["attention_triton"] and graph["lora_triton"]  # the parser sees their imports
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_find_cycle_finds_lazy_and_long_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
