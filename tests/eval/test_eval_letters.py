"""Letter bias and permutation robustness: the figures on hand-built records, permutation evals end to end
(in-process and against a fake server), their resume, the letter-prior share in compare, and CLI errors."""

from __future__ import annotations

import json
import math
import re
import threading
from collections import Counter
from dataclasses import replace

import pytest

from fakes.openai_server import FakeOpenAI, Reply
from scirl.eval.letters import letter_stats, letter_summary, prior_shift
from scirl.eval.local import evaluate_generator
from scirl.eval.permutations import items, orders_for
from scirl.eval.results import RecordsFile, SettingsMismatch, build_results, records_path
from scirl.synth.questions import generate_rows, write_jsonl
from scirl.task.data import load_splits, question_from_row
from scirl.task.shuffle import permute

SETTINGS = {"model": "m", "data": "d", "n_samples": 1, "temperature": 0.0, "top_p": 1.0, "max_tokens": 8, "seed": None}


def record(qid, gold, answers, task="t", labels=("A", "B", "C", "D")):
    correct = [a == gold for a in answers]
    return {
        "id": qid,
        "domain": "Biology",
        "task": task,
        "labels": list(labels),
        "answerKey": gold,
        "answers": list(answers),
        "correct": correct[0],
        "correct_samples": correct,
    }


def test_a_model_always_answering_a_gets_the_expected_letters_kl_and_conditional_accuracy():
    golds = "ABCD" * 2
    records = [record(str(i), g, ["A"]) for i, g in enumerate(golds)]
    stats = letter_stats(records)
    assert stats["labels"] == ["A", "B", "C", "D"] and stats["samples"] == 8
    assert stats["predicted"] == {"A": 1.0, "B": 0.0, "C": 0.0, "D": 0.0}
    assert stats["gold"] == {x: 0.25 for x in "ABCD"}
    assert stats["accuracy_by_gold"] == {"A": 1.0, "B": 0.0, "C": 0.0, "D": 0.0}
    # add-1/2 counts: predicted (8.5, .5, .5, .5) / 10, gold (2.5, 2.5, 2.5, 2.5) / 10
    expected = 0.85 * math.log(0.85 / 0.25) + 3 * 0.05 * math.log(0.05 / 0.25)
    assert stats["kl_predicted_gold"] == pytest.approx(expected)
    assert stats["unparsed_rate"] == 0.0
    # a model picking letters as often as they are right has no letter bias
    assert letter_stats([record(str(i), g, [g]) for i, g in enumerate(golds)])["kl_predicted_gold"] == pytest.approx(
        0.0
    )


def test_unparsed_samples_count_apart_and_tasks_get_their_own_letters():
    records = [
        record("1", "A", ["A", None]),
        record("2", "B", ["A", "A"]),
        record("3", "A", ["B"], task="u", labels=("A", "B")),
    ]
    summary = letter_summary(records)
    assert summary["samples"] == 5 and summary["unparsed_rate"] == pytest.approx(1 / 5)
    assert summary["predicted"]["A"] == pytest.approx(3 / 4)  # of the 4 parsed samples
    assert summary["gold"]["A"] == pytest.approx(3 / 5)  # of all 5 samples
    assert summary["accuracy_by_gold"]["A"] == pytest.approx(1 / 3) and summary["accuracy_by_gold"]["B"] == 0.0
    assert set(summary["per_task"]) == {"Biology/t", "Biology/u"}
    two = summary["per_task"]["Biology/u"]
    assert two["labels"] == ["A", "B"] and two["predicted"] == {"A": 0.0, "B": 1.0}


@pytest.fixture(scope="module")
def questions():
    rows = generate_rows(n_per_domain=3, seed=1, non_mcq=False)
    return [question_from_row(r, source=f"t:{i}") for i, r in enumerate(rows)]


def test_every_results_file_reports_the_letters(questions):
    answered = {q.id: {"replies": ["A."]} for q in questions}
    results = build_results(questions, answered, [], SETTINGS)
    letters = results["letters"]
    assert letters["predicted"]["A"] == 1.0 and letters["unparsed_rate"] == 0.0
    gold = Counter(q.answer_key for q in questions)
    assert letters["gold"] == {x: gold[x] / len(questions) for x in letters["labels"]}
    assert letters["accuracy_by_gold"]["A"] == 1.0 and letters["accuracy_by_gold"]["B"] == 0.0
    assert set(letters["per_task"]) == set(results["per_task_accuracy"])
    assert "permutations" not in results
    json.dumps(results)


def test_orders_start_with_the_question_s_own_are_distinct_seeded_and_cycle_when_used_up(questions):
    q = questions[0]
    orders = orders_for(q, 6, seed=0)
    assert orders[0] == (0, 1, 2, 3) and len(set(orders)) == 6
    assert orders == orders_for(q, 6, seed=0)  # the same after a restart
    assert orders != orders_for(q, 6, seed=1)
    two = replace(q, labels=("A", "B"), options=q.options[:2], answer_key="A")
    assert orders_for(two, 5, seed=0) == [(0, 1), (1, 0), (0, 1), (1, 0), (0, 1)]
    with pytest.raises(ValueError):
        items([q], 0)


class ContentGenerator:
    """A local generator that reads the options it is shown: it answers the letter now holding the gold TEXT
    for the questions in ``knows``, and "A" to the others. The tokenizer hands out one token per prompt."""

    model_dir = "content"
    chat_template = None

    def __init__(self, questions, knows=frozenset(), interrupt_after=None):
        self.questions, self.knows = questions, knows
        self.texts: list[str] = []
        self.asked: Counter = Counter()  # (question id, options as shown) -> times asked
        self.tokenizer = self
        self.interrupt_after = interrupt_after  # raise KeyboardInterrupt at this generate call (a Ctrl-C)
        self.calls = 0

    def encode(self, text, add_special_tokens=False):
        self.texts.append(text)
        return [len(self.texts) - 1]

    def reply(self, text):
        q = next(q for q in self.questions if q.question + "\n\n" in text)
        shown = dict(re.findall(r"^([A-D])\. (.*)$", text, re.MULTILINE))
        self.asked[q.id, tuple(shown.values())] += 1
        if q.id not in self.knows:
            return "A."
        gold_text = q.options[q.labels.index(q.answer_key)]
        return "Answer: " + next(x for x, t in shown.items() if t == gold_text)

    def generate(self, prompts, params):
        from scirl.inference.base import Completion

        self.calls += 1
        if self.interrupt_after is not None and self.calls > self.interrupt_after:
            raise KeyboardInterrupt
        return [
            [Completion(self.reply(self.texts[p[0]]), [1], [0.0], "stop") for _ in range(params.n)] for p in prompts
        ]


def expected_figures(questions, knows, k, seed=0):
    """The permutation figures worked out from the orders alone, for ContentGenerator."""
    mean, consistent, changed, same_letter = [], [], [], []
    for q in questions:
        orders = orders_for(q, k, seed)
        if q.id in knows:
            right = [True] * k
            chosen = {q.labels.index(q.answer_key)}
            letters = {permute(q, o).answer_key for o in orders}
        else:  # "A" names the option that order puts first
            right = [permute(q, o).answer_key == "A" for o in orders]
            chosen = {o[0] for o in orders}
            letters = {"A"}
        mean.append(sum(right) / k)
        consistent.append(all(right))
        changed.append(len(chosen) > 1)
        same_letter.append(len(letters) == 1)
    n = len(questions)
    return sum(mean) / n, sum(consistent) / n, sum(changed) / n, sum(same_letter) / n


def test_permutation_eval_in_process_reports_consistency_and_text_changes(questions, tmp_path):
    k = 4
    knows = frozenset(q.id for q in questions[::2])
    generator = ContentGenerator(questions, knows)
    out = tmp_path / "perm.json"
    results = evaluate_generator(generator, questions, out=out, permutations=k, batch_size=5)
    perm = results["permutations"]
    mean, consistent, changed, same_letter = expected_figures(questions, knows, k)
    assert perm["k"] == k and perm["questions"] == len(questions)
    assert perm["mean_accuracy"] == pytest.approx(mean)
    assert perm["consistent_accuracy"] == pytest.approx(consistent)
    assert perm["answer_changed_rate"] == pytest.approx(changed)
    assert perm["consistent_accuracy"] <= perm["mean_accuracy"]
    assert 0 < perm["answer_changed_rate"] < 1
    assert perm["same_letter_rate"] == pytest.approx(same_letter)
    # each question was shown under its k distinct orders, once each
    assert len(generator.asked) == k * len(questions) and set(generator.asked.values()) == {1}
    # order 0 is the question's own: the headline figures are a plain eval's
    plain = evaluate_generator(ContentGenerator(questions, knows), questions)
    assert results["overall_accuracy"] == plain["overall_accuracy"] == perm["per_order_accuracy"][0]
    assert perm["per_order_accuracy"][0] == pytest.approx(
        sum(q.id in knows or q.answer_key == "A" for q in questions) / len(questions)
    )
    for r, q in zip(results["records"], questions):
        entries = r["permutations"]
        assert [e["permutation"] for e in entries] == list(range(k))
        assert [tuple(e["order"]) for e in entries] == orders_for(q, k, 0)
        if q.id in knows:  # the letter moved with the text; the chosen text stayed
            assert {e["chosen_options"][0] for e in entries} == {q.labels.index(q.answer_key)}
    lines = [json.loads(line) for line in records_path(out).read_text().splitlines()[1:]]
    assert len(lines) == k * len(questions) and all({"permutation", "order"} <= set(line) for line in lines)
    assert json.loads(out.read_text())["permutations"] == perm


def test_an_interrupted_permutation_eval_resumes_without_asking_finished_pairs(questions, tmp_path):
    k = 3
    out = tmp_path / "perm.json"
    first = ContentGenerator(questions, interrupt_after=2)
    with pytest.raises(KeyboardInterrupt):
        evaluate_generator(first, questions, out=out, permutations=k, batch_size=4)
    recorded = [json.loads(line) for line in records_path(out).read_text().splitlines()[1:]]
    assert len(recorded) == 8  # two batches of four (question, order) pairs
    again = ContentGenerator(questions)
    results = evaluate_generator(again, questions, out=out, permutations=k, batch_size=4)
    assert sum(again.asked.values()) == k * len(questions) - 8
    assert not set(again.asked) & set(first.asked)  # no finished pair asked again
    assert results["counts"]["answered"] == len(questions)
    complete = evaluate_generator(ContentGenerator(questions), questions, permutations=k)
    assert results["permutations"] == complete["permutations"]
    # another K is other answers: refused with the settings named
    with pytest.raises(SettingsMismatch, match="permutations: 3 there, 2 now"):
        evaluate_generator(ContentGenerator(questions), questions, out=out, permutations=2)
    # a plain eval's records file made before permutations existed still resumes as K = 1
    plain = tmp_path / "plain.json"
    with RecordsFile(records_path(plain), SETTINGS) as rf:
        rf.append(questions[0].id, ["A"])
    resumed = ContentGenerator(questions)
    evaluate_generator(resumed, questions, out=plain, max_tokens=8, settings={"model": "m", "data": "d"})
    assert sum(resumed.asked.values()) == len(questions) - 1


def test_a_record_of_another_order_is_skipped_and_asked_again(questions, tmp_path):
    qs = questions[:2]
    out = tmp_path / "perm.json"
    evaluate_generator(ContentGenerator(qs), qs, out=out, permutations=2)
    path = records_path(out)
    header, *lines = path.read_text().splitlines()
    entry = json.loads(lines[1])
    entry["order"] = list(reversed(entry["order"]))
    path.write_text("\n".join([header, lines[0], json.dumps(entry), *lines[2:]]) + "\n")
    again = ContentGenerator(qs)
    results = evaluate_generator(again, qs, out=out, permutations=2)
    assert sum(again.asked.values()) == 1 and results["counts"]["answered"] == 2


def test_compare_reports_the_share_a_letter_prior_shift_explains(tmp_path, capsys):
    from scirl.commands.eval import main

    golds = "AAAABBCD"
    base = [record(str(i), g, [a]) for i, (g, a) in enumerate(zip(golds, "AABCBACD"))]
    trained = [record(str(i), g, [a]) for i, (g, a) in enumerate(zip(golds, "AAAAAACD"))]
    shift = prior_shift(base, trained)
    assert shift["accuracy_a"] == 5 / 8 and shift["accuracy_b"] == 6 / 8
    assert shift["precision_a"] == {"A": 2 / 3, "B": 1 / 2, "C": 1 / 2, "D": 1.0}
    assert shift["predicted_b"] == {"A": 6 / 8, "B": 0.0, "C": 1 / 8, "D": 1 / 8}
    # A's precision per letter under B's letter shares: 6/8 * 2/3 + 1/8 * 1/2 + 1/8 * 1
    assert shift["prior_only_accuracy"] == pytest.approx(0.6875)
    assert shift["explained"] == pytest.approx(0.5)
    assert shift["by_gold"]["A"] == {"questions": 4, "accuracy_a": 0.5, "accuracy_b": 1.0}
    assert shift["by_gold"]["B"] == {"questions": 2, "accuracy_a": 0.5, "accuracy_b": 0.0}
    # B's prior equal to A's: nothing to explain by it
    assert prior_shift(base, base)["prior_only_accuracy"] == pytest.approx(5 / 8)

    (tmp_path / "a.json").write_text(json.dumps({"records": base}))
    (tmp_path / "b.json").write_text(json.dumps({"records": trained}))
    assert main(["compare", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["letter_prior"]["explained"] == pytest.approx(0.5)
    assert main(["compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "letter prior alone" in out and "68.75%" in out and "50% of the difference" in out


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return write_jsonl(generate_rows(n_per_domain=8, seed=2), tmp_path_factory.mktemp("letters") / "rows.jsonl")


def cli_args(url, data_file, out, *extra):
    return [
        "--base-url",
        url,
        "--model",
        "fake",
        "--data",
        str(data_file),
        "--eval-per-domain",
        "2",
        "--timeout",
        "30",
        "--out",
        str(out),
        "--no-progress",
        *extra,
    ]


def test_permutation_eval_through_a_server_prints_the_figures_and_resumes(data_file, tmp_path, capsys):
    from scirl.commands.eval import main

    questions = load_splits(str(data_file), eval_per_domain=2).split("eval")
    server = FakeOpenAI(answer="A.")  # counts requests per (question, options shown)
    out = tmp_path / "perm.json"
    with server as srv:
        assert main(cli_args(srv.url, data_file, out, "--permutations", "3", "--permutation-seed", "5")) == 0
        printed = " ".join(capsys.readouterr().out.split())
        assert sum(server.requests.values()) == 3 * len(questions) and set(server.requests.values()) == {1}
        results = json.loads(out.read_text())
        perm = results["permutations"]
        assert perm["k"] == 3 and perm["seed"] == 5 and perm["same_letter_rate"] == 1.0
        assert perm["consistent_accuracy"] <= perm["mean_accuracy"]
        assert results["letters"]["predicted"]["A"] == 1.0
        assert "KL(predicted || gold)" in printed and "consistent (right under every order)" in printed
        assert "chosen answer text changes with the order" in printed
        # a rerun asks nothing; another K is refused in one line
        server.requests.clear()
        assert main(cli_args(srv.url, data_file, out, "--permutations", "3", "--permutation-seed", "5")) == 0
        assert sum(server.requests.values()) == 0 and "resuming" in capsys.readouterr().out
        assert main(cli_args(srv.url, data_file, out, "--permutations", "2")) == 2
        err = capsys.readouterr().err
        assert "permutations: 3 there, 2 now" in err and len(err.strip().splitlines()) == 1
        assert sum(server.requests.values()) == 0


@pytest.mark.parametrize("value", ["0", "-2"])
def test_permutations_below_one_is_a_one_line_usage_error(tmp_path, capsys, value):
    from scirl.commands.eval import main

    assert (
        main(
            [
                "--base-url",
                "http://127.0.0.1:9/v1",
                "--model",
                "m",
                "--out",
                str(tmp_path / "x.json"),
                "--permutations",
                value,
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--permutations must be >= 1" in err and "Traceback" not in err


def test_failed_orders_are_listed_and_a_rerun_asks_only_them(data_file, tmp_path):
    """A question counts as answered once every order is; the orders that failed are named and asked again."""
    from scirl.eval.client import ClientConfig, evaluate_server
    from scirl.task.prompt import user_text

    questions = load_splits(str(data_file), eval_per_domain=1).split("eval")
    own = {user_text(q) for q in questions}
    healthy = threading.Event()

    def own_order_only(request):  # until the server is healthy, only the question's own order gets an answer
        return "B" if healthy.is_set() or request.text in own else Reply(400, {"error": "bad request"})

    app = FakeOpenAI(answer=own_order_only, max_n=1)
    asked = app.requests
    out = tmp_path / "perm.json"
    with app as srv:
        cfg = ClientConfig(base_url=srv.url, model="fake", retries=0, timeout=30.0)
        results = evaluate_server(questions, cfg, out=out, progress=False, permutations=3)
        assert results["counts"]["answered"] == 0 and results["counts"]["failed"] == len(questions)
        assert sorted((f["id"], f["permutation"]) for f in results["failed"]) == sorted(
            (q.id, i) for q in questions for i in (1, 2)
        )
        asked.clear()
        healthy.set()
        results = evaluate_server(questions, cfg, out=out, progress=False, permutations=3)
    assert sum(asked.values()) == 2 * len(questions) and not set(asked) & own
    assert results["counts"]["answered"] == len(questions) and results["failed"] == []
    assert results["permutations"]["same_letter_rate"] == 1.0


def test_report_plots_the_letters_before_and_after(questions, tmp_path):
    from scirl.report import plots, write_compare, write_report
    from scirl.report.inputs import Evaluation, letter_table

    run = tmp_path / "run"
    run.mkdir()
    base = build_results(questions, {q.id: {"replies": ["A"]} for q in questions}, [], SETTINGS)
    final = evaluate_generator(
        ContentGenerator(questions, knows=frozenset(q.id for q in questions)), questions, permutations=2
    )
    (run / "eval_base.json").write_text(json.dumps(base))
    (run / "eval_final.json").write_text(json.dumps(final))
    page = write_report(run).read_text()
    assert (run / "report" / "letters.png").read_bytes()[:4] == b"\x89PNG"
    assert "Share of each answer letter among the gold answers" in page  # the plot's caption: it is on the page
    assert "letter bias KL" in page and "100.0% / 100.0% (2 orders)" in page  # the final eval knows every answer
    drawn = plots.plot_letters(
        [("before", letter_table(Evaluation("b", base))), ("after", letter_table(Evaluation("f", final)))],
        tmp_path / "letters.png",
        "t",
    )
    assert drawn["gold"] == base["letters"]["gold"] == final["letters"]["gold"]  # the same questions: one gold set
    assert drawn["predicted, before"]["A"] == 1.0
    assert drawn["predicted, after"] == final["letters"]["gold"]
    compare_page, comparison = write_compare(run / "eval_base.json", run / "eval_final.json", out_dir=tmp_path / "cmp")
    assert (tmp_path / "cmp" / "compare_eval_base_vs_eval_final_letters.png").is_file()
    assert comparison["letter_prior"]["predicted_a"]["A"] == 1.0
    assert "Letter prior alone" in compare_page.read_text()


def test_permutation_eval_of_a_local_model_directory(tiny_model_dir, data_file, tmp_path, capsys):
    from scirl.commands.eval import main

    out = tmp_path / "local.json"
    args = [
        "--model",
        str(tiny_model_dir),
        "--data",
        str(data_file),
        "--eval-per-domain",
        "1",
        "--max-tokens",
        "3",
        "--device",
        "cpu",
        "--permutations",
        "2",
        "--out",
        str(out),
        "--no-progress",
    ]
    assert main(args) == 0
    results = json.loads(out.read_text())
    perm = results["permutations"]
    assert perm["k"] == 2 and perm["questions"] == results["counts"]["answered"] == 4
    assert perm["consistent_accuracy"] <= perm["mean_accuracy"]
    assert all(len(r["permutations"]) == 2 for r in results["records"])
    lines = records_path(out).read_text().splitlines()
    assert len(lines) == 1 + 2 * 4
    assert main(args) == 0  # resumed: nothing asked, nothing appended
    assert records_path(out).read_text().splitlines() == lines
    assert main(args[:-5] + ["--permutations", "3", "--out", str(out), "--no-progress"]) == 2
    assert "permutations: 2 there, 3 now" in capsys.readouterr().err
