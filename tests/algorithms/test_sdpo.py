"""SDPO's parts on small inputs: the divergence against a direct computation, the teacher prompts, the
teacher held fixed (no gradient through it), the EMA teacher, and the CPU trainer's shared prompts."""

from __future__ import annotations

import math

import pytest
import torch

from helpers.train_runs import samples_with_teachers
from scirl import algorithms
from scirl.algorithms.sdpo.distill import divergence
from scirl.algorithms.sdpo.prompts import TeacherSettings, group_teachers
from scirl.inference.base import Completion
from scirl.rollouts.contract import PromptedQuestion
from scirl.run.config import TrainConfig
from scirl.task.prompt import build_messages, teacher_messages
from scirl.task.reward import Scored
from scirl.trainer.batching import Batching
from scirl.trainer.targets import student_logprobs, teacher_targets

# ---- the divergence, against the textbook formulas written out entry by entry ----


def direct_divergence(student_logits, teacher_logits, alpha, temperature, top_k=None, tail=True):
    """D_alpha per position, from probabilities in float64: the distributions (top-k + tail bucket, or
    renormalised top-k) built by hand, then KL(q||s), KL(s||q) or the mixture's two KLs."""
    out = []
    for s_row, t_row in zip(student_logits.double(), teacher_logits.double()):
        s = torch.softmax(s_row / temperature, -1).tolist()
        q = torch.softmax(t_row / temperature, -1).tolist()
        if top_k is not None:
            ids = sorted(range(len(q)), key=lambda i: -q[i])[:top_k]
            s_top, q_top = [s[i] for i in ids], [q[i] for i in ids]
            if tail:
                s, q = s_top + [max(1 - sum(s_top), 0.0)], q_top + [max(1 - sum(q_top), 0.0)]
            else:
                s, q = [x / sum(s_top) for x in s_top], [x / sum(q_top) for x in q_top]

        def kl(p, r):
            return sum(pi * math.log(pi / ri) for pi, ri in zip(p, r) if pi > 0)

        if alpha == 0:
            out.append(kl(q, s))
        elif alpha == 1:
            out.append(kl(s, q))
        else:
            m = [(1 - alpha) * si + alpha * qi for si, qi in zip(s, q)]
            out.append((1 - alpha) * kl(s, m) + alpha * kl(q, m))
    return torch.tensor(out, dtype=torch.float64)


def our_divergence(student_logits, teacher_logits, alpha, temperature, top_k=0, tail=True):
    targets = teacher_targets(teacher_logits, top_k=top_k, tail=tail, temperature=temperature)
    student = student_logprobs(student_logits, targets, tail=tail, temperature=temperature)
    return divergence(student, targets.logprobs, alpha)


def logits_pair(n=6, vocab=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, vocab, generator=g) * 2, torch.randn(n, vocab, generator=g) * 2


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0, 0.3])
def test_full_vocabulary_divergence_is_the_direct_one(alpha):
    student, teacher = logits_pair()
    got = our_divergence(student, teacher, alpha, temperature=0.7)
    torch.testing.assert_close(got.double(), direct_divergence(student, teacher, alpha, 0.7), rtol=1e-5, atol=1e-6)
    assert (got >= -1e-6).all()
    assert our_divergence(student, student, alpha, 0.7).abs().max() < 1e-6  # zero against itself


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("tail", [True, False])
def test_top_k_divergence_is_the_direct_one(alpha, tail):
    student, teacher = logits_pair(seed=1)
    got = our_divergence(student, teacher, alpha, temperature=1.0, top_k=4, tail=tail)
    want = direct_divergence(student, teacher, alpha, 1.0, top_k=4, tail=tail)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_top_k_of_the_whole_vocabulary_with_its_empty_tail_equals_the_full_divergence(alpha):
    student, teacher = logits_pair(vocab=13, seed=2)
    full = our_divergence(student, teacher, alpha, temperature=0.9)
    every = our_divergence(student, teacher, alpha, temperature=0.9, top_k=13, tail=True)
    torch.testing.assert_close(every, full, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(our_divergence(student, teacher, alpha, 0.9, top_k=500), full, rtol=1e-5, atol=1e-6)


def test_no_gradient_reaches_the_teacher():
    student, teacher = logits_pair(seed=3)
    student.requires_grad_(True)
    teacher.requires_grad_(True)
    our_divergence(student, teacher, 0.5, 1.0, top_k=4).sum().backward()
    assert teacher.grad is None and student.grad is not None and student.grad.abs().sum() > 0


# ---- the teacher prompts ----


class CharTokenizer:
    """One token per character, a chat template that joins the messages: enough to count and read prompts."""

    chat_template = None

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def group(rewards, texts=None, finish=None, parsed=None):
    """One group of completions of one question (all from one prompt), with these rewards; a completion is
    parsed unless ``parsed`` says otherwise (successes always are)."""
    from scirl.synth.questions import generate_rows
    from scirl.task.data import question_from_row

    q = question_from_row(generate_rows(n_per_domain=1, seed=0)[0])
    n = len(rewards)
    items = [PromptedQuestion(q, [1, 2, 3], "prompt")] * n
    texts = texts or [f"reply {k}" for k in range(n)]
    completions = [Completion(texts[k], [5], [-0.1], (finish or ["stop"] * n)[k]) for k in range(n)]
    parsed = parsed or [True] * n
    scored = [
        Scored(answer="B" if parsed[k] else None, correct=r > 0, parsed=parsed[k], reward=r)
        for k, r in enumerate(rewards)
    ]
    return q, items, completions, scored


def settings(**changes):
    base = dict(success_threshold=0.5, reprompt_on_self_success=False, feedback=False, max_prompt_tokens=100_000)
    return TeacherSettings(**{**base, **changes})


def test_one_success_is_shown_to_the_others_and_not_to_itself():
    q, items, completions, scored = group([0.0, 1.0, 0.0, 0.0], texts=["wrong", "<think>hmm</think> A", "x", "y"])
    teachers = group_teachers(items, completions, scored, settings(), CharTokenizer(), "strict")
    assert [t.solution if t else None for t in teachers] == [1, None, 1, 1]
    prompt = CharTokenizer().decode(teachers[0].prompt_ids)
    want = teacher_messages(q, solution="A")  # the <think> block removed
    assert prompt.endswith("Assistant:") and want[-1]["content"] in prompt
    assert want[-1]["content"].endswith("Correct solution:\n\nA\n\nCorrectly solve the original question.")
    assert want[0] == build_messages(q)[0] and want[0]["content"] in prompt  # the system message kept as it was


def test_several_successes_each_success_is_shown_another():
    q, items, completions, scored = group([1.0, 0.0, 1.0, 1.0])
    teachers = group_teachers(items, completions, scored, settings(), CharTokenizer(), "strict")
    assert [t.solution for t in teachers] == [2, 0, 0, 0]  # the first success other than itself


def test_a_self_success_sees_itself_only_when_asked():
    q, items, completions, scored = group([0.0, 1.0])
    assert group_teachers(items, completions, scored, settings(), CharTokenizer(), "strict")[1] is None
    teachers = group_teachers(
        items, completions, scored, settings(reprompt_on_self_success=True), CharTokenizer(), "strict"
    )
    assert [t.solution for t in teachers] == [1, 1]


def test_a_group_without_success_has_no_teacher_unless_the_reward_says_why_it_failed():
    q, items, completions, scored = group(
        [0.0, 0.0, 0.0], finish=["stop", "stop", "length"], parsed=[True, False, False]
    )
    assert group_teachers(items, completions, scored, settings(), CharTokenizer(), "strict") == [None] * 3
    teachers = group_teachers(items, completions, scored, settings(feedback=True), CharTokenizer(), "strict")
    assert teachers[0] is None  # a wrong letter: the reward says only that it is wrong
    text = CharTokenizer().decode(teachers[1].prompt_ids)
    assert teachers[1].solution is None and "feedback from your unsuccessful earlier attempt" in text
    assert "No answer letter could be read" in text and "Correct solution" not in text
    assert "cut off at the length limit" in CharTokenizer().decode(teachers[2].prompt_ids)
    # a random reward says nothing about a reply
    assert group_teachers(items, completions, scored, settings(feedback=True), CharTokenizer(), "random") == [None] * 3


def test_a_success_sampled_from_another_option_order_is_not_shown():
    q, items, completions, scored = group([1.0, 0.0, 0.0])
    other = PromptedQuestion(q, [9, 9, 9], "another order")
    items = [items[0], other, items[0]]
    teachers = group_teachers(items, completions, scored, settings(), CharTokenizer(), "strict")
    assert teachers[1] is None and teachers[2].solution == 0


def test_a_long_teacher_prompt_is_cut_in_its_solution():
    long_reply = "A" + " because" * 200
    q, items, completions, scored = group([1.0, 0.0], texts=[long_reply, "B"])
    full = group_teachers(items, completions, scored, settings(), CharTokenizer(), "strict")[1]
    limit = len(full.prompt_ids) - 100
    cut = group_teachers(items, completions, scored, settings(max_prompt_tokens=limit), CharTokenizer(), "strict")[1]
    assert len(cut.prompt_ids) <= limit and cut.solution == 0
    assert "Correctly solve the original question." in CharTokenizer().decode(cut.prompt_ids)
    frame = len(full.prompt_ids) - len(long_reply)
    assert (
        group_teachers(items, completions, scored, settings(max_prompt_tokens=frame - 1), CharTokenizer(), "strict")[1]
        is None
    )


def test_grpo_makes_no_teacher_prompts():
    assert not TrainConfig().rollout_settings().algorithm.needs_tokenizer()
    assert TrainConfig(algorithm="sdpo").rollout_settings().algorithm.teacher == settings(
        feedback=True, max_prompt_tokens=10240
    )


# ---- the trainer: teacher held fixed, EMA, shared prompts ----


def make_trainer(model_dir, **sdpo):
    from scirl.distributed import Dist
    from scirl.trainer import Trainer
    from scirl.trainer.model import load_model

    cfg = TrainConfig(algorithm="sdpo", sdpo=sdpo)
    model = load_model(str(model_dir), torch.device("cpu"), Dist(), torch.float32)
    trainer = Trainer(
        model,
        cfg.optim,
        algorithms.build(cfg),
        temperature=0.8,
        device=torch.device("cpu"),
        dist=Dist(),
        dtype=torch.float32,
    )
    trainer.optimizer = torch.optim.SGD(trainer.trainable, lr=1.0)
    return trainer


def direct_gradient(trainer, samples, alpha, top_k, is_clip):
    """The SDPO gradient written out: the teacher's logits computed without gradient from the same module,
    the student's with it, D_alpha over the completion tokens weighted by min(ratio, is_clip), divided by
    the count of teacher tokens."""
    model = trainer.model
    total, count = 0.0, sum(len(s.completion_ids) for s in samples if s.teacher_prompt_ids)
    for s in samples:
        if s.teacher_prompt_ids is None:
            continue
        c = len(s.completion_ids)
        with torch.no_grad():
            t_ids = torch.tensor([s.teacher_prompt_ids + s.completion_ids])
            teacher = model(input_ids=t_ids).logits[0, len(s.teacher_prompt_ids) - 1 : -1]
        ids = torch.tensor([s.prompt_ids + s.completion_ids])
        student = model(input_ids=ids).logits[0, len(s.prompt_ids) - 1 : -1]
        d = our_divergence(student, teacher, alpha, 0.8, top_k=top_k)
        sampled = torch.log_softmax(student.float() / 0.8, -1).gather(-1, torch.tensor(s.completion_ids)[:, None])[:, 0]
        weight = (sampled.detach() - torch.tensor(s.logprobs)).exp().clamp(max=is_clip)
        total = total + (weight * d).sum()
        assert c > 0
    (total / count).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("alpha, top_k", [(0.5, 5), (1.0, 0)])
def test_the_trainer_step_is_the_direct_sdpo_gradient_with_the_teacher_held_fixed(tiny_model_dir, alpha, top_k):
    """teacher = "current": the teacher is the very module being trained, so any gradient through the teacher
    forward would change the step; the step equals SGD (lr 1) on the direct gradient with the teacher's logits
    taken as constants."""
    from scirl.trainer.packing import make_micro_batches

    trainer = make_trainer(tiny_model_dir, teacher="current", alpha=alpha, top_k=top_k, is_clip=1.5)
    samples = samples_with_teachers()
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    grads = direct_gradient(trainer, samples, alpha, top_k, 1.5)
    trainer.batching = Batching(micro_batch_size=2)
    batches = trainer.batches(samples)
    assert sum(mb.loss_tokens for mb in batches) == 11  # the sample without a teacher is left out
    stats = trainer.train_step(batches)
    assert stats["stepped"] and stats["sdpo/teacher_tokens"] == 11
    scale = min(1.0, 1.0 / (math.sqrt(sum(float(g.pow(2).sum()) for g in grads.values())) + 1e-6))  # clip at 1
    for name, p in trainer.model.named_parameters():
        torch.testing.assert_close(p.detach(), before[name] - scale * grads[name], rtol=1e-4, atol=1e-6, msg=name)
    assert make_micro_batches(samples, max_rows=8)[0].teacher.has_teacher.tolist().count(False) == 1


def test_the_ema_teacher_follows_the_policy_after_each_step_and_is_put_back_exactly(tiny_model_dir):
    from scirl.trainer.packing import make_micro_batches

    trainer = make_trainer(tiny_model_dir, ema_rate=0.25)
    start = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train_step(trainer.batches(samples_with_teachers()))
    after = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    state = trainer.algorithm.ema.state_dict()
    assert state.keys() == start.keys() and all(t.dtype == torch.float32 for t in state.values())
    moved = 0
    for name in start:
        torch.testing.assert_close(state[name], 0.75 * start[name] + 0.25 * after[name], rtol=1e-6, atol=1e-7)
        moved += int(not torch.equal(after[name], start[name]))
    assert moved > 0
    with trainer.algorithm.ema.holding():  # the teacher forward sees the average...
        for name, p in trainer.model.named_parameters():
            assert torch.equal(p.detach(), state[name])
    for name, p in trainer.model.named_parameters():  # ...and the policy is back, bit for bit
        assert torch.equal(p.detach(), after[name])
    assert all(torch.equal(trainer.algorithm.ema.tensors()[name], state[name]) for name in state)  # what is saved
    trainer.algorithm.ema.reset()  # resumed from a checkpoint without a teacher: the average starts at the policy
    assert all(torch.equal(trainer.algorithm.ema.tensors()[name], after[name]) for name in after)
    # the teacher's sequences: 4 rows after 3 distinct teacher prompts (group 1's two completions share theirs)
    teacher = make_micro_batches(samples_with_teachers(), max_rows=8)[0].teacher.packed
    assert teacher.sequences == 4 and teacher.layout.prompt_index.shape[0] == 3


def test_the_metrics_row_and_step_line_say_how_many_rollouts_had_a_teacher():
    from scirl.run.metrics import step_line, step_metrics

    def record(teacher, tokens):
        return {
            "reward": 1.0,
            "dropped": False,
            "advantage": 0.5,
            "domain": "Physics",
            "parsed_strict": True,
            "parsed_lenient": True,
            "correct_strict": True,
            "correct_lenient": True,
            "filter": None,
            "num_tokens": 3,
            "finish_reason": "stop",
            "teacher": teacher,
            "teacher_prompt_tokens": tokens,
        }

    rollouts = [record("solution", 100), record("feedback", 60), record("none", 0), record("none", 0)]
    stats = {
        "stepped": True,
        "loss": 0.1,
        "entropy": 0.5,
        "grad_norm": 1.0,
        "mismatch_kl": 0.0,
        "masked_fraction": 0.0,
        "loss_tokens": 6,
        "sdpo/divergence": 0.25,
        "sdpo/teacher_tokens": 6,
        "time/teacher": 0.01,
    }
    timings = {"time/generate": 1.0, "time/train": 1.0, "time/weight_sync": 0.0, "time/step": 2.0}
    sdpo = algorithms.build(TrainConfig(algorithm="sdpo"))
    m = step_metrics(3, rollouts, stats, timings, sdpo)
    assert (m["sdpo/teacher_fraction"], m["sdpo/feedback_fraction"], m["sdpo/teacher_prompt_tokens"]) == (0.5, 0.25, 80)
    assert (m["sdpo/divergence"], m["time/teacher"]) == (0.25, 0.01)
    assert "SDPO teacher 50.0% | Divergence 0.2500" in step_line(m, sdpo)
    grpo_algorithm = algorithms.build(TrainConfig())
    grpo = step_metrics(
        3,
        [{k: v for k, v in r.items() if not k.startswith("teacher")} for r in rollouts],
        {k: v for k, v in stats.items() if not k.startswith(("sdpo", "time/"))},
        timings,
        grpo_algorithm,
    )
    assert not any(k.startswith("sdpo/") for k in grpo) and "SDPO" not in step_line(grpo, grpo_algorithm)


def test_the_sdpo_config_round_trips_and_bad_values_are_one_line_errors(tmp_path, capsys):
    from scirl.commands.train import main
    from scirl.run.config_io import load_config, read_toml, validate, write_config

    cfg = load_config(["--algorithm", "sdpo", "--sdpo.top-k", "0", "--sdpo.teacher", "current", "--sdpo.is-clip", "0"])
    assert validate(read_toml(write_config(cfg, tmp_path / "config.toml"))) == cfg
    for flags, field in (
        (["--algorithm", "ppo"], "algorithm"),
        (["--sdpo.alpha", "1.5"], "sdpo.alpha"),
        (["--sdpo.teacher", "frozen"], "sdpo.teacher"),
        (["--sdpo.ema-rate", "0"], "sdpo.ema_rate"),
    ):
        assert main([*flags, "--dry-run"]) == 2
        err = capsys.readouterr().err
        assert field in err and "Traceback" not in err and err.count("\n") == 1, err


def test_in_one_bf16_process_the_teacher_computes_with_the_ema_cast_and_the_copy_comes_back(tiny_model_dir):
    """One bf16 process trains float32 masters through a bf16 compute copy: the teacher forward puts the
    EMA's values, cast, into that copy, and the copy is the masters' cast again afterwards."""
    from scirl.distributed import Dist
    from scirl.trainer import Trainer
    from scirl.trainer.model import load_model

    cfg = TrainConfig(algorithm="sdpo")
    model = load_model(str(tiny_model_dir), torch.device("cpu"), Dist(), torch.float32)
    trainer = Trainer(
        model,
        cfg.optim,
        algorithms.build(cfg),
        temperature=1.0,
        device=torch.device("cpu"),
        dist=Dist(),
        dtype=torch.bfloat16,
    )
    assert trainer.compute_copy is not None
    for value in trainer.algorithm.ema.values:
        value.add_(0.01)
    with trainer.algorithm.ema.holding(trainer.compute_copy):
        for (_, compute), value in zip(trainer.compute_copy.pairs, trainer.algorithm.ema.values):
            assert torch.equal(compute.detach(), value.to(torch.bfloat16))
    for master, compute in trainer.compute_copy.pairs:
        assert torch.equal(compute.detach(), master.detach().to(torch.bfloat16))
    stats = trainer.train_step(trainer.batches(samples_with_teachers()))
    assert stats["stepped"] and stats["sdpo/divergence"] > 0  # the teacher (EMA + 0.01) differs from the student
