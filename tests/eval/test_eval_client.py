"""The eval client against a deterministic fake OpenAI server: faults, n-fallback, fatal errors, kill and resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest

from fakes.openai_server import FakeOpenAI, Reply, answering
from scirl.eval.client import ClientConfig, FatalServerError, evaluate_server
from scirl.eval.results import records_path
from scirl.synth.questions import generate_rows, write_jsonl
from scirl.task.data import load_splits

FAST = 0.4  # a timeout well under the fake's 1.5 s hang


def rule_reply(q) -> str:
    """A fixed answer per question: right for about two thirds of them, in varied formats."""
    h = int(q.id, 16)
    label = q.answer_key if h % 3 else next(x for x in q.labels if x != q.answer_key)
    return (f"Answer: {label}", label, f"The answer is {label}.")[h % 5 % 3]


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return write_jsonl(generate_rows(n_per_domain=20, seed=3), tmp_path_factory.mktemp("data") / "rows.jsonl")


@pytest.fixture(scope="module")
def splits(data_file):
    return load_splits(str(data_file), eval_per_domain=10)


def expected_accuracy(questions) -> float:
    from scirl.task.reward import extract_answer

    return sum(extract_answer(rule_reply(q), q.labels, options=q.options) == q.answer_key for q in questions) / len(
        questions
    )


def config(url, **kw) -> ClientConfig:
    """Client settings for these tests. The default timeout is generous so that a loaded machine never turns a
    healthy reply into a retry (tests count requests exactly); tests of hanging servers pass ``timeout=FAST``."""
    base = dict(
        base_url=url, model="fake", timeout=30.0, retries=12, concurrency=8, backoff_base=0.01, backoff_max=0.05
    )
    return ClientConfig(**{**base, **kw})


def test_faulty_server_gives_every_answer_and_the_clean_accuracy(splits):
    questions = splits.split("eval")
    assert len(questions) == 40
    clean = answering(questions, rule_reply)
    with clean as srv:
        clean_results = evaluate_server(questions, config(srv.url), progress=False)
    faulty = answering(questions, rule_reply, faults=0.4, seed=7)
    with faulty as srv:
        faulty_results = evaluate_server(questions, config(srv.url, timeout=FAST), progress=False)
    # the faults really happened, each kind of them
    assert {"500", "429", "hang", "bad_json", "no_choices"} <= set(faulty.injected)
    assert sum(faulty.requests.values()) > len(questions)
    for results in (clean_results, faulty_results):
        assert results["counts"]["answered"] == 40 and results["failed"] == []
        assert results["overall_accuracy"] == pytest.approx(expected_accuracy(questions))
    assert faulty_results["per_domain_accuracy"] == clean_results["per_domain_accuracy"]
    assert [r["answers"] for r in faulty_results["records"]] == [r["answers"] for r in clean_results["records"]]
    assert [r["id"] for r in faulty_results["records"]] == [
        q.id for q in questions
    ]  # question order, not arrival order


def test_question_failing_after_all_retries_is_reported_and_filled_in_by_a_rerun(splits, tmp_path):
    questions = splits.split("eval")[:12]
    out = tmp_path / "eval.json"
    broken = answering(questions, rule_reply, faults=1.0, seed=1)  # every request fails
    with broken as srv:
        results = evaluate_server(questions, config(srv.url, retries=2, timeout=FAST), out=out, progress=False)
    assert results["counts"] == {**results["counts"], "answered": 0, "failed": 12}
    assert {f["id"] for f in results["failed"]} == {q.id for q in questions}
    assert all("attempts" in f["error"] for f in results["failed"])
    assert json.loads(out.read_text())["counts"]["failed"] == 12
    healthy = answering(questions, rule_reply)
    with healthy as srv:
        results = evaluate_server(questions, config(srv.url, retries=2), out=out, progress=False)
    assert results["counts"]["answered"] == 12 and results["failed"] == []


def test_n_samples_fall_back_to_one_call_per_sample(splits):
    questions = splits.split("eval")[:10]
    server = answering(questions, rule_reply, max_n=1)
    with server as srv:
        results = evaluate_server(questions, config(srv.url, n_samples=3, concurrency=2), progress=False)
    assert all(len(r["replies"]) == 3 for r in results["records"])
    assert all(server.requests[q.id] == 3 for q in questions)
    assert results["n_samples"] == 3 and set(results["pass_at"]) == {"1", "2", "3"}
    assert results["mean_at_k"] == pytest.approx(expected_accuracy(questions))
    # one call with n=3 when the server honours n
    server = answering(questions, rule_reply)
    with server as srv:
        evaluate_server(questions, config(srv.url, n_samples=3), progress=False)
    assert all(server.requests[q.id] == 1 for q in questions)


def test_wrong_url_or_model_stops_at_once_with_a_clear_error(splits):
    questions = splits.split("eval")[:4]
    server = answering(questions, rule_reply)
    with server as srv:
        with pytest.raises(FatalServerError, match="/v1"):
            evaluate_server(questions, config(srv.url.removesuffix("/v1")), progress=False)
    with pytest.raises(FatalServerError, match="cannot reach"):
        evaluate_server(questions, config(srv.url), progress=False)  # server gone


def _eval_cmd(url, data_file, out):
    return [
        sys.executable,
        "-m",
        "scirl",
        "eval",
        "--base-url",
        url,
        "--model",
        "fake",
        "--data",
        str(data_file),
        "--eval-per-domain",
        "10",
        "--concurrency",
        "2",
        "--timeout",
        "5",
        "--out",
        str(out),
        "--no-progress",
    ]


@pytest.mark.slow
def test_killed_eval_resumes_without_asking_answered_questions_again(splits, data_file, tmp_path):
    questions = splits.split("eval")
    out = tmp_path / "eval.json"
    records = records_path(out)
    server = answering(questions, rule_reply, delay_s=0.05)
    env = {**os.environ, "OPENAI_API_KEY": "sk-test-secret-key"}
    with server as srv:
        proc = subprocess.Popen(
            _eval_cmd(srv.url, data_file, out), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        deadline = time.time() + 60
        while not (records.exists() and len(records.read_text().splitlines()) >= 11):
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.time() < deadline, "no records written"
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        recorded = {json.loads(line)["id"] for line in records.read_text().splitlines()[1:] if line.endswith("}")}
        assert 10 <= len(recorded) < len(questions)
        first_run = Counter(server.requests)
        server.requests.clear()
        done = subprocess.run(_eval_cmd(srv.url, data_file, out), env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "resuming" in done.stdout
    asked_again = [i for i in recorded if server.requests[i]]
    assert asked_again == []
    # only questions in flight at the kill are asked twice; nothing asked more than twice
    assert all(first_run[i] + server.requests[i] <= 2 for i in first_run)
    results = json.loads(out.read_text())
    assert results["counts"]["answered"] == len(questions) and results["failed"] == []
    assert sorted(r["id"] for r in results["records"]) == sorted(q.id for q in questions)
    assert results["overall_accuracy"] == pytest.approx(expected_accuracy(questions))
    lines = records.read_text().splitlines()[1:]
    assert len(lines) == len({json.loads(line)["id"] for line in lines}) == len(questions)
    # the API key is never written or printed
    for text in (out.read_text(), records.read_text(), done.stdout, done.stderr):
        assert "sk-test-secret-key" not in text


def test_rerun_with_other_settings_is_refused(splits, data_file, tmp_path):
    questions = splits.split("eval")
    out = tmp_path / "eval.json"
    server = answering(questions, rule_reply)
    with server as srv:
        first = subprocess.run(
            _eval_cmd(srv.url, data_file, out) + ["--limit", "4"], capture_output=True, text=True, timeout=120
        )
        assert first.returncode == 0, first.stdout + first.stderr
        other = subprocess.run(
            _eval_cmd(srv.url, data_file, out) + ["--limit", "4", "--temperature", "0.7"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert other.returncode == 2
    assert "temperature" in other.stderr and "--overwrite" in other.stderr
    assert sum(server.requests.values()) == 4


def test_reply_with_odd_choice_indexes_is_malformed_not_a_crash():
    from scirl.eval.client import RetryableError, parse_choices

    ok = {"index": 0, "message": {"content": "B"}, "finish_reason": "stop"}
    for body in (
        {"choices": [ok, {"index": None, "message": {"content": "C"}}]},
        {"choices": [ok, {"index": "1", "message": {"content": "C"}}]},
    ):
        with pytest.raises(RetryableError, match="malformed"):
            parse_choices(json.dumps(body).encode())
    assert parse_choices(
        json.dumps({"choices": [{**ok, "index": 1}, {**ok, "index": 0, "message": {"content": "A"}}]}).encode()
    ) == [("A", "stop"), ("B", "stop")]


def test_timeout_bounds_the_whole_request_even_when_the_server_trickles_bytes(splits):
    """httpx's timeout is per read; a server that sends a byte now and then must still time out."""
    whole = json.dumps({"choices": [{"index": 0, "message": {"content": "A"}, "finish_reason": "stop"}]}).encode()
    # 1.5 s in all, each byte well inside the 0.4 s timeout
    app = FakeOpenAI(answer=Reply(chunks=[b" "] * 15 + [whole], chunk_delay_s=0.1), count_by=lambda request: "chat")
    requests = app.requests

    questions = splits.split("eval")[:1]
    with app as srv:
        results = evaluate_server(questions, config(srv.url, retries=1, timeout=FAST), progress=False)
    assert results["counts"]["answered"] == 0 and requests["chat"] == 2
    assert "timed out" in results["failed"][0]["error"]


def test_api_key_echoed_in_a_server_error_is_not_written_or_printed(splits, tmp_path, capsys):
    """Some servers and proxies quote the bad credential in their error body; the error text ends up
    in the results file and on the terminal, so the key must be blanked out of it."""
    key = "sk-test-echoed-secret"

    def rejected(request):
        echoed = request.headers.get("authorization", "")
        status = 400 if "x" in request.text[:1] else 500
        return Reply(status, {"error": {"message": f"rejected credentials {echoed}"}})

    app = FakeOpenAI(answer=rejected)
    unauthorized = FakeOpenAI(
        answer=lambda request: Reply(401, {"error": f"bad key {request.headers.get('authorization')}"})
    )

    questions = splits.split("eval")[:3]
    out = tmp_path / "eval.json"
    with app as srv, unauthorized as other:
        results = evaluate_server(questions, config(srv.url, api_key=key, retries=1), out=out, progress=False)
        with pytest.raises(FatalServerError) as fatal:
            evaluate_server(questions, config(other.url, api_key=key), progress=False)
    assert results["counts"]["failed"] == 3 and "rejected credentials" in results["failed"][0]["error"]
    for text in (
        out.read_text(),
        records_path(out).read_text(),
        str(fatal.value),
        json.dumps(results),
        capsys.readouterr().out,
    ):
        assert key not in text


def test_a_reply_that_cannot_be_decoded_is_retried_not_fatal(splits):
    """A body that fails to decompress (a broken proxy) is a malformed reply like any other."""
    questions = splits.split("eval")[:4]

    def undecodable_first(q):
        if seen[q.id] == 1:
            return Reply(body=b"this is not gzip", headers={"content-encoding": "gzip"})
        return rule_reply(q)

    app = answering(questions, undecodable_first)
    seen = app.requests
    with app as srv:
        results = evaluate_server(questions, config(srv.url), progress=False)
    assert results["counts"]["answered"] == 4 and results["failed"] == []
    assert all(n == 2 for n in seen.values())


def test_eval_takes_the_split_seed_so_a_reseeded_holdout_can_be_evaluated(splits, data_file, tmp_path):
    """scirl data and scirl train take the holdout's seed; eval must be able to evaluate that same holdout."""
    reseeded = load_splits(str(data_file), eval_per_domain=10, seed=7).split("eval")
    assert {q.id for q in reseeded} != {q.id for q in splits.split("eval")}
    server = answering(load_splits(str(data_file), eval_per_domain=0).split("train"), rule_reply)
    out = tmp_path / "eval.json"
    with server as srv:
        done = subprocess.run(
            _eval_cmd(srv.url, data_file, out) + ["--split-seed", "7"], capture_output=True, text=True, timeout=120
        )
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads(out.read_text())
    assert [r["id"] for r in results["records"]] == [q.id for q in reseeded]
    assert results["settings"]["split_seed"] == 7


def test_several_greedy_samples_are_flagged_as_identical(splits, data_file, tmp_path):
    """--n-samples 4 at the default temperature 0 gives four copies of one reply: pass@k would equal
    mean@k and look like a measurement, so the user is told."""
    server = answering(splits.split("eval"), rule_reply)
    with server as srv:
        greedy = subprocess.run(
            _eval_cmd(srv.url, data_file, tmp_path / "a.json") + ["--limit", "2", "--n-samples", "4"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        sampled = subprocess.run(
            _eval_cmd(srv.url, data_file, tmp_path / "b.json")
            + ["--limit", "2", "--n-samples", "4", "--temperature", "0.7"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert greedy.returncode == 0 and sampled.returncode == 0
    assert "--temperature 0" in greedy.stderr and "identical" in greedy.stderr
    assert "identical" not in sampled.stderr


def test_bad_numeric_flags_are_refused_with_a_message(tmp_path, capsys):
    from scirl.cli import main

    for flag, value in (("--batch-size", "0"), ("--n-samples", "0"), ("--eval-per-domain", "-1")):
        try:  # argparse's own refusals (a type that checks the value) arrive as SystemExit(2)
            status = main(
                [
                    "eval",
                    "--base-url",
                    "http://127.0.0.1:9/v1",
                    "--model",
                    "m",
                    "--out",
                    str(tmp_path / "x.json"),
                    "--data",
                    str(tmp_path / "absent.jsonl"),
                    flag,
                    value,
                ]
            )
        except SystemExit as exit_:
            status = exit_.code
        assert status == 2
        assert flag in capsys.readouterr().err


def test_a_password_in_the_base_url_is_not_written_or_printed(splits, tmp_path, capsys):
    """`--base-url http://user:password@host/v1` is how some proxies take credentials; the URL goes into
    the results' settings and into error messages, so its password is blanked there (the request keeps it)."""
    from scirl.eval.client import public_url

    assert public_url("http://me:s3cret-pw@host:8000/v1") == "http://me:***@host:8000/v1"
    assert public_url("http://host:8000/v1") == "http://host:8000/v1"
    questions = splits.split("eval")[:3]
    server = answering(questions, rule_reply)
    out = tmp_path / "eval.json"
    with server as srv:
        url = srv.url.replace("http://", "http://me:s3cret-pw@")
        results = evaluate_server(questions, config(url), out=out, progress=False)
        with pytest.raises(FatalServerError) as fatal:
            evaluate_server(questions, config(url.removesuffix("/v1") + "/v2"), progress=False)
    assert results["counts"]["answered"] == 3 and sum(server.requests.values()) == 3
    assert results["settings"]["base_url"].startswith("http://me:***@")
    for text in (out.read_text(), records_path(out).read_text(), str(fatal.value), capsys.readouterr().out):
        assert "s3cret-pw" not in text
