"""Every weight push checked: the sampler holds the weights the trainer sent.

A push that goes wrong is otherwise silent: rollouts keep coming, from stale or broken weights,
and training only gets slowly worse (an adapter that never reached the engine, an engine woken from
sleep with its old weights, a tensor left out, weights rounded on the way). Three checks, cheapest
first:

1. **Version** (servers, every push; in the transports, ``scirl.weights.filesystem`` and ``.nccl``):
   every server reports the pushed version (``GET /weight_info``). vLLM 0.25 and 0.26 keep no weight version
   (no ``/weight_info``, no ``/update_weight_version``): for such servers the probe below runs after
   every push instead (``every_push``), which catches a push that did not arrive at bf16 only when the
   weights moved by more than the probe's tolerance.
2. **Probe** (``WeightCheck``; the first push, then every ``deployment.verify_interval`` versions):
   the trainer's own logprobs of a fixed sequence (a training prompt and a seeded completion) against
   each sampler's logprobs of the same tokens. The mean absolute difference over the completion's
   tokens must stay within the compute dtype's tolerance (``TOLERANCE``).
3. **Checksums** (with the probe, where the sampler offers them: vLLM's ``/weight_checker`` and its
   workers' ``compute_weight_checksums``, both from 0.32 on): a server's data-parallel replicas hold the
   same tensors, and the weights changed since the last check when the trainer's did. Before 0.32 vLLM
   offers neither: there the probe alone checks each replica.

The tolerances, measured on the demo model (``scirl/assets/demo-base``) with a 48-token probe:

- float32: vLLM (CPU) against transformers, same weights: mean 2e-6, largest 1e-5. Weights rounded to
  bf16 on the way (after one step at lr 5e-3) give a mean of 0.036; one MLP matrix left out of a push,
  0.79; every weight off by 1e-3 (one missed step at the demo's learning rate), 0.14. Tolerance 1e-3:
  hundreds of times the noise, far below any of these.
- bfloat16: two bf16 implementations of the same weights (vLLM's and transformers' kernels) differ
  by a mean of 0.02-0.04 (largest 0.08-0.17): rounding at every layer. Tolerance 0.1. In bf16 the
  probe catches gross errors only (garbage after a sleep, a wrong or missing tensor, a stale head);
  a push that is a few small optimizer steps stale hides in the rounding noise, and the version and
  checksum checks are what catch it.

A failed check ends the run with one line naming the sampler, the version and the difference.
"""

from __future__ import annotations

import random
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from scirl import distributed
from scirl.errors import TrainError

PROBE_COMPLETION_TOKENS = 48
PROBE_SEED = 0
# mean |trainer logprob - sampler logprob| over the probe's completion tokens (see the module docstring)
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.1}
REPLICA_PREFIX = re.compile(r"^dp\d+:")  # vLLM's checksum keys: dp<i>:pp<j>:pcp<k>:tp<l>:<tensor name>


@dataclass
class Replica:
    """One sampler that should hold the trainer's weights: a server, or an in-process engine."""

    name: str
    prompt_logprobs: Callable[[list[int]], list[float]]
    checksums: Callable[[], dict[str, str] | None] = lambda: None


def probe_sequence(prompt_ids: list[int], token_limit: int, room: int) -> tuple[list[int], int]:
    """A fixed sequence to score: ``prompt_ids`` and a completion of up to ``PROBE_COMPLETION_TOKENS``
    seeded token ids below ``token_limit``, within ``room`` tokens in all. Returns (ids, index of the
    first completion token). The same on every rank and every run."""
    length = max(1, min(PROBE_COMPLETION_TOKENS, room - len(prompt_ids)))
    rng = random.Random(PROBE_SEED)
    completion = [rng.randrange(token_limit) for _ in range(length)]
    return list(prompt_ids) + completion, len(prompt_ids)


class WeightCheck:
    """The probe and the checksums, run after a push when ``due``; every rank calls ``run`` (the
    trainer's forward is a collective under FSDP), each with the replicas it owns (servers: rank 0)."""

    def __init__(self, trainer, probe: tuple[list[int], int], *, interval: int):
        if trainer.dtype not in TOLERANCE:
            raise ValueError(f"no weight-check tolerance for {trainer.dtype}")
        self.trainer, self.interval = trainer, interval
        self.ids, self.start = probe
        self.tolerance = TOLERANCE[trainer.dtype]
        self.checked_once = False
        # every push, whatever the interval: set where a sampler cannot confirm a push's version itself
        self.every_push = False
        # replica name -> (version, the trainer's optimizer steps then, its checksums then)
        self.last_checksums: dict[str, tuple[int, int, dict[str, str]]] = {}

    def due(self, version: int) -> bool:
        return self.interval > 0 and (not self.checked_once or self.every_push or version % self.interval == 0)

    def run(self, version: int, replicas: list[Replica]) -> dict:
        """Check every replica against the trainer's weights of ``version``; the metrics on success, a
        ``TrainError`` (the same on every rank) on failure."""
        started = time.perf_counter()
        expected = self.trainer.sequence_logprobs(self.ids)[self.start - 1 :]
        problems, diffs = [], []
        for replica in replicas:
            got = replica.prompt_logprobs(self.ids)[self.start - 1 :]
            gaps = [abs(a - b) for a, b in zip(expected, got)]
            mean, largest = statistics.fmean(gaps), max(gaps)
            diffs.append((mean, largest))
            if not mean <= self.tolerance:  # NaN fails too
                dtype = str(self.trainer.dtype).removeprefix("torch.")
                problems.append(
                    f"{replica.name} does not hold the trainer's weights after the push of version "
                    f"{version}: logprobs of a fixed sequence differ by {mean:.3g} on average, {largest:.3g} "
                    f"at most (tolerance {self.tolerance:g} for {dtype})"
                )
                continue
            problem = self._check_checksums(replica, version)
            if problem:
                problems.append(problem)
        verdicts = distributed.gather_objects([(problems, diffs)], self.trainer.dist)
        problems = [p for ps, _ in verdicts for p in ps]
        diffs = [d for _, ds in verdicts for d in ds]
        self.checked_once = True
        if problems:
            raise TrainError(problems[0])
        metrics = {"time/weight_check": time.perf_counter() - started}
        if diffs:
            metrics["weight_check/logprob_diff"] = max(mean for mean, _ in diffs)
            metrics["weight_check/logprob_diff_max"] = max(largest for _, largest in diffs)
        return metrics

    def _check_checksums(self, replica: Replica, version: int) -> str | None:
        checksums = replica.checksums()
        if not checksums:
            return None
        by_tensor: dict[str, set[str]] = {}
        for key, digest in checksums.items():
            by_tensor.setdefault(REPLICA_PREFIX.sub("", key), set()).add(digest)
        split = sorted(name for name, digests in by_tensor.items() if len(digests) > 1)
        if split:
            return (
                f"{replica.name}: its data-parallel replicas hold different weights after the push of version "
                f"{version} ({len(split)} tensors differ, e.g. {split[0]})"
            )
        previous = self.last_checksums.get(replica.name)
        self.last_checksums[replica.name] = (version, self.trainer.updates, checksums)
        if previous is not None and previous[1] != self.trainer.updates and previous[2] == checksums:
            return (
                f"{replica.name} holds exactly the weights of version {previous[0]} after the push of version "
                f"{version}, although the trainer's changed in between: the push did not reach it"
            )
        return None
