"""Weights to a sampler in this process: a vLLM engine (loaded in place, its prefix cache reset; on one
GPU it sleeps during the train step and wakes for the push), or a per-rank transformers copy under
FSDP. A sampler that shares the trainer's very module needs no push: the optimizer step is its update.

The engine reads the trainer's full weights as a stream, each tensor gathered (in the compute dtype) when
vLLM's reload asks for it and dropped once loaded: a push holds one tensor beyond the model, plus what vLLM's
layer-wise reload keeps until a layer is complete (a part of one decoder layer), less than one bucket of a
server push. A transformers copy takes them as one dict (its ``load_state_dict``)."""

from __future__ import annotations

from scirl.inference.base import Generator
from scirl.weights.check import Replica, WeightCheck


class InProcessSink:
    def __init__(self, generator: Generator, trainer, check: WeightCheck):
        self.generator, self.trainer, self.check = generator, trainer, check

    def make_room(self) -> None:
        self.generator.sleep()  # a no-op for engines that hold no GPU memory of their own; the push wakes it

    def push(self, version: int) -> dict:
        if not self.generator.needs_weight_updates:
            return {}
        # read as the engine loads them, a tensor gathered at a time: nothing is held but what it holds
        self.refresh()
        if not self.check.due(version):
            return {}
        return self.check.run(version, [self.replica()])

    def refresh(self) -> None:
        """The trainer's weights to the sampler now, unchecked: a resumed run's sampler was loaded from the
        checkpoint's serving weights, in the model's dtype, and must sample from the trainer's own (float32 where it
        computes in float32)."""
        trainer = self.trainer
        if self.generator.needs_weight_updates:
            self.generator.update_weights(trainer.full_weights(device=trainer.device, dtype=trainer.dtype))

    def replica(self) -> Replica:
        dist, checksums = self.trainer.dist, getattr(self.generator, "weight_checksums", None)
        kind = "vLLM engine" if checksums is not None else "transformers copy"
        name = f"the in-process {kind}" + (f" of rank {dist.rank}" if dist.world_size > 1 else "")
        return Replica(name, self.generator.prompt_logprobs, checksums or (lambda: None))

    def close(self) -> None:
        """The generator is the run's: it closes it."""
