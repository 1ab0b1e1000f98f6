"""The prime-rl plug-in's `sciknoweval` verifiers taskset: the tasks scirl's data export gives, their order and
rewards, the settings a scirl run or checkpoint gives it, and other sets' formats and columns."""

from __future__ import annotations

import asyncio
import json

import pytest
import sciknoweval
import verifiers.v1 as vf
from pydantic import ValidationError
from sciknoweval import SciKnowEvalConfig, SciKnowEvalTaskset
from sciknoweval.taskset import SciKnowEvalData, SciKnowEvalTask

from helpers.taskset import EVAL_PER_DOMAIN, load
from scirl.cli import main as cli_main
from scirl.synth.questions import write_jsonl
from scirl.task import reward
from scirl.task.data import question_from_row
from scirl.task.prompt import build_messages


def exported_questions(data_file, split, tmp_path):
    out = tmp_path / f"{split}.jsonl"
    rc = cli_main(
        [
            "data",
            "export",
            "--data",
            str(data_file),
            "--split",
            split,
            "--out",
            str(out),
            "--eval-per-domain",
            str(EVAL_PER_DOMAIN),
        ]
    )
    assert rc == 0
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    return [question_from_row(row) for row in rows]


def make_trace(task: SciKnowEvalTask, reply: str) -> vf.Trace:
    """A finished single-turn trace, built as verifiers' rollout builds one, with `reply` as the model's answer."""
    return vf.Trace(
        task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
        agent=vf.AgentInfo(config=vf.AgentConfig()),
        nodes=[
            vf.MessageNode(message=vf.SystemMessage(content=task.data.system_prompt)),
            vf.MessageNode(parent=0, message=vf.UserMessage(content=task.data.prompt)),
            vf.MessageNode(parent=1, message=vf.AssistantMessage(content=reply), sampled=True),
        ],
    )


def score(task: SciKnowEvalTask, reply: str) -> vf.Trace:
    trace = make_trace(task, reply)
    asyncio.run(task.score(trace))
    return trace


def test_package_exports_exactly_one_taskset_and_id_resolves_to_it():
    tasksets = [
        name
        for name in sciknoweval.__all__
        if isinstance(getattr(sciknoweval, name), type) and issubclass(getattr(sciknoweval, name), vf.Taskset)
    ]
    assert tasksets == ["SciKnowEvalTaskset"]
    assert vf.taskset_config_type("sciknoweval") is SciKnowEvalConfig
    assert SciKnowEvalTaskset.task_type() is SciKnowEvalTask
    assert SciKnowEvalTask.data_type() is SciKnowEvalData


def test_config_rejects_unknown_keys_and_bad_values():
    with pytest.raises(ValidationError):
        SciKnowEvalConfig.model_validate({"id": "sciknoweval", "splt": "eval"})
    for bad in ({"split": "test"}, {"reward_mode": "fuzzy"}, {"split_method": "random"}, {"eval_per_domain": -1}):
        with pytest.raises(ValidationError):
            SciKnowEvalConfig.model_validate({"id": "sciknoweval", **bad})


@pytest.mark.parametrize("split", ["train", "eval"])
def test_tasks_equal_scirl_data_export_question_for_question(data_file, split, tmp_path):
    tasks = load(data_file, split=split)
    questions = {q.id: q for q in exported_questions(data_file, split, tmp_path)}
    assert sorted(t.key for t in tasks) == sorted(questions)
    if split == "eval":
        assert len(tasks) == 4 * EVAL_PER_DOMAIN
    for task in tasks:
        q = questions[task.key]
        system, user = build_messages(q)
        assert task.data.system_prompt == system["content"]
        assert task.data.prompt == user["content"]
        assert (task.data.answer_key, task.data.labels, task.data.options, task.data.domain) == (
            q.answer_key,
            list(q.labels),
            list(q.options),
            q.domain,
        )


def test_train_and_eval_are_disjoint_and_keys_unique(data_file):
    train, eval_ = load(data_file, split="train"), load(data_file, split="eval")
    train_keys, eval_keys = [t.key for t in train], [t.key for t in eval_]
    assert len(set(train_keys)) == len(train_keys) and len(set(eval_keys)) == len(eval_keys)
    assert not set(train_keys) & set(eval_keys)
    assert [t.data.idx for t in train] == list(range(len(train)))


def test_a_scirl_run_or_checkpoint_gives_the_taskset_its_data_settings(data_file, tmp_path):
    """`run = RUN_DIR` (its config.toml) or a checkpoint copied out of it (the run_config.toml it carries): the
    taskset's eval split is the questions that run held out, under its own split settings; a key given wins."""
    from scirl.run.config_io import load_config, write_config
    from scirl.task.data import load_splits

    cfg = load_config(["--data.source", str(data_file), "--data.eval-per-domain", "3", "--data.split-seed", "7"])
    write_config(cfg, tmp_path / "run" / "config.toml")
    write_config(cfg, tmp_path / "copied_step_3" / "run_config.toml")
    held_out = {q.id for q in load_splits(str(data_file), eval_per_domain=3, seed=7).eval}
    for run in (tmp_path / "run", tmp_path / "copied_step_3"):
        config = SciKnowEvalConfig(id="sciknoweval", run=str(run), split="eval")
        assert (config.eval_per_domain, config.split_seed, config.data) == (3, 7, str(data_file))
        assert {t.data.qid for t in vf.load_taskset(config)} == held_out
    assert SciKnowEvalConfig(id="sciknoweval", run=str(tmp_path / "run"), eval_per_domain=4).eval_per_domain == 4
    with pytest.raises(ValidationError, match="neither a scirl run directory nor a scirl checkpoint"):
        SciKnowEvalConfig(id="sciknoweval", run=str(tmp_path))


def test_order_is_a_seeded_shuffle_independent_of_file_order(data_file, synthetic_rows, tmp_path):
    keys = [t.key for t in load(data_file)]
    assert keys == [t.key for t in load(data_file)]
    assert keys != sorted(keys)  # shuffled: prime-rl cycles tasks in load order
    assert keys != [t.key for t in load(data_file, shuffle_seed=1)]
    reversed_file = write_jsonl(list(reversed(synthetic_rows)), tmp_path / "reversed.jsonl")
    assert keys == [t.key for t in load(reversed_file)]


def replies_for(task: SciKnowEvalTask) -> list[str]:
    gold = task.data.answer_key
    wrong = next(label for label in task.data.labels if label != gold)
    gold_text = task.data.options[task.data.labels.index(gold)]
    return [
        gold,
        f"({gold})",
        f"{gold}.",
        wrong,
        "",
        f"Answer: {gold}",
        f"answer: {wrong}",
        f"The answer is {gold}.",
        f"**{gold}**",
        f"\\boxed{{{gold}}}",
        f"{gold}. {gold_text}",
        f"<think>Maybe {wrong}. No, {wrong} is wrong.</think>\n{gold}",
        f"<think>it is {gold}",
        f"Let me think.\nAnswer: {gold}",
        f"{gold} or {wrong}",
        gold_text,
        f"{wrong}\nActually the answer is {gold}",
    ]


@pytest.mark.parametrize("mode", ["strict", "lenient"])
def test_rewards_equal_scirl_reward_over_a_table_of_replies(data_file, mode):
    tasks = load(data_file, reward_mode=mode)
    checked = 0
    for task in tasks[:6]:
        q = question_from_row(
            {
                "question": task.data.question,
                "choices": {"text": task.data.options, "label": task.data.labels},
                "answerKey": task.data.answer_key,
                "type": task.data.mcq_type,
                "domain": task.data.domain,
            }
        )
        assert q.id == task.key
        for reply in replies_for(task):
            trace = score(task, reply)
            expected = reward.score(reply, q, mode)
            assert trace.rewards["correct"].score == expected.reward, (mode, reply)
            assert trace.reward == expected.reward
            assert trace.metrics["parsed"] == float(expected.parsed)
            assert trace.metrics["correct_lenient"] == reward.score(reply, q, "lenient").reward
            checked += 1
    assert checked == 6 * len(replies_for(tasks[0]))
    # anchors, so that a reward that agrees with a broken scirl.task.reward still fails
    task, gold = tasks[0], tasks[0].data.answer_key
    wrong = next(label for label in task.data.labels if label != gold)
    assert score(task, gold).reward == 1.0
    assert score(task, wrong).reward == 0.0
    assert score(task, f"<think>{wrong}? {wrong}.</think>\n{gold}").reward == 1.0
    assert score(task, f"<think>{wrong}</think>{wrong}").reward == 0.0
    assert score(task, f"The answer is {gold}.").reward == (1.0 if mode == "lenient" else 0.0)


def test_env_server_path_rebuilds_the_task_from_wire_data_and_scores_the_same(data_file):
    """The env server validates the shipped task data into our TaskData type and scores without loading data."""
    task = load(data_file)[0]
    wire = json.loads(json.dumps(task.data.model_dump(mode="json")))
    rebuilt = SciKnowEvalTask(SciKnowEvalData.model_validate(wire), vf.TaskConfig())
    assert rebuilt.key == task.key and rebuilt.hash == task.hash
    for reply in replies_for(task):
        assert score(rebuilt, reply).reward == score(task, reply).reward


def test_epoch_shuffle_permutes_options_as_scirl_does_and_scores_the_shown_order(data_file):
    from scirl.task.shuffle import epoch_order, permute

    plain = {t.key: t for t in load(data_file)}
    shuffled = load(data_file, shuffle_options="epoch", shuffle_seed=3)
    assert [t.key for t in shuffled] == [t.key for t in load(data_file, shuffle_seed=3)]  # same tasks, same order
    moved = 0
    for task in shuffled:
        row = plain[task.key].data
        q = question_from_row(
            {
                "question": row.question,
                "choices": {"text": row.options, "label": row.labels},
                "answerKey": row.answer_key,
                "type": row.mcq_type,
                "domain": row.domain,
            }
        )
        shown = permute(q, epoch_order(q, 3, 0))  # scirl's epoch 0 under seed 3: the same seeding rule
        assert (task.data.options, task.data.answer_key, task.data.option_order) == (
            list(shown.options),
            shown.answer_key,
            list(shown.option_order),
        )
        assert task.data.prompt == build_messages(shown)[1]["content"]
        # the gold label follows its text, and the reward reads the shown letter
        assert (
            task.data.options[task.data.labels.index(task.data.answer_key)]
            == row.options[row.labels.index(row.answer_key)]
        )
        assert score(task, task.data.answer_key).reward == 1.0
        moved += task.data.answer_key != row.answer_key
    assert moved >= len(shuffled) // 2
    # the env server rebuilds the shown question from the wire data
    wire = json.loads(json.dumps(shuffled[0].data.model_dump(mode="json")))
    rebuilt = SciKnowEvalTask(SciKnowEvalData.model_validate(wire), vf.TaskConfig())
    for reply in replies_for(shuffled[0]):
        assert score(rebuilt, reply).reward == score(shuffled[0], reply).reward


def test_format_control_rewards_any_strict_letter_and_logs_strict_accuracy(data_file):
    task = load(data_file, reward_mode="format")[0]
    gold = task.data.answer_key
    wrong = next(label for label in task.data.labels if label != gold)
    for reply, paid, correct in ((gold, 1.0, 1.0), (wrong, 1.0, 0.0), (f"The answer is {gold}.", 0.0, 0.0)):
        trace = score(task, reply)
        assert (trace.reward, trace.metrics["correct_strict"]) == (paid, correct), reply


def test_settings_the_taskset_cannot_express_are_refused(data_file, tmp_path, capsys):
    for bad in ({"shuffle_options": "rollout"}, {"reward_mode": "random"}):
        with pytest.raises(ValidationError):
            SciKnowEvalConfig.model_validate({"id": "sciknoweval", **bad})
    for flags in (["--shuffle-options", "rollout"], ["--reward-mode", "random"], ["--algorithm", "sdpo"]):
        assert cli_main(["export", "prime-rl", "--out", str(tmp_path / "x"), *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith("scirl export:") and "cannot be exported" in err and err.count("\n") == 1
    assert not (tmp_path / "x").exists()  # refused before anything is written


def test_data_errors_name_the_tasksets_data_key(monkeypatch):
    """scirl's hub hint says `--data`; inside prime-rl the knob is the taskset's `data` key."""
    from scirl.task.data import DataSourceError, hub_unreachable_message

    def no_hub(*args, **kwargs):
        raise DataSourceError(hub_unreachable_message("hicai-zju/SciKnowEval", "no network"))

    monkeypatch.setattr("sciknoweval.taskset.load_splits", no_hub)
    with pytest.raises(DataSourceError, match=r"(?s)--data.*taskset's `data` key.*source\.env\.taskset"):
        list(vf.load_taskset(SciKnowEvalConfig(id="sciknoweval")))
    monkeypatch.undo()
    with pytest.raises(DataSourceError, match=r"(?s)neither the hub id.*taskset's `data` key"):
        list(vf.load_taskset(SciKnowEvalConfig(id="sciknoweval", data="/nonexistent/rows.jsonl")))


def test_other_sets_and_their_exports_load_in_the_taskset(tmp_path):
    from scirl.synth import other_formats as synthetic_formats

    arc = write_jsonl(synthetic_formats.generate_format_rows("arc", n=60, seed=1), tmp_path / "arc.jsonl")
    direct = load(arc, split="train")
    assert {len(t.data.options) for t in direct} == {3, 4, 5}  # no option count is dropped as "not MCQ"
    assert [t.data.qid for t in load(arc, split="train", data_format="arc")] == [t.data.qid for t in direct]
    out = tmp_path / "exported.jsonl"
    assert (
        cli_main(
            [
                "data",
                "export",
                "--data",
                str(arc),
                "--split",
                "train",
                "--out",
                str(out),
                "--eval-per-domain",
                str(EVAL_PER_DOMAIN),
            ]
        )
        == 0
    )
    config = SciKnowEvalConfig(id="sciknoweval", data=str(out), eval_per_domain=0, data_format="sciknoweval")
    assert sorted(t.data.qid for t in vf.load_taskset(config)) == sorted(t.data.qid for t in direct)
    mapped = load(arc, split="train", data_columns="question=question,options=choices,answer=answerKey")
    assert sorted(t.data.answer_key for t in mapped) == sorted(t.data.answer_key for t in direct)
    for bad in ({"data_format": "csv"}, {"data_columns": "question=Q"}):
        with pytest.raises(ValidationError):
            SciKnowEvalConfig(id="sciknoweval", **bad)
