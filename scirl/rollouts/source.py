"""Where a step's batch comes from: one call, ``source.next(step) -> RolloutBatch``, in either deployment.

- ``ColocatedSource``: every rank draws the step's questions (the same seeded order everywhere), takes
  its share and generates them with its own in-process generator, synchronously.
- ``ServerSource``: rank 0's ``Orchestrator`` thread makes the batches on vLLM servers, up to
  ``max_async_level`` steps ahead; rank 0 hands each one to every rank, and rank r keeps the groups
  ``g`` with ``g % world_size == r`` (rank 0 also keeps the rollout records, which it writes).

The trainer's half (``scirl.run.train.learn``) never knows which one made its batch.
"""

from __future__ import annotations

import time
from dataclasses import replace

from scirl import distributed
from scirl.rollouts.contract import PromptedQuestion, RolloutBatch, RolloutSettings
from scirl.rollouts.generate import generate_batch
from scirl.rollouts.orchestrator import Orchestrator
from scirl.rollouts.sampler import QuestionSampler


class ColocatedSource:
    """This rank's share of each step, generated here and now by ``generator``."""

    def __init__(
        self,
        questions: list[PromptedQuestion],
        sampler: QuestionSampler,
        generator,
        settings: RolloutSettings,
        *,
        vocab_size: int,
        dist: distributed.Dist,
    ):
        self.questions, self.sampler, self.generator = questions, sampler, generator
        self.settings, self.vocab_size, self.dist = settings, vocab_size, dist

    def next(self, step: int) -> RolloutBatch:
        picked = self.sampler.take(self.settings.questions_per_step, self.questions)
        # refilling dropped groups draws more questions: one rank only (``run.setup`` refuses it on several)
        draw = (lambda k: self.sampler.take(k, self.questions)) if self.dist.world_size == 1 else None
        batch = generate_batch(
            step,
            picked[self.dist.rank :: self.dist.world_size],
            self.generator,
            self.settings,
            vocab_size=self.vocab_size,
            rank=self.dist.rank,
            draw=draw,
        )
        return replace(batch, data_position=self.sampler.state())  # after any refill's questions

    def close(self) -> None:
        """Nothing of its own: the generator is the run's (the weight sink and the eval use it too)."""


class ServerSource:
    """Batches made by the orchestrator on rank 0 (``orchestrator``: None on the other ranks)."""

    def __init__(self, orchestrator: Orchestrator | None, dist: distributed.Dist):
        self.orchestrator, self.dist = orchestrator, dist

    def next(self, step: int) -> RolloutBatch:
        started = time.perf_counter()
        batch = self.orchestrator.next_batch(step) if self.dist.is_main else None
        batch = distributed.broadcast_object(batch, self.dist)
        samples = [s for s in batch.samples if s.group % self.dist.world_size == self.dist.rank]
        return replace(
            batch,
            samples=samples,
            rollouts=batch.rollouts if self.dist.is_main else [],
            time_waited=time.perf_counter() - started,
        )

    def between_batches(self, version: int, push) -> None:
        """Run ``push()`` (version ``version`` to the servers) while no batch is being generated (rank 0;
        the others only join the push's collectives)."""
        if self.orchestrator is None:
            push()
        else:
            self.orchestrator.push_weights(version, push)

    def close(self) -> None:
        if self.orchestrator is not None:
            self.orchestrator.stop()
