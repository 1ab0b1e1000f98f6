"""Eval during training (``[eval] interval``): greedy accuracy on a fixed held-out subset in the step's
row, questions never trained on, training itself unchanged, the same subset after a resume."""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import pytest
import torch

from helpers.train_runs import (
    COMPUTED_KEYS,
    EXACT_KEYS,
    final_weights,
    rows,
    run_in_process,
    torchrun_train,
    train_args,
)
from scirl.errors import ConfigError
from scirl.eval import local
from scirl.run import eval_hook
from scirl.run.config_io import load_config
from scirl.task.schema import DOMAINS, Question

MAX_STEPS, INTERVAL, QUESTIONS = 3, 2, 6  # the data holds out 2 per domain: 8 questions, 6 evaluated
EVAL = ["--eval.interval", str(INTERVAL), "--eval.questions", str(QUESTIONS)]
EVALUATED_STEPS = [2, 3]  # every INTERVAL steps, and the last


def question(domain: str, i: int) -> Question:
    return Question(
        id=f"{domain}-{i}", question=f"q{i}", labels=("A", "B"), options=("x", "y"), answer_key="A", domain=domain
    )


# ---- config ----


def test_eval_is_off_by_default_and_its_keys_validate():
    cfg = load_config([])
    assert cfg.eval.interval is None and cfg.eval.questions == 200
    assert load_config(["--eval.interval", "0"]).eval.interval is None  # 0 is off too
    assert load_config(EVAL).eval.interval == INTERVAL
    for bad, field in (
        (["--eval.interval", "-1"], "eval.interval"),
        (["--eval.questions", "0"], "eval.questions"),
        (["--eval.intervall", "2"], "eval.intervall"),
    ):
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            load_config(bad)
    # the held-out split must exist and must not be what trains
    with pytest.raises(ConfigError, match="data.split"):
        load_config([*EVAL, "--data.split", "eval"])
    with pytest.raises(ConfigError, match="eval_per_domain = 0"):
        load_config([*EVAL, "--data.eval-per-domain", "0"])
    load_config(["--data.split", "eval", "--data.eval-per-domain", "0"])  # fine with eval off


def test_a_bad_eval_value_is_a_one_line_usage_error(capsys):
    from scirl.commands.train import main

    assert main(["--eval.questions", "0", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert "eval.questions" in err and "\n" not in err


# ---- which questions ----


def test_the_subset_is_seeded_balanced_and_independent_of_the_split_order():
    held_out = [question(d, i) for d in DOMAINS for i in range(10)]
    chosen = eval_hook.eval_subset(held_out, 12, seed=7)
    assert len(chosen) == 12 and len({q.id for q in chosen}) == 12
    assert all(sum(q.domain == d for q in chosen) == 3 for d in DOMAINS)  # balanced across domains
    shuffled = held_out[:]
    random.Random(0).shuffle(shuffled)
    assert eval_hook.eval_subset(shuffled, 12, seed=7) == chosen
    assert eval_hook.eval_subset(held_out, 12, seed=8) != chosen
    assert eval_hook.eval_subset(held_out, 5, seed=7) == chosen[:5]  # fewer questions: a prefix
    assert len(eval_hook.eval_subset(held_out, 500, seed=7)) == 40  # more than there are: all of them
    # a question that does not fit is passed over, and the next one in the order takes its place
    skip = chosen[0].id
    refit = eval_hook.eval_subset(held_out, 12, seed=7, fits=lambda q: q.id != skip)
    assert skip not in {q.id for q in refit} and refit[:11] == chosen[1:]


def test_the_step_line_shows_the_eval_accuracy():
    from scirl.run.metrics import step_line

    row = {
        "step": 4,
        "time/step": 1.0,
        "reward/mean": 0.5,
        "trainable/count": 8,
        "trainable/total": 16,
        "trainable/fraction": 0.5,
        "tokens_per_s": 100.0,
    }
    assert "Eval" not in step_line(row)
    assert "| Eval 61.5% |" in step_line({**row, "eval/accuracy": 0.615})


class DrawingGenerator:
    """Answers "A" to everything, and draws from every global RNG while it does, as an engine might."""

    def __init__(self, tokenizer):
        self.tokenizer, self.params, self.cache_resets = tokenizer, [], 0

    def reset_prefix_cache(self):
        self.cache_resets += 1

    def generate(self, prompts, params):
        import numpy as np

        from scirl.inference.base import Completion

        self.params.append(params)
        random.random(), np.random.rand(), torch.rand(3)
        return [[Completion("A", [1], [0.0], "stop")] for _ in prompts]


def test_an_eval_scores_greedy_answers_and_leaves_every_global_rng_as_it_was(tiny_model_dir):
    import numpy as np
    from transformers import AutoTokenizer

    from scirl.distributed import Dist

    questions = [question(d, i) for d in DOMAINS for i in range(2)]
    questions = [q if i % 2 else Question(**{**q.__dict__, "answer_key": "B"}) for i, q in enumerate(questions)]
    generator = DrawingGenerator(AutoTokenizer.from_pretrained(tiny_model_dir))
    evaluate = eval_hook.TrainingEval(
        questions, generator, Dist(), interval=3, last_step=7, max_tokens=5, seed=1, colocated=True
    )
    before = random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state()
    assert [step for step in range(1, 8) if evaluate(step)] == [3, 6, 7]
    assert (random.getstate(), torch.get_rng_state().tolist()) == (before[0], before[2].tolist())
    assert (np.random.get_state()[1] == before[1]).all()
    assert all(p.temperature == 0 and p.n == 1 and p.max_tokens == 5 for p in generator.params)
    assert generator.cache_resets == 3  # the next step prefills as if no eval had run
    m = evaluate(3)
    assert m["eval/accuracy"] == 0.5 and m["eval/parse_rate"] == 1.0 and m["eval/questions"] == 8
    assert all(m[f"eval/accuracy/{d}"] == 0.5 for d in DOMAINS)
    assert not eval_hook.TrainingEval(
        questions, generator, Dist(), interval=None, last_step=7, max_tokens=5, seed=1, colocated=True
    )(7)  # eval off


# ---- a run ----


@pytest.fixture(scope="module")
def spy():
    """Records the eval subset each run picks and the questions each eval asks."""
    seen: dict[str, list] = {"subsets": [], "asked": []}
    patch = pytest.MonkeyPatch()
    pick, ask = eval_hook.eval_subset, eval_hook.evaluate_generator

    def eval_subset(*args, **kwargs):
        chosen = pick(*args, **kwargs)
        seen["subsets"].append([q.id for q in chosen])
        return chosen

    def evaluate_generator(generator, questions, **kwargs):
        seen["asked"].append([q.id for q in questions])
        return ask(generator, questions, **kwargs)

    patch.setattr(eval_hook, "eval_subset", eval_subset)
    patch.setattr(eval_hook, "evaluate_generator", evaluate_generator)
    yield seen
    patch.undo()


@pytest.fixture(scope="module")
def runs(letter_model_dir, data_file, tmp_path_factory, spy):
    """The same 3 steps with eval off and on (checkpoints 2 and 3), in one thread for identical float results."""
    root = tmp_path_factory.mktemp("eval_runs")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name, extra in (("off", []), ("on", EVAL)):
            assert run_in_process(train_args(letter_model_dir, data_file, root / name, MAX_STEPS, extra)) == 0
    finally:
        torch.set_num_threads(threads)
    return {"off": root / "off", "on": root / "on", "subset": spy["subsets"][0], "asked": list(spy["asked"])}


@pytest.mark.slow
def test_eval_rows_every_interval_and_at_the_last_step(runs):
    metrics = rows(runs["on"])
    assert [m["step"] for m in metrics] == list(range(1, MAX_STEPS + 1))  # still one row per step
    for m in metrics:
        keys = {k for k in m if k.startswith("eval/")}
        if m["step"] not in EVALUATED_STEPS:
            assert not keys and "time/eval" not in m
            continue
        assert {"eval/accuracy", "eval/accuracy_strict", "eval/parse_rate", "eval/questions"} <= keys
        assert m["eval/questions"] == QUESTIONS
        domains = {k.split("/", 2)[2] for k in keys if k.startswith("eval/accuracy/")}
        assert domains and domains <= set(DOMAINS)
        for key in keys - {"eval/questions"}:
            assert 0.0 <= m[key] <= 1.0, key
        assert m["time/eval"] >= 0 and m["time/step"] >= m["time/eval"]
    # the last eval measured the last step's weights as `scirl eval` would: the same numbers from the checkpoint
    from scirl.run.backends import hf_generator
    from scirl.task.data import load_splits

    cfg = load_config(["@", str(runs["on"] / "config.toml")])
    held_out = {
        q.id: q
        for q in load_splits(
            cfg.data.source,
            eval_per_domain=cfg.data.eval_per_domain,
            split_method=cfg.data.split_method,
            seed=cfg.data.split_seed,
        ).split("eval")
    }
    generator = hf_generator(str(runs["on"] / "weights" / f"step_{MAX_STEPS}"), device="cpu", dtype="float32")
    results = local.evaluate_generator(
        generator, [held_out[i] for i in runs["subset"]], max_tokens=cfg.max_completion_tokens
    )
    assert metrics[-1]["eval/accuracy"] == results["overall_accuracy"]
    assert metrics[-1]["eval/parse_rate"] == 1 - results["unparsed_rate"]
    log = (runs["on"] / "logs" / "train.log").read_text()
    evaluated = [int(re.search(r"Step (\d+)/\d+ \|", line)[1]) for line in log.splitlines() if "| Eval " in line]
    assert evaluated == EVALUATED_STEPS


@pytest.mark.slow
def test_eval_does_not_change_training(runs):
    off, on = rows(runs["off"]), rows(runs["on"])
    assert [m["step"] for m in on] == [m["step"] for m in off]
    for want, have in zip(off, on):  # one process, one thread: bit for bit
        for key in (*EXACT_KEYS, *COMPUTED_KEYS, "parse_rate/strict", "trainable/fraction"):
            assert have.get(key) == want.get(key), (want["step"], key)
    for step in range(1, MAX_STEPS + 1):  # the same completions sampled
        assert (runs["on"] / "rollouts" / f"step_{step}.jsonl").read_text() == (
            runs["off"] / "rollouts" / f"step_{step}.jsonl"
        ).read_text()
    w_off, w_on = final_weights(runs["off"], MAX_STEPS), final_weights(runs["on"], MAX_STEPS)
    assert w_off.keys() == w_on.keys() and all(torch.equal(w_on[k], w_off[k]) for k in w_off)


@pytest.mark.slow
def test_eval_questions_are_held_out_and_never_in_a_training_batch(runs, letter_model_dir, data_file):
    subset = runs["subset"]
    assert len(subset) == QUESTIONS
    assert runs["asked"] == [subset] * len(EVALUATED_STEPS)  # the same questions at every eval
    from scirl.task.data import load_splits

    cfg = load_config(["@", str(runs["on"] / "config.toml")])
    splits = load_splits(
        cfg.data.source,
        eval_per_domain=cfg.data.eval_per_domain,
        split_method=cfg.data.split_method,
        seed=cfg.data.split_seed,
    )
    assert set(subset) <= {q.id for q in splits.split("eval")}
    trained = {
        json.loads(line)["question_id"]
        for step in range(1, MAX_STEPS + 1)
        for line in (runs["on"] / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()
    }
    assert trained and not trained & set(subset)


@pytest.mark.slow
def test_a_resumed_run_evaluates_the_same_subset_and_gets_the_same_numbers(runs, tmp_path, spy):
    run_dir = Path(shutil.copytree(runs["on"], tmp_path / "run"))
    shutil.rmtree(run_dir / "weights" / f"step_{MAX_STEPS}")  # as if stopped after checkpoint 2
    before = len(spy["subsets"]), len(spy["asked"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert run_in_process(["@", str(run_dir / "config.toml"), "--output-dir", str(run_dir)], resume=True) == 0
    finally:
        torch.set_num_threads(threads)
    assert spy["subsets"][before[0] :] == [runs["subset"]]
    assert spy["asked"][before[1] :] == [runs["subset"]]  # step 3's eval, on the same questions
    want, have = rows(runs["on"]), rows(run_dir)
    assert [m["step"] for m in have] == [m["step"] for m in want]
    for w, h in zip(want, have):
        assert {k: v for k, v in h.items() if k.startswith("eval/")} == {
            k: v for k, v in w.items() if k.startswith("eval/")
        }
        for key in (*EXACT_KEYS, *COMPUTED_KEYS):
            assert h.get(key) == w.get(key), (w["step"], key)


@pytest.mark.slow
def test_two_ranks_split_the_eval_questions_and_rank_0_logs_them_all(letter_model_dir, data_file, tmp_path):
    """Colocated multi-rank: each rank answers its share, the records are gathered, no collective left unmatched."""
    run_dir = tmp_path / "ddp"
    argv = train_args(
        letter_model_dir, data_file, run_dir, max_steps=2, extra=["--eval.interval", "1", "--eval.questions", "5"]
    )
    torchrun_train(argv)
    metrics = rows(run_dir)
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["eval/questions"] == 5 and 0 <= m["eval/accuracy"] <= 1 for m in metrics)
