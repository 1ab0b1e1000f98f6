"""Every command given bad input ends with exit status 2 and one line on stderr, never a traceback (issue 12, item 14),
and every flag that line names is one the command accepts (issue 43: a fix that names a flag the command rejects
is no fix; the flags of another command or program named before them in the line are theirs).

Each case runs in-process through ``scirl.cli.main`` (argparse's usage errors arrive as SystemExit(2)).
Placeholders in the arguments: {data} a small valid .jsonl, {model} a tiny HF model dir, {tmp} a scratch dir,
{results} a valid eval results file, {latin1} / {utf16} a data file in another encoding, {notutf8} a results
file that is not UTF-8, {file} an existing plain file, {ambiguous} / {file_of_nothing} rows whose columns fit
two known sets / none.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest

from scirl.cli import COMMANDS
from scirl.cli import main as cli_main
from scirl.commands.parser import Parser
from scirl.errors import ConfigError
from scirl.run.config_io import load_config, parse_overrides, write_config
from scirl.synth.questions import generate_rows, write_jsonl

DATA_CASES = [
    ["data"],  # no action
    ["data", "stats", "--data", "{tmp}/missing.jsonl"],
    ["data", "stats", "--data", "{tmp}"],  # a directory without .jsonl files
    ["data", "stats", "--data", "{file}"],  # an unsupported suffix
    ["data", "stats", "--data", "hf:{tmp}/missing/dir"],
    ["data", "stats", "--data", "hf:"],
    ["data", "stats", "--data", "{latin1}"],
    ["data", "stats", "--data", "{utf16}"],
    ["data", "stats", "--data", "{data}", "--types", ","],
    ["data", "stats", "--data", "{data}", "--eval-per-domain", "-1"],
    ["data", "stats", "--data", "{data}", "--eval-per-domain", "many"],
    ["data", "stats", "--data", "{data}", "--split-seed", "-5"],
    ["data", "stats", "--data", "{data}", "--seed", "5"],  # the old name of --split-seed
    ["data", "stats", "--data", "{data}", "--split-method", "random"],
    ["data", "stats", "--data", "{data}", "--bogus"],
    ["data", "export", "--data", "{data}", "--split", "eval"],  # no --out
    ["data", "export", "--data", "{data}", "--split", "eval", "--out", "{tmp}"],
    ["data", "export", "--data", "{data}", "--split", "eval", "--out", "{data}"],  # its own source
    ["data", "export", "--data", "{data}", "--split", "eval", "--out", "{file}/under/a/file.jsonl"],
    ["data", "stats", "--data", "{data}", "--data-format", "csv"],  # not a known format
    ["data", "stats", "--data", "{data}", "--data-columns", "question=Q"],  # no options, no answer
    ["data", "stats", "--data", "{data}", "--data-columns", "question=Q,options=O,answer=A,colour=C"],
    ["data", "stats", "--data", "{data}", "--data-format", "arc", "--data-columns", "question=Q,options=O,answer=A"],
    ["data", "stats", "--data", "{ambiguous}"],  # columns of both MMLU-Pro and SuperGPQA
    ["data", "stats", "--data", "{file_of_nothing}"],  # columns of no known set
    ["data", "stats", "--data", "allenai/ai2_arc:ARC-Hard"],  # no such config: refused before any network use
    # issue 49: input that does not fit, refused where it is read (each row was skipped, the column never named)
    ["data", "stats", "--data", "{data}", "--data-columns", "question=Q,options=O,answer=A"],
    ["data", "stats", "--data", "{data}", "--data-format", "medmcqa"],
    ["data", "stats", "--data", "{not_jsonl}"],  # a CSV named .jsonl: was "2 MCQ", every line bad JSON
    [
        "data",
        "export",
        "--data",
        "{data}",
        "--split",
        "eval",
        "--out",
        "{tmp}/e.jsonl",
        "--data-columns",
        "question=Q,options=O,answer=A",
    ],
]

EVAL_SERVER = [
    "eval",
    "--base-url",
    "http://127.0.0.1:9/v1",
    "--model",
    "m",
    "--data",
    "{data}",
    "--out",
    "{tmp}/e.json",
]
EVAL_CASES = [
    ["eval"],  # no --model / --out
    EVAL_SERVER + ["--n-samples", "0"],
    EVAL_SERVER + ["--concurrency", "0"],
    EVAL_SERVER + ["--max-tokens", "0"],
    EVAL_SERVER + ["--temperature", "nan"],
    EVAL_SERVER + ["--temperature", "inf"],
    EVAL_SERVER + ["--temperature", "-1"],
    EVAL_SERVER + ["--top-p", "2"],
    EVAL_SERVER + ["--top-p", "nan"],
    EVAL_SERVER + ["--timeout", "nan"],
    EVAL_SERVER + ["--timeout", "0"],
    EVAL_SERVER + ["--retries", "-1"],
    EVAL_SERVER + ["--limit", "0"],
    EVAL_SERVER + ["--eval-per-domain", "-1"],
    EVAL_SERVER + ["--split-seed", "-1"],
    EVAL_SERVER + ["--seed", "-1"],
    EVAL_SERVER + ["--max-reply-chars", "0"],
    EVAL_SERVER + ["--split", "test"],
    EVAL_SERVER + ["--unknown-flag"],
    EVAL_SERVER + ["--base-url", ""],
    EVAL_SERVER + ["--base-url", "http://localhost:notaport/v1"],
    EVAL_SERVER + ["--base-url", "http://localhost:99999/v1"],
    EVAL_SERVER + ["--base-url", "ftp://localhost/v1"],
    EVAL_SERVER + ["--base-url", "localhost:8000/v1"],
    EVAL_SERVER + ["--model", ""],
    EVAL_SERVER + ["--out", "{tmp}"],  # a directory: found up front, not after the whole evaluation
    EVAL_SERVER + ["--out", "{file}/e.json"],  # under a plain file
    EVAL_SERVER + ["--out", ""],
    EVAL_SERVER + ["--data", "{tmp}/missing.jsonl"],
    EVAL_SERVER + ["--data", "{latin1}"],
    EVAL_SERVER + ["--data", "hf:{tmp}/missing"],
    EVAL_SERVER + ["--data-format", "csv"],
    EVAL_SERVER + ["--data-columns", "options=O,answer=A"],  # no question column
    EVAL_SERVER + ["--data", "{ambiguous}"],
    ["eval", "--model", "{tmp}/no-model", "--data", "{data}", "--out", "{tmp}/e.json"],  # local: not a model dir
    ["eval", "--model", "{model}", "--data", "{data}", "--out", "{tmp}/e.json", "--device", "tpu9"],
    ["eval", "--model", "{model}", "--data", "{data}", "--out", "{tmp}/e.json", "--batch-size", "0"],
]

COMPARE_CASES = [
    ["eval", "compare"],
    ["eval", "compare", "{results}"],
    ["eval", "compare", "{results}", "{tmp}/missing.json"],
    ["eval", "compare", "{results}", "{notutf8}"],
    ["eval", "compare", "{results}", "{tmp}"],  # a directory
    ["eval", "compare", "{results}", "{file}"],  # not JSON
    ["eval", "compare", "{results}", "{list_json}"],  # JSON, not an object
    ["eval", "compare", "{results}", "{bad_records}"],  # records of the wrong types
]

SERVE_CASES = [
    ["serve"],
    ["serve", "{tmp}/no-model"],
    ["serve", "{model}", "--port", "notaport"],
    ["serve", "{model}", "--port", "99999"],
    ["serve", "{model}", "--port", "-1"],
    ["serve", "{model}", "--host", ""],
    ["serve", "{model}", "--device", "tpu9"],
    ["serve", "{model}", "--max-batch", "0"],
    ["serve", "{model}", "--default-max-tokens", "0"],
    ["serve", "{model}", "--max-body-bytes", "0"],
    ["serve", "{model}", "--max-request-tokens", "0"],
    ["serve", "{model}", "--served-model-name", ""],
]

REPORT_CASES = [
    ["report"],  # neither RUN_DIR nor --compare
    ["report", "{tmp}", "--compare", "{results}", "{results}"],  # both
    ["report", "{tmp}/missing-run"],
    ["report", "{file}"],  # a file, not a run directory
    ["report", "--compare", "{results}", "{tmp}/missing.json"],
    ["report", "--compare", "{results}", "{notutf8}"],
    ["report", "--compare", "{results}", "{list_json}"],
    ["report", "{tmp}", "--out", "{file}"],  # --out names a plain file
    ["report", "{tmp}"],  # neither a run nor results: was an empty page and exit 0
    ["report", "--compare", "{results}", "{disjoint}"],  # no question in both: was "+0.0 pts, McNemar p = 1", exit 0
    ["report", "--compare", "{results}", "{repeated}"],
]

EXPORT_CASES = [
    ["export"],
    ["export", "prime-rl"],  # no --out
    ["export", "prime-rl", "--out", "{tmp}/x", "--base-port", "notaport"],
    ["export", "prime-rl", "--out", "{tmp}/x", "--base-port", "99999"],
    ["export", "prime-rl", "--out", "{file}"],  # a plain file
    ["export", "other-target", "--out", "{tmp}/x"],
    # scirl settings prime-rl's taskset cannot reproduce (a group shares one prompt; no step or sample index)
    ["export", "prime-rl", "--out", "{tmp}/x", "--shuffle-options", "rollout"],
    ["export", "prime-rl", "--out", "{tmp}/x", "--reward-mode", "random"],
    ["export", "prime-rl", "--out", "{tmp}/x", "--shuffle-options", "always"],
]

# `scirl train` and `scirl demo` cases: added with the training-side hardening.
TRAIN_DEMO_CASES = [
    ["train", "--max-steps", "0"],
    ["train", "--optim.lr", "inf"],
    ["train", "--temperature", "nan"],
    ["train", "--optim.betas", "[2, -5]"],
    ["train", "--batch-size", "10", "--group-size", "3"],
    ["train", "--device", "tpu9"],
    ["train", "--no-such-field", "1"],
    ["train", "--inference.backend", "tensorrt"],
    ["train", "--data.shuffle-options", "always"],
    ["train", "--reward.mode", "coin"],
    ["train", "@", "{tmp}/missing.toml"],
    ["train", "@", "{file}"],  # not TOML
    ["train", "--resume", "{tmp}/nowhere"],
    ["train", "--output-dir", "{file}", "--model", "{model}", "--data.source", "{data}"],  # a file, not a directory
    ["train", "--output-dir", "{tmp}/run", "--model", "{model}", "--data.source", "{tmp}/missing.jsonl"],
    ["train", "--output-dir", "{tmp}/run", "--model", "{model}", "--data.source", "{latin1}"],
    ["train", "--data.format", "csv"],
    ["train", "--data.columns", "question=Q,distractors=D1+D2"],  # distractors without the answer's column
    ["train", "--output-dir", "{tmp}/run", "--model", "{model}", "--data.source", "{ambiguous}"],
    ["demo", "--threads", "many"],
    ["demo", "--model", "{model}"],  # the demo trains its own base model: overriding it is refused
    ["demo", "--config", "{tmp}/missing.toml"],
    ["train", "@", "{latin1_toml}"],  # a Latin-1 byte in a comment: TOML is UTF-8
    ["train", "--resume", "{latin1_run}"],  # the run's config.toml is not UTF-8
    ["demo", "--output-dir", "{file}/demo"],  # under a plain file
    ["demo", "--output-dir", "{file}"],  # a plain file
    ["demo", "--train-per-domain", "-3"],
    ["demo", "--eval-per-domain", "0"],
    ["demo", "--deployment.num-train-gpus", "2"],  # trainer ranks without servers: the demo trains in one process
    # issue 49: the same bad input is 2 in train as where it is read elsewhere (these were 1)
    [
        "train",
        "--output-dir",
        "{tmp}/run",
        "--model",
        "{model}",
        "--data.source",
        "{data}",
        "--data.columns",
        "question=Q,options=O,answer=A",
    ],
    ["train", "--output-dir", "{tmp}/run", "--model", "{model}", "--data.source", "{not_jsonl}"],
    ["train", "--output-dir", "{tmp}/run", "--model", "{model}", "--data.source", "{data}", "--batch-size", "800"],
]

# Issue 43: an eval that knows the run, refusals before any work, exports that read their data
RUN_CASES = [
    ["eval", "--out", "{tmp}/e.json"],  # no model, no run
    ["eval", "--run", "{tmp}", "--out", "{tmp}/e.json"],  # not a run directory
    ["eval", "--run", "{run}", "--base-url", "http://127.0.0.1:9/v1", "--out", "{tmp}/e.json"],  # a served model's name
    ["eval", "--model", "{run}/weights/step_1", "--eval-per-domain", "2", "--out", "{tmp}/e.json"],  # trained questions
    ["eval", "--run", "{run}", "--split", "train", "--out", "{tmp}/e.json"],  # the split it trained on
    [
        "eval",
        "--base-url",
        "http://127.0.0.1:9/v1",
        "--model",
        "m",
        "--run",
        "{run}",
        "--eval-per-domain",
        "2",
        "--out",
        "{tmp}/e.json",
    ],  # refused before any request (nothing listens on port 9)
    ["eval", "--model", "{empty_run}/weights/latest", "--out", "{tmp}/e.json"],  # a run without a checkpoint
    ["eval", "--run", "{empty_run}", "--model", "{run}/weights/step_1", "--out", "{tmp}/e.json"],  # two runs
    ["eval", "--model", "{run}/weights/step_1", "--data", "{tmp}/missing.jsonl", "--out", "{tmp}/e.json"],
    ["eval", "compare", "{results}", "{disjoint}"],  # no question in both: nothing to pair
    ["eval", "compare", "{results}", "{repeated}"],  # a question twice
    ["train", "--model", "{tmp}/no-model", "--dry-run"],
    [
        "train",
        "--model",
        "{tmp}/no-model",
        "--device",
        "cuda",
        "--dry-run",
    ],  # was HFValidationError from the memory plan
    ["train", "--model", "{file}", "--dry-run"],
    ["train", "--model", "{tmp}", "--dry-run"],  # a directory without config.json
    ["train", "--resume", "{run}", "--model", "org/another-model", "--dry-run"],  # the run trains its own model
    ["train", "--data.seed", "3"],  # renamed: data.split_seed
    ["train", "--output-dir", "{file}/run", "--model", "{model}", "--data.source", "{data}"],
    ["export", "prime-rl", "--out", "{tmp}/x", "--data", "{tmp}/missing.jsonl"],  # was exit 0, the path in grpo.toml
    ["export", "prime-rl", "--out", "{tmp}/x", "--data", "{file_of_nothing}"],
    ["export", "prime-rl", "--out", "{tmp}/x", "--data", "{ambiguous}"],
    ["export", "prime-rl", "--out", "{tmp}/x", "--data", "{data}", "--data-columns", "question=Q,options=O,answer=A"],
    [
        "eval",
        "--model",
        "{model}",
        "--data",
        "{data}",
        "--data-columns",
        "question=Q,options=O,answer=A",
        "--out",
        "{tmp}/e.json",
    ],
    [
        "export",
        "prime-rl",
        "--out",
        "{tmp}/x",
        "--data-format",
        "arc",
        "--data-columns",
        "question=Q,options=O,answer=A",
    ],
    ["export", "prime-rl", "--out", "{tmp}/x", "--split-seed", "-1"],
    ["export", "prime-rl", "--out", "{exported}"],  # an earlier export: --force
    ["inference", "--model", "{tmp}/no-model"],  # before any server starts
    ["dcp-to-hf"],
    ["dcp-to-hf", "{tmp}/nowhere", "--out", "{tmp}/o"],
    ["dcp-to-hf", "{tmp}/nowhere", "--out", "{file}/o"],  # under a plain file: before any checkpoint is read
    ["export", "prime-rl", "--out", "{file}/x"],
    # served under its path (vLLM's default name): the run is known, and its trained questions refused
    [
        "eval",
        "--base-url",
        "http://127.0.0.1:9/v1",
        "--model",
        "{run}/weights/step_1",
        "--eval-per-domain",
        "2",
        "--out",
        "{tmp}/e.json",
    ],
]

ALL_CASES = (
    DATA_CASES + EVAL_CASES + COMPARE_CASES + SERVE_CASES + REPORT_CASES + EXPORT_CASES + TRAIN_DEMO_CASES + RUN_CASES
)


@pytest.fixture(scope="module")
def places(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("cli_errors")
    rows = generate_rows(n_per_domain=4, seed=2)
    data = write_jsonl(rows, root / "rows.jsonl")
    latin1 = root / "latin1.jsonl"
    latin1.write_bytes(
        "\n".join(json.dumps(dict(r, question=r["question"] + " \u00e9"), ensure_ascii=False) for r in rows).encode(
            "latin-1"
        )
    )
    utf16 = root / "utf16.jsonl"
    utf16.write_bytes(data.read_text(encoding="utf-8").encode("utf-16"))
    file = root / "plain.txt"
    file.write_text("not json\n")
    notutf8 = root / "notutf8.json"
    notutf8.write_bytes(b'{"records": "\xff\xfe"}')
    list_json = root / "list.json"
    list_json.write_text("[1, 2]")
    bad_records = root / "bad_records.json"
    bad_records.write_text(json.dumps({"records": [{"id": ["x"], "correct": "yes"}]}))
    ambiguous = write_jsonl(
        [{"question": "q?", "options": ["a", "b"], "answer": "A", "answer_index": 0, "answer_letter": "A"}],
        root / "ambiguous.jsonl",
    )
    file_of_nothing = write_jsonl([{"prompt": "q?", "response": "a"}], root / "nothing.jsonl")
    not_jsonl = root / "table.jsonl"
    not_jsonl.write_text("question,A,B,answer\nWhich is a metal?,iron,wood,A\n")
    latin1_toml = root / "latin1.toml"
    latin1_toml.write_bytes("# r\u00e9glages du caf\u00e9\nmax_steps = 2\n".encode("latin-1"))
    latin1_run = root / "latin1_run"
    latin1_run.mkdir()
    (latin1_run / "config.toml").write_bytes(latin1_toml.read_bytes())
    results = root / "results.json"
    results.write_text(json.dumps({"records": [{"id": "a", "correct": True, "domain": "Biology"}], "settings": {}}))
    disjoint = root / "disjoint.json"
    disjoint.write_text(json.dumps({"records": [{"id": "b", "correct": True, "domain": "Biology"}], "settings": {}}))
    repeated = root / "repeated.json"
    repeated.write_text(json.dumps({"records": [{"id": "a", "correct": True}, {"id": "a", "correct": False}]}))
    # a run (its config and a checkpoint, the tiny model: nothing here trains), and one with no checkpoint yet
    run, empty_run = root / "run", root / "empty_run"
    config = load_config(
        [
            "--model",
            str(tiny_model_dir),
            "--data.source",
            str(data),
            "--data.eval-per-domain",
            "1",
            "--output-dir",
            str(run),
        ]
    )
    write_config(config, run / "config.toml")
    shutil.copytree(tiny_model_dir, run / "weights" / "step_1")
    (run / "weights" / "latest").write_text("step_1\n")
    write_config(config, empty_run / "config.toml")
    exported = root / "exported"
    exported.mkdir()
    (exported / "grpo.toml").write_text("")
    return {
        "data": data,
        "model": tiny_model_dir,
        "latin1": latin1,
        "utf16": utf16,
        "file": file,
        "notutf8": notutf8,
        "list_json": list_json,
        "bad_records": bad_records,
        "results": results,
        "ambiguous": ambiguous,
        "file_of_nothing": file_of_nothing,
        "latin1_toml": latin1_toml,
        "latin1_run": latin1_run,
        "disjoint": disjoint,
        "repeated": repeated,
        "run": run,
        "empty_run": empty_run,
        "exported": exported,
        "not_jsonl": not_jsonl,
    }


def run_cli(argv: list[str]) -> int:
    try:
        return cli_main(argv)
    except SystemExit as e:  # argparse's usage errors
        return e.code if isinstance(e.code, int) else 2


@pytest.mark.parametrize("argv", ALL_CASES, ids=[" ".join(a) for a in ALL_CASES])
def test_bad_input_is_one_line_and_exit_2(argv, places, tmp_path, capsys, monkeypatch):
    fill = {**{k: str(v) for k, v in places.items()}, "tmp": str(tmp_path)}
    argv = [a.format(**fill) for a in argv]
    rc = run_cli(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith(("warning:", "note:"))]
    assert rc == 2, err
    assert len(lines) == 1, err
    assert lines[0].startswith("scirl"), err
    assert_names_only_flags_it_accepts(argv, lines[0], monkeypatch)


# ---- the flags a message names ----

# Programs a message may tell one to run, with flags of their own
OTHER_PROGRAMS = {
    "pip",
    "torchrun",
    "vllm",
    "uv",
    "git",
    "sbatch",
    "srun",
    "scancel",
    "huggingface-cli",
    "python",
    "python3",
    "nvidia-smi",
    "curl",
}
# The commands that take scirl train's config as flags (besides options of their own)
TAKE_TRAIN_CONFIG = {"train", "demo", "inference", "slurm", "job"}
FLAG = re.compile(r"--[a-z][a-z0-9-]*(?:\.[a-z0-9-]+)*")
WORD = re.compile(r"[^\s,;:()`'\"]+|[,;:()]")


class Captured(Exception):
    def __init__(self, parser):
        self.parser = parser


def command_of(argv: list[str]) -> tuple[str, ...]:
    """The command (and subcommand) ``argv`` runs: ("data", "stats"), ("eval", "compare"), ("train",)."""
    name = argv[0]
    if len(argv) > 1 and (
        (name == "data" and argv[1] in ("stats", "export"))
        or (name == "export" and argv[1] == "prime-rl")
        or (name == "eval" and argv[1] == "compare")
    ):
        return name, argv[1]
    return (name,)


def options_of(command: tuple[str, ...], monkeypatch) -> set[str]:
    """The option strings of ``command``'s parser, caught as its main() asks it to parse."""

    def catch(self, *args, **kwargs):
        raise Captured(self)

    monkeypatch.setattr(Parser, "parse_args", catch)
    monkeypatch.setattr(Parser, "parse_known_args", catch)
    try:
        cli_main(list(command[:1]) + (["compare"] if command == ("eval", "compare") else []))
    except Captured as caught:
        parser = caught.parser
    finally:
        monkeypatch.undo()
    if len(command) > 1 and command[1] != "compare":  # a subcommand's own parser
        parser = parser._subparsers._group_actions[0].choices[command[1]]
    return set(parser._option_string_actions)


def accepted(command: tuple[str, ...], flag: str, options: set[str]) -> bool:
    if flag in options:
        return True
    if command[0] not in TAKE_TRAIN_CONFIG:
        return False
    for argv in ([flag], [flag, "1"]):  # a true/false field, or one with a value
        try:
            parse_overrides(argv)
            return True
        except ConfigError:
            continue
    return False


def named_flags(line: str, command: tuple[str, ...]) -> list[tuple[tuple[str, ...], str]]:
    """(command, flag) for each flag ``line`` names: the flags of the command that said it, except where another
    scirl command or another program is named before them in the same clause (up to , ; : or a parenthesis)."""
    found, owner, words = [], command, WORD.findall(line)
    for i, word in enumerate(words):
        if word in ",;:()":
            owner = command
        elif word == "scirl" and i + 1 < len(words) and words[i + 1] in COMMANDS:
            owner = (words[i + 1],)
        elif word in OTHER_PROGRAMS:
            owner = None
        elif FLAG.fullmatch(word.rstrip(".")) and owner is not None:
            found.append((owner, word.rstrip(".")))
    return found


def assert_names_only_flags_it_accepts(argv: list[str], line: str, monkeypatch) -> None:
    assert not re.search(r"\b\w+=(True|False)\b", line), f"a Python argument is no flag: {line}"
    typed = {arg.split("=")[0] for arg in argv if arg.startswith("--")}
    for command, flag in named_flags(line, command_of(argv)):
        if flag in typed:  # the user's own flag, named as what is wrong
            continue
        assert accepted(command, flag, options_of(command, monkeypatch)), (
            f"`scirl {' '.join(command)}` does not accept {flag}, which its message names: {line}"
        )


def test_the_flag_check_knows_each_commands_flags(monkeypatch):
    """The check itself: a flag of one command is not another's, train's config fields count for train."""
    assert accepted(("train",), "--data.format", options_of(("train",), monkeypatch))
    assert accepted(("train",), "--filters.zero-advantage.no-enforce", options_of(("train",), monkeypatch))
    assert not accepted(("train",), "--data-format", options_of(("train",), monkeypatch))
    assert accepted(("eval",), "--data-format", options_of(("eval",), monkeypatch))
    assert not accepted(("eval",), "--data.format", options_of(("eval",), monkeypatch))
    assert accepted(("data", "stats"), "--split-seed", options_of(("data", "stats"), monkeypatch))
    assert not accepted(("data", "stats"), "--split", options_of(("data", "stats"), monkeypatch))
    assert named_flags("x: fix: pip install 'scirl[gpu]', or --inference.backend hf", ("train",)) == [
        (("train",), "--inference.backend")
    ]
    assert named_flags("stopped; resume with: scirl train --resume run", ("demo",)) == [(("train",), "--resume")]


# ---- input read and named where it is given (issue 49)

MISFIT = ["--data", "{data}", "--data-columns", "question=Q,options=O,answer=A"]  # columns the file does not have


@pytest.mark.parametrize(
    "argv",
    [
        ["data", "stats", *MISFIT],
        [
            "train",
            "--output-dir",
            "{tmp}/run",
            "--model",
            "{model}",
            "--data.source",
            "{data}",
            "--data.columns",
            "question=Q,options=O,answer=A",
        ],
        ["eval", "--model", "{model}", *MISFIT, "--out", "{tmp}/e.json"],
        ["export", "prime-rl", "--out", "{tmp}/x", *MISFIT],
    ],
    ids=["data stats", "train", "eval", "export"],
)
def test_a_column_mapping_that_does_not_fit_the_file_is_refused_naming_the_column(argv, places, tmp_path, capsys):
    """data stats read every row as missing_field and exited 0, train exited 1: each command now names the
    column no row has."""
    fill = {**{k: str(v) for k, v in places.items()}, "tmp": str(tmp_path)}
    assert run_cli([a.format(**fill) for a in argv]) == 2
    err = capsys.readouterr().err
    assert "column 'Q', which no row has" in err and len(err.strip().splitlines()) == 1, err


def test_a_file_that_is_not_json_lines_is_refused_naming_its_line(places, capsys):
    assert run_cli(["data", "stats", "--data", str(places["not_jsonl"])]) == 2
    assert f"{places['not_jsonl']}:1: not JSON" in capsys.readouterr().err
