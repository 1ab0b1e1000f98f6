"""Each algorithm's loss against its paper's formula, written out here token by token on small tensors: padded
tokens under the mask, ratios on both sides of each clip boundary, completions of different lengths (so a
per-completion mean, a per-token mean and a constant give different numbers) and a batch split over two
micro-batches whose normalisers are summed first, as ``Trainer.train_step`` sums them. Values and gradients
with respect to the trainer's logprobs are compared in float64 (the only rounding is the order of a few sums).

Then the seam: ``--algorithm NAME`` and each section from the registry, DAPO's dropped flat groups, the
export's refusal, and a short run of every algorithm end to end."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from helpers.train_runs import final_weights, rows, run_in_process, train_args
from scirl import algorithms
from scirl.run.config import TrainConfig

# completion lengths 3, 1 and 4 (T = 4); a padded position holds a wild value the mask must hide
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
ADVANTAGES = torch.tensor([1.0, -0.5, -1.5], dtype=torch.float64)
SAMPLER = torch.tensor(
    [[-1.0, -0.5, -2.0, -30.0], [-0.7, 9.0, 9.0, 9.0], [-1.2, -0.3, -0.9, -2.5]], dtype=torch.float64
)


def trainer_logprobs(ratios) -> torch.Tensor:
    """The trainer's logprobs that give these trainer/sampler ratios (padding: anything)."""
    return (SAMPLER + torch.tensor(ratios, dtype=torch.float64).log()).requires_grad_(True)


def run_loss(algorithm, logprobs: torch.Tensor) -> tuple[float, torch.Tensor]:
    """The algorithm's loss as the trainer takes it: rows {0} and {1, 2} as two micro-batches, the normalisers
    summed over both before either loss (``train_step``), the two losses added, backward."""
    parts = [slice(0, 1), slice(1, 3)]
    # what ``counts`` reads of a micro-batch: its loss mask, its completions (counted when it was built)
    batches = [SimpleNamespace(loss_mask=MASK[p], sequences=int(MASK[p].any(dim=1).sum())) for p in parts]
    scales = [float(MASK.sum()), *algorithm.counts(batches)]
    total = sum(algorithm.loss(logprobs[p], SAMPLER[p], ADVANTAGES[p], MASK[p], scales)[0] for p in parts)
    total.backward()
    return float(total.detach()), logprobs.grad.clone()


def direct_gradient(objective, logprobs: torch.Tensor) -> tuple[float, torch.Tensor]:
    value = objective(logprobs)
    (grad,) = torch.autograd.grad(value, logprobs)
    return float(value.detach()), grad


def tokens():
    """(i, t) of every loss token."""
    return [(i, t) for i in range(MASK.shape[0]) for t in range(MASK.shape[1]) if MASK[i, t]]


def clip(x, low, high):
    return torch.clamp(x, min=low, max=high)


def assert_same(got, want):
    assert got[0] == pytest.approx(want[0], rel=1e-12, abs=1e-12)
    torch.testing.assert_close(got[1], want[1], rtol=1e-12, atol=1e-12)


# ratios straddling the boundaries: row 0 (A > 0) at 1.25 lies between 1 + 0.2 and 1 + 0.28, at 1.3 above both;
# row 1 (A < 0) at 0.75 below 1 - 0.2; row 2 (A < 0) at 0.85 inside, 1.5 above (never clipped for A < 0)
RATIOS = [[1.25, 1.3, 0.9, 50.0], [0.75, 3.0, 3.0, 3.0], [0.85, 1.5, 1.1, 0.79]]


def test_dr_grpo_is_the_clipped_surrogate_summed_over_a_constant():
    """Liu et al. 2025, eq. (3): -1/(N * L_max) sum_i sum_t min(r A, clip(r, 0.8, 1.2) A), N completions,
    L_max = max_completion_tokens."""
    algorithm = algorithms.build(TrainConfig(algorithm="dr_grpo", max_completion_tokens=6))

    def paper(lp):
        total = 0
        for i, t in tokens():
            r = torch.exp(lp[i, t] - SAMPLER[i, t])
            total = total + torch.minimum(r * ADVANTAGES[i], clip(r, 1 - 0.2, 1 + 0.2) * ADVANTAGES[i])
        return -total / (3 * 6)

    assert_same(run_loss(algorithm, trainer_logprobs(RATIOS)), direct_gradient(paper, trainer_logprobs(RATIOS)))


def test_dapo_clips_higher_and_averages_every_token_of_the_batch():
    """Yu et al. 2025, eq. (8): -1/sum_i |o_i| sum_i sum_t min(r A, clip(r, 1 - 0.2, 1 + 0.28) A)."""
    algorithm = algorithms.build(TrainConfig(algorithm="dapo"))

    def paper(lp):
        total = 0
        for i, t in tokens():
            r = torch.exp(lp[i, t] - SAMPLER[i, t])
            total = total + torch.minimum(r * ADVANTAGES[i], clip(r, 1 - 0.2, 1 + 0.28) * ADVANTAGES[i])
        return -total / len(tokens())

    got = run_loss(algorithm, trainer_logprobs(RATIOS))
    assert_same(got, direct_gradient(paper, trainer_logprobs(RATIOS)))
    assert got[1][0, 0] != 0 and got[1][0, 1] == 0  # 1.25 still learns under clip-higher, 1.3 is clipped


def test_gspo_clips_the_length_normalised_sequence_ratio():
    """Zheng et al. 2025, eqs. (5)-(7): s_i = exp(mean_t log r_it), -1/N sum_i min(s_i A_i, clip(s_i, 1 - 3e-4,
    1 + 4e-4) A_i). Sequence ratios: row 0 at 1 + 3.5e-4 (A > 0: inside the upper clip), row 1 at 1 - 3.5e-4
    (A < 0: below the lower clip), row 2 at 1 + 5e-4 (A < 0: never clipped above)."""
    algorithm = algorithms.build(TrainConfig(algorithm="gspo"))
    ratios = [
        [math.exp(math.log(1 + 3.5e-4) * 3 - 2e-3 - 1e-3), math.exp(2e-3), math.exp(1e-3), 9.0],
        [1 - 3.5e-4, 2.0, 2.0, 2.0],
        [math.exp(4e-3), math.exp(-2e-3), 1.0, math.exp(4 * math.log(1 + 5e-4) - 2e-3)],
    ]

    def paper(lp):
        total = 0
        for i in range(3):
            n = int(MASK[i].sum())
            s = torch.exp(sum(lp[i, t] - SAMPLER[i, t] for t in range(n)) / n)
            total = total + torch.minimum(s * ADVANTAGES[i], clip(s, 1 - 3e-4, 1 + 4e-4) * ADVANTAGES[i])
        return -total / 3

    got = run_loss(algorithm, trainer_logprobs(ratios))
    assert_same(got, direct_gradient(paper, trainer_logprobs(ratios)))
    assert got[1][0].abs().sum() > 0 and got[1][1].abs().sum() == 0 and got[1][2].abs().sum() > 0


def test_cispo_weights_every_token_by_its_clipped_detached_ratio():
    """MiniMax 2025, eq. (4): -1/sum_i |o_i| sum_i sum_t sg(clip(r, 1 - eps_low, 1 + 0.28)) A log p, with no lower
    bound by default (eps_low 1): a token above the clip keeps its gradient, weighted 1.28."""
    algorithm = algorithms.build(TrainConfig(algorithm="cispo"))

    def paper(lp):
        total = 0
        for i, t in tokens():
            weight = clip(torch.exp(lp[i, t] - SAMPLER[i, t]).detach(), 0.0, 1 + 0.28)
            total = total + weight * ADVANTAGES[i] * lp[i, t]
        return -total / len(tokens())

    got = run_loss(algorithm, trainer_logprobs(RATIOS))
    assert_same(got, direct_gradient(paper, trainer_logprobs(RATIOS)))
    assert got[1][0, 1] == pytest.approx(-1.28 * 1.0 / len(tokens()), rel=1e-12)  # clipped weight, gradient kept


def test_the_default_is_prime_rls_loss_and_its_advantages():
    """grpo: prime-rl's default loss (``tests/algorithms/test_loss.py`` has its formula), on r - mean advantages."""
    cfg = TrainConfig()
    algorithm = algorithms.build(cfg)
    assert cfg.algorithm == "grpo" and algorithm.spec.prime_rl and algorithms.exportable("grpo")

    def paper(lp):
        total = 0
        for i, t in tokens():
            log_ratio = lp[i, t] - SAMPLER[i, t]
            diff = float((torch.exp(lp[i, t]) - torch.exp(SAMPLER[i, t])).detach())
            masked = diff > 0.2 if ADVANTAGES[i] > 0 else diff < -0.2
            total = total - (0 if masked else ADVANTAGES[i] * torch.exp(log_ratio)) + 1e-3 * log_ratio**2
        return total / len(tokens())

    assert_same(run_loss(algorithm, trainer_logprobs(RATIOS)), direct_gradient(paper, trainer_logprobs(RATIOS)))
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    assert algorithm.advantages(rewards).tolist() == [[0.75, -0.25, -0.25, -0.25]]


@pytest.mark.parametrize(
    "name, normalised", [("grpo", False), ("dr_grpo", False), ("dapo", True), ("gspo", True), ("cispo", True)]
)
def test_each_algorithm_takes_its_papers_advantage(name, normalised):
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0, 1.0]], dtype=torch.float64)
    centred = rewards - rewards.mean()
    want = centred / (rewards.std(unbiased=False) + 1e-6) if normalised else centred
    torch.testing.assert_close(algorithms.build(TrainConfig(algorithm=name)).advantages(rewards), want)


# ---- the seam: config, sampling, export ----


def test_every_algorithm_is_a_flag_with_its_own_section_and_a_bad_value_is_one_line(tmp_path, capsys):
    from scirl.commands.train import main
    from scirl.run.config_io import load_config, read_toml, validate, write_config

    assert set(algorithms.names()) == {"grpo", "dr_grpo", "dapo", "gspo", "cispo", "sdpo"}
    cfg = load_config(["--algorithm", "dapo", "--dapo.eps-high", "0.3", "--gspo.eps-low", "1e-4"])
    assert (cfg.algorithm, cfg.dapo.eps_high, cfg.gspo.eps_low) == ("dapo", 0.3, 1e-4)
    assert validate(read_toml(write_config(cfg, tmp_path / "config.toml"))) == cfg
    for flags, field in (
        (["--algorithm", "ppo"], "algorithm"),
        (["--dapo.eps-low", "-1"], "dapo.eps_low"),
        (["--algorithm", "dr_grpo", "--advantage.std-normalize", "true"], "std normalisation"),
    ):
        assert main([*flags, "--dry-run"]) == 2
        err = capsys.readouterr().err
        assert field in err and "Traceback" not in err and err.count("\n") == 1, err


def test_dapo_drops_a_group_whose_rewards_are_all_equal_whatever_the_filter_says():
    from scirl.inference.base import Completion
    from scirl.rollouts.contract import PromptedQuestion
    from scirl.rollouts.generate import score_groups
    from scirl.task.schema import Question

    q = Question(
        id="q1",
        question="Which?",
        labels=("A", "B", "C", "D"),
        options=("a", "b", "c", "d"),
        answer_key="A",
        domain="Physics",
    )
    item = PromptedQuestion(q, [1, 2, 3], "Which?")
    groups = [
        [Completion(text, [5, 6], [-0.1, -0.2], "stop") for text in texts]
        for texts in (["Answer: A", "Answer: B"], ["Answer: B", "Answer: C"])
    ]  # a mixed group, a flat one
    for name, dropped in (("dapo", [False, False, True, True]), ("grpo", [False, False, False, False])):
        cfg = TrainConfig(algorithm=name, group_size=2, batch_size=4, filters={"zero_advantage": {"enforce": False}})
        rollouts, samples = score_groups(1, [[item], [item]], groups, cfg.rollout_settings(), vocab_size=100)
        assert [r["dropped"] for r in rollouts] == dropped, name
        assert len(samples) == dropped.count(False)
        assert [r["filter"] for r in rollouts][2:] == ["zero_advantage"] * 2


class ScriptedGenerator:
    """Question ``i`` (prompt ids ``[i]``): odd ones answered B by every completion (a flat group), even ones A then
    B."""

    tokenizer = None

    def generate(self, prompts, params):
        from scirl.inference.base import Completion

        return [
            [
                Completion(text, [5], [-0.1], "stop")
                for text in (["Answer: B"] * params.n if p[0] % 2 else ["Answer: A", "Answer: B"][: params.n])
            ]
            for p in prompts
        ]


@pytest.mark.parametrize("rounds, kept_groups", [(3, [1, 3]), (1, [1])])
def test_dapo_refills_dropped_groups_from_the_next_questions_and_the_checkpoint_position_follows(rounds, kept_groups):
    """Questions 1 (flat) and 2 (mixed) drawn; refill: question 3 (flat) replaces 1, then question 4 (mixed)
    replaces 3, within ``refill_rounds``; every round's rollouts are logged and the data position is after them."""
    from scirl.distributed import Dist
    from scirl.rollouts.contract import PromptedQuestion
    from scirl.rollouts.sampler import QuestionSampler
    from scirl.rollouts.source import ColocatedSource
    from scirl.task.schema import Question

    questions = [
        PromptedQuestion(
            Question(
                id=f"q{i}", question="Which?", labels=("A", "B"), options=("a", "b"), answer_key="A", domain="Physics"
            ),
            [i],
            "Which?",
        )
        for i in range(8)
    ]
    sampler = QuestionSampler(8, seed=0)
    sampler.order = list(range(8))  # the questions in order: 0, 1, 2, ...
    sampler.take(1, questions)  # question 0 was an earlier step's
    cfg = TrainConfig(
        algorithm="dapo", group_size=2, batch_size=4, dapo={"dynamic_sampling": "refill", "refill_rounds": rounds}
    )
    batch = ColocatedSource(
        questions, sampler, ScriptedGenerator(), cfg.rollout_settings(), vocab_size=100, dist=Dist()
    ).next(1)
    drawn = 2 + (2 if rounds >= 2 else 1)
    assert sorted({r["question_id"] for r in batch.rollouts}) == [f"q{i}" for i in range(1, 1 + drawn)]
    assert sorted({s.group for s in batch.samples}) == kept_groups
    assert all(r["dropped"] == (int(r["question_id"][1:]) % 2 == 1) for r in batch.rollouts)
    assert batch.data_position == {"epoch": 0, "cursor": 1 + drawn}
    drop = TrainConfig(algorithm="dapo", group_size=2, batch_size=4)
    sampler = QuestionSampler(8, seed=0)
    sampler.order = list(range(8))
    sampler.take(1, questions)
    assert ColocatedSource(
        questions, sampler, ScriptedGenerator(), drop.rollout_settings(), vocab_size=100, dist=Dist()
    ).next(1).data_position == {"epoch": 0, "cursor": 3}


@pytest.mark.parametrize("name", ["dr_grpo", "dapo", "gspo", "cispo", "sdpo"])
def test_the_export_to_prime_rl_refuses_an_algorithm_it_has_no_counterpart_for_in_one_line(name, tmp_path, capsys):
    from scirl.commands.export import main

    assert main(["prime-rl", "--out", str(tmp_path / "out"), "--algorithm", name]) == 2
    err = capsys.readouterr().err
    assert f"algorithm {name!r} cannot be exported" in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


# ---- end to end ----


@pytest.mark.parametrize("name, lora", [("dr_grpo", False), ("dapo", False), ("gspo", False), ("cispo", True)])
def test_a_short_run_of_each_variant_trains_and_logs_its_loss(
    name,
    lora,
    letter_model_dir,
    data_file,
    tmp_path,  # noqa: F811
    one_thread,
):  # noqa: F811
    """Two steps of each variant (CISPO under LoRA): its section in config.toml, finite losses and weights."""
    if lora:
        pytest.importorskip("peft")
    run_dir = tmp_path / name
    extra = [
        "--algorithm",
        name,
        "--optim.lr",
        "2e-3",
        "--temperature",
        "1.2",
        *(["--lora.enabled", "true"] if lora else []),
    ]
    assert run_in_process(train_args(letter_model_dir, data_file, run_dir, max_steps=2, extra=extra)) == 0
    config = (run_dir / "config.toml").read_text()
    assert f'algorithm = "{name}"' in config and f"[{name}]" in config
    got = rows(run_dir)
    assert [m["step"] for m in got] == [1, 2]
    stepped = [m for m in got if "loss" in m]
    assert stepped and all(math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) for m in stepped)
    weights = final_weights(run_dir, 2)
    assert all(torch.isfinite(t).all() for t in weights.values())
    records = [json.loads(line) for line in (run_dir / "rollouts" / "step_1.jsonl").read_text().splitlines()]
    assert "teacher" not in records[0]
