"""Weight sync against fake vLLM servers (``tests/fakes/openai_server.py``; no vLLM, no GPU): the NCCL weight
sync's handshake and order, the weight-sync support check, the weights directory, pushes in buckets as vLLM's own
receiver reads them, weight versions per release, and the errors a push raises. The NCCL communicator is a fake
that records what it would broadcast (``tests/fakes/nccl.py``).
"""

from __future__ import annotations

import json
import threading

import pytest
import torch

from fakes.nccl import FakeCommunicator, received_by_vllm
from fakes.openai_server import RELEASE_PAYLOAD_FIELDS, body, fake_vllm, routes
from helpers.live_tensors import LiveTensors, bucket_bound
from scirl.inference.client import ServerClient, ServerError
from scirl.weights import filesystem
from scirl.weights.filesystem import FilesystemWeightSync, write_weights
from scirl.weights.nccl import NCCLWeightSync


def small_model():
    """A tied-embedding tiny Qwen3 (no download): names, shapes and a config."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=True,
    )
    return Qwen3ForCausalLM(config)


def test_nccl_sync_one_group_over_all_servers_ranks_names_and_version():
    model = small_model()
    a, b = fake_vllm(world_size=2), fake_vllm(world_size=1)
    opened = []

    def factory(*args):
        opened.append(FakeCommunicator(*args))
        return opened[-1]

    with a as srv_a, b as srv_b:
        clients = [ServerClient(srv_a.url, timeout_s=10), ServerClient(srv_b.url, timeout_s=10)]
        sync = NCCLWeightSync(
            clients,
            master_address="10.0.0.1",
            master_port=29555,
            timeout_s=10,
            communicator_factory=factory,
            packed=False,
        )
        sync.init()
        # the trainer is rank 0 of one group of 1 + 3 workers; server a's workers are 1-2, server b's 3
        assert opened[0].opened_with == ("10.0.0.1", 29555, 0, 4)
        assert sync.rank_offsets == [1, 3] and sync.world_size == 4
        [init_a], [init_b] = body(a, "/init_weight_transfer_engine"), body(b, "/init_weight_transfer_engine")
        for init, offset in ((init_a, 1), (init_b, 3)):
            info = init["init_info"]
            assert info["master_address"] == "10.0.0.1" and info["master_port"] == 29555
            assert info["world_size"] == 4 and info["rank_offset"] == offset and info["packed"] is False

        params = list(model.named_parameters())  # fp32 masters, no lm_head (tied)
        sync.push(((n, p.detach()) for n, p in params), 7, model_config=model.config)
        for app in (a, b):
            assert routes(app)[1:] == [
                "/start_weight_update",
                "/update_weights",
                "/finish_weight_update",
                "/reset_prefix_cache",
            ]
            assert body(app, "/finish_weight_update") == [{"weight_version": "7"}]
            assert app.state.version == "7"  # and the push checked that every server reports it
        info = body(a, "/update_weights")[0]["update_info"]
        assert info == body(b, "/update_weights")[0]["update_info"]
        # HF names in the trainer's order, then the tied head; everything in bf16, as declared
        assert info["names"] == [n for n, _ in params] + ["lm_head.weight"]
        assert info["dtype_names"] == ["bfloat16"] * len(info["names"])
        sent = opened[0].sent
        assert [list(shape) for _, shape, _ in sent] == info["shapes"]
        assert all(dtype == torch.bfloat16 for dtype, _, _ in sent)
        expected = [p.detach() for _, p in params] + [model.model.embed_tokens.weight.detach()]
        assert all(torch.equal(t, e.to(torch.bfloat16)) for (_, _, t), e in zip(sent, expected))

        sync.close()
        assert opened[0].destroyed
        assert routes(a)[-1] == routes(b)[-1] == "/shutdown_weight_transfer_engine"


def test_nccl_sync_failures_name_the_server_and_route():
    with fake_vllm(fail={"/update_weights": 500}) as srv:
        sync = NCCLWeightSync(
            [ServerClient(srv.url, timeout_s=10)],
            master_address="127.0.0.1",
            master_port=1,
            timeout_s=10,
            communicator_factory=FakeCommunicator,
            packed=False,
        )
        with pytest.raises(RuntimeError, match="before init"):
            sync.push([("w", torch.ones(2))], 1)
        sync.init()
        with pytest.raises(ServerError, match=r"/update_weights: status 500: .*failed on purpose") as info:
            sync.push([("w", torch.ones(2))], 1)
        assert info.value.url == srv.url[: -len("/v1")]

    def refuse(*args):
        raise ConnectionError("rendezvous refused")

    with fake_vllm() as srv:
        sync = NCCLWeightSync(
            [ServerClient(srv.url, timeout_s=10)],
            master_address="127.0.0.1",
            master_port=1,
            timeout_s=10,
            communicator_factory=refuse,
        )
        with pytest.raises(RuntimeError, match="did not form .ConnectionError: rendezvous refused.*filesystem"):
            sync.init()


def test_weight_sync_support_names_the_missing_piece_and_the_fix():
    with fake_vllm(dev_mode=False) as srv:
        problem = ServerClient(srv.url, timeout_s=10).check_weight_sync_support("filesystem")
        assert "VLLM_SERVER_DEV_MODE=1" in problem and "\n" not in problem
    with fake_vllm(weight_transfer=None) as srv:
        client = ServerClient(srv.url, timeout_s=10)
        assert client.check_weight_sync_support("filesystem") is None
        problem = client.check_weight_sync_support("nccl")
        assert "--weight-transfer-config" in problem and "filesystem" in problem and "\n" not in problem
    with fake_vllm(weight_transfer={"backend": "ipc"}) as srv:
        assert "'ipc'" in ServerClient(srv.url, timeout_s=10).check_weight_sync_support("nccl")
    with fake_vllm(weight_transfer={"backend": "nccl"}) as srv:
        assert ServerClient(srv.url, timeout_s=10).check_weight_sync_support("nccl") is None


def test_filesystem_sync_writes_reloads_every_server_and_prunes(tmp_path):
    model = small_model()
    a, b = fake_vllm(), fake_vllm()
    with a as srv_a, b as srv_b:
        sync = FilesystemWeightSync(
            [ServerClient(srv_a.url, timeout_s=10), ServerClient(srv_b.url, timeout_s=10)],
            tmp_path / "broadcasts",
            keep=2,
            timeout_s=10,
        )
        for version in (1, 2, 3):
            path = sync.push(model.named_parameters(), version, model_config=model.config)
            assert path == tmp_path / "broadcasts" / f"step_{version}"
        for app in (a, b):
            reloads = body(app, "/collective_rpc")
            assert [r["kwargs"]["weights_path"] for r in reloads] == [
                str(tmp_path / "broadcasts" / f"step_{v}") for v in (1, 2, 3)
            ]
            assert all(r["method"] == "reload_weights" for r in reloads)
            assert routes(app).count("/reset_prefix_cache") == 3
    assert sorted(p.name for p in (tmp_path / "broadcasts").iterdir()) == ["step_2", "step_3"]


def test_write_weights_is_whole_or_absent_and_adds_the_tied_head(tmp_path, monkeypatch):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    model = small_model()
    out = write_weights(model.named_parameters(), tmp_path / "step_1", model_config=model.config)
    tensors = load_file(out / "model.safetensors")
    assert "lm_head.weight" in tensors and torch.equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"])
    assert set(tensors) == {n for n, _ in model.named_parameters()} | {"lm_head.weight"}
    assert AutoConfig.from_pretrained(out).tie_word_embeddings
    assert [p.name for p in tmp_path.iterdir()] == ["step_1"]

    # sharded: several files and an index naming every tensor
    monkeypatch.setattr(filesystem, "SHARD_BYTES", 4096)
    out = write_weights(model.named_parameters(), tmp_path / "step_2", model_config=model.config.to_dict())
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 1 and set(index["weight_map"].values()) == set(files)
    loaded = {k: v for f in files for k, v in load_file(out / f).items()}
    assert set(loaded) == set(index["weight_map"]) == set(tensors)

    # a write that fails leaves the previous directory as it was, and no tmp dir
    before = sorted(p.name for p in out.iterdir())

    def broken():
        yield "model.norm.weight", torch.ones(2)
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_weights(broken(), out, model_config=model.config)
    assert sorted(p.name for p in out.iterdir()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1", "step_2"]


# ---------------------------------------------------------------------------------------------
# stand-ins that keep NCCL's and CUDA's contracts (read from torch's and vLLM's source): what the
# GPU path does when it goes wrong, checked on a CPU

HANG_GUARD_S = 30  # a stand-in that would wait forever on real hardware gives up after this, failing the test


class FakeNCCLGroup:
    """One weight-broadcast group as NCCL forms it: each rank joins on a device and waits for the
    others (ncclCommInitRank blocks until all ranks have joined); two ranks on one device are refused
    ("Duplicate GPU detected", reported as invalid usage) and every waiting rank then fails too."""

    def __init__(self, world_size: int):
        self.world_size, self.devices, self.failed = world_size, {}, None
        self.changed = threading.Condition()

    def join(self, rank: int, device: str) -> None:
        with self.changed:
            if device in self.devices.values():
                self.failed = f"NCCL error: invalid usage (Duplicate GPU detected: rank {rank} and another on {device})"
                self.changed.notify_all()
                raise RuntimeError(self.failed)
            self.devices[rank] = device
            self.changed.notify_all()
            if not self.changed.wait_for(lambda: self.failed or len(self.devices) == self.world_size, HANG_GUARD_S):
                raise AssertionError("the stand-in NCCL group waited past its guard: something hangs")
            if self.failed:
                raise RuntimeError("NCCL error: invalid usage")


class BlockingCommunicator(FakeCommunicator):
    """A broadcast that waits for its receivers, as NCCL's does (the sender's stream does not finish
    until every rank has joined the collective); ``destroy`` aborts it, as ncclCommAbort does."""

    def __init__(self, *args):
        super().__init__(*args)
        self.receivers_arrived, self.aborted = threading.Event(), threading.Event()

    def broadcast(self, tensor, src):
        if not self.receivers_arrived.wait(0) and not self.aborted.wait(HANG_GUARD_S):
            raise AssertionError("the broadcast waited past its guard: nothing aborted it")
        if self.aborted.is_set():
            raise RuntimeError("NCCL error: remote process exited or there was a network error (aborted)")
        super().broadcast(tensor, src)

    def destroy(self):
        super().destroy()
        self.aborted.set()


def test_a_failed_update_weights_aborts_the_broadcast_and_names_the_server():
    """The workers never arrive when /update_weights fails: without an abort the trainer's broadcast
    would wait for them forever (PyNccl has no watchdog)."""
    opened = []

    def factory(*args):
        opened.append(BlockingCommunicator(*args))
        opened[-1].receivers_arrived.set()  # the rendezvous itself is fine
        return opened[-1]

    with fake_vllm() as good, fake_vllm(fail={"/update_weights": 500}) as bad:
        sync = NCCLWeightSync(
            [ServerClient(good.url, timeout_s=10), ServerClient(bad.url, timeout_s=10)],
            master_address="127.0.0.1",
            master_port=1,
            timeout_s=10,
            communicator_factory=factory,
            packed=False,
        )
        sync.init()
        opened[0].receivers_arrived.clear()  # from now on the broadcast waits for workers that never come
        with pytest.raises(ServerError, match=r"/update_weights: status 500") as info:
            sync.push([("w", torch.ones(2))], 1)
        assert info.value.url == bad.url.removesuffix("/v1")
        assert opened[0].aborted.is_set() and sync.communicator is None
        with pytest.raises(RuntimeError, match="before init"):  # a later push cannot use the aborted group
            sync.push([("w", torch.ones(2))], 2)


def test_the_group_refused_on_a_shared_gpu_names_the_fix():
    """One GPU shared by a server and the trainer: NCCL refuses two ranks of one communicator on it."""
    group = FakeNCCLGroup(world_size=2)

    def factory(address, port, rank, world_size):
        group.join(rank, "cuda:0")
        return FakeCommunicator(address, port, rank, world_size)

    server = fake_vllm(on_init=lambda info: group.join(info["rank_offset"], "cuda:0"))
    with server as srv:
        sync = NCCLWeightSync(
            [ServerClient(srv.url, timeout_s=10)],
            master_address="127.0.0.1",
            master_port=1,
            timeout_s=10,
            communicator_factory=factory,
        )
        with pytest.raises(RuntimeError) as info:
            sync.init()
    message = str(info.value)
    assert 'deployment.weight_sync = "filesystem"' in message and "\n" not in message


class RecordingCommunicator(FakeCommunicator):
    """Records what it sends without the copies counting as the trainer's memory (they are the servers')."""

    def broadcast(self, tensor, src):
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            super().broadcast(tensor, src)


def test_a_packed_push_is_cut_and_laid_out_as_vllms_receiver_reads_it(monkeypatch):
    """Each bucket is one of the workers' receive buffers: vLLM's real receiver, given the metadata and the
    bucket size the push sent, unpacks exactly the model (bf16 on the wire, the tied head added), bucket by
    bucket, including a tensor bigger than a bucket."""
    model = small_model()
    opened = []
    bucket_bytes = 700  # smaller than the embedding (64 x 16 bf16 = 2 KiB)
    app = fake_vllm()
    with app as srv:
        sync = NCCLWeightSync(
            [ServerClient(srv.url, timeout_s=10)],
            master_address="127.0.0.1",
            master_port=1,
            timeout_s=10,
            communicator_factory=lambda *a: opened.append(FakeCommunicator(*a)) or opened[-1],
            packed=True,
            bucket_bytes=bucket_bytes,
        )
        sync.init()
        sync.push(model.named_parameters(), 1, model_config=model.config)
    [init], [update] = body(app, "/init_weight_transfer_engine"), body(app, "/update_weights")
    assert init["init_info"]["packed_buffer_size_bytes"] == bucket_bytes
    sent = [t for _, _, t in opened[0].sent]
    assert len(sent) > 3 and all(t.dtype == torch.uint8 for t in sent)
    got = received_by_vllm(sent, init["init_info"], update["update_info"], monkeypatch)
    expected = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}
    expected["lm_head.weight"] = expected["model.embed_tokens.weight"]
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[n], expected[n]) for n in expected)


def test_a_push_in_buckets_delivers_todays_weights_and_holds_one_bucket_beyond_the_model(monkeypatch):
    """The trainer's full weights, cast to bf16 shard by shard and read as they are sent, reach vLLM's receiver
    as the whole-model push delivered them (every tensor cast, then sent), while the push never holds more than
    one bucket of tensors (tracked as they are created and dropped); the whole-model push held all of them."""
    from scirl.trainer.full_weights import FullWeights
    from scirl.weights.buckets import LARGEST_FIRST

    model = small_model()
    bucket_bytes = 1000

    def push(named_tensors) -> tuple[dict, int]:
        opened, app = [], fake_vllm()
        with app as srv:
            sync = NCCLWeightSync(
                [ServerClient(srv.url, timeout_s=10)],
                master_address="127.0.0.1",
                master_port=1,
                timeout_s=10,
                communicator_factory=lambda *a: opened.append(RecordingCommunicator(*a)) or opened[-1],
                packed=True,
                bucket_bytes=bucket_bytes,
            )
            sync.init()
            with LiveTensors() as live:
                sync.push(named_tensors(), 1, model_config=model.config)
        [init], [update] = body(app, "/init_weight_transfer_engine"), body(app, "/update_weights")
        sent = [t for _, _, t in opened[0].sent]
        return received_by_vllm(sent, init["init_info"], update["update_info"], monkeypatch), live.peak

    today = {n: t.to(torch.bfloat16) for n, t in model.state_dict().items()}  # what full_state_dict(dtype) gave
    got, peak = push(lambda: FullWeights(model, device="cpu", dtype=torch.bfloat16, first=LARGEST_FIRST))  # the sink's
    assert got.keys() == today.keys() and all(torch.equal(got[n], today[n]) for n in today)
    specs = FullWeights(model, device="cpu", dtype=torch.bfloat16, first=LARGEST_FIRST).specs
    model_bytes = sum(t.numel() * t.element_size() for t in today.values())
    assert 0 < peak <= bucket_bound(specs, bucket_bytes) < model_bytes / 3
    # the whole model at once, as pushes were before: what the tracker sees then
    _, whole = push(lambda: {n: t.to(torch.bfloat16) for n, t in model.state_dict().items()}.items())
    assert whole >= model_bytes


def test_every_push_ends_with_every_server_reporting_its_version(tmp_path):
    model = small_model()
    with fake_vllm() as good, fake_vllm(keeps_version=False) as restarted:
        clients = [ServerClient(good.url, timeout_s=10), ServerClient(restarted.url, timeout_s=10)]
        with pytest.raises(
            ServerError,
            match=r"/weight_info: reports weight version 'default' after the push of "
            r"version 3",
        ) as info:
            FilesystemWeightSync(clients, tmp_path, timeout_s=10).push(
                model.named_parameters(), 3, model_config=model.config
            )
        assert info.value.url == restarted.url.removesuffix("/v1")


@pytest.mark.parametrize("release", ["0.25", "0.32"])
def test_nccl_payloads_follow_the_release_the_workers_run(release):
    """The packing settings go where the installed release's workers read them (0.25: each update; 0.32 and
    0.33: init), so neither side refuses a key nor unpacks what was not packed; a 0.25 server, which has no
    shutdown route, is not asked to shut its engine down."""
    model = small_model()
    app = fake_vllm(release=release)
    opened = []

    def factory(*args):
        opened.append(FakeCommunicator(*args))
        return opened[-1]

    with app as srv:
        client = ServerClient(srv.url, timeout_s=10)
        sync = NCCLWeightSync(
            [client],
            master_address="127.0.0.1",
            master_port=29555,
            timeout_s=10,
            communicator_factory=factory,
            packed=False,
            payload_fields=RELEASE_PAYLOAD_FIELDS[release],
        )
        sync.init()
        sync.push(((n, p.detach()) for n, p in model.named_parameters()), 3, model_config=model.config)
        [init] = body(app, "/init_weight_transfer_engine")
        [update] = body(app, "/update_weights")
        assert ("packed" in init["init_info"]) == (release != "0.25")
        assert ("packed" in update["update_info"]) == (release == "0.25")
        assert sync.unversioned == ([client.url] if release == "0.25" else [])
        sync.close()
        assert ("/shutdown_weight_transfer_engine" in routes(app)) == (release != "0.25")


def test_a_025_server_takes_filesystem_pushes_and_says_it_keeps_no_version(tmp_path):
    """vLLM 0.25 keeps no weight version: the push reloads it, records nothing, and reports it as unversioned
    (the probe then checks every push, ``WeightCheck.every_push``); a 0.32 server is confirmed by version."""
    model = small_model()
    old_app, new_app = fake_vllm(release="0.25"), fake_vllm()
    with old_app as old, new_app as new:
        clients = [ServerClient(old.url, timeout_s=10), ServerClient(new.url, timeout_s=10)]
        sync = FilesystemWeightSync(clients, tmp_path / "broadcasts", timeout_s=10)
        sync.push(((n, p.detach()) for n, p in model.named_parameters()), 1, model_config=model.config)
        assert sync.unversioned == [clients[0].url]
        assert "/reset_prefix_cache" in routes(old_app)  # answered with an empty body, as 0.25 does
        assert "/update_weight_version" not in routes(old_app) and "/update_weight_version" in routes(new_app)
        assert new_app.state.version == "1"
        assert clients[0].weight_checksums() is None  # no /weight_checker either: the probe alone checks it


def test_the_probe_runs_after_every_push_where_versions_cannot_be_confirmed():
    from scirl.weights.check import WeightCheck

    class Stub:
        dtype = torch.float32

    check = WeightCheck(Stub(), ([1, 2, 3], 1), interval=10)
    assert [check.due(v) for v in (0,)] == [True]
    check.checked_once = True
    assert [check.due(v) for v in (1, 2, 10)] == [False, False, True]
    check.every_push = True
    assert [check.due(v) for v in (1, 2, 10)] == [True, True, True]


def test_trainer_init_gets_a_rank_only_where_it_takes_one():
    """vLLM's trainer_init takes ``rank`` from 0.31 on; before, the keyword is a TypeError (rank 0 implied)."""
    from scirl.weights.nccl import rank_argument

    def before_031(init_info):
        return init_info

    def from_031(init_info, rank=0):
        return init_info, rank

    assert rank_argument(from_031, 0) == {"rank": 0} and rank_argument(from_031, 2) == {"rank": 2}
    assert rank_argument(before_031, 0) == {}
    with pytest.raises(ValueError, match="rank 0 only"):
        rank_argument(before_031, 1)
