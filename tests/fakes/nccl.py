"""The NCCL side of a weight push on a CPU: a communicator that records what it would broadcast, and vLLM's own
packed receiver replaying what was sent."""

from __future__ import annotations

import torch


class FakeCommunicator:
    """Stands in for the PyNccl endpoint: records the rendezvous and every broadcast tensor."""

    def __init__(self, master_address, master_port, rank, world_size):
        self.opened_with = (master_address, master_port, rank, world_size)
        self.sent: list[tuple[torch.dtype, tuple[int, ...], torch.Tensor]] = []
        self.destroyed = False

    def broadcast(self, tensor, src):
        assert src == 0
        self.sent.append((tensor.dtype, tuple(tensor.shape), tensor.clone()))

    def destroy(self):
        self.destroyed = True


def received_by_vllm(sent: list[torch.Tensor], init_info: dict, update_info: dict, monkeypatch) -> dict:
    """What vLLM's own packed receiver (``packed_nccl_broadcast_consumer``, as its workers run it) makes of the
    broadcasts ``sent``, told what the push told the servers. It cuts its receive buffers from the metadata and
    the buffer size alone, so a bucket cut otherwise fails here. CUDA streams become no-ops on a CPU."""
    import contextlib

    import vllm.distributed.weight_transfer.packed_tensor as packed_tensor

    class NoStream:
        def synchronize(self):
            pass

    monkeypatch.setattr(packed_tensor, "_get_streams", lambda device, count: tuple(NoStream() for _ in range(count)))
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    queue = list(sent)

    class Replay:
        def broadcast(self, buffer, src):
            assert queue, "the receiver expects more broadcasts than were sent"
            got = queue.pop(0)
            assert (got.dtype, got.shape) == (buffer.dtype, buffer.shape), "a bucket cut otherwise than the receiver's"
            buffer.copy_(got)

    loaded = {}
    meta = (
        (name, (shape, getattr(torch, dtype)))
        for name, dtype, shape in zip(update_info["names"], update_info["dtype_names"], update_info["shapes"])
    )
    packed_tensor.packed_nccl_broadcast_consumer(
        meta,
        Replay(),
        0,
        lambda pairs: loaded.update((n, t.clone()) for n, t in pairs),
        buffer_size_bytes=init_info["packed_buffer_size_bytes"],
        num_buffers=init_info["packed_num_buffers"],
        device="cpu",
    )
    assert not queue, "broadcasts the receiver never took"
    return loaded
