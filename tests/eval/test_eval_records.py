"""A damaged eval records file never crashes `scirl eval`: intact answers are kept, damaged lines are
counted by reason and their questions asked again, a bad header is refused with advice."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from fakes.openai_server import answering
from scirl.commands.eval import main
from scirl.eval.results import BadRecordsFile, RecordsFile, SettingsMismatch, check_resumable, records_path
from scirl.synth.questions import generate_rows, write_jsonl
from scirl.task.data import load_splits
from scirl.task.prompt import user_text

N = 6  # questions per evaluation (--limit)
OTHER_ID = "0123456789abcdef"  # a well-formed id that is in no eval set here


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """(data file, the N questions, running server, clean records bytes from a full first run)."""
    tmp = tmp_path_factory.mktemp("records")
    data_file = write_jsonl(generate_rows(n_per_domain=12, seed=5), tmp / "rows.jsonl")
    questions = load_splits(str(data_file), eval_per_domain=4).split("eval")[:N]
    with answering(questions, lambda q: f"Answer: {q.answer_key}") as server:
        out = tmp / "clean.json"
        assert main(eval_args(server, data_file, out)) == 0
        # records arrive in completion order, which a loaded machine shuffles; the cases below damage
        # "line i" meaning question i's record, so put them in question order (order means nothing to a resume)
        header, lines = split_clean(records_path(out).read_bytes())
        position = {q.id: i for i, q in enumerate(questions)}
        lines.sort(key=lambda line: position[json.loads(line)["id"]])
        yield data_file, questions, server, b"\n".join([header, *lines]) + b"\n"


def eval_args(server, data_file, out, *extra):
    return [
        "--base-url",
        server.url,
        "--model",
        "fake",
        "--data",
        str(data_file),
        "--eval-per-domain",
        "4",
        "--limit",
        str(N),
        "--timeout",
        "30",
        "--out",
        str(out),
        "--no-progress",
        *extra,
    ]


def split_clean(clean: bytes) -> tuple[bytes, list[bytes]]:
    header, *lines = clean.split(b"\n")[:-1]
    return header, lines


def edit(line: bytes, **changes) -> bytes:
    """The record line with fields changed (a value of ... removes the field)."""
    entry = json.loads(line)
    for key, value in changes.items():
        if value is ...:
            del entry[key]
        else:
            entry[key] = value
    return json.dumps(entry).encode()


def joined(header, lines) -> bytes:
    return b"".join(line + b"\n" for line in [header, *lines])


def replace(i, new):
    """A damage: line i of the records (0-based, header excluded) replaced by ``new(line)``."""
    return lambda h, lines: joined(h, [new(line) if j == i else line for j, line in enumerate(lines)])


# name, damage(header, record lines) -> file bytes, expected skipped {reason: count}, indexes of questions re-asked
CASES = [
    ("torn last line (a kill)", lambda h, L: joined(h, L[:-1]) + L[-1][:20], {"cut short at the end": 1}, {5}),
    ("line cut in the middle", replace(1, lambda line: line[:25]), {"not JSON": 1}, {1}),
    ("a list", replace(2, lambda line: b"[1, 2, 3]"), {"not a record object": 1}, {2}),
    ("a number", replace(3, lambda line: b"42"), {"not a record object": 1}, {3}),
    ("JSON null", replace(0, lambda line: b"null"), {"not a record object": 1}, {0}),
    ("missing id", replace(1, lambda line: edit(line, id=...)), {"missing field 'id'": 1}, {1}),
    ("missing replies", replace(4, lambda line: edit(line, replies=...)), {"missing field 'replies'": 1}, {4}),
    ("id not a string", replace(0, lambda line: edit(line, id=7)), {"bad field 'id'": 1}, {0}),
    ("replies not a list", replace(2, lambda line: edit(line, replies="A")), {"bad field 'replies'": 1}, {2}),
    ("a reply not a string", replace(2, lambda line: edit(line, replies=[3])), {"bad field 'replies'": 1}, {2}),
    ("no replies", replace(3, lambda line: edit(line, replies=[])), {"wrong number of replies": 1}, {3}),
    (
        "finish reasons mistyped",
        replace(5, lambda line: edit(line, finish_reasons="stop")),
        {"bad field 'finish_reasons'": 1},
        {5},
    ),
    (
        "id not in this eval set",
        lambda h, L: joined(h, L + [edit(L[0], id=OTHER_ID)]),
        {"id not in this eval set": 1},
        set(),
    ),
    ("duplicated id", lambda h, L: joined(h, L + [edit(L[0], replies=["I cannot tell."])]), {"duplicate id": 1}, set()),
    ("binary junk line", replace(2, lambda line: b"\x00\xff\xfe junk \x80\x81"), {"not JSON": 1}, {2}),
    ("binary junk inserted", lambda h, L: joined(h, L[:3] + [b"\xff\xfe\x00\x01"] + L[3:]), {"not JSON": 1}, set()),
    ("pathologically nested", replace(1, lambda line: b"[" * 100_000), {"not JSON": 1}, {1}),
    ("extra header line", lambda h, L: joined(h, L[:2] + [h] + L[2:]), {"extra header line": 1}, set()),
    (
        "mixed damage",
        lambda h, L: joined(h, [L[0], b"{oops", L[2][:-3], edit(L[3], id=...), L[4], L[5]]),
        {"not JSON": 2, "missing field 'id'": 1},
        {1, 2, 3},
    ),
    # harmless: nothing skipped, nothing asked again
    ("blank lines, no final newline", lambda h, L: joined(h, L[:2] + [b"", b"  "] + L[2:])[:-1], {}, set()),
    # a file that holds nothing: everything asked
    ("empty file", lambda h, L: b"", {}, set(range(N))),
]


@pytest.mark.parametrize("name, damage, skipped, asked", CASES, ids=[c[0] for c in CASES])
def test_damaged_records_are_skipped_counted_and_asked_again(env, tmp_path, capsys, name, damage, skipped, asked):
    data_file, questions, server, clean = env
    header, lines = split_clean(clean)
    out = tmp_path / "eval.json"
    damaged = damage(header, lines)
    records_path(out).write_bytes(damaged)
    server.requests.clear()

    assert main(eval_args(server, data_file, out)) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err
    if skipped:
        total = sum(skipped.values())
        assert f"kept {N - len(asked)}, skipped {total} damaged line{'s' if total > 1 else ''} (" in err
        for reason, count in skipped.items():
            assert f"{count} {reason}" in err
        assert "asked again" in err and str(records_path(out)) in err
    else:
        assert "damaged" not in err
    # only the damaged questions were asked, each once
    assert server.requests == Counter({questions[i].id: 1 for i in asked})
    results = json.loads(out.read_text())
    assert [r["id"] for r in results["records"]] == [q.id for q in questions]  # one record per question
    assert results["counts"]["answered"] == N and results["failed"] == []
    # the first intact answer wins; the server answers right, the duplicate below it is wrong
    assert all(r["replies"] == [f"Answer: {r['answerKey']}"] for r in results["records"])
    # nothing the user had was rewritten: new answers follow the old bytes (a torn tail moved to a side file)
    after = records_path(out).read_bytes()
    if "torn" in name:
        kept = damaged[: damaged.rfind(b"\n") + 1]
        assert records_path(out).with_name("eval.records.jsonl.damaged").read_bytes() == lines[-1][:20] + b"\n"
    else:
        kept = damaged
    assert after.startswith(kept)

    # a rerun reads the same file back: nothing asked, the same results
    server.requests.clear()
    assert main(eval_args(server, data_file, out)) == 0
    assert sum(server.requests.values()) == 0
    assert [r["id"] for r in json.loads(out.read_text())["records"]] == [q.id for q in questions]


def header_with(header: bytes, **settings) -> bytes:
    entry = json.loads(header)
    entry["settings"].update(settings)
    return json.dumps(entry).encode()


# name, damage(header, record lines) -> file bytes, words the refusal must hold
BAD_HEADERS = [
    ("missing header", lambda h, L: joined(L[0], L[1:]), "no header line"),
    ("garbled header", lambda h, L: joined(h[:15] + b"#~", L), "garbled"),
    ("binary header", lambda h, L: joined(b"\x89PNG\r\n\x1a\x00\xff", L), "garbled"),
    ("header settings not an object", lambda h, L: joined(b'{"scirl_eval_records": 1, "settings": [1]}', L), "garbled"),
    (
        "header of another format version",
        lambda h, L: joined(h.replace(b'"scirl_eval_records": 1', b'"scirl_eval_records": 9'), L),
        "format 9",
    ),
    ("header with other settings", lambda h, L: joined(header_with(h, temperature=0.5), L), "temperature"),
]


@pytest.mark.parametrize("name, damage, words", BAD_HEADERS, ids=[c[0] for c in BAD_HEADERS])
def test_bad_header_is_refused_with_advice_and_overwrite_starts_afresh(env, tmp_path, capsys, name, damage, words):
    data_file, questions, server, clean = env
    out = tmp_path / "eval.json"
    damaged = damage(*split_clean(clean))
    records_path(out).write_bytes(damaged)
    server.requests.clear()

    assert main(eval_args(server, data_file, out)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert words in err and str(records_path(out)) in err and "--overwrite" in err
    assert sum(server.requests.values()) == 0 and not out.exists()
    assert records_path(out).read_bytes() == damaged  # untouched

    # the in-process path checks the header before it loads a model
    with pytest.raises((BadRecordsFile, SettingsMismatch), match="--overwrite"):
        check_resumable(out, json.loads(split_clean(clean)[0])["settings"])

    assert main(eval_args(server, data_file, out, "--overwrite")) == 0
    assert server.requests == Counter({q.id: 1 for q in questions})
    assert [r["id"] for r in json.loads(out.read_text())["records"]] == [q.id for q in questions]


def test_a_cut_short_header_alone_starts_afresh(env, tmp_path):
    data_file, questions, server, clean = env
    out = tmp_path / "eval.json"
    records_path(out).write_bytes(clean[:30])  # killed while writing the header
    check_resumable(out, {})  # nothing to refuse
    server.requests.clear()
    assert main(eval_args(server, data_file, out)) == 0
    assert server.requests == Counter({q.id: 1 for q in questions})


def test_a_reply_holding_unicode_line_separators_reads_back(tmp_path):
    """Records split on newlines only: U+2028 and U+0085 are written unescaped and must not cut a record."""
    settings = {
        "model": "m",
        "data": "d",
        "n_samples": 1,
        "temperature": 0.0,
        "top_p": 1.0,
        "max_tokens": 8,
        "seed": None,
    }
    path = tmp_path / "r.records.jsonl"
    with RecordsFile(path, settings) as rf:
        rf.append("a" * 16, ["Answer:\u2028B\x85\r"])
    with RecordsFile(path, settings) as rf:
        assert rf.skipped == {}
        assert rf.answered["a" * 16]["replies"] == ["Answer:\u2028B\x85\r"]


class StubGenerator:
    """A generator that answers the right letter: the tokenizer hands out one token per distinct prompt text."""

    model_dir = "stub"

    def __init__(self, questions):
        self.questions = questions
        self.texts: list[str] = []
        self.asked: Counter = Counter()
        self.tokenizer = self  # no chat template: the prompt is a plain transcript

    chat_template = None

    def encode(self, text, add_special_tokens=False):
        self.texts.append(text)
        return [len(self.texts) - 1]

    def generate(self, prompts, params):
        from scirl.inference.base import Completion

        outputs = []
        for prompt in prompts:
            q = next(q for q in self.questions if user_text(q) in self.texts[prompt[0]])
            self.asked[q.id] += 1
            outputs.append([Completion(f"Answer: {q.answer_key}", [1], [0.0], "stop") for _ in range(params.n)])
        return outputs


def test_local_evaluation_skips_damaged_lines_too(env, tmp_path, capsys):
    from scirl.eval.local import evaluate_generator

    questions = env[1]
    out = tmp_path / "local.json"
    first = StubGenerator(questions)
    evaluate_generator(first, questions, out=out)
    header, lines = split_clean(records_path(out).read_bytes())
    records_path(out).write_bytes(joined(header, [lines[0], b"[]", b"{bad", *lines[3:], edit(lines[4], id=OTHER_ID)]))
    capsys.readouterr()

    again = StubGenerator(questions)
    results = evaluate_generator(again, questions, out=out)
    err = capsys.readouterr().err
    assert f"kept {N - 2}, skipped 3 damaged lines" in err
    assert "1 not a record object" in err and "1 not JSON" in err and "1 id not in this eval set" in err
    assert again.asked == Counter({questions[1].id: 1, questions[2].id: 1})
    assert [r["id"] for r in results["records"]] == [q.id for q in questions]
    assert json.loads(out.read_text())["counts"]["answered"] == N
