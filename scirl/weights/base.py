"""The weight sink: where the trainer's new weights go after each optimizer step, and the one seam
between the training loop and its deployments (prime-rl's ``transports/weights/base.py``).

    sink.make_room()        before the train step: a sampler that shares the trainer's GPU gives it back
    sink.push(version)      after it: the sampler takes version ``version`` (the weights after that
                            step), checked when due; returns the check's metrics (or {})
    sink.close()

Every rank calls every method (a push gathers the full weights, a collective under FSDP). Three sinks:
``InProcessSink`` (an engine in this process), ``ServerSink`` with a ``FilesystemWeightSync`` or an
``NCCLWeightSync`` transport (vLLM servers).
"""

from __future__ import annotations

from typing import Protocol

# a push's bucket (``deployment.weight_bucket_mib``, ``scirl/weights/buckets.py``): vLLM's packed NCCL transfer's
# default buffer size
DEFAULT_BUCKET_MIB = 1024


class WeightSink(Protocol):
    def make_room(self) -> None: ...

    def push(self, version: int) -> dict: ...

    def close(self) -> None: ...
