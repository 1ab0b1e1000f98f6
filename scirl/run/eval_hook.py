"""Eval during training: every ``eval.interval`` steps and at the last, the policy's greedy accuracy on a fixed
subset of the held-out split, in that step's ``metrics.jsonl`` row.

Which questions (``eval_subset``): the first ``eval.questions`` of the held-out split, each domain's sorted by a
hash of (``data.split_seed``, id), the domains interleaved. The holdout's own seed, not the training seed, so the
subset is balanced across domains and the same after any resume and in every run on the same data (their curves
compare); a smaller ``eval.questions`` takes a prefix of a larger one. A question too long for ``seq_len`` is
passed over, as training passes it over.

How: ``scirl.eval.local.evaluate_generator`` through the rollouts' generator (the step's new weights), greedy:
``scirl eval``'s prompts, extraction and scoring, so ``eval/accuracy`` is that command's ``overall_accuracy`` and
``eval/accuracy_strict`` the training reward's parser.

Where: colocated, each rank answers its share and the records are gathered (every rank generates, as in a step,
so engines in lockstep stay in step). With servers, rank 0 alone evaluates and the others go on to the next
step, whose first collective waits for it; its client then takes the orchestrator thread's calls concurrently.
Either way a collective is called by every rank or by none.

Training is untouched: no data position moves and the RNG states are restored after the eval (an engine may
draw from them), so a resumed run trains bit for bit as an uninterrupted one, eval on or off.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from itertools import zip_longest

from scirl import distributed
from scirl.errors import TrainError
from scirl.eval.local import evaluate_generator
from scirl.eval.stats import summarize
from scirl.inference.base import encode_messages
from scirl.run.checkpoint import capture_rng_state, restore_rng_state
from scirl.task.data import stable_hash
from scirl.task.prompt import build_messages
from scirl.task.schema import Question


def eval_subset(
    questions: list[Question], n: int, seed: int, fits: Callable[[Question], bool] = lambda q: True
) -> list[Question]:
    """The first ``n`` questions ``fits`` accepts in the seeded, domain-interleaved order, which depends on the ids,
    domains and ``seed``, never on the order of ``questions``."""
    by_domain: dict[str, list[Question]] = defaultdict(list)
    for q in questions:
        by_domain[q.domain].append(q)
    columns = [
        sorted(by_domain[d], key=lambda q: stable_hash(seed, f"eval-subset\x00{q.id}")) for d in sorted(by_domain)
    ]
    chosen: list[Question] = []
    for q in (q for row in zip_longest(*columns) for q in row if q is not None):
        if len(chosen) == n:
            break
        if fits(q):
            chosen.append(q)
    return chosen


def eval_metrics(records: list[dict], seconds: float) -> dict:
    """The ``eval/*`` keys of a metrics row, from scored eval records (``scirl.eval.results``)."""
    summary = summarize(records, n_samples=1)
    m = {"eval/accuracy": summary["overall_accuracy"], "eval/accuracy_strict": summary["strict_accuracy"]}
    for domain, accuracy in summary["per_domain_accuracy"].items():
        m[f"eval/accuracy/{domain}"] = accuracy
    m["eval/parse_rate"] = 1 - summary["unparsed_rate"]
    m["eval/questions"] = len(records)
    m["time/eval"] = seconds
    return m


class TrainingEval:
    """``evaluate(step)``: the ``eval/*`` metrics on rank 0 when an eval is due after ``step``, else ``{}``; every
    rank calls it after every step. ``colocated``: every rank holds a generator (else rank 0 alone, a client)."""

    def __init__(
        self,
        questions: list[Question],
        generator,
        dist,
        *,
        interval: int | None,
        last_step: int,
        max_tokens: int,
        seed: int,
        colocated: bool,
    ):
        self.questions, self.generator, self.dist = questions, generator, dist
        self.interval, self.last_step, self.max_tokens, self.seed = interval, last_step, max_tokens, seed
        self.colocated = colocated

    def due(self, step: int) -> bool:
        if not self.interval:
            return False
        return step % self.interval == 0 or step == self.last_step

    def __call__(self, step: int) -> dict:
        if not self.due(step) or not (self.colocated or self.dist.is_main):
            return {}

        started = time.perf_counter()
        mine = self.questions[self.dist.rank :: self.dist.world_size] if self.colocated else self.questions
        rng = capture_rng_state()
        try:
            # one call: the generator batches by its own memory bounds
            records = (
                evaluate_generator(
                    self.generator,
                    mine,
                    temperature=0.0,
                    max_tokens=self.max_tokens,
                    seed=self.seed,
                    batch_size=len(mine),
                )["records"]
                if mine
                else []
            )
        finally:
            restore_rng_state(rng)
        if self.colocated and mine and hasattr(self.generator, "reset_prefix_cache"):
            # an in-process vLLM engine starts each step with an empty prefix cache (the weight update resets it):
            # the eval prompts' cached K/V would change how the next step prefills
            self.generator.reset_prefix_cache()
        if self.colocated:
            records = distributed.gather_objects(records, self.dist)
        return eval_metrics(records, time.perf_counter() - started) if self.dist.is_main else {}


def training_eval(cfg, splits, tokenizer, generator, dist, *, colocated: bool, say) -> TrainingEval:
    """The run's ``TrainingEval`` (one that never evaluates when ``eval.interval`` is off)."""
    chosen: list[Question] = []
    if cfg.eval.interval:
        held_out = splits.split("eval")

        def fits(q: Question) -> bool:
            return len(encode_messages(tokenizer, build_messages(q))) + cfg.max_completion_tokens <= cfg.seq_len

        chosen = eval_subset(held_out, cfg.eval.questions, cfg.data.split_seed, fits)
        if not chosen:
            raise TrainError(
                f"eval.interval is set but none of the {len(held_out)} held-out questions can be evaluated "
                f"(none held out, or every prompt + max_completion_tokens exceeds seq_len {cfg.seq_len})"
            )
        short = (
            f" (of {cfg.eval.questions} asked: every held-out question that fits seq_len)"
            if len(chosen) < cfg.eval.questions
            else ""
        )
        say(
            f"Eval: {len(chosen)} held-out questions{short}, greedy, every {cfg.eval.interval} steps and at the last; "
            f"the subset is seeded by data.split_seed ({cfg.data.split_seed})"
        )
    return TrainingEval(
        chosen,
        generator,
        dist,
        interval=cfg.eval.interval,
        last_step=cfg.max_steps,
        max_tokens=cfg.max_completion_tokens,
        seed=cfg.seed,
        colocated=colocated,
    )
