"""The demo: its question world, its base-model builder, and a shortened end-to-end run."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest

from scirl.demo.world import HABITS, LETTERS, generate_reading_rows, web_answer
from scirl.synth.questions import RELATIONS
from scirl.task.data import question_from_row
from scirl.task.schema import DOMAINS


def test_reading_rows_are_valid_mcqs_whose_text_states_exactly_one_option():
    rows = generate_reading_rows(12, seed=3)
    assert Counter(r["domain"] for r in rows) == {d: 12 for d in DOMAINS}
    for i, row in enumerate(rows):
        q = question_from_row(row, source=f"t:{i}")
        text = q.question.split("\nQuestion:")[0]
        stated = [label for label, option in zip(q.labels, q.options) if f" {option}" in text]
        assert stated == [q.answer_key], (q.question, q.options)
    assert generate_reading_rows(12, seed=3) == rows  # deterministic in the seed
    assert generate_reading_rows(12, seed=4) != rows


def test_answer_letters_are_balanced_so_a_single_letter_cannot_score():
    letters = Counter(r["answerKey"] for r in generate_reading_rows(200, seed=0))
    assert set(letters) == set(LETTERS)
    assert max(letters.values()) / sum(letters.values()) < 0.3


def test_web_answers_follow_each_relations_habit():
    rng = random.Random(0)
    rows = generate_reading_rows(400, seed=1)
    for index, relation in enumerate(RELATIONS):
        mine = [r for r in rows if r["details"]["task"] == relation.task]
        answers = [web_answer(r, rng).removeprefix("Answer: ") for r in mine]
        right = sum(a == r["answerKey"] for a, r in zip(answers, mine)) / len(mine)
        habit = HABITS[index]
        # right: p_correct, plus the habit or a random letter that happens to be right
        expected = habit.p_correct + habit.p_habit * 0.25 + (1 - habit.p_correct - habit.p_habit) * 0.25
        assert abs(right - expected) < 0.1, (relation.task, right, expected)


def test_pretrain_script_runs_and_writes_a_loadable_model(tmp_path):
    from transformers import AutoModelForCausalLM

    from scirl.demo.pretrain import main

    out = tmp_path / "base"
    assert (
        main(
            [
                "--out",
                str(out),
                "--steps",
                "3",
                "--clean-steps",
                "1",
                "--batch-size",
                "4",
                "--eval-every",
                "3",
                "--val-per-domain",
                "2",
                "--hidden-size",
                "32",
                "--layers",
                "1",
                "--heads",
                "2",
                "--vocab-size",
                "400",
            ]
        )
        == 0
    )
    log = [json.loads(line) for line in (out / "pretrain_log.jsonl").read_text().splitlines()]
    assert log[-1]["step"] == 3 and 0 <= log[-1]["greedy_acc"] <= 1
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.num_hidden_layers == 1


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_shortened_demo_runs_end_to_end_and_the_reward_rises(tmp_path):
    from helpers.train_runs import assert_forwards_compute_the_unique_tokens
    from scirl.demo.run import BASE_MODEL_DIR, DemoOptions, run_demo

    out = tmp_path / "demo"
    summary = run_demo(
        DemoOptions(
            output_dir=out,
            train_per_domain=40,
            eval_per_domain=10,
            report=False,
            progress=False,
            overrides=["--max-steps", "10", "--ckpt.interval", "10"],
        )
    )
    before = json.loads((out / "eval_base.json").read_text())
    after = json.loads((out / "eval_final.json").read_text())
    for results in (before, after):  # scirl eval's format, on the 40 held-out questions
        assert results["counts"]["answered"] == 40 and set(results["per_domain_accuracy"]) == set(DOMAINS)
    # held-out means the RL phase never saw them
    trained_on = {row["question_id"] for path in (out / "rollouts").glob("step_*.jsonl") for row in read_jsonl(path)}
    assert trained_on and not trained_on & {r["id"] for r in before["records"]}
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, 11))
    rewards = [m["reward/mean"] for m in metrics]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1, rewards
    assert after["overall_accuracy"] > before["overall_accuracy"], (
        before["overall_accuracy"],
        after["overall_accuracy"],
    )
    assert (out / "weights" / "step_10" / "config.json").is_file()
    assert_forwards_compute_the_unique_tokens(out, BASE_MODEL_DIR)
    assert summary["gain_points"] == pytest.approx(100 * (after["overall_accuracy"] - before["overall_accuracy"]))
    assert summary["layout"] == "colocated: one process samples with transformers and trains"


@pytest.mark.slow
def test_the_demos_training_on_two_torchrun_ranks_computes_each_prompt_once(tmp_path):
    """``torchrun --nproc-per-node 2 -m scirl train`` on the demo's config and data (2 gloo ranks, FSDP2): each rank
    packs its groups' prompts once, and what the forwards compute is the batches' unique tokens."""
    from helpers.train_runs import assert_forwards_compute_the_unique_tokens, torchrun_train
    from scirl.demo.run import BASE_MODEL_DIR, DEMO_CONFIG, write_questions

    data = write_questions(tmp_path / "questions.jsonl", 40, 10, 0)
    torchrun_train(
        [
            "@",
            str(DEMO_CONFIG),
            "--model",
            str(BASE_MODEL_DIR),
            "--data.source",
            str(data),
            "--output-dir",
            str(tmp_path / "run"),
            "--max-steps",
            "3",
            "--eval.interval",
            "0",
        ]
    )
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert {
        json.loads(line)["rank"] for line in (tmp_path / "run" / "rollouts" / "step_1.jsonl").read_text().splitlines()
    } == {0, 1}
    assert_forwards_compute_the_unique_tokens(tmp_path / "run", BASE_MODEL_DIR)


@pytest.mark.slow
def test_shortened_demo_with_the_vllm_backend_raises_held_out_accuracy(tmp_path):
    """`scirl demo --inference.backend vllm`: the flag reaches the trainer, an in-process vLLM engine
    samples the rollouts (taking the new weights after every step), and the model still learns."""
    pytest.importorskip("vllm")
    import tomllib
    import torch

    from scirl.demo.run import DemoOptions, run_demo

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # before the engine starts: afterwards vLLM's CPU backend pins the count
    out = tmp_path / "demo"
    try:
        summary = run_demo(
            DemoOptions(
                output_dir=out,
                train_per_domain=40,
                eval_per_domain=10,
                report=False,
                progress=False,
                overrides=["--max-steps", "10", "--ckpt.interval", "10", "--inference.backend", "vllm"],
            )
        )
    finally:
        torch.set_num_threads(threads)
    config = tomllib.loads((out / "config.toml").read_text())
    assert config["inference"]["backend"] == "vllm" and config["inference"]["enforce_eager"] is True
    assert summary["inference_backend"] == "vllm"
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, 11))
    # the engine samples from the distribution the trainer computes (same weights, same processing)
    assert max(m["mismatch_kl"] for m in metrics) < 1e-3, [m["mismatch_kl"] for m in metrics]
    before = json.loads((out / "eval_base.json").read_text())
    after = json.loads((out / "eval_final.json").read_text())
    assert after["counts"]["answered"] == before["counts"]["answered"] == 40
    assert after["overall_accuracy"] > before["overall_accuracy"], (
        before["overall_accuracy"],
        after["overall_accuracy"],
    )


def test_demo_with_inference_servers_trains_through_the_launcher_in_the_guides_layout(tmp_path):
    """`scirl demo --deployment.num-infer-gpus 1 --deployment.num-train-gpus 2` trains as the guide's layout: a
    server and two trainer ranks started by scirl train's launcher (stand-ins here, tests/fakes/deploy_fakes.py), given
    the demo's own settings; the demo evaluates what they left and says which layout trained."""
    from fakes.deploy_fakes import launch_options
    from scirl.demo.run import BASE_MODEL_DIR, DemoOptions, run_demo

    out, record = tmp_path / "demo", tmp_path / "record"
    record.mkdir()
    summary = run_demo(
        DemoOptions(
            output_dir=out,
            train_per_domain=10,
            eval_per_domain=2,
            report=False,
            progress=False,
            overrides=["--max-steps", "4", "--deployment.num-infer-gpus", "1", "--deployment.num-train-gpus", "2"],
            launch_options=launch_options({"record": str(record), "behave": "demo"}),
        )
    )
    ranks = [json.loads((record / f"trainer_{rank}.json").read_text()) for rank in (0, 1)]
    assert [rank["world_size"] for rank in ranks] == ["2", "2"] and len(ranks[0]["urls"]) == 1
    argv = ranks[0]["argv"]
    for flag, value in (
        ("--model", str(BASE_MODEL_DIR)),
        ("--output-dir", str(out)),
        ("--max-steps", "4"),
        ("--data.source", str(out / "data" / "demo_questions.jsonl")),
    ):
        assert argv[argv.index(flag) + 1] == value
    assert summary["layout"] == "1 vLLM server(s) + 2 trainer rank(s)"
    assert summary["inference_backend"] == "vllm" and summary["steps"] == 4
    assert json.loads((out / "eval_final.json").read_text())["counts"]["answered"] == 8
    assert (out / "logs" / "trainer.log").is_file() and (out / "ports.json").is_file()


def test_demo_command_refuses_a_used_output_dir(tmp_path, capsys):
    from scirl.cli import main

    (tmp_path / "old.txt").write_text("x")
    assert main(["demo", "--output-dir", str(tmp_path)]) == 2
    assert "not empty" in capsys.readouterr().err


def test_demo_command_reports_a_training_problem_without_a_traceback(tmp_path, capsys):
    from scirl.cli import main

    # 20 training questions, a step wants 64 (batch 512 / group 8)
    argv = [
        "demo",
        "--output-dir",
        str(tmp_path / "d"),
        "--no-report",
        "--no-progress",
        "--train-per-domain",
        "5",
        "--eval-per-domain",
        "2",
        "--batch-size",
        "512",
    ]
    assert main(argv) == 2  # data and config that do not fit: refused as bad input is, whatever the command
    assert "fewer than the 64 a step needs" in capsys.readouterr().err


def test_demo_refuses_overrides_it_would_misapply_and_leaves_no_output_dir(tmp_path, capsys):
    """`--model X` would train X but evaluate the shipped base model as 'before'; a bad flag must not
    leave a half-made output dir that the next try then refuses as 'not empty'."""
    from scirl.cli import main

    out = tmp_path / "d"
    assert main(["demo", "--output-dir", str(out), "--model", str(tmp_path)]) == 2
    assert "--base-model" in capsys.readouterr().err
    assert main(["demo", "--output-dir", str(out), "--max-steps", "zero"]) == 2
    assert "max_steps" in capsys.readouterr().err
    assert not out.exists()


def test_the_demo_config_ships_inside_the_package():
    """A regular (non-editable) install has only what package-data lists: the demo's config must be among it."""
    import tomllib

    from scirl.demo.run import DEMO_CONFIG, PACKAGE_DIR

    pyproject = tomllib.loads((PACKAGE_DIR.parent / "pyproject.toml").read_text())
    shipped = {
        p.resolve()
        for pattern in pyproject["tool"]["setuptools"]["package-data"]["scirl"]
        for p in PACKAGE_DIR.glob(pattern)
    }
    assert DEMO_CONFIG.is_file() and DEMO_CONFIG.resolve() in shipped
    assert DEMO_CONFIG.parent.name == "configs" and DEMO_CONFIG.is_relative_to(PACKAGE_DIR)
