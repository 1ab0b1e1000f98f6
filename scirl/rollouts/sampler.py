"""The data order: questions in a seeded permutation, reshuffled each epoch. ``(epoch, cursor)`` is
the whole state a checkpoint saves, so a resumed run draws exactly the questions it would have."""

from __future__ import annotations

import random
from dataclasses import replace

from scirl.rollouts.contract import PromptedQuestion


class QuestionSampler:
    """Questions in a seeded order, reshuffled each epoch; ``(epoch, cursor)`` is the whole state."""

    def __init__(self, n_questions: int, seed: int, epoch: int = 0, cursor: int = 0):
        if n_questions < 1:
            raise ValueError("no training questions to sample from")
        self.n, self.seed, self.epoch, self.cursor = n_questions, seed, epoch, cursor
        self.order = self._permutation(epoch)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(self.n))
        random.Random(f"{self.seed}-{epoch}").shuffle(order)
        return order

    def next(self, k: int) -> list[int]:
        return [index for index, _ in self._draw(k)]

    def take(self, k: int, questions: list[PromptedQuestion]) -> list[PromptedQuestion]:
        """The next ``k`` of ``questions``, each tagged with the epoch it was drawn in (a batch can
        straddle two): its option order under ``shuffle_options = "epoch"``."""
        return [replace(questions[index], epoch=epoch) for index, epoch in self._draw(k)]

    def _draw(self, k: int) -> list[tuple[int, int]]:
        picked = []
        while len(picked) < k:
            if self.cursor == self.n:
                self.epoch, self.cursor = self.epoch + 1, 0
                self.order = self._permutation(self.epoch)
            picked.append((self.order[self.cursor], self.epoch))
            self.cursor += 1
        return picked

    def state(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}
