"""Weights to the servers over NCCL, through vLLM's weight-transfer API (GPUs only; servers started with
``--weight-transfer-config '{"backend":"nccl"}'``): trainer rank 0 broadcasts every tensor to every
worker of every server, in one group.

Never run on a GPU yet: tested against stand-ins that keep NCCL's contract (``tests/test_vllm_server_fakes.py``).
Why this is not vLLM's own trainer side (``NCCLTrainerWeightTransferEngine.send_weights``): its
``WeightSource`` contract differs between the releases we pin, it cannot end a broadcast whose server
failed mid-way, and it knows nothing of the dtype, tied head and version checks around a push
(docs/architecture.md, "Weights to the servers").
"""

from __future__ import annotations

import dataclasses
import inspect
import threading
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from typing import Callable, Iterable

import torch

from scirl.inference.client import ServerClient, ServerError, confirm_version, on_every_server
from scirl.inference.vllm import with_tied_lm_head
from scirl.weights.filesystem import ties_embeddings

# vLLM's packed NCCL transfer: staging buffers per side (its defaults), sent explicitly so both sides agree
PACKED_BUFFER_BYTES = 1 << 30
PACKED_NUM_BUFFERS = 2


def _open_nccl_endpoint(master_address: str, master_port: int, rank: int, world_size: int):
    """Trainer rank 0's end of the broadcast group: vLLM's own helper (a TCP-store rendezvous, then a
    PyNccl communicator on the current CUDA device)."""
    from vllm.distributed.weight_transfer.nccl_common import trainer_init  # deferred: vLLM is optional, GPUs only

    return trainer_init({"master_address": master_address, "master_port": master_port, "world_size": world_size},
                        **rank_argument(trainer_init, rank))


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
    return (frozenset(f.name for f in dataclasses.fields(nccl_engine.NCCLWeightTransferInitInfo)),
            frozenset(f.name for f in dataclasses.fields(nccl_engine.NCCLWeightTransferUpdateInfo)))


def _synchronize_current_stream() -> None:
    """Wait until the work queued on the current CUDA stream is done (nothing to wait for without CUDA).

    The full weights are gathered (FSDP all-gathers) and cast on the current stream, while vLLM's packed
    producer copies them into its staging buffers on side streams of its own: nothing else orders the
    two, so without this a broadcast could send memory the gather has not written yet."""
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


NCCL_SHARED_GPU_HINT = ("if a server runs on one of this trainer's GPUs, NCCL cannot put both in one group (one rank "
                        "per GPU): use deployment.weight_sync = \"filesystem\", or give the servers GPUs of their own")


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
    in it too, so nothing is rounded on the way), in the order of the metadata sent. ``packed``: vLLM's
    packed transfer (a few large broadcasts through double-buffered staging on side streams; CUDA only)
    or one broadcast per tensor on the current stream.

    Failures never hang the trainer: a server whose ``/update_weights`` fails while the broadcast waits
    for its workers aborts the group (the run then ends naming that server); a rendezvous that a server
    refuses fails at once, with the fix for the usual cause (a server on the trainer's GPU).

    Why not vLLM's own trainer side (0.33's ``NCCLTrainerWeightTransferEngine``): it checks a failed
    ``/update_weights`` only once, before broadcasting, so a server that fails during the broadcast
    leaves the sender waiting in NCCL forever; and its worker payload puts every server at rank offset 1,
    where scirl's servers (one per CPU replica or per node) each need their own. This class keeps its
    patterns instead: the gather ordered before the side streams, the metadata sent equal to what is
    broadcast, every stream drained before returning.

    ``communicator_factory(master_address, master_port, rank, world_size)`` returns an object with
    ``broadcast(tensor, src)`` (and ``destroy()``, which aborts); the default opens vLLM's PyNccl
    endpoint. ``stream_sync()`` orders the caller's queued work before the broadcast (default: the
    current CUDA stream's). Tests pass stand-ins for both."""

    def __init__(self, clients: list[ServerClient], *, master_address: str, master_port: int, timeout_s: float,
                 communicator_factory: Callable | None = None, dtype: str = "bfloat16", packed: bool = True,
                 stream_sync: Callable[[], None] = _synchronize_current_stream,
                 payload_fields: tuple[frozenset[str], frozenset[str]] | None = None):
        if not clients:
            raise ValueError("NCCLWeightSync needs at least one server")
        self.clients, self.timeout_s = list(clients), timeout_s
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
        return [{"master_address": self.master_address, "master_port": self.master_port, "rank_offset": offset,
                 "world_size": world_size, **packing} for offset in offsets]

    def packing(self) -> dict:
        """How the broadcasts are cut, which both sides must agree on (sent at init or with each update)."""
        return dict(zip(PACKING_FIELDS, (self.packed, PACKED_BUFFER_BYTES, PACKED_NUM_BUFFERS)))

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
        joining = _in_thread(lambda: on_every_server(self.clients, lambda c: c.post(
            route, {"init_info": by_client[id(c)]}, timeout_s=self.timeout_s), self.timeout_s, route))
        opening = _in_thread(lambda: self.communicator_factory(self.master_address, self.master_port, 0,
                                                               self.world_size))
        try:
            _first_failure([joining, opening], 2 * self.timeout_s + 1, "the NCCL weight group's rendezvous")
        except ServerError as exc:
            raise ServerError(exc.url, exc.route, f"{exc.problem}; {NCCL_SHARED_GPU_HINT}", exc.body) from exc
        except Exception as exc:  # noqa: BLE001 - NCCL's own error ("invalid usage") does not say why
            raise RuntimeError(f"the NCCL weight group did not form ({type(exc).__name__}: {exc}); "
                               f"{NCCL_SHARED_GPU_HINT}") from exc
        self.communicator = opening.result()

    def update_info(self, tensors: list[tuple[str, object]]) -> dict:
        return {"names": [n for n, _ in tensors],
                "dtype_names": [self.dtype] * len(tensors),
                "shapes": [list(t.shape) for _, t in tensors],
                **(self.packing() if self.packing_per_update else {})}

    def push(self, named_tensors: Iterable[tuple[str, object]], version: int, *, model_config=None,
             tokenizer=None) -> None:
        """Broadcast one policy version to every server worker. ``model_config``: adds ``lm_head.weight``
        for a model with tied embeddings (vLLM keeps the old head otherwise). ``tokenizer``: unused (the
        filesystem transport writes it)."""
        if self.communicator is None:
            raise RuntimeError("NCCLWeightSync.push before init() (or after a failed push aborted the group)")
        dtype = getattr(torch, self.dtype)
        tensors = list(with_tied_lm_head(named_tensors, model_config is not None and ties_embeddings(model_config)))
        info = self.update_info(tensors)
        device = getattr(self.communicator, "device", None)  # PyNccl sends from its own device only
        wire = ((name, tensor.detach().to(device=device, dtype=dtype).contiguous()) for name, tensor in tensors)

        self._post_all("/start_weight_update")
        self.stream_sync()  # the gathered weights are complete before any side stream reads them
        receiving = _in_thread(lambda: self._post_all("/update_weights", {"update_info": info}))
        communicator = self.communicator
        # a server that fails while its workers should be receiving leaves this broadcast waiting for
        # them: end the group, so the broadcast returns and the server's error is what the caller sees
        receiving.add_done_callback(lambda done: done.exception() is not None and _abort(communicator))
        try:
            self._broadcast(wire)
            _first_failure([receiving], 2 * self.timeout_s + 1, "/update_weights")
        except BaseException:
            self.communicator = None  # aborted, or in a state no later push can trust
            if receiving.done() and receiving.exception() is not None:
                raise receiving.exception() from None  # the server's refusal: the cause of what NCCL did next
            raise
        self._post_all("/finish_weight_update", {"weight_version": str(version)})
        on_every_server(self.clients, lambda c: c.reset_prefix_cache(timeout_s=self.timeout_s), self.timeout_s,
                         "/reset_prefix_cache")
        self.unversioned = confirm_version(self.clients, version, self.timeout_s)

    def _post_all(self, route: str, payload: dict | None = None) -> None:
        on_every_server(self.clients, lambda c: c.post(route, payload, timeout_s=self.timeout_s), self.timeout_s, route)

    def _broadcast(self, pairs: Iterable[tuple[str, object]]) -> None:
        if self.packed:
            from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer  # deferred: vLLM

            # drains its own side streams before it returns
            packed_nccl_broadcast_producer(iterator=iter(pairs), group=self.communicator, src=0,
                                           post_iter_func=lambda item: item[1], buffer_size_bytes=PACKED_BUFFER_BYTES,
                                           num_buffers=PACKED_NUM_BUFFERS)
        else:
            for _, tensor in pairs:
                self.communicator.broadcast(tensor, src=0)
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
