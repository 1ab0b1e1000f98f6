"""scirl eval against hostile servers and careless use: markup in outside text, floods, two runs on one --out,
credentials echoed back (issue 12, items 7, 9, 10, 13)."""

from __future__ import annotations

import base64
import json

import pytest

from fakes.openai_server import FakeOpenAI, Reply
from scirl.eval.client import ClientConfig, evaluate_server
from scirl.synth.questions import generate_rows, write_jsonl
from scirl.task.data import load_splits


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return write_jsonl(generate_rows(n_per_domain=6, seed=3), tmp_path_factory.mktemp("hostile") / "rows.jsonl")


def questions(data_file, per_domain=1):
    return load_splits(str(data_file), eval_per_domain=per_domain).split("eval")


def fake_server(reply=None, status=200, error_body=None, model="m") -> FakeOpenAI:
    """The shared fake giving every request the same reply (or the same error: ``{auth}`` in ``error_body`` is the
    request's Authorization header); it records each request's headers."""

    def error(request):
        return Reply(
            status,
            (error_body or "").replace("{auth}", request.headers.get("authorization", "")),
            media_type="text/plain",
        )

    return FakeOpenAI(answer=reply if status == 200 else error, model=model, finish_reason="length")


def test_markup_in_a_model_name_and_a_server_error_is_printed_literally(data_file, tmp_path, capsys):
    """Before: "[/x]" in the --model name or a server's error ended `scirl eval` in rich's MarkupError."""
    from scirl.commands.eval import main

    with fake_server(status=400, error_body="bad [/x] request [bold]", model="[/x]") as srv:
        rc = main(
            [
                "--base-url",
                srv.url,
                "--model",
                "[/x]",
                "--data",
                str(data_file),
                "--eval-per-domain",
                "1",
                "--retries",
                "0",
                "--out",
                str(tmp_path / "e.json"),
                "--no-progress",
            ]
        )
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    assert rc == 1  # every question failed (HTTP 400), and the summary still printed
    assert "[/x]" in out and "bad [/x] request [bold]" in out
    assert json.loads((tmp_path / "e.json").read_text())["counts"]["failed"] == 4


def test_markup_in_data_fields_is_printed_literally(tmp_path, capsys):
    from scirl.commands.data import main

    rows = generate_rows(n_per_domain=3, seed=1)
    for row in rows:
        row["details"]["level"] = "[/lvl]"
        row["details"]["task"] = "[red]task"
    path = write_jsonl(rows, tmp_path / "rows.jsonl")
    assert main(["stats", "--data", str(path), "--eval-per-domain", "1"]) == 0
    assert "[/lvl]" in capsys.readouterr().out


def test_replies_past_the_cap_are_stored_cut_and_counted(data_file, tmp_path):
    """Before: a server ignoring max_tokens with 20 MB replies made 160 MB results for 8 questions."""
    qs = questions(data_file)
    with fake_server(reply="Answer: B " + "x" * 200_000) as srv:
        cfg = ClientConfig(
            base_url=srv.url, model="m", n_samples=2, temperature=1.0, max_tokens=8, retries=0, max_reply_chars=1000
        )
        results = evaluate_server(qs, cfg, out=tmp_path / "e.json", progress=False)
    assert results["counts"]["truncated_replies"] == 2 * len(qs)
    assert results["settings"]["max_reply_chars"] == 1000
    assert all(len(reply) == 1000 for r in results["records"] for reply in r["replies"])
    assert (tmp_path / "e.records.jsonl").stat().st_size < 2 * len(qs) * 1000 + 10_000
    assert all(
        json.loads(line).get("truncated") == 2 for line in (tmp_path / "e.records.jsonl").read_text().splitlines()[1:]
    )


def test_a_flood_is_not_read_past_the_limit(data_file):
    qs = questions(data_file)[:2]
    with fake_server(reply="x" * 3_000_000) as srv:
        cfg = ClientConfig(base_url=srv.url, model="m", max_tokens=8, retries=0, max_reply_chars=100)
        results = evaluate_server(qs, cfg, progress=False)
    assert results["counts"]["answered"] == 0 and len(results["failed"]) == 2
    assert all("--max-reply-chars" in f["error"] for f in results["failed"])


def test_default_cap_follows_max_tokens():
    from scirl.eval.client import default_max_reply_chars

    assert default_max_reply_chars(1024) == 16 * 1024 and default_max_reply_chars(8) == 4096


def test_a_second_eval_on_the_same_out_is_refused(data_file, tmp_path, capsys):
    """Before: two runs on one --out both asked every question and left a corrupt line and duplicates."""
    from scirl.commands.eval import main
    from scirl.eval.results import lock_out

    out = tmp_path / "e.json"
    args = ["--base-url", "http://127.0.0.1:9/v1", "--model", "m", "--data", str(data_file), "--out", str(out)]
    held = lock_out(out)  # another scirl eval holds it (flock: a second open file conflicts, in one process too)
    try:
        assert main(args) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "another scirl eval" in err and "e.json.lock" in err
    finally:
        held.close()
    lock_out(out).close()  # released with its holder: the next run may take it


def test_an_eval_leaves_no_lock_file_behind(data_file, tmp_path):
    """Every eval left `OUT.lock` beside its results (issue 49): the lock's file goes with the lock."""
    from scirl.commands.eval import main
    from scirl.eval.results import lock_out

    out = tmp_path / "e.json"
    with fake_server(reply="Answer: A") as srv:
        assert (
            main(
                [
                    "--base-url",
                    srv.url,
                    "--model",
                    "m",
                    "--data",
                    str(data_file),
                    "--eval-per-domain",
                    "1",
                    "--out",
                    str(out),
                    "--no-progress",
                ]
            )
            == 0
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.json", "e.records.jsonl"]
    first = lock_out(out)
    first.close()
    second = lock_out(out)  # a new file, held by the next one alone
    assert (tmp_path / "e.json.lock").exists()
    second.close()
    assert not (tmp_path / "e.json.lock").exists()


def test_echoed_credentials_are_blanked(data_file, tmp_path, capsys):
    """Before: a server echoing the Authorization header leaked base64(user:password) into failed[].error."""
    from scirl.commands.eval import main

    with fake_server(status=400, error_body="you sent Authorization: {auth}") as srv:
        url = srv.url.replace("http://", "http://alice:pa%24%24word@")
        rc = main(
            [
                "--base-url",
                url,
                "--model",
                "m",
                "--data",
                str(data_file),
                "--eval-per-domain",
                "1",
                "--retries",
                "0",
                "--out",
                str(tmp_path / "e.json"),
                "--no-progress",
            ]
        )
        sent = srv.state.headers[0]["authorization"]
    assert rc == 1 and sent.startswith("Basic ")
    token = sent.split()[1]
    assert base64.b64decode(token) == b"alice:pa$$word"
    saved = (tmp_path / "e.json").read_text()
    shown = capsys.readouterr()
    for text in (saved, shown.out, shown.err):
        assert (
            token not in text
            and token.rstrip("=") not in text
            and "pa$$word" not in text
            and "pa%24%24word" not in text
        )
    assert "Basic ***" in json.loads(saved)["failed"][0]["error"]


def test_bearer_values_are_blanked_even_when_not_ours():
    from scirl.eval.client import blank_secrets

    cfg = ClientConfig(base_url="http://u:secret@h/v1", model="m", api_key="sk-123456")
    text = blank_secrets("Authorization: Bearer sk-123456 proxy: Bearer other-token.x Basic dTpzZWNyZXQ= secret", cfg)
    assert "sk-123456" not in text and "other-token" not in text and "dTpzZWNyZXQ" not in text and "secret" not in text
