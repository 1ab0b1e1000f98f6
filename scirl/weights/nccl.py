"""Weights to the servers over NCCL, through vLLM's weight-transfer API (GPUs only; servers started with
``--weight-transfer-config '{"backend":"nccl"}'``): trainer rank 0 broadcasts every tensor to every
worker of every server, in one group.

Never run on a GPU yet: tested against stand-ins that keep NCCL's contract (``tests/weights/test_weight_sync.py``).
Why this is not vLLM's own trainer side (``NCCLTrainerWeightTransferEngine.send_weights``): its
``WeightSource`` contract differs between the releases we pin, it cannot end a broadcast whose server
failed mid-way, and it knows nothing of the dtype, tied head and version checks around a push
(docs/architecture.md, "Weights to the servers"). Nor its packed producer (``packed_nccl_broadcast_producer``):
it concatenates each chunk into a new buffer while holding the tensors it packs, and keeps up to two chunks in
flight; this module gathers each bucket straight into the one buffer it sends (``buckets.pack``), laid out and
cut as vLLM's packed receiver expects.
"""

from __future__ import annotations

import dataclasses
import inspect
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_EXCEPTION, Future, wait

import torch

from scirl.inference.client import ServerClient, ServerError, confirm_version, on_every_server
from scirl.weights.base import DEFAULT_BUCKET_MIB
from scirl.weights.buckets import Declared, buckets, declared, mib_to_bytes, pack
from scirl.weights.filesystem import ties_embeddings

# vLLM's packed NCCL transfer: the workers' receive buffers (the buffer size is the push's bucket size), sent
# explicitly so both sides agree
PACKED_NUM_BUFFERS = 2


def _open_nccl_endpoint(master_address: str, master_port: int, rank: int, world_size: int):
    """Trainer rank 0's end of the broadcast group: vLLM's own helper (a TCP-store rendezvous, then a
    PyNccl communicator on the current CUDA device)."""
    from vllm.distributed.weight_transfer.nccl_common import trainer_init  # deferred: vLLM is optional, GPUs only

    return trainer_init(
        {"master_address": master_address, "master_port": master_port, "world_size": world_size},
        **rank_argument(trainer_init, rank),
    )


def rank_argument(trainer_init: Callable, rank: int) -> dict:
    """``rank=`` for vLLM's ``trainer_init`` where it takes one (0.31 on); before, it opens rank 0 only and a
    ``rank`` keyword is a TypeError, so rank 0 is passed as nothing and any other rank is refused here."""
    if "rank" in inspect.signature(trainer_init).parameters:
        return {"rank": rank}
    if rank != 0:
        raise ValueError(f"this vLLM's trainer_init opens rank 0 only, asked for rank {rank}")
    return {}


PACKING_FIELDS = ("packed", "packed_buffer_size_bytes", "packed_num_buffers")


def worker_payload_fields() -> tuple[frozenset[str], frozenset[str]] | None:
    """The fields vLLM's NCCL workers read from ``init_info`` and from ``update_info``: the installed
    release's own dataclasses (``NCCLWeightTransferInitInfo``, ``NCCLWeightTransferUpdateInfo``), which
    refuse any other key. Where the packing settings go moved between releases: 0.25-0.27 take them with
    every update, 0.28 on once, at init. Read from the trainer's own install: servers of another release
    on the other side of that change would refuse the payload (docs/vllm-range.md). None without vLLM."""
    try:
        from vllm.distributed.weight_transfer import nccl_engine  # deferred: vLLM is optional, GPUs only
    except ImportError:
        return None
    return (
        frozenset(f.name for f in dataclasses.fields(nccl_engine.NCCLWeightTransferInitInfo)),
        frozenset(f.name for f in dataclasses.fields(nccl_engine.NCCLWeightTransferUpdateInfo)),
    )


def _synchronize_current_stream() -> None:
    """Wait until the work queued on the current CUDA stream is done (nothing to wait for without CUDA).

    The gathers, the packing and the broadcasts are all queued on the current stream, in that order; the
    CPU returns from each before the GPU has run it. A push waits for them before it returns: the servers
    are told the version next, and the caller changes the weights at its next step."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.current_stream().synchronize()


def _abort(communicator) -> None:
    """End a broadcast group at once (PyNccl's ``destroy`` is ``ncclCommAbort``): NCCL calls waiting in it
    for peers that will never come return, instead of waiting forever (PyNccl has no watchdog)."""
    for name in ("abort", "destroy"):
        end = getattr(communicator, name, None)
        if end is not None:
            end()
            return


NCCL_SHARED_GPU_HINT = (
    "if a server runs on one of this trainer's GPUs, NCCL cannot put both in one group (one rank "
    'per GPU): use deployment.weight_sync = "filesystem", or give the servers GPUs of their own'
)


class NCCLWeightSync:
    """vLLM's weight-transfer API over NCCL: trainer rank 0 broadcasts every tensor to every worker of
    every server.

    One NCCL group for all servers: the trainer is rank 0 and server ``i``'s workers take ranks from
    ``1 + (workers of servers 0..i-1)``, so world size = 1 + all workers (each server's worker count
    from ``/get_world_size``). Per push: ``/start_weight_update`` on every server, ``/update_weights``
    with the names/dtypes/shapes (run concurrently with the broadcast: the workers receive inside it),
    ``/finish_weight_update`` with the version, then ``/reset_prefix_cache``; every server must then
    report the version (``/weight_info``).

    Tensors go out with HF names, cast to ``dtype`` (the trainer's compute dtype: the servers compute
    in it too, so nothing is rounded on the way), in the order of the metadata sent, a bucket of
    ``bucket_bytes`` at a time (``scirl/weights/buckets.py``). ``packed``: vLLM's packed transfer (each bucket
    in one broadcast, into one of the workers' receive buffers of ``bucket_bytes``; CUDA only) or one
    broadcast per tensor. Every broadcast runs on the current stream, after the gathers queued there.

    Failures never hang the trainer: a server whose ``/update_weights`` fails while the broadcast waits
    for its workers aborts the group (the run then ends naming that server); a rendezvous that a server
    refuses fails at once, with the fix for the usual cause (a server on the trainer's GPU).

    Why not vLLM's own trainer side (0.33's ``NCCLTrainerWeightTransferEngine``): it checks a failed
    ``/update_weights`` only once, before broadcasting, so a server that fails during the broadcast
    leaves the sender waiting in NCCL forever; and its worker payload puts every server at rank offset 1,
    where scirl's servers (one per CPU replica or per node) each need their own. This class keeps its
    patterns instead: every tensor declared before the first broadcast, the metadata sent equal to what is
    broadcast, the stream drained before returning.

    ``communicator_factory(master_address, master_port, rank, world_size)`` returns an object with
    ``broadcast(tensor, src)`` (and ``destroy()``, which aborts); the default opens vLLM's PyNccl
    endpoint. ``stream_sync()`` waits for the queued broadcasts before the push returns (default: the
    current CUDA stream's). Tests pass stand-ins for both."""

    def __init__(
        self,
        clients: list[ServerClient],
        *,
        master_address: str,
        master_port: int,
        timeout_s: float,
        communicator_factory: Callable | None = None,
        dtype: str = "bfloat16",
        packed: bool = True,
        stream_sync: Callable[[], None] = _synchronize_current_stream,
        payload_fields: tuple[frozenset[str], frozenset[str]] | None = None,
        bucket_bytes: int = mib_to_bytes(DEFAULT_BUCKET_MIB),
    ):
        if not clients:
            raise ValueError("NCCLWeightSync needs at least one server")
        self.clients, self.timeout_s, self.bucket_bytes = list(clients), timeout_s, bucket_bytes
        self.master_address, self.master_port = master_address, master_port
        self.communicator_factory = communicator_factory or _open_nccl_endpoint
        self.dtype, self.packed, self.stream_sync = dtype, packed, stream_sync
        # (init_info fields, update_info fields) the servers' workers accept; None: the layout of 0.28 on
        fields = payload_fields or worker_payload_fields()
        self.packing_at_init = fields is None or "packed" in fields[0]
        self.packing_per_update = fields is not None and "packed" in fields[1]
        if not (self.packing_at_init or self.packing_per_update):
            self.packed = False  # a release that cannot be told to unpack: one broadcast per tensor
        self.communicator = None
        self.world_size: int | None = None
        self.rank_offsets: list[int] = []
        self.unversioned: list[str] = []  # servers that keep no weight version (set by each push)

    def init_payloads(self, worker_counts: list[int]) -> list[dict]:
        """Each server's ``init_info``: the rendezvous, the group's size and the server's first rank."""
        world_size = 1 + sum(worker_counts)
        offsets = [1 + sum(worker_counts[:i]) for i in range(len(worker_counts))]
        packing = self.packing() if self.packing_at_init else {}
        return [
            {
                "master_address": self.master_address,
                "master_port": self.master_port,
                "rank_offset": offset,
                "world_size": world_size,
                **packing,
            }
            for offset in offsets
        ]

    def packing(self) -> dict:
        """How the broadcasts are cut, which both sides must agree on (sent at init or with each update): a
        receive buffer is one of the trainer's buckets (``buckets.plan_buckets`` cuts them as the workers do)."""
        return dict(zip(PACKING_FIELDS, (self.packed, self.bucket_bytes, PACKED_NUM_BUFFERS)))

    def init(self) -> None:
        """Form the broadcast group: every server's workers join (their HTTP calls block until the
        rendezvous completes) while this process opens rank 0. Whichever side fails first ends it:
        the other may be waiting for a peer that will never come."""
        counts = on_every_server(self.clients, lambda c: c.world_size(), self.timeout_s, "/get_world_size")
        payloads = self.init_payloads(counts)
        self.world_size = payloads[0]["world_size"]
        self.rank_offsets = [p["rank_offset"] for p in payloads]
        by_client = dict(zip(map(id, self.clients), payloads))
        route = "/init_weight_transfer_engine"
        joining = _in_thread(
            lambda: on_every_server(
                self.clients,
                lambda c: c.post(route, {"init_info": by_client[id(c)]}, timeout_s=self.timeout_s),
                self.timeout_s,
                route,
            )
        )
        opening = _in_thread(
            lambda: self.communicator_factory(self.master_address, self.master_port, 0, self.world_size)
        )
        try:
            _first_failure([joining, opening], 2 * self.timeout_s + 1, "the NCCL weight group's rendezvous")
        except ServerError as exc:
            raise ServerError(exc.url, exc.route, f"{exc.problem}; {NCCL_SHARED_GPU_HINT}", exc.body) from exc
        except Exception as exc:  # noqa: BLE001 - NCCL's own error ("invalid usage") does not say why
            raise RuntimeError(
                f"the NCCL weight group did not form ({type(exc).__name__}: {exc}); {NCCL_SHARED_GPU_HINT}"
            ) from exc
        self.communicator = opening.result()

    def update_info(self, entries: list[tuple]) -> dict:
        """The names, dtypes and shapes the workers receive, in the order broadcast: ``entries`` are specs
        (name, shape, dtype) or (name, tensor) pairs."""
        return {
            "names": [entry[0] for entry in entries],
            "dtype_names": [self.dtype] * len(entries),
            "shapes": [list(getattr(entry[1], "shape", entry[1])) for entry in entries],
            **(self.packing() if self.packing_per_update else {}),
        }

    def push(
        self, named_tensors: Iterable[tuple[str, object]], version: int, *, model_config=None, tokenizer=None
    ) -> None:
        """Broadcast one policy version to every server worker, a bucket at a time: every tensor is declared
        first (one ``/update_weights``), then each bucket is gathered into one buffer, broadcast and dropped
        before the next is gathered. ``named_tensors``: the trainer's full weights (a declared stream, read as
        it is sent) or any (name, tensor) pairs. ``model_config``: adds ``lm_head.weight`` for a model with
        tied embeddings (vLLM keeps the old head otherwise). ``tokenizer``: unused (the filesystem transport
        writes it)."""
        if self.communicator is None:
            raise RuntimeError("NCCLWeightSync.push before init() (or after a failed push aborted the group)")
        stream = declared(
            named_tensors,
            dtype=getattr(torch, self.dtype),
            ties_embeddings=model_config is not None and ties_embeddings(model_config),
        )
        info = self.update_info(stream.specs)

        self._post_all("/start_weight_update")
        receiving = _in_thread(lambda: self._post_all("/update_weights", {"update_info": info}))
        communicator = self.communicator
        # a server that fails while its workers should be receiving leaves this broadcast waiting for
        # them: end the group, so the broadcast returns and the server's error is what the caller sees
        receiving.add_done_callback(lambda done: done.exception() is not None and _abort(communicator))
        try:
            self._broadcast(stream)
            _first_failure([receiving], 2 * self.timeout_s + 1, "/update_weights")
        except BaseException:
            self.communicator = None  # aborted, or in a state no later push can trust
            if receiving.done() and receiving.exception() is not None:
                raise receiving.exception() from None  # the server's refusal: the cause of what NCCL did next
            raise
        self._post_all("/finish_weight_update", {"weight_version": str(version)})
        on_every_server(
            self.clients,
            lambda c: c.reset_prefix_cache(timeout_s=self.timeout_s),
            self.timeout_s,
            "/reset_prefix_cache",
        )
        self.unversioned = confirm_version(self.clients, version, self.timeout_s)

    def _post_all(self, route: str, payload: dict | None = None) -> None:
        on_every_server(self.clients, lambda c: c.post(route, payload, timeout_s=self.timeout_s), self.timeout_s, route)

    def _broadcast(self, stream: Declared) -> None:
        """Each bucket in one broadcast (packed: the workers' receive buffer, cut as they cut it), or each
        tensor in its own, all on the current stream, where the gathers ran: each gathered tensor is complete
        before it is sent, and its memory is reused only by work queued after its broadcast."""
        wire = getattr(torch, self.dtype)
        device = getattr(self.communicator, "device", None)  # PyNccl sends from its own device only
        for bucket in buckets(stream, self.bucket_bytes):
            if self.packed:
                packed = pack(bucket, device)
                self.communicator.broadcast(packed, src=0)
                del packed
            else:
                for _, tensor in bucket.pairs:
                    self.communicator.broadcast(tensor.detach().to(device=device, dtype=wire).contiguous(), src=0)
                    del tensor
        self.stream_sync()  # the broadcasts are only enqueued: the caller may change the weights next

    def close(self) -> None:
        """Leave the group: the servers drop their end, then this process its own."""
        if self.communicator is None:
            return
        try:
            route = "/shutdown_weight_transfer_engine"  # none before vLLM 0.32: the engine ends with its server
            serving = [c for c in self.clients if c.offers(route)]
            on_every_server(serving, lambda c: c.post(route, None, timeout_s=self.timeout_s), self.timeout_s, route)
        finally:
            destroy = getattr(self.communicator, "destroy", None)
            self.communicator = None
            if destroy is not None:
                destroy()


def _in_thread(call: Callable[[], object]) -> Future:
    """``call()`` in a daemon thread of its own, as a Future: a call stuck in NCCL or a TCP store must
    never keep the process alive, nor be joined."""
    future: Future = Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(call())
        except BaseException as exc:  # noqa: BLE001 - handed to whoever reads the future
            future.set_exception(exc)

    threading.Thread(target=run, daemon=True, name="weight-sync").start()
    return future


def _first_failure(futures: list[Future], timeout_s: float, what: str) -> None:
    """Wait until every future is done, raising the first failure as soon as it happens."""
    done, pending = wait(futures, timeout=timeout_s, return_when=FIRST_EXCEPTION)
    for future in done:
        if future.exception() is not None:
            raise future.exception()
    if pending:
        raise TimeoutError(f"{what}: not done within {timeout_s:g}s")
