"""The orchestrator of a disaggregated run: rollout batches from vLLM servers, up to ``max_async_level``
steps ahead of the trainer.

It runs as a thread of trainer rank 0 (no GPU, no model: it samples questions, sends token-id prompts
over HTTP, scores the completions, computes advantages and filters), so a rollout batch reaches the
trainer as an object in memory: there is no transport that can fail silently, and a crash of either
ends the same process. Its contract with the trainer is ``rollouts.RolloutBatch``; with the servers,
``inference.remote``.

Policy versions. Version ``v`` is the weights after optimizer step ``v`` (0: the run's start). Step
``n`` trains version ``n-1`` into ``n``. The batch for step ``n`` may be sampled by any version
``>= n - 1 - max_async_level``:

- ``max_async_level = 0``: batch ``n`` waits for version ``n-1``: the synchronous loop;
- ``max_async_level = 1`` (default): batch ``n+1`` is sampled by version ``n-1`` while step ``n`` trains,
  so generation and training overlap; each sample's lag (``n - 1 - version``) is logged, and the loss's
  importance ratio against the sampling logprobs corrects for it.

New weights reach the servers only between two batches (``push_weights`` waits for the batch being
generated), so every batch comes from exactly one version. Every wait is bounded: generation requests
and weight reloads have their deadlines in the server client, and ``next_batch`` gives up once the
thread has failed or stopped.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import replace

from scirl.errors import TrainError
from scirl.rollouts.contract import PromptedQuestion, RolloutBatch, RolloutSettings
from scirl.rollouts.generate import generate_batch
from scirl.rollouts.sampler import QuestionSampler

log = logging.getLogger("scirl.rollouts.orchestrator")

POLL_S = 1.0  # how often a waiting side rechecks whether the other one died


class Orchestrator:
    """Produces ``RolloutBatch``es for steps ``start_step + 1 .. max_steps`` in a background thread."""

    def __init__(
        self,
        questions: list[PromptedQuestion],
        generator,
        settings: RolloutSettings,
        *,
        vocab_size: int,
        start_step: int,
        last_step: int,
        position: dict,
        max_async_level: int,
    ):
        self.questions, self.generator, self.settings = questions, generator, settings
        self.vocab_size, self.max_async_level = vocab_size, max_async_level
        self.sampler = QuestionSampler(
            len(questions), settings.seed, epoch=position.get("epoch", 0), cursor=position.get("cursor", 0)
        )
        self.next_step, self.last_step = start_step + 1, last_step
        self.version = start_step  # the weights the servers hold
        self._batches: dict[int, RolloutBatch] = {}
        self._changed = threading.Condition()
        self._servers_busy = threading.Lock()  # held while a batch is generated: weights change between batches only
        self._error: BaseException | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="scirl-orchestrator", daemon=True)

    # ---- the trainer's side ----

    def start(self) -> Orchestrator:
        self._thread.start()
        return self

    def next_batch(self, step: int) -> RolloutBatch:
        """Step ``step``'s batch, once generated; raises what stopped the orchestrator."""
        with self._changed:
            while step not in self._batches:
                self._raise_if_failed()
                if not self._thread.is_alive():
                    raise TrainError(f"the orchestrator stopped before step {step}'s batch")
                self._changed.wait(POLL_S)
            return self._batches.pop(step)

    def push_weights(self, version: int, push: Callable[[], None]) -> None:
        """Run ``push()`` (weights of ``version`` to every server) between two batches, then let the
        batches that wait for this version go."""
        self._raise_if_failed()
        with self._servers_busy:
            self._raise_if_failed()  # the batch it waited for failed: the servers may be gone
            push()
        with self._changed:
            self.version = version
            self._changed.notify_all()

    def stop(self) -> None:
        with self._changed:
            self._stopping = True
            self._changed.notify_all()
        # a batch in flight ends within the request deadline; a daemon thread never holds up the exit
        self._thread.join(timeout=POLL_S)

    # ---- the thread ----

    def _run(self) -> None:
        try:
            while self.next_step <= self.last_step:
                step = self.next_step
                if not self._wait_for_version(step - 1 - self.max_async_level):
                    return
                with self._servers_busy:
                    version = self.version
                    picked = self.sampler.take(self.settings.questions_per_step, self.questions)
                    batch = generate_batch(
                        step,
                        picked,
                        self.generator,
                        self.settings,
                        vocab_size=self.vocab_size,
                        policy_version=version,
                        draw=lambda k: self.sampler.take(k, self.questions),
                    )
                    batch = replace(batch, data_position=self.sampler.state())  # after any refill's questions
                with self._changed:
                    self._batches[step] = batch
                    self.next_step = step + 1
                    self._changed.notify_all()
        except BaseException as exc:  # noqa: BLE001 - handed to the trainer, which reports and stops
            log.error("orchestrator failed: %s", exc)
            with self._changed:
                self._error = exc
                self._changed.notify_all()

    def _wait_for_version(self, needed: int) -> bool:
        with self._changed:
            while self.version < needed and not self._stopping:
                self._changed.wait(POLL_S)
            return not self._stopping

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            if isinstance(self._error, TrainError):
                raise self._error
            raise TrainError(f"generation failed: {self._error}") from self._error
