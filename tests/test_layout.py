"""The package's imports point one way: no module imports, even inside a function, a module that imports it back.

An import loop is what lets a low layer reach up into a high one (the trainer importing the training
loop's errors, the loop's ``__main__`` importing the CLI that imports the loop), and it breaks as soon
as someone moves an import to the top of a file.
"""

from __future__ import annotations

import ast
from pathlib import Path

import scirl

ROOT = Path(scirl.__file__).parent


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            for target in targets:
                # the deepest scirl module the import names ("from scirl import rundir" -> scirl.rundir)
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name and not name.startswith(target + "."):
                    graph[name].add(target)
    return graph


def test_no_import_cycles():
    graph = import_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_core_training_path_does_not_reach_the_cpu_speed_code():
    """scirl.cpu is chosen once, in scirl.backends: the loop, trainer, generator and loss never import it."""
    graph = import_graph()
    core = ["scirl.train", "scirl.trainer", "scirl.inference.hf", "scirl.inference.base", "scirl.loss", "scirl.rollouts",
            "scirl.grpo", "scirl.distributed", "scirl.rundir", "scirl.checkpoint"]
    for module in core:
        assert not any(t.startswith("scirl.cpu") for t in graph[module]), module
