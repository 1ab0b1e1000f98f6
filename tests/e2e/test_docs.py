"""The docs run as written, and their links lead somewhere.

Every shell block of README.md and docs/*.md runs here, as a reader would run it in a clone after
`make demo`. Sybil reads the pages' fenced blocks; this file says how each kind runs:

- a ```bash block runs whole, as one bash script under ``set -eo pipefail``: a command that fails fails the page;
- a ```console block is a transcript: each ``$ command`` (with the lines the shell reads on after an open
  quote or a trailing backslash) runs and must exit 0, and the lines under it are output it must print, in
  that order, among its other lines (runs of spaces compare as one; ``...`` in a line stands for any text, a
  line of ``...`` alone for lines left out);
- a block whose first line says what else it needs (``# needs a GPU``, ``# needs GPUs``, ``# needs 8 GPUs``,
  ``# needs a cluster``, ``# needs the hub``, ``# needs a prime-rl checkout``, ``# needs minutes``) is not run.

Each page runs in a fresh directory of its own, its blocks in page order (a block may use what an earlier one
wrote). The directory looks like the clone's root to the commands (links to its top-level files and folders)
and `scirl` is the installed one on PATH, so nothing is written into the clone.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from markdown_it import MarkdownIt
from sybil import Document
from sybil.parsers.markdown import CodeBlockParser

ROOT = Path(__file__).resolve().parents[2]
PAGES = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))]
LINKED = [*PAGES, "benchmarks/README.md"]  # pages whose links are checked
NEEDS = re.compile(r"# needs (a GPU|GPUs|\d+ GPUs|a cluster|the hub|a prime-rl checkout|minutes)$")
FENCE_LANGUAGES = {"bash", "console", "text", "toml", "python", "json"}
BLOCK_TIMEOUT_S = 600  # one command; a few seconds on 2 idle cores


def needs(source: str) -> str | None:
    """What a block needs beyond this machine (its first line, ``# needs ...``), or None when it runs here."""
    first = source.lstrip("\n").split("\n", 1)[0].strip()
    return first if first.startswith("# needs") else None


def run_shell(script: str, namespace: dict) -> tuple[int, str]:
    """``script`` under bash in the page's directory: its exit status and what it printed (stdout and stderr).
    Whatever it left running (a server started with ``&``) is stopped with it."""
    log = namespace["log"]
    with log.open("w") as out:
        process = subprocess.Popen(
            ["bash", "-c", "set -eo pipefail\n" + script],
            cwd=namespace["cwd"],
            env=namespace["env"],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            status = process.wait(timeout=BLOCK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            status = f"timeout after {BLOCK_TIMEOUT_S}s"
        finally:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()
    return status, log.read_text(errors="replace")


def tail(output: str, lines: int = 40) -> str:
    return "\n".join(output.splitlines()[-lines:])


def run_bash(example) -> str | None:
    if needs(example.parsed):
        return None
    status, output = run_shell(example.parsed, example.namespace)
    if status != 0:
        return f"the block exited with {status}; its output ends:\n{tail(output)}"
    return None


def unfinished(command: str) -> bool:
    """Whether the shell reads on after this line: an open quote, or a backslash at the end."""
    try:
        shlex.split(command, comments=True)
    except ValueError:
        return True
    return False


def transcript(source: str) -> list[tuple[str, list[str]]]:
    """A console block's ``$ command`` lines (with their continuation lines) and the output lines under each."""
    steps: list[tuple[str, list[str]]] = []
    lines = source.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("$ "):
            command = line[2:]
            while unfinished(command) and i + 1 < len(lines):
                i += 1
                command += "\n" + lines[i]
            steps.append((command, []))
        elif steps:
            steps[-1][1].append(line)
        elif line.strip():
            raise ValueError(f"a console block starts with output, not a '$ ' command: {line!r}")
        i += 1
    return steps


def squeeze(line: str) -> str:
    return " ".join(line.split())


def line_pattern(expected: str) -> re.Pattern:
    return re.compile(".*".join(re.escape(squeeze(part)) for part in expected.split("...")))


def missing_lines(expected: list[str], output: str) -> list[str]:
    """The expected lines not found in ``output`` in order (an empty list: all of them were)."""
    actual = [squeeze(line) for line in output.splitlines()]
    at = 0
    for n, line in enumerate(expected):
        if not line.strip() or line.strip() == "...":
            continue
        pattern = line_pattern(line)
        while at < len(actual) and not pattern.fullmatch(actual[at]):
            at += 1
        if at == len(actual):
            return [line for line in expected[n:] if line.strip() and line.strip() != "..."]
        at += 1
    return []


def run_console(example) -> str | None:
    if needs(example.parsed):
        return None
    for command, expected in transcript(example.parsed):
        status, output = run_shell(command, example.namespace)
        if status != 0:
            return f"`{command}` exited with {status}; its output ends:\n{tail(output)}"
        missing = missing_lines(expected, output)
        if missing:
            return (
                f"`{command}` did not print, in this order:\n"
                + "\n".join(missing)
                + f"\nIt printed (the end):\n{tail(output, 60)}"
            )
    return None


def parse(path: Path) -> Document:
    return Document.parse(str(path), CodeBlockParser("bash", run_bash), CodeBlockParser("console", run_console))


def clone_like(directory: Path) -> Path:
    """A fresh directory whose top-level entries link to the clone's (not its outputs or hidden ones)."""
    directory.mkdir()
    for entry in ROOT.iterdir():
        if not entry.name.startswith(".") and entry.name != "outputs":
            (directory / entry.name).symlink_to(entry)
    return directory


def run_page(path: Path, tmp_path: Path) -> None:
    """Run ``path``'s blocks in order in a fresh clone-like directory; raises on the first that fails."""
    document = parse(path)
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # the installed scirl
    env["HF_HUB_OFFLINE"] = "1"  # nothing here may reach the hub: a block that needs it says so
    env["COLUMNS"] = "250"  # rich wraps at the terminal's width; quoted lines are a wide terminal's
    document.namespace.update(cwd=clone_like(tmp_path / "clone"), env=env, log=tmp_path / "output.txt")
    for example in document.examples():
        example.evaluate()


@pytest.mark.slow
@pytest.mark.recorded  # the quoted figures were printed on another machine
@pytest.mark.timeout(900)  # a page's commands one after another: about 30 s on 2 idle cores
@pytest.mark.parametrize("page", PAGES)
def test_every_command_of_the_page_runs_as_written(page, tmp_path):
    run_page(ROOT / page, tmp_path)


# ---- what the runner itself must do (a docs test that cannot fail checks nothing)


def write_page(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "page.md"
    path.write_text(text)
    return path


def test_a_failing_command_fails_its_page(tmp_path):
    page = write_page(tmp_path, "```bash\ntrue\nscirl data stats --data no-such-file.jsonl\necho after\n```\n")
    with pytest.raises(AssertionError, match="exited with 2"):
        run_page(page, tmp_path)


def test_quoted_output_must_be_printed_in_order(tmp_path):
    command = "$ printf 'one   two\\nthree 3.0%%\\nfour\\n'\n"
    run_page(write_page(tmp_path, f"```console\n{command}one two\n...\nfour\n```\n"), tmp_path)
    for n, wrong in enumerate(("three 3.1%", "four\none two", "five")):
        where = tmp_path / str(n)
        where.mkdir()
        with pytest.raises(AssertionError, match="did not print"):
            run_page(write_page(where, f"```console\n{command}{wrong}\n```\n"), where)


def test_ellipsis_stands_for_any_text_within_a_line():
    assert missing_lines(["Step 1 | ... | Reward 0.5000 | ..."], "Step 1 | 0.3s | Reward 0.5000 | Loss 1") == []
    assert missing_lines(["Step 1 | ... | Reward 0.5000 | ..."], "Step 1 | 0.3s | Reward 0.6000 | Loss 1") != []


def test_a_block_that_needs_a_gpu_is_not_run_and_the_next_one_sees_the_last_ones_files(tmp_path):
    page = write_page(
        tmp_path,
        "```bash\n# needs a GPU\nexit 1\n```\n\n```bash\necho hi > made.txt\n```\n\n"
        "```console\n$ cat made.txt\nhi\n```\n",
    )
    run_page(page, tmp_path)


def test_a_command_left_running_is_stopped_with_its_block(tmp_path):
    page = write_page(tmp_path, "```bash\nsleep 600 &\necho $! > pid\n```\n")
    run_page(page, tmp_path)
    pid = (tmp_path / "clone" / "pid").read_text().strip()

    def alive() -> bool:  # a killed process is gone, or a zombie until its new parent reaps it
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except (FileNotFoundError, ProcessLookupError):
            return False

    deadline = time.monotonic() + 30  # SIGKILL is delivered asynchronously
    while alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive()


# ---- what the pages hold


def markdown_tokens(path: Path):
    return MarkdownIt("commonmark").enable("table").parse(path.read_text(encoding="utf-8"))


@pytest.mark.parametrize("page", PAGES)
def test_every_code_block_says_what_it_is_and_shell_is_run_or_marked(page):
    """A block without a language, or a transcript outside a console block, would escape the runner."""
    problems = []
    for token in markdown_tokens(ROOT / page):
        if token.type == "code_block":
            problems.append(f"line {token.map[0] + 1}: an indented code block (fence it and name its language)")
        if token.type != "fence":
            continue
        language = token.info.strip()
        where = f"line {token.map[0] + 1}"
        if language not in FENCE_LANGUAGES:
            problems.append(f"{where}: fenced block of language {language!r}, not one of {sorted(FENCE_LANGUAGES)}")
        first = token.content.split("\n", 1)[0].strip()
        if first.startswith("# needs") and not NEEDS.fullmatch(first):
            problems.append(f"{where}: {first!r} is not one of the needs the runner knows ({NEEDS.pattern})")
        if language not in ("console",) and any(line.startswith("$ ") for line in token.content.splitlines()):
            problems.append(f"{where}: a '$ ' transcript in a {language!r} block: make it a console block")
    assert not problems, f"{page}:\n" + "\n".join(problems)


@pytest.mark.parametrize("page", LINKED)
def test_no_line_of_prose_is_printed_twice_in_a_row(page):
    """A sentence of docs/data-formats.md stood twice, one line after the other (issue 49)."""
    lines = (ROOT / page).read_text(encoding="utf-8").splitlines()
    twice = [f"line {n + 2}: {b}" for n, (a, b) in enumerate(zip(lines, lines[1:])) if a == b and len(b.split()) > 3]
    assert not twice, f"{page}:\n" + "\n".join(twice)


def test_the_serve_example_waits_quietly_for_the_servers_ready_line(tmp_path):
    """docs/evaluation.md's wait for `scirl serve`'s URL printed a grep error while serve.log did not exist yet."""
    page = (ROOT / "docs" / "evaluation.md").read_text(encoding="utf-8")
    [wait] = [line for line in page.splitlines() if line.startswith("until url=")]
    script = (
        "(sleep 1; echo 'scirl serve: ready at http://127.0.0.1:1/v1' > serve.log; sleep 60) &\nserver=$!\n"
        f'{wait}\necho "$url"\nkill $server\n'
    )  # the log appears a second after the first look
    done = subprocess.run(
        ["bash", "-c", "set -eo pipefail\n" + script], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and done.stdout == "http://127.0.0.1:1/v1\n" and done.stderr == "", done.stderr


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of ``path``'s headings; a repeated one gets -1, -2, ... as on GitHub."""
    tokens = markdown_tokens(path)
    found: set[str] = set()
    seen: dict[str, int] = {}
    for i, token in enumerate(tokens):
        if token.type == "heading_open":
            base = slug(
                "".join(child.content for child in tokens[i + 1].children if child.type in ("text", "code_inline"))
            )
            found.add(f"{base}-{seen[base]}" if base in seen else base)
            seen[base] = seen.get(base, 0) + 1
    return found


def links(path: Path) -> list[str]:
    found = []
    for token in markdown_tokens(path):
        for child in token.children or []:
            if child.type == "link_open":
                found.append(child.attrs["href"])
    return found


@pytest.mark.parametrize("page", LINKED)
def test_links_between_pages_lead_somewhere(page):
    path = ROOT / page
    dead = []
    for href in links(path):
        if re.match(r"[a-z]+:", href):  # http:, https:, mailto:
            continue
        target, _, anchor = href.partition("#")
        file = (path.parent / target).resolve() if target else path
        if not file.exists():
            dead.append(f"{href}: no {file.relative_to(ROOT) if file.is_relative_to(ROOT) else file}")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            dead.append(f"{href}: no heading with anchor #{anchor} in {file.relative_to(ROOT)}")
    assert not dead, f"dead links in {page}:\n" + "\n".join(dead)


def test_the_link_checker_finds_a_dead_file_and_a_dead_anchor(tmp_path, monkeypatch):
    page = tmp_path / "page.md"
    page.write_text("# Top `x` (y)\n\n## Top x y\n\n[a](#top-x-y) [b](#top-x-y-1) [c](#gone) [d](other.md)\n")
    assert anchors(page) == {"top-x-y", "top-x-y-1"}
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    with pytest.raises(AssertionError) as failure:
        test_links_between_pages_lead_somewhere("page.md")
    assert "#gone" in str(failure.value) and "other.md" in str(failure.value)
    assert "#top-x-y:" not in str(failure.value) and "#top-x-y-1" not in str(failure.value)


def test_the_readme_is_a_quick_start_that_begins_with_the_set_up_ci_runs():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 250
    first = next(t for t in markdown_tokens(ROOT / "README.md") if t.type == "fence")
    commands = [line.split("#")[0].strip() for line in first.content.splitlines() if not line.startswith("#")]
    assert commands[:2] == ["make demo", "make test"]
    assert "make test" in (ROOT / ".ci" / "run").read_text().splitlines()


# ---- what the pages rely on: configs/demo.toml from any directory, the demo's questions on their own


def test_the_demo_config_reads_its_model_beside_itself_from_any_directory(tmp_path, monkeypatch):
    from scirl.run.config_io import load_config

    demo_base = ROOT / "scirl" / "assets" / "demo-base"
    monkeypatch.chdir(tmp_path)
    cfg = load_config(["@", str(ROOT / "configs" / "demo.toml")])
    assert Path(cfg.model) == demo_base and (demo_base / "config.json").is_file()
    assert cfg.data.source == "outputs/demo/data/demo_questions.jsonl"  # where you run, like output_dir
    (tmp_path / "configs").symlink_to(ROOT / "configs")  # a clone-like directory, as the pages run in
    assert Path(load_config(["@", "configs/demo.toml"]).model) == demo_base
    assert load_config(["@", "configs/demo.toml", "--model", "../mine"]).model == "../mine"  # a flag: as typed


def test_the_demo_questions_alone_are_the_file_scirl_demo_writes(tmp_path, capsys):
    from scirl.demo.run import DemoOptions, write_questions
    from scirl.demo.world import main

    opts = DemoOptions(output_dir=tmp_path / "demo")
    demo_file = write_questions(tmp_path / "demo.jsonl", opts.train_per_domain, opts.eval_per_domain, opts.seed)
    assert main([str(tmp_path / "alone.jsonl")]) == 0
    assert (tmp_path / "alone.jsonl").read_bytes() == demo_file.read_bytes()
    assert capsys.readouterr().out == f"wrote 1200 questions to {tmp_path / 'alone.jsonl'}\n"
    assert main([str(tmp_path / "alone.jsonl" / "under-a-file.jsonl")]) == 2
    assert capsys.readouterr().err.count("\n") == 1
