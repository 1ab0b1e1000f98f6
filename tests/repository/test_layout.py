"""The package's imports point one way: no module imports, even inside a function, a module that imports it back.

An import loop is what lets a low layer reach up into a high one (the trainer importing the training
loop's errors, the loop's ``__main__`` importing the CLI that imports the loop), and it breaks as soon
as someone moves an import to the top of a file.
"""

from __future__ import annotations

import ast
import subprocess
import sys
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
                    base = ".".join(
                        package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                    )
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            for target in targets:
                # the deepest scirl module the import names ("from scirl.run import rundir" -> scirl.run.rundir)
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
                cycles.append(path[path.index(nxt) :] + [nxt] if nxt in path else [node, nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


BASE = {"scirl.errors", "scirl.files", "scirl.net", "scirl.distributed", "scirl.hub", "scirl.extras"}
FOLDERS = (
    "task",
    "synth",
    "inference",
    "rollouts",
    "trainer",
    "algorithms",
    "weights",
    "cpu",
    "eval",
    "run",
    "deploy",
    "report",
    "primerl",
    "demo",
    "commands",
)
# What each part may import besides itself, bottom up: the table of docs/architecture.md ("Layers").
# A folder's every module, and every import in it (inside functions too), counts.
ALLOWED = {
    "scirl.errors": set(),
    "scirl.files": set(),
    "scirl.distributed": set(),
    "scirl.net": {"scirl.errors"},
    "scirl.hub": set(),
    "scirl.extras": set(),
    "scirl.task": BASE,
    "scirl.synth": BASE | {"scirl.task"},
    "scirl.inference": BASE | {"scirl.task"},
    "scirl.rollouts": BASE | {"scirl.task", "scirl.inference"},
    "scirl.trainer": BASE | {"scirl.rollouts.contract"},  # the contract, nothing else of the orchestrator's side
    # an algorithm combines both halves' primitives; the halves get it built, never import it
    "scirl.algorithms": BASE | {"scirl.task", "scirl.inference", "scirl.rollouts", "scirl.trainer"},
    "scirl.weights": BASE | {"scirl.inference"},
    "scirl.cpu": BASE | {"scirl.inference", "scirl.trainer", "scirl.rollouts.contract"},
    "scirl.eval": BASE | {"scirl.task", "scirl.inference"},
    "scirl.run": BASE
    | {
        "scirl.task",
        "scirl.inference",
        "scirl.rollouts",
        "scirl.trainer",
        "scirl.weights",
        "scirl.cpu",
        "scirl.eval",
        "scirl.algorithms",
    },
    "scirl.deploy": BASE | {"scirl.task", "scirl.inference", "scirl.run", "scirl.algorithms"},
    "scirl.report": BASE | {"scirl.eval", "scirl.run", "scirl.algorithms"},
    "scirl.primerl": BASE | {"scirl.task", "scirl.run", "scirl.algorithms"},
    "scirl.serve": BASE | {"scirl.task", "scirl.inference", "scirl.run"},
    "scirl.demo": BASE
    | {"scirl.task", "scirl.synth", "scirl.inference", "scirl.eval", "scirl.run", "scirl.deploy", "scirl.report"},
    "scirl.commands": BASE | {f"scirl.{f}" for f in FOLDERS} | {"scirl.serve", "scirl"},
    "scirl.cli": {"scirl", "scirl.commands", "scirl.extras"},
    "scirl.__main__": {"scirl.cli"},
    "scirl": set(),
}


def part(module: str) -> str:
    """The row of ``ALLOWED`` a module belongs to: its folder, or itself at the package root."""
    pieces = module.split(".")
    return f"scirl.{pieces[1]}" if len(pieces) > 2 or (len(pieces) == 2 and pieces[1] in FOLDERS) else module


def allowed(importer: str, target: str) -> bool:
    if part(target) == part(importer):
        return True
    return any(target == a or target.startswith(a + ".") for a in ALLOWED[part(importer)])


def test_each_part_imports_only_the_layers_below_it():
    graph = import_graph()
    wrong = sorted(f"{m} -> {t}" for m, targets in graph.items() for t in targets if not allowed(m, t))
    assert not wrong, "imports against the layers of docs/architecture.md:\n" + "\n".join(wrong)


def test_every_folder_says_its_job_and_what_it_may_import():
    for folder in FOLDERS:
        init = ROOT / folder / "__init__.py"
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
        assert "May import" in doc and len(doc.split()) > 15, f"{init}: one paragraph on its job and its imports"


def test_the_package_root_holds_at_most_ten_modules():
    assert len(list(ROOT.glob("*.py"))) <= 10


def test_the_core_training_path_does_not_reach_the_cpu_speed_code():
    """scirl.cpu is chosen once, in scirl.run.backends: the loop, trainer, generator and loss never import it."""
    graph = import_graph()
    core = [
        m
        for m in graph
        if m.startswith(("scirl.trainer", "scirl.rollouts", "scirl.algorithms", "scirl.weights", "scirl.inference"))
    ]
    core += ["scirl.run.train", "scirl.run.setup", "scirl.distributed", "scirl.run.rundir", "scirl.run.checkpoint"]
    for module in core:
        assert not any(t.startswith("scirl.cpu") for t in graph[module]), module


def test_the_training_path_reads_in_functions_of_at_most_90_lines():
    """The loop reads as one screen; so does every function it calls into (docs/architecture.md's reading order)."""
    long = []
    for folder in ("task", "inference", "rollouts", "trainer", "algorithms", "weights", "run"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 90:
                    long.append(f"{path.relative_to(ROOT)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert not long, long


def test_reading_a_config_and_launching_a_run_import_neither_torch_nor_transformers():
    """The processes that only read a config (the launcher of a run with servers and its ``--dry-run``, a Slurm
    job's driver, ``scirl report``, the prime-rl export) start in a fraction of a second: torch, transformers and
    peft cost ~3 s of import, and the algorithms' implementations, which import them, load only in ``build``."""
    code = (
        "import contextlib, io, sys\n"
        "import scirl.deploy.job, scirl.deploy.launch, scirl.primerl.export, scirl.report, scirl.run.config_io\n"
        "from scirl.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "    rc = main(['train', '--device', 'cpu', '--algorithm', 'sdpo', '--dry-run'])\n"
        "assert rc == 0 and 'algorithm = \"sdpo\"' in out.getvalue(), (rc, out.getvalue()[-500:])\n"
        "print(sorted(m for m in ('torch', 'transformers', 'peft', 'vllm') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", f"imported: {done.stdout.strip()}"


def test_the_architecture_page_maps_every_module_in_a_line():
    """docs/architecture.md's package map names every module of scirl/ once, with what it holds, and no module that
    is gone: a module added, moved or removed fails here until the map says so."""
    page = (ROOT.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    block = page.split("```text\nscirl/\n", 1)[1].split("```", 1)[0]
    folders: list[str] = []
    named = []
    for line in block.splitlines():
        depth = (len(line) - len(line.lstrip())) // 2 - 1
        name, _, holds = line.strip().partition(" ")
        del folders[depth:]
        if name.endswith("/"):
            folders.append(name.rstrip("/"))
        else:
            assert holds.strip(), f"{line!r}: a module and what it holds"
            named.append("/".join([*folders, name]))
    modules = {p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.py")}
    assert len(named) == len(set(named)), f"named twice: {sorted(n for n in set(named) if named.count(n) > 1)}"
    assert set(named) == modules, (
        f"not in the map: {sorted(modules - set(named))}; in the map, not in scirl/: {sorted(set(named) - modules)}"
    )


def test_a_test_file_holds_one_concern_in_at_most_700_lines():
    """A test file past 700 lines has become two concerns (the last split: the allocator's tests out of the memory
    plan's): split it by what it tests, in the folder of the package part it tests."""
    tests = ROOT.parent / "tests"
    long = {
        p.relative_to(tests).as_posix(): n for p in tests.rglob("*.py") if (n := len(p.read_text().splitlines())) > 700
    }
    assert not long, f"over 700 lines: {long}"
