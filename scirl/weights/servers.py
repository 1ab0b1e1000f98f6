"""Weights to vLLM servers: every trainer rank gathers the full weights, a bucket at a time, and rank 0 hands
each bucket to the servers between two batches, through the filesystem or over NCCL; the servers then report
the version and, when due, the push is checked. The run's start weights go first, so the first batch comes from
the version the run starts at, whatever the servers held before (another run's weights, or a crash
mid-push)."""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlparse

from scirl import distributed
from scirl.errors import TrainError
from scirl.inference.client import ServerClient, ServerError
from scirl.net import pick
from scirl.weights.buckets import LARGEST_FIRST, mib_to_bytes, paced
from scirl.weights.check import Replica, WeightCheck
from scirl.weights.filesystem import FilesystemWeightSync
from scirl.weights.nccl import NCCLWeightSync


class ServerSink:
    """``between_batches(version, push)`` runs ``push`` while no batch is being generated (the
    orchestrator's lock on rank 0; at once on the other ranks, which only join the gathers).

    A push reads the trainer's full weights a bucket of ``bucket_bytes`` at a time: every rank casts its shard
    to the wire dtype and joins each bucket's gathers, rank 0 sends the bucket (``transport``) and drops it
    before the next is gathered. Before each bucket every rank meets at ``rendezvous``: a rank that waits there
    longer than its timeout ends the run saying which rank it waited for, and for what, instead of sitting in a
    gather until the process group's own 30-minute timeout. The timeout is ``deployment.weight_sync_timeout_s``
    between buckets, and ``start_wait_s`` before the first: rank 0 first waits for the batch being generated
    (its requests bounded by ``deployment.request_timeout_s``), then starts the push."""

    def __init__(
        self,
        trainer,
        transport,
        tokenizer,
        check: WeightCheck,
        replicas: list[Replica],
        between_batches: Callable[[int, Callable[[], None]], None],
        *,
        bucket_bytes: int,
        rendezvous: distributed.Rendezvous,
        start_wait_s: float | None = None,
    ):
        self.trainer, self.transport, self.tokenizer = trainer, transport, tokenizer
        self.check, self.replicas, self.between_batches = check, replicas, between_batches
        self.bucket_bytes, self.rendezvous, self.start_wait_s = bucket_bytes, rendezvous, start_wait_s

    def make_room(self) -> None:
        """The servers have GPUs of their own."""

    def push(self, version: int) -> dict:
        self.between_batches(version, lambda: self._send(version))
        return self.check.run(version, self.replicas) if self.check.due(version) else {}

    def _send(self, version: int) -> None:
        trainer = self.trainer
        weights = trainer.full_weights(device=trainer.device, dtype=trainer.dtype, all_ranks=False, first=LARGEST_FIRST)
        weights = paced(weights, self.bucket_bytes, lambda index, count: self._meet(version, index, count))
        if self.transport is None:  # ranks > 0: their part is the gathers
            for _ in weights:
                pass
            return
        try:
            self.transport.push(weights, version, model_config=trainer.model.config, tokenizer=self.tokenizer)
        except TrainError:
            raise  # a rank missed the push's rendezvous (``_meet``): its own line
        except (ServerError, RuntimeError, TimeoutError) as exc:  # RuntimeError: NCCL's own, after an abort
            raise TrainError(f"weights of step {version} did not reach the servers: {exc}") from exc

    def _meet(self, version: int, index: int, count: int) -> None:
        """Every rank here before bucket ``index`` of ``count`` is gathered, or the run ends in one line."""
        try:
            self.rendezvous.reach(self.start_wait_s if index == 0 else None)
        except distributed.RendezvousMissed as exc:
            raise TrainError(missed_push_message(exc, version, index, count)) from exc

    def close(self) -> None:
        """Nothing to release: the servers keep the last version."""


def missed_push_message(missed: distributed.RendezvousMissed, version: int, index: int, count: int) -> str:
    """Which rank waited, for which ranks, and what those were doing: one line."""
    others = ", ".join(map(str, missed.missing))
    whom = f"rank{'s' if len(missed.missing) > 1 else ''} {others}"
    if missed.waiting != 0:  # only rank 0 can be late: it waits for the batch in flight, then sends each bucket
        doing = (
            "to start the push (rank 0 first waits for the batch being generated on the servers)"
            if index == 0
            else f"to send bucket {index} of {count} to the servers and start the next"
        )
    else:
        doing = f"to join the push at bucket {index + 1} of {count}"
    if missed.waited_s >= 0.99 * missed.timeout_s:  # gloo gave up at its timeout (not a rank that died)
        knobs = (
            "deployment.request_timeout_s + weight_sync_timeout_s" if index == 0 else "deployment.weight_sync_timeout_s"
        )
        return (
            f"rank {missed.waiting} waited more than {missed.timeout_s:g}s ({knobs}) for {whom} {doing}, in the "
            f"push of the weights of step {version}; raise the timeout if that is expected"
        )
    return (
        f"rank {missed.waiting} lost {whom} after {missed.waited_s:.0f}s of waiting for it {doing}, in the push of "
        f"the weights of step {version} ({missed})"
    )


def start_server_sink(
    trainer,
    tokenizer,
    deployment,
    urls: list[str],
    *,
    run_dir: Path,
    start_step: int,
    check: WeightCheck,
    replicas: list[Replica],
    between_batches: Callable[[int, Callable[[], None]], None],
) -> ServerSink:
    """The sink for ``urls`` (``deployment``: the run's ``[deployment]`` section), with the run's start
    weights already pushed (and checked). Rank 0 opens the transport: NCCL on GPUs (the group formed here),
    the filesystem elsewhere. Every rank forms the push's rendezvous group (a collective)."""
    transport = None
    bucket_bytes = mib_to_bytes(deployment.weight_bucket_mib)
    rendezvous = distributed.Rendezvous(trainer.dist, deployment.weight_sync_timeout_s)
    if trainer.dist.is_main:
        mode = deployment.weight_sync_on(trainer.device.type == "cuda")
        clients = [ServerClient(url, timeout_s=deployment.weight_sync_timeout_s) for url in urls]
        if mode == "nccl":
            transport = open_nccl(clients, deployment, urls, dtype=str(trainer.dtype).removeprefix("torch."))
        else:
            transport = FilesystemWeightSync(
                clients,
                Path(run_dir) / "broadcasts",
                timeout_s=deployment.weight_sync_timeout_s,
                bucket_bytes=bucket_bytes,
            )
    sink = ServerSink(
        trainer,
        transport,
        tokenizer,
        check,
        replicas,
        between_batches,
        bucket_bytes=bucket_bytes,
        rendezvous=rendezvous,
        start_wait_s=deployment.request_timeout_s + deployment.weight_sync_timeout_s,
    )
    sink.push(start_step)
    # a server that keeps no weight version (vLLM 0.25, 0.26) cannot confirm a push: the probe checks every one
    # instead (every rank must agree: under FSDP the trainer's side of the probe is a collective)
    unversioned = transport.unversioned if transport is not None else []
    check.every_push = bool(distributed.broadcast_object(unversioned, trainer.dist)) and check.interval > 0
    return sink


def open_nccl(clients: list[ServerClient], deployment, urls: list[str], *, dtype: str) -> NCCLWeightSync:
    """The NCCL group with every server worker, on the port the launcher reserved (or a free one). The
    wire carries the trainer's compute dtype, which the servers compute in (``scirl.deploy.launch``):
    a float32 run's servers get float32, not a bf16 rounding of it."""
    address = nccl_master_address(urls, deployment.nccl_address)
    port = pick(
        address, deployment.nccl_port, "deployment.nccl_port", "set deployment.nccl_port = 0 (a free port) or free it"
    )
    sync = NCCLWeightSync(
        clients,
        master_address=address,
        master_port=port,
        timeout_s=deployment.weight_sync_timeout_s,
        dtype=dtype,
        bucket_bytes=mib_to_bytes(deployment.weight_bucket_mib),
    )
    try:
        sync.init()
    except (ServerError, RuntimeError, TimeoutError) as exc:
        raise TrainError(f"the NCCL weight group with the servers did not form: {exc}") from exc
    return sync


def nccl_master_address(urls: list[str], configured: str | None = None) -> str:
    """Where the servers reach trainer rank 0: ``deployment.nccl_address`` when set; loopback when they
    all run here; else this machine's address on the interface that routes to them.

    Not ``gethostbyname(gethostname())``: on stock Debian/Ubuntu the hostname resolves to 127.0.1.1,
    which no other machine can reach. A UDP socket ``connect``ed to a server sends nothing, but makes
    the kernel pick the route to it, whose source address ``getsockname`` then gives."""
    if configured:
        return configured
    hosts = [urlparse(url).hostname for url in urls]
    if all(host in ("127.0.0.1", "localhost", "::1") for host in hosts):
        return "127.0.0.1"
    addresses = {}
    for url, host in zip(urls, hosts):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            try:
                probe.connect((host, urlparse(url).port or 80))
            except OSError as exc:
                raise TrainError(
                    f"no route from this machine to the server {url} ({exc}); set "
                    "deployment.nccl_address to this machine's address the servers can reach"
                ) from exc
            addresses[url] = probe.getsockname()[0]
    if len(set(addresses.values())) > 1:
        raise TrainError(
            "the servers are reached through different interfaces of this machine ("
            + ", ".join(f"{url} via {address}" for url, address in addresses.items())
            + "); set deployment.nccl_address to the one address every server can reach"
        )
    return next(iter(addresses.values()))
