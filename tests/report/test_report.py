"""`scirl report`: plots and the HTML page from a synthetic run directory, written here line by line."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess

import pytest

from scirl.commands.report import main as report_main
from scirl.eval.stats import compare, wilson_interval
from scirl.report import plots, write_compare, write_report
from scirl.report.inputs import Evaluation, accuracy_table, domain_reward_keys, gather, read_jsonl_complete
from scirl.report.page import rollout_samples

DOMAINS = ("Biology", "Chemistry", "Material", "Physics")
STEPS = 12
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PLOTS = ("reward.png", "filters.png", "training.png", "timing.png", "eval.png", "accuracy.png", "letters.png")
EVAL_EVERY = 4  # the run below evaluated during training every 4 steps


def metrics_row(step: int) -> dict:
    reward = 0.3 + 0.4 * (1 - math.exp(-step / 5))
    return {
        "step": step,
        "time": 1000.0 + 30 * step,
        "reward/mean": reward,
        "reward/std": 0.2,
        **{f"reward/{d}": reward + 0.02 * i for i, d in enumerate(DOMAINS)},
        "parse_rate/strict": 0.6 + 0.03 * step,
        "parse_rate/lenient": 0.9,
        "filters/gibberish": 0.01,
        "filters/repetition": 0.02 * (step % 3),
        "filters/zero_advantage": 0.3,
        "trainable/count": 90,
        "trainable/total": 128,
        "trainable/fraction": 90 / 128,
        "loss": 0.1 / step,
        "entropy": 1.0 - 0.02 * step,
        "grad_norm": 0.5 + 0.1 * (step % 4),
        "mismatch_kl": 1e-4 * step,
        "tokens_per_s": 4000.0 + 100 * step,
        "time/step": 30.0,
        "time/generate": 18.0,
        "time/train": 8.0,
        "time/weight_sync": 1.5,
        "time/checkpoint": 2.0 if step % 5 == 0 else 0.0,
        "memory/peak_mb": 20000.0,
        **(eval_keys(step) if step % EVAL_EVERY == 0 else {}),
    }


def eval_keys(step: int) -> dict:
    """What eval during training (``eval.interval``) adds to a step's row."""
    accuracy = 0.4 + 0.02 * step
    return {
        "eval/accuracy": accuracy,
        "eval/accuracy_strict": accuracy - 0.1,
        **{f"eval/accuracy/{d}": accuracy + 0.01 * i for i, d in enumerate(DOMAINS)},
        "eval/parse_rate": 0.9,
        "eval/questions": 200,
        "time/eval": 3.0,
    }


def eval_results(accuracy_by_domain: dict[str, float], n_per_domain: int = 40, with_ci: bool = True) -> dict:
    """A results file in scirl eval's format; question ids are shared across calls so results pair up."""
    records = []
    for domain in DOMAINS:
        n_right = round(accuracy_by_domain[domain] * n_per_domain)
        for q in range(n_per_domain):
            correct = q < n_right
            records.append(
                {
                    "id": f"{domain}-{q}",
                    "question": f"q{q}",
                    "domain": domain,
                    "answerKey": "A",
                    "answers": ["A" if correct else "B"],
                    "correct": correct,
                    "replies": ["..."],
                }
            )
    per_domain = {d: sum(r["correct"] for r in records if r["domain"] == d) / n_per_domain for d in DOMAINS}
    overall = sum(r["correct"] for r in records) / len(records)
    data = {
        "overall_accuracy": overall,
        "per_domain_accuracy": per_domain,
        "strict_accuracy": overall - 0.05,
        "unparsed_rate": 0.02,
        "records": records,
        "counts": {
            "questions": len(records),
            "answered": len(records),
            "failed": 0,
            "per_domain": {d: n_per_domain for d in DOMAINS},
        },
    }
    if with_ci:
        data["ci95"] = {
            "overall": list(wilson_interval(overall * len(records), len(records))),
            "per_domain": {d: list(wilson_interval(a * n_per_domain, n_per_domain)) for d, a in per_domain.items()},
        }
    return data


def rollout(i: int, parsed: str | None, answer: str = "A") -> dict:
    reward = float(parsed == answer)
    return {
        "question_id": f"q{i:03d}",
        "prompt": [{"role": "user", "content": f"question {i}?"}],
        "completion": f"<script>alert({i})</script> thinking... Answer: {parsed}",
        "answer": answer,
        "parsed": parsed,
        "reward": reward,
        "advantage": reward - 0.4,
    }


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A finished-looking run whose metrics.jsonl ends in a line still being written. Tests only read it."""
    run = tmp_path_factory.mktemp("report") / "run"
    (run / "rollouts").mkdir(parents=True)
    lines = [json.dumps(metrics_row(s)) for s in range(1, STEPS + 1)]
    (run / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 13, "reward/me')
    (run / "config.toml").write_text('model = "tiny"\n[grpo]\ngroup_size = 8\nlearning_rate = 1e-6\n')
    rows = [rollout(i, [None, "A", "B", "C", "A"][i % 5]) for i in range(20)]
    (run / "rollouts" / "step_1.jsonl").write_text(json.dumps(rollout(99, "A")) + "\n")
    (run / "rollouts" / f"step_{STEPS}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "eval_base.json").write_text(json.dumps(eval_results(dict(zip(DOMAINS, (0.5, 0.4, 0.6, 0.55))))))
    (run / "eval_final.json").write_text(json.dumps(eval_results(dict(zip(DOMAINS, (0.8, 0.7, 0.65, 0.75))))))
    return run


@pytest.fixture(scope="module")
def report_page(run_dir):
    """The run's report, written once into its default place (RUN_DIR/report/report.html)."""
    return write_report(run_dir)


def assert_nonblank_png(path):
    from matplotlib.image import imread

    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path.name} is not a PNG"
    pixels = imread(path)
    assert pixels.size > 0 and pixels[..., :3].var() > 1e-3, f"{path.name} is blank"


def test_every_plot_is_a_nonblank_png_embedded_in_a_self_contained_page(run_dir, report_page):
    assert report_page == run_dir / "report" / "report.html"
    for name in PLOTS:
        assert_nonblank_png(run_dir / "report" / name)
    text = report_page.read_text()
    assert text.count('src="data:image/png;base64,') == len(PLOTS)
    # self-contained: nothing is fetched from anywhere
    for external in ('src="http', 'href="http', "<link", "<script"):
        assert external not in text
    assert "group_size" in text and "grpo.learning_rate" in text  # settings
    assert "eval_base.json" in text and "eval_final.json" in text


def test_plotted_series_match_metrics_jsonl(run_dir, tmp_path):
    run = gather(run_dir)
    assert len(run.metrics) == STEPS  # the partial 13th line is not a step
    drawn = plots.plot_reward(run.metrics, tmp_path / "reward.png")
    steps, means = drawn["reward/mean"]
    assert steps == list(range(1, STEPS + 1))
    assert means == pytest.approx([metrics_row(s)["reward/mean"] for s in range(1, STEPS + 1)])
    assert set(drawn) >= {f"reward/{d}" for d in DOMAINS} | {"parse_rate/strict"}
    training = plots.plot_training(run.metrics, tmp_path / "training.png")
    assert training["grad_norm"][1] == pytest.approx([metrics_row(s)["grad_norm"] for s in range(1, STEPS + 1)])
    timing = plots.plot_timing(run.metrics, tmp_path / "timing.png")
    assert len(timing["time/checkpoint"][0]) == STEPS
    filters = plots.plot_filters(run.metrics, tmp_path / "filters.png")
    assert filters["trainable/fraction"][1] == pytest.approx([90 / 128] * STEPS)


def test_eval_during_training_is_plotted_at_the_steps_that_evaluated(run_dir, report_page, tmp_path):
    run = gather(run_dir)
    drawn = plots.plot_eval(run.metrics, tmp_path / "eval.png")
    evaluated = [s for s in range(1, STEPS + 1) if s % EVAL_EVERY == 0]
    assert drawn["eval/accuracy"] == (evaluated, pytest.approx([eval_keys(s)["eval/accuracy"] for s in evaluated]))
    assert set(drawn) == {"eval/accuracy", "eval/accuracy_strict", "eval/parse_rate"} | {
        f"eval/accuracy/{d}" for d in DOMAINS
    }
    assert plots.plot_timing(run.metrics, tmp_path / "timing.png")["time/eval"][0] == evaluated
    last = eval_keys(evaluated[-1])["eval/accuracy"]
    assert "held-out accuracy" in report_page.read_text() and f"{100 * last:.1f}%" in report_page.read_text()


def test_a_run_without_eval_during_training_has_no_eval_plot_and_no_note_about_it(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.4, "loss": 0.1}) + "\n")
    text = write_report(run).read_text()
    assert not (run / "report" / "eval.png").exists()
    assert "eval.png" not in text and "held-out accuracy" not in text


def test_a_metric_logged_on_some_steps_only_is_plotted_on_those_steps(tmp_path):
    rows = [{"step": s, "reward/mean": 0.5} | ({"loss": 1.0 / s} if s % 2 else {}) for s in range(1, 9)]
    drawn = plots.plot_training(rows, tmp_path / "training.png")
    assert drawn["loss"][0] == [1, 3, 5, 7]
    assert "entropy" not in drawn
    assert_nonblank_png(tmp_path / "training.png")


def test_an_sdpo_run_gets_its_divergence_plotted_and_a_grpo_run_no_such_plot(tmp_path):
    rows = [
        {
            "step": s,
            "reward/mean": 0.5,
            "sdpo/divergence": 0.2 / s,
            "sdpo/teacher_fraction": 0.1 * s,
            "sdpo/feedback_fraction": 0.0,
        }
        for s in range(1, 6)
    ]
    drawn = plots.plot_algorithm(rows, tmp_path / "sdpo.png", "sdpo")
    assert drawn["sdpo/divergence"] == ([1, 2, 3, 4, 5], pytest.approx([0.2 / s for s in range(1, 6)]))
    assert drawn["sdpo/teacher_fraction"][1] == pytest.approx([0.1 * s for s in range(1, 6)])
    assert_nonblank_png(tmp_path / "sdpo.png")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert "sdpo: the algorithm metrics per step" in write_report(run).read_text()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.4, "loss": 0.1}) + "\n")
    text = write_report(run).read_text()
    assert not (run / "report" / "sdpo.png").exists() and "sdpo" not in text and "sdpo.png" not in text


def test_only_complete_lines_are_read_and_bad_lines_are_counted(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\nnot json\n[1, 2]\n\n{"step": 2}\n{"step": 3')
    notes: list[str] = []
    rows = read_jsonl_complete(path, notes)
    assert rows == [{"step": 1}, {"step": 2}]
    assert any("incomplete" in n for n in notes)
    assert any("2 line(s)" in n and "line 2, 3" in n for n in notes)


def test_missing_inputs_produce_a_page_that_names_them(tmp_path):
    run = tmp_path / "empty_run"
    run.mkdir()
    page = write_report(run)
    assert page == run / "report" / "report.html"
    text = page.read_text()
    for missing in ("metrics.jsonl is missing", "config.toml is missing", "no eval_*.json", "rollouts/ is missing"):
        assert missing in text
    assert not list((run / "report").glob("*.png"))


def test_partial_inputs_say_which_plots_have_no_data(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.4}) + "\n")
    (run / "config.toml").write_text("this is = = not toml")
    (run / "eval_final.json").write_text("{truncated")
    text = write_report(run).read_text()
    assert (run / "report" / "reward.png").is_file()
    assert "training.png: none of its metrics are logged" in text
    assert "config.toml: not valid TOML" in text
    assert "eval_final.json: unreadable" in text


def test_rollout_samples_are_best_worst_unparsed_of_the_latest_step_and_escaped(report_page):
    text = report_page.read_text()
    assert "from step 12 (20 completions)" in text
    assert "<script>alert(" not in text
    assert "&lt;script&gt;alert(" in text
    unparsed = text.split("<h3>unparsed</h3>")[1].split("</table>")[0]
    assert "q000" in unparsed and "q005" in unparsed and "q001" not in unparsed
    best = text.split("<h3>best</h3>")[1].split("</table>")[0]
    assert "q001" in best and "q099" not in best  # q099 lives in an older step file


def test_trainer_rollouts_unparsed_means_lenient_failed_first_then_strict():
    rows = [
        {"question_id": "ok", "reward": 1.0, "advantage": 0.5, "parsed_strict": True, "parsed_lenient": True},
        {
            "question_id": "strict_only",
            "reward": 0.0,
            "advantage": -0.5,
            "parsed_strict": False,
            "parsed_lenient": True,
        },
        {"question_id": "nothing", "reward": 0.0, "advantage": -0.5, "parsed_strict": False, "parsed_lenient": False},
    ]
    samples, notes = rollout_samples(rows)
    assert [r["question_id"] for r in samples["unparsed"]] == ["nothing", "strict_only"]
    assert samples["best"][0]["question_id"] == "ok" and notes == []
    _, notes = rollout_samples([{"reward": 1.0}, {"reward": "high"}])
    assert any("1 rollout(s) have no numeric reward" in n for n in notes)
    assert any("cannot be picked" in n for n in notes)


def test_batch_reward_statistics_are_not_mistaken_for_domains():
    rows = [{"step": 1, "reward/mean": 0.5, "reward/std": 0.1, "reward/mean_all": 0.4, "reward/Physics": 0.6}]
    assert domain_reward_keys(rows) == ["reward/Physics"]


def test_before_and_after_are_chosen_by_name_else_by_modification_time(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    good, bad = dict(zip(DOMAINS, (0.8,) * 4)), dict(zip(DOMAINS, (0.3,) * 4))
    (run / "eval_zzz_newer.json").write_text(json.dumps(eval_results(good)))
    (run / "eval_aaa_older.json").write_text(json.dumps(eval_results(bad)))
    os.utime(run / "eval_aaa_older.json", (1_000_000, 1_000_000))
    os.utime(run / "eval_zzz_newer.json", (2_000_000, 2_000_000))
    inputs = gather(run)
    assert (inputs.before.name, inputs.after.name) == ("eval_aaa_older.json", "eval_zzz_newer.json")
    # a file named eval_base.json is "before" even when it is the newest
    (run / "eval_base.json").write_text(json.dumps(eval_results(bad)))
    inputs = gather(run)
    assert (inputs.before.name, inputs.after.name) == ("eval_base.json", "eval_zzz_newer.json")


def test_a_base_evaluation_alone_says_the_after_one_is_missing(tmp_path):
    """A run in progress has eval_base.json but no eval_final.json yet: the page must say so."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "eval_base.json").write_text(json.dumps(eval_results(dict(zip(DOMAINS, (0.5,) * 4)))))
    inputs = gather(run)
    assert inputs.before.name == "eval_base.json" and inputs.after is None
    assert any("eval_base.json" in n and "no before/after" in n for n in inputs.notes)


def test_missing_confidence_intervals_are_computed_from_counts():
    data = eval_results(dict(zip(DOMAINS, (0.5, 0.25, 0.75, 1.0))), n_per_domain=40, with_ci=False)
    table = accuracy_table(Evaluation("eval_x.json", data))
    accuracy, low, high = table["Chemistry"]
    assert accuracy == 0.25
    assert (low, high) == pytest.approx(wilson_interval(10, 40))
    assert table["Overall"][1:] == pytest.approx(wilson_interval(data["overall_accuracy"] * 160, 160))


def test_missing_overall_interval_counts_answered_questions_not_failed_ones():
    """overall_accuracy covers the answered questions only, so its interval must use their number."""
    data = eval_results(dict(zip(DOMAINS, (0.5, 0.25, 0.75, 1.0))), n_per_domain=40, with_ci=False)
    data["counts"] = {**data["counts"], "questions": 800, "failed": 640}
    table = accuracy_table(Evaluation("eval_x.json", data))
    assert table["Overall"][1:] == pytest.approx(wilson_interval(data["overall_accuracy"] * 160, 160))


def test_odd_shapes_in_evaluations_and_rollouts_give_a_page_not_a_crash(tmp_path):
    run = tmp_path / "odd"
    (run / "rollouts").mkdir(parents=True)
    # records that are not a list; an interval that does not hold its accuracy (a hand-edited file)
    (run / "eval_base.json").write_text(
        json.dumps({"overall_accuracy": 0.5, "records": 5, "ci95": {"overall": [0.9, 0.95]}})
    )
    (run / "eval_final.json").write_text(json.dumps({"overall_accuracy": 0.6, "records": {"a": 1}}))
    (run / "rollouts" / "step_1.jsonl").write_text(
        json.dumps({"question_id": [1], "reward": 1.0})
        + "\n"
        + json.dumps({"question_id": {"a": 1}, "reward": 0.0})
        + "\n"
    )
    page = write_report(run).read_text()
    assert "50.0%" in page and "60.0%" in page
    with pytest.raises(ValueError, match="share no question"):  # no records to pair: refused, not "+0.0 pts, p = 1"
        write_compare(run / "eval_base.json", run / "eval_final.json", out_dir=tmp_path / "cmp")


def test_compare_writes_plot_and_page_with_the_mcnemar_result(run_dir, tmp_path, capsys):
    a, b = run_dir / "eval_base.json", run_dir / "eval_final.json"
    assert report_main(["--compare", str(a), str(b), "--out", str(tmp_path / "cmp")]) == 0
    out = capsys.readouterr().out
    expected = compare(json.loads(a.read_text()), json.loads(b.read_text()))
    assert f"p = {expected['mcnemar']['p_value']:.3g}" in out
    page = tmp_path / "cmp" / "compare_eval_base_vs_eval_final.html"
    assert out.strip().splitlines()[-1] == str(page)
    assert f"{expected['mcnemar']['p_value']:.3g}" in page.read_text()
    assert_nonblank_png(tmp_path / "cmp" / "compare_eval_base_vs_eval_final.png")


def test_cli_prints_the_page_path_and_rejects_a_missing_run_dir(run_dir, tmp_path, capsys):
    assert report_main([str(run_dir), "--out", str(tmp_path / "o")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "o" / "report.html")
    assert report_main([str(tmp_path / "nope")]) == 2
    assert "run directory not found" in capsys.readouterr().err


CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="no headless Chromium on this machine")
def test_page_renders_in_headless_chromium(report_page, tmp_path):
    page = report_page
    shot = tmp_path / "screenshot.png"
    subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={tmp_path / 'profile'}",
            f"--screenshot={shot}",
            "--window-size=1200,2000",
            page.as_uri(),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    assert_nonblank_png(shot)
