"""Option shuffling (`[data] shuffle_options`) and the control rewards (`[reward] mode = random | format`):
seeded orders, what each completion is shown and scored against, and group baselines. The end-to-end resume
with shuffling is in tests/e2e/test_train_resume.py."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from scirl.inference.base import Completion
from scirl.rollouts.generate import generate_batch, prompt_for
from scirl.rollouts.sampler import QuestionSampler
from scirl.run.config import TrainConfig
from scirl.run.metrics import step_metrics
from scirl.task import reward
from scirl.task import shuffle as options
from scirl.task.data import question_from_row


@pytest.fixture(scope="module")
def questions(synthetic_rows):
    out = []
    for row in synthetic_rows:
        try:
            out.append(question_from_row(row))
        except Exception:  # noqa: BLE001 - the generator's non-MCQ rows
            continue
    assert len(out) >= 60
    return out


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def prompted(questions, tokenizer):
    return [prompt_for(q, tokenizer) for q in questions[:12]]


class AnswerA:
    """A generator that answers "A" to everything, so a reward says which label the gold text was shown under."""

    def __init__(self, tokenizer):
        self.tokenizer, self.calls = tokenizer, []

    def generate(self, prompts, params):
        self.calls.append((len(prompts), params.n))
        return [[Completion("A", [5], [-0.5], "stop") for _ in range(params.n)] for _ in prompts]


def config(mode="none", reward_mode="strict", group_size=4, questions_per_step=3):
    """The orchestrator's slice of a run's config."""
    return TrainConfig(
        group_size=group_size,
        batch_size=group_size * questions_per_step,
        seed=3,
        data={"shuffle_options": mode},
        reward={"mode": reward_mode},
        filters={"zero_advantage": {"enforce": False}},
    ).rollout_settings()  # every completion a sample


def shown_text(q) -> list[str]:
    return [f"{label}. {text}" for label, text in zip(q.labels, q.options)]


# --- orders -------------------------------------------------------------------------------------


def test_orders_are_deterministic_spread_and_move_with_the_epoch(questions):
    four = [q for q in questions if len(q.options) == 4]
    orders = [options.epoch_order(q, 3, 0) for q in four]
    assert orders == [options.epoch_order(q, 3, 0) for q in four]  # from the key alone
    assert all(sorted(o) == [0, 1, 2, 3] for o in orders)
    identity = sum(o == (0, 1, 2, 3) for o in orders)
    assert identity <= len(four) // 5, identity  # 1 in 24 expected
    assert len(set(orders)) >= 12  # many different orders, not one shared shift
    next_epoch = [options.epoch_order(q, 3, 1) for q in four]
    assert sum(a != b for a, b in zip(orders, next_epoch)) >= len(four) * 3 // 4
    other_seed = [options.epoch_order(q, 4, 0) for q in four]
    assert sum(a != b for a, b in zip(orders, other_seed)) >= len(four) * 3 // 4
    q = four[0]
    per_sample = {options.rollout_order(q, 3, 7, k) for k in range(16)}
    assert len(per_sample) >= 8 and options.rollout_order(q, 3, 7, 2) == options.rollout_order(q, 3, 7, 2)


def test_gold_follows_its_text_and_the_reward_reads_the_shown_order(questions):
    q = next(q for q in questions if len(q.options) == 4)
    gold_text = q.options[q.labels.index(q.answer_key)]
    for order in ((1, 2, 3, 0), (3, 2, 1, 0), (0, 1, 2, 3)):
        shown = options.permute(q, order)
        assert shown.options[shown.labels.index(shown.answer_key)] == gold_text
        assert shown.option_order == order and shown.id == q.id
        for label in shown.labels:
            expected = 1.0 if label == shown.answer_key else 0.0
            assert reward.score(label, shown, "strict").reward == expected
            assert reward.score(f"Answer: {label}", shown, "strict").reward == expected
    moved = options.permute(q, (1, 2, 3, 0))
    assert moved.answer_key != q.answer_key
    assert reward.score(q.answer_key, moved, "strict").reward == 0.0  # the row's gold letter is wrong once it moved


# --- what a step shows -----------------------------------------------------------------------------


def test_none_keeps_the_runs_prompts(prompted, tokenizer):
    generator = AnswerA(tokenizer)
    batch = generate_batch(1, prompted[:3], generator, config("none"), vocab_size=1000)
    assert generator.calls == [(3, 4)]
    for record, sample in zip(batch.rollouts, batch.samples):
        item = prompted[record["group"]]
        assert record["prompt"] == item.prompt_text and sample.prompt_ids == item.prompt_ids
        assert record["option_order"] == list(range(len(item.question.options)))
        assert record["answer_key"] == item.question.answer_key


def test_epoch_mode_one_prompt_per_group_and_a_new_order_each_epoch(prompted, tokenizer):
    cfg = config("epoch")
    sampler = QuestionSampler(len(prompted), cfg.seed)
    shown_by_epoch: dict[int, dict[str, list[int]]] = {0: {}, 1: {}}
    generator = AnswerA(tokenizer)
    for step in range(1, 9):  # 8 steps x 3 questions: two passes over 12 questions
        batch_items = sampler.take(3, prompted)
        batch = generate_batch(step, batch_items, generator, cfg, vocab_size=1000)
        assert generator.calls[-1] == (3, 4)  # one prompt per group, group_size completions of it
        for group, item in enumerate(batch_items):
            records = [r for r in batch.rollouts if r["group"] == group]
            assert len({r["prompt"] for r in records}) == 1 and len({tuple(r["option_order"]) for r in records}) == 1
            order = records[0]["option_order"]
            assert order == list(options.epoch_order(item.question, cfg.seed, item.epoch))
            # the prompt lists the options in that order, and the record's gold is where the gold text went
            shown = options.permute(item.question, order)
            assert all(line in records[0]["prompt"] for line in shown_text(shown))
            assert records[0]["answer_key"] == shown.answer_key
            assert all(r["reward"] == float(shown.answer_key == "A") for r in records)
            shown_by_epoch[item.epoch][item.question.id] = order
    assert len(shown_by_epoch[0]) == len(shown_by_epoch[1]) == len(prompted)
    changed = sum(shown_by_epoch[0][i] != shown_by_epoch[1][i] for i in shown_by_epoch[0])
    assert changed >= len(prompted) // 2, changed


@dataclass(frozen=True)
class Tagged:  # take() needs only an ``epoch`` field to replace
    i: int
    epoch: int = 0


def test_a_batch_straddling_two_epochs_tags_each_question_with_its_own():
    sampler = QuestionSampler(3, seed=0)
    tagged = [Tagged(i) for i in range(3)]
    assert [t.epoch for t in sampler.take(2, tagged)] == [0, 0]
    assert [t.epoch for t in sampler.take(2, tagged)] == [0, 1]
    assert sampler.state() == {"epoch": 1, "cursor": 1}


def test_rollout_mode_each_completion_its_own_order_and_a_per_question_baseline(prompted, tokenizer):
    cfg = config("rollout", group_size=8)
    generator = AnswerA(tokenizer)
    batch = generate_batch(5, prompted[:3], generator, cfg, vocab_size=1000)
    assert generator.calls == [(24, 1)]  # a prompt per completion, each sampled once
    assert len(batch.rollouts) == 24 and [s.group for s in batch.samples] == [r["group"] for r in batch.rollouts]
    for group, item in enumerate(prompted[:3]):
        records = [r for r in batch.rollouts if r["group"] == group]
        assert [r["sample"] for r in records] == list(range(8))
        assert all(r["question_id"] == item.question.id for r in records)
        assert len({tuple(r["option_order"]) for r in records}) > 1  # not one order for the group
        for r in records:
            assert r["option_order"] == list(options.rollout_order(item.question, cfg.seed, 5, r["sample"]))
            shown = options.permute(item.question, r["option_order"])
            assert all(line in r["prompt"] for line in shown_text(shown))
            assert r["reward"] == float(shown.answer_key == "A")  # scored against what it was shown
        rewards = [r["reward"] for r in records]
        mean = sum(rewards) / len(rewards)
        assert [r["advantage"] for r in records] == pytest.approx([x - mean for x in rewards])
        samples = [s for s in batch.samples if s.group == group]
        assert len({tuple(s.prompt_ids) for s in samples}) > 1
    # the same step again (a resumed run): the same orders, prompts and rewards
    again = generate_batch(5, prompted[:3], AnswerA(tokenizer), cfg, vocab_size=1000)
    assert again.rollouts == batch.rollouts


# --- control rewards -------------------------------------------------------------------------------


def test_format_reward_pays_any_strict_letter_and_nothing_else(questions):
    q = next(q for q in questions if len(q.options) == 4)
    wrong = next(label for label in q.labels if label != q.answer_key)
    for reply, paid, correct in (
        (q.answer_key, 1.0, True),
        (wrong, 1.0, False),
        (f"Answer: {wrong}", 1.0, False),
        (f"The answer is {q.answer_key}.", 0.0, False),
        ("E", 0.0, False),
        ("", 0.0, False),
    ):
        s = reward.score(reply, q, "format")
        assert (s.reward, s.correct) == (paid, correct), reply


def test_random_reward_is_a_fair_reproducible_coin_independent_of_the_reply(questions):
    q = questions[0]
    wrong = next(label for label in q.labels if label != q.answer_key)
    draws = [
        reward.score(q.answer_key, q, "random", draw=(3, step, q.id, k)).reward
        for step in range(1, 26)
        for k in range(16)
    ]
    assert set(draws) == {0.0, 1.0} and 0.4 < sum(draws) / len(draws) < 0.6
    for step, k in ((1, 0), (2, 5), (9, 15)):
        key = (3, step, q.id, k)
        right, wrong_reply = (
            reward.score(q.answer_key, q, "random", draw=key),
            reward.score(wrong, q, "random", draw=key),
        )
        assert right.reward == wrong_reply.reward == reward.random_reward(*key)
        assert right.correct and not wrong_reply.correct  # the truth is still there
    assert [reward.score("A", q, "random", draw=(4, 1, q.id, k)).reward for k in range(32)] != draws[:32]
    with pytest.raises(ValueError, match="key"):
        reward.score("A", q, "random")
    with pytest.raises(ValueError, match="mode"):
        reward.score("A", q, "coin")


def test_a_control_run_logs_its_true_accuracy(prompted, tokenizer):
    cfg = config("rollout", reward_mode="random", group_size=8)
    batch = generate_batch(2, prompted[:3], AnswerA(tokenizer), cfg, vocab_size=1000)
    for r in batch.rollouts:
        shown = options.permute(
            next(p.question for p in prompted if p.question.id == r["question_id"]), r["option_order"]
        )
        assert r["correct_strict"] == (shown.answer_key == "A")
        assert r["reward"] == reward.random_reward(cfg.seed, 2, r["question_id"], r["sample"])
    timings = {"time/generate": 1.0, "time/train": 1.0, "time/weight_sync": 0.0}
    m = step_metrics(2, batch.rollouts, {"stepped": False}, timings)
    assert m["accuracy/strict"] == sum(r["correct_strict"] for r in batch.rollouts) / 24
    assert m["reward/mean_all"] == sum(r["reward"] for r in batch.rollouts) / 24
    assert m["accuracy/strict"] != m["reward/mean_all"]


def test_a_shuffled_run_keeps_a_token_per_option_line_to_spare(prompted, tokenizer):
    from scirl.rollouts.generate import fits

    item = next(p for p in prompted if len(p.question.options) == 4)
    exact = len(item.prompt_ids) + 8
    for mode, seq_len, kept in (
        ("none", exact, True),
        ("epoch", exact, False),
        ("rollout", exact + 3, False),
        ("rollout", exact + 4, True),
    ):
        cfg = TrainConfig(seq_len=seq_len, max_completion_tokens=8, data={"shuffle_options": mode})
        assert fits(item, cfg.rollout_settings()) is kept, (mode, seq_len)
    # byte-level BPE: every order of every question has the row order's length, so the spare is never used up
    q = item.question
    lengths = {
        len(prompt_for(options.permute(q, options.rollout_order(q, 0, 1, k)), tokenizer).prompt_ids) for k in range(24)
    }
    assert lengths == {len(item.prompt_ids)}
