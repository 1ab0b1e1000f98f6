"""Pushes in buckets (``scirl/weights/buckets.py``, ``scirl/trainer/full_weights.py``): the trainer's full
weights gathered a tensor at a time in the wire dtype, cut into buckets as vLLM cuts them, each sent and
dropped before the next is gathered; and the bounded wait of the ranks that join a push.

What a push holds is measured by tracking every tensor created while it runs (``tests/helpers/live_tensors.py``),
never RSS or timings. The NCCL push against vLLM's own receiver is in ``test_vllm_server_fakes.py``; the
filesystem push to a real vLLM server in ``test_train_servers.py`` and ``test_vllm_server.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers.live_tensors import LiveTensors, bucket_bound
from scirl import algorithms
from scirl.distributed import Dist
from scirl.weights.buckets import LARGEST_FIRST, plan_buckets, spec_bytes

TESTS = Path(__file__).parents[1]


def specs(*sizes: int) -> list:
    return [(f"t{i}", (size,), torch.uint8) for i, size in enumerate(sizes)]


def test_buckets_close_once_they_hold_more_than_the_bucket_size():
    """vLLM's packed receiver cuts its buffers this way: in order, a buffer received once it holds more than its
    size (so a tensor larger than a bucket is a bucket of its own when it comes first)."""
    plan = plan_buckets(specs(3, 4, 2, 10, 1, 1, 1), bucket_bytes=5)
    assert [[spec_bytes(s) for s in bucket] for bucket in plan] == [[3, 4], [2, 10], [1, 1, 1]]
    assert plan_buckets(specs(6, 1), bucket_bytes=5) == [specs(6, 1)[:1], specs(6, 1)[1:]]
    assert plan_buckets([], bucket_bytes=5) == []


def bf16_trainer(model_dir):
    """One process, bf16 compute on a CPU: a push casts every float32 master (a tensor it creates)."""
    from scirl.run.config import TrainConfig
    from scirl.trainer import Trainer
    from scirl.trainer.model import load_model

    model = load_model(str(model_dir), torch.device("cpu"), Dist(), torch.float32)
    cfg = TrainConfig()
    return Trainer(
        model,
        cfg.optim,
        algorithms.build(cfg),
        temperature=1.0,
        device=torch.device("cpu"),
        dist=Dist(),
        dtype=torch.bfloat16,
    )


def test_full_weights_are_the_state_dict_in_the_wire_dtype_largest_first_on_request(tiny_model_dir):
    trainer = bf16_trainer(tiny_model_dir)
    state = trainer.model.state_dict()
    weights = trainer.full_weights(device="cpu", dtype=torch.bfloat16, first=LARGEST_FIRST)
    assert [name for name, _, _ in weights.specs[:2]] == list(LARGEST_FIRST)
    assert sorted(name for name, _, _ in weights.specs) == sorted(state)
    for (name, tensor), (spec_name, shape, dtype) in zip(weights, weights.specs):
        assert name == spec_name and tuple(tensor.shape) == shape and tensor.dtype == dtype == torch.bfloat16
        assert torch.equal(tensor, state[name].to(torch.bfloat16)), name
    # a checkpoint's: the float32 masters, all of them
    assert all(torch.equal(t, state[n]) and t.dtype == torch.float32 for n, t in trainer.full_state_dict().items())


class Tracked:
    """A declared stream whose tensors are tracked as they are gathered (only those: the engine's own reload
    buffers are the engine's, whatever feeds it), however long their reader keeps them."""

    def __init__(self, weights, live: LiveTensors):
        self.weights, self.live, self.specs = weights, live, weights.specs

    def __iter__(self):
        pairs = iter(self.weights)
        while True:
            with self.live:
                pair = next(pairs, None)
            if pair is None:
                return
            yield pair
            del pair


@pytest.mark.slow
def test_the_in_process_engine_takes_todays_weights_reading_them_as_it_loads(tiny_model_dir, monkeypatch):
    """vLLM's CPU engine, pushed to through the sink: it holds exactly what the whole-model push gave it
    (vLLM's checksums of every tensor), while the push never has more than the largest tensor and one decoder
    layer gathered (what vLLM's reload keeps until a layer is complete); the whole-model push had all of it."""
    from scirl.inference import vllm as adapter
    from scirl.weights.check import WeightCheck
    from scirl.weights.inprocess import InProcessSink

    try:
        adapter.import_vllm()
    except ImportError as exc:
        pytest.skip(f"vLLM is not installed: {exc}")
    torch.set_num_threads(1)  # before the engine: afterwards the CPU backend ignores it
    engine = adapter.VLLMGenerator(
        tiny_model_dir, dtype="float32", max_model_len=128, enforce_eager=True, seed=0, kv_cache_gib=0.125
    )
    try:
        trainer = bf16_trainer(tiny_model_dir)
        sink = InProcessSink(engine, trainer, WeightCheck(trainer, ([1, 2, 3], 1), interval=0))
        live = LiveTensors()
        full_weights = trainer.full_weights
        monkeypatch.setattr(trainer, "full_weights", lambda **kwargs: Tracked(full_weights(**kwargs), live))
        sink.push(1)
        streamed = engine.weight_checksums()

        whole = LiveTensors()
        with whole:
            state = {n: t.to(torch.bfloat16) for n, t in trainer.model.state_dict().items()}  # today's push
        engine.update_weights(state.items())
        del state
        assert engine.weight_checksums() == streamed and streamed
    finally:
        engine.close()
    sizes = {spec[0]: spec_bytes(spec) for spec in full_weights(device="cpu", dtype=torch.bfloat16).specs}
    layer = sum(size for name, size in sizes.items() if name.startswith("model.layers.0."))
    model_bytes = sum(sizes.values())
    assert 0 < live.peak <= max(sizes.values()) + layer < model_bytes / 2
    assert whole.peak >= model_bytes


PUSH_SCRIPT = r"""
import contextlib, os, sys, time, torch
tests, model_dir, out, bucket_bytes = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
sys.path.insert(0, tests)
from fakes.openai_server import fake_vllm
from helpers.live_tensors import LiveTensors
from scirl import algorithms
from scirl.distributed import Rendezvous, exit_process, setup, teardown
from scirl.errors import TrainError
from scirl.inference.client import ServerClient
from scirl.run.config import TrainConfig
from scirl.trainer.model import load_model
from scirl.trainer import Trainer
from scirl.weights.buckets import LARGEST_FIRST
from scirl.weights.check import WeightCheck
from scirl.weights.filesystem import FilesystemWeightSync
from scirl.weights.servers import ServerSink

dist, device = setup("cpu")
model = load_model(model_dir, device, dist, torch.bfloat16)  # FSDP2, float32 masters, bf16 compute: the wire dtype
cfg = TrainConfig()
trainer = Trainer(model, cfg.optim, algorithms.build(cfg), temperature=1.0, device=device, dist=dist,
                  dtype=torch.bfloat16)
check = WeightCheck(trainer, ([1, 2, 3], 1), interval=0)

def sink(transport, timeout_s, between_batches=lambda version, push: push()):
    return ServerSink(trainer, transport, None, check, [], between_batches, bucket_bytes=bucket_bytes,
                      rendezvous=Rendezvous(dist, timeout_s), start_wait_s=timeout_s)

# 1. a push in buckets through the filesystem, every rank's tensors tracked
app = fake_vllm()
with app if dist.is_main else contextlib.nullcontext() as srv:
    transport = (FilesystemWeightSync([ServerClient(srv.url, timeout_s=30)], f"{out}/broadcasts", timeout_s=30,
                                      bucket_bytes=bucket_bytes) if dist.is_main else None)
    pushing = sink(transport, 120)
    with LiveTensors() as live:
        pushing.push(1)
# what a push gathered before: every float32 master whole, cast after the gather
before = {name: (v.full_tensor() if hasattr(v, "full_tensor") else v).to(torch.bfloat16)
          for name, v in model.state_dict().items()}
torch.save({"peak": live.peak, "made": dict(live.made), "before": before if dist.is_main else None,
            "specs": trainer.full_weights(device=device, dtype=torch.bfloat16, first=LARGEST_FIRST).specs},
           f"{out}/push_{dist.rank}.pt")

# 2. rank 0 held back (a batch that never ends) until rank 1 has given up waiting for it
gave_up = f"{out}/gave_up_1.txt"
def held(version, push):
    guard = time.monotonic() + 60  # only a push that never gives up waits this long: it fails the test
    while not os.path.exists(gave_up):  # what rank 1 records once it has given up
        if time.monotonic() > guard:
            print("rank 1 never gave up waiting for rank 0", file=sys.stderr, flush=True)
            os._exit(3)
        os.sched_yield()
try:
    sink(None, 1.0, held if dist.is_main else (lambda version, push: push())).push(2)
except TrainError as exc:
    with open(gave_up + ".tmp", "w") as f:
        f.write(str(exc))
    os.replace(gave_up + ".tmp", gave_up)
teardown()
exit_process(0)
"""


@pytest.fixture(scope="module")
def two_rank_push(tiny_model_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("two_rank_push")
    (out / "push.py").write_text(PUSH_SCRIPT)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(out / "push.py"),
            str(TESTS),
            str(tiny_model_dir),
            str(out),
            str(40_000),
        ],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out


@pytest.mark.slow
def test_two_ranks_push_todays_weights_a_bucket_at_a_time_in_bf16(two_rank_push):
    """FSDP2 over 2 gloo ranks: the files the servers load hold what the whole-model push gathered; every gather
    moved bf16 (each rank cast its shard first: half the bytes of the float32 masters), and neither rank ever
    held more than a bucket (rank 0, which writes it) or a tensor (rank 1, which only joins the gathers)."""
    from safetensors.torch import load_file

    rank0, rank1 = (torch.load(two_rank_push / f"push_{r}.pt") for r in (0, 1))
    step = two_rank_push / "broadcasts" / "step_1"
    files = sorted(step.glob("*.safetensors"))
    written = {name: t for f in files for name, t in load_file(f).items()}
    before = rank0["before"]
    assert len(files) > 2 and written.keys() == before.keys()
    assert all(torch.equal(written[name], before[name]) for name in before)

    sizes = [spec_bytes(spec) for spec in rank0["specs"]]
    model_bytes, bound = sum(sizes), bucket_bound(rank0["specs"], 40_000)
    for got in (rank0, rank1):
        gathers = {dtype: n for (op, dtype), n in got["made"].items() if "all_gather" in op}
        assert set(gathers) == {torch.bfloat16} and sum(gathers.values()) == len(sizes)
    # a gather also holds this rank's cast shard (half a tensor on 2 ranks) beside what it gathers
    assert rank0["peak"] <= bound + max(sizes) // 2 < model_bytes / 2, (rank0["peak"], bound)
    assert rank1["peak"] <= max(sizes) * 3 // 2


@pytest.mark.slow
def test_a_rank_that_waits_past_the_push_timeout_ends_the_run_saying_for_whom_and_what(two_rank_push):
    message = (two_rank_push / "gave_up_1.txt").read_text()
    assert "\n" not in message
    # before the first bucket rank 0 may be waiting for a batch: the bound is a request's and a push's timeouts
    assert message.startswith(
        "rank 1 waited more than 1s (deployment.request_timeout_s + weight_sync_timeout_s) for "
        "rank 0 to start the "
        "push (rank 0 first waits for the batch being generated on the servers), in the push "
        "of the weights of step 2"
    ), message
