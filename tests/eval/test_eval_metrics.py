"""Metrics against hand-computed values, the results format, and the records file's resume rules."""

from __future__ import annotations

import json
import math

import pytest

from scirl.eval.results import RecordsFile, SettingsMismatch, build_results, records_path
from scirl.eval.stats import compare, mcnemar, pass_at_k, summarize, wilson_interval
from scirl.synth.questions import generate_rows
from scirl.task.data import question_from_row


def test_wilson_interval_matches_hand_computation():
    # 8 of 10: p=0.8, z=1.96 -> center 0.7167, half-width 0.2266 (textbook value [0.490, 0.943])
    lo, hi = wilson_interval(8, 10)
    assert lo == pytest.approx(0.4902, abs=1e-4)
    assert hi == pytest.approx(0.9433, abs=1e-4)
    # the interval stays inside [0, 1] at the edges and is not degenerate there (unlike Wald's)
    lo, hi = wilson_interval(0, 20)
    assert lo == 0.0 and hi == pytest.approx(0.1611, abs=1e-4)
    lo, hi = wilson_interval(20, 20)
    assert hi == 1.0 and lo == pytest.approx(0.8389, abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_pass_at_k_unbiased_estimator():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)  # 1 - C(3,3)/C(5,3)
    assert pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(4, 3, 2) == 1.0
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


def test_mcnemar_exact_and_chi_square():
    exact = mcnemar(1, 5)  # 6 discordant pairs: 2 * (C(6,0) + C(6,1)) / 2^6
    assert exact["method"] == "exact_binomial"
    assert exact["p_value"] == pytest.approx(14 / 64)
    assert mcnemar(3, 3)["p_value"] == 1.0
    big = mcnemar(10, 30)  # (|10-30| - 1)^2 / 40 = 9.025
    assert big["method"] == "chi2_continuity"
    assert big["statistic"] == pytest.approx(9.025)
    assert big["p_value"] == pytest.approx(math.erfc(math.sqrt(9.025 / 2)))
    assert big["p_value"] == pytest.approx(0.002663, abs=1e-6)
    assert mcnemar(0, 0)["p_value"] == 1.0


def _record(qid, domain, correct, strict=None, answers=None, level="L1", task="t"):
    answers = answers if answers is not None else ["A" if c else "B" for c in correct]
    strict = strict if strict is not None else correct
    return {
        "id": qid,
        "domain": domain,
        "level": level,
        "task": task,
        "correct": correct[0],
        "correct_samples": correct,
        "strict_correct_samples": strict,
        "answers": answers,
        "strict_answers": [a if s else None for a, s in zip(answers, strict)],
    }


def test_summarize_per_group_and_k_samples():
    records = [
        _record("1", "Biology", [True, False]),
        _record("2", "Biology", [False, False], answers=[None, "C"]),
        _record("3", "Physics", [True, True], strict=[False, True], level="L2"),
        _record("4", "Physics", [False, True], task="u"),
    ]
    s = summarize(records, n_samples=2)
    assert s["overall_accuracy"] == pytest.approx((0.5 + 0 + 1 + 0.5) / 4)
    assert s["mean_at_k"] == s["overall_accuracy"]
    assert s["per_domain_accuracy"] == {"Biology": 0.25, "Physics": 0.75}
    assert s["per_level_accuracy"] == {"L1": pytest.approx(1 / 3), "L2": 1.0}
    assert s["per_task_accuracy"] == {"Biology/t": 0.25, "Physics/t": 1.0, "Physics/u": 0.5}
    assert s["strict_accuracy"] == pytest.approx((0.5 + 0 + 0.5 + 0.5) / 4)
    assert s["unparsed_rate"] == pytest.approx(1 / 8)
    assert s["pass_at"]["1"] == pytest.approx(s["overall_accuracy"])
    assert s["pass_at_k"] == pytest.approx(3 / 4)  # questions 1, 3, 4 have a right sample
    lo, hi = s["ci95"]["overall"]
    assert lo < s["overall_accuracy"] < hi
    assert set(s["ci95"]["per_domain"]) == {"Biology", "Physics"}


def test_compare_paired_difference_on_common_ids():
    a = {"records": [{"id": str(i), "correct": i < 6} for i in range(10)] + [{"id": "a-only", "correct": True}]}
    b = {"records": [{"id": str(i), "correct": 2 <= i < 10} for i in range(10)]}
    c = compare(a, b)
    assert c["common_questions"] == 10 and c["only_in_a"] == 1 and c["only_in_b"] == 0
    assert c["table"] == {"both_right": 4, "a_right_only": 2, "b_right_only": 4, "both_wrong": 0}
    assert c["accuracy_a"] == 0.6 and c["accuracy_b"] == 0.8
    assert c["difference"] == pytest.approx(0.2)
    assert c["mcnemar"]["p_value"] == pytest.approx(2 * (1 + 6 + 15) / 64)  # exact, 6 discordant, min 2
    lo, hi = c["difference_ci95"]
    assert lo < 0.2 < hi


@pytest.fixture
def questions():
    rows = generate_rows(n_per_domain=5, seed=1, non_mcq=False)
    return [question_from_row(r, source=f"t:{i}") for i, r in enumerate(rows)]


SETTINGS = {"model": "m", "data": "d", "n_samples": 1, "temperature": 0.0, "top_p": 1.0, "max_tokens": 8, "seed": None}


def test_build_results_has_documented_keys_and_scores_replies(questions):
    q0, q1, q2 = questions[:3]
    wrong = next(label for label in q1.labels if label != q1.answer_key)
    answered = {
        q0.id: {"replies": [f"Answer: {q0.answer_key}"]},
        q1.id: {"replies": [f"I think {wrong}... no wait"]},
    }
    results = build_results(questions[:3], answered, [{"id": q2.id, "error": "HTTP 500"}], SETTINGS)
    assert list(results)[:2] == ["overall_accuracy", "per_domain_accuracy"]
    for key in (
        "per_level_accuracy",
        "per_task_accuracy",
        "strict_accuracy",
        "strict_per_domain_accuracy",
        "ci95",
        "unparsed_rate",
        "mean_at_k",
        "pass_at_k",
        "n_samples",
        "counts",
        "failed",
        "settings",
        "records",
    ):
        assert key in results
    assert results["counts"]["questions"] == 3
    assert results["counts"]["answered"] == 2
    assert results["counts"]["failed"] == 1 and results["failed"][0]["id"] == q2.id
    r0, r1 = results["records"]
    assert r0["id"] == q0.id and r0["answers"] == [q0.answer_key] and r0["correct"] is True
    assert r0["strict_answers"] == [q0.answer_key] and r0["answerKey"] == q0.answer_key
    assert r0["replies"] == [f"Answer: {q0.answer_key}"] and r0["question"] == q0.question
    assert r1["correct"] is False
    assert results["overall_accuracy"] == pytest.approx(0.5)
    json.dumps(results)  # JSON-ready


def test_records_file_resumes_and_drops_half_written_line(tmp_path, questions):
    path = records_path(tmp_path / "out.json")
    assert path.name == "out.records.jsonl"
    with RecordsFile(path, SETTINGS) as rf:
        rf.append(questions[0].id, ["A"], ["stop"])
        rf.append(questions[1].id, ["B"], ["stop"])
    with path.open("a") as f:  # a kill in the middle of a write
        f.write('{"id": "' + questions[2].id + '", "repl')
    with RecordsFile(path, SETTINGS) as rf:
        assert set(rf.answered) == {questions[0].id, questions[1].id}
        rf.append(questions[2].id, ["C"])
    with RecordsFile(path, SETTINGS) as rf:
        assert set(rf.answered) == {q.id for q in questions[:3]}
        assert rf.answered[questions[2].id]["replies"] == ["C"]
    lines = path.read_text().splitlines()
    assert len(lines) == 4 and all(json.loads(line) for line in lines)


def test_records_file_refuses_other_settings_unless_overwrite(tmp_path, questions):
    path = tmp_path / "r.records.jsonl"
    with RecordsFile(path, SETTINGS) as rf:
        rf.append(questions[0].id, ["A"])
    with pytest.raises(SettingsMismatch, match="temperature"):
        RecordsFile(path, {**SETTINGS, "temperature": 1.0})
    # settings that do not change answers (concurrency, limit) resume fine
    with RecordsFile(path, {**SETTINGS, "concurrency": 4, "limit": 3}) as rf:
        assert questions[0].id in rf.answered
    with RecordsFile(path, {**SETTINGS, "temperature": 1.0}, overwrite=True) as rf:
        assert rf.answered == {}


def test_background_writer_keeps_every_line_in_order(tmp_path, questions):
    path = tmp_path / "bg.records.jsonl"
    rf = RecordsFile(path, SETTINGS, background=True)
    for i, q in enumerate(questions):
        rf.append(q.id, [f"reply {i}"])
    rf.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [e["id"] for e in lines[1:]] == [q.id for q in questions]
    with RecordsFile(path, SETTINGS) as again:
        assert again.answered[questions[3].id]["replies"] == ["reply 3"]


def test_compare_command_prints_json(tmp_path, capsys):
    from scirl.commands.eval import main

    a = {"records": [{"id": str(i), "correct": i < 30} for i in range(40)]}
    b = {"records": [{"id": str(i), "correct": i >= 4} for i in range(40)]}
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    assert main(["compare", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["table"]["a_right_only"] == 4 and result["table"]["b_right_only"] == 10
    assert result["mcnemar"]["method"] == "exact_binomial"
    assert main(["compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    assert "McNemar" in capsys.readouterr().out
    (tmp_path / "bad.json").write_text("[]")
    assert main(["compare", str(tmp_path / "a.json"), str(tmp_path / "bad.json")]) == 2
    for records in ([{"id": "1"}], ["x"], [{"correct": True}]):  # records that are not scirl's
        (tmp_path / "bad.json").write_text(json.dumps({"records": records}))
        assert main(["compare", str(tmp_path / "a.json"), str(tmp_path / "bad.json")]) == 2
        assert "bad.json" in capsys.readouterr().err
