"""The inference server client against fake vLLM servers (``tests/fakes/openai_server.py``; no vLLM): a dead URL,
a hung server, prompts spread over servers with every sampling field, a generation cancelled while it runs, the
server's command line, and URLs with or without /v1.
"""

from __future__ import annotations

import socket
import threading

import pytest

from fakes.openai_server import body, fake_vllm
from helpers.server_process import free_port
from scirl.inference.base import SamplingParams
from scirl.inference.client import ServerClient, ServerError
from scirl.inference.remote import RemoteGenerator
from scirl.inference.vllm_command import server_command


def test_a_dead_url_fails_fast_and_clearly():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    client = ServerClient(url, timeout_s=600, model="m")
    with pytest.raises(ServerError, match=rf"^{url}/v1/completions: cannot connect"):
        client.complete([1, 2], SamplingParams(max_tokens=2), seed=0, stop_token_ids=[2])
    assert not client.is_healthy()
    with pytest.raises(ServerError, match="process exited"):
        client.wait_ready(timeout_s=600, alive=lambda: False)
    with pytest.raises(ServerError, match="not ready after 0.2s"):
        client.wait_ready(timeout_s=0.2)


def test_a_hung_server_times_out():
    """A server that accepts the connection and never answers (as a stopped process does)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)  # the kernel completes connections; nobody ever reads them
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    try:
        with pytest.raises(ServerError, match=r"/v1/completions: no answer within 0.5s"):
            ServerClient(url, timeout_s=0.5, model="m").complete([1, 2], SamplingParams(max_tokens=2), seed=0)
    finally:
        listener.close()


def test_remote_generator_spreads_prompts_and_sends_every_sampling_field():
    a, b = fake_vllm(), fake_vllm()
    with a as srv_a, b as srv_b:
        generator = RemoteGenerator(
            [srv_a.url, srv_b.url], _Tokenizer(), model_name="m", timeout_s=10, max_concurrency=4
        )
        groups = generator.generate(
            [[1], [2], [3]], SamplingParams(n=2, temperature=0.7, top_p=0.9, max_tokens=4, seed=3)
        )
        assert [len(g) for g in groups] == [2, 2, 2] and groups[0][0].token_ids == [5, 2]
        sent = {tuple(b_["prompt"]): b_ for app in (a, b) for b_ in body(app, "/v1/completions")}
        assert len(body(a, "/v1/completions")) == 2 and len(body(b, "/v1/completions")) == 1
        first = sent[(1,)]
        assert first["top_k"] == 0 and first["min_p"] == 0 and first["repetition_penalty"] == 1
        assert first["stop_token_ids"] == [2] and first["logprobs"] == 0 and first["return_token_ids"] is True
        assert first["model"] == "m" and first["temperature"] == 0.7 and first["top_p"] == 0.9
        assert len({s["seed"] for s in sent.values()}) == 3  # one seed per prompt
        # greedy with n > 1: one request with n = 1, copied
        greedy = generator.generate([[1]], SamplingParams(n=3, temperature=0, max_tokens=4))[0]
        assert len(greedy) == 3 and greedy[0].token_ids is not greedy[1].token_ids
        assert [b_["n"] for app in (a, b) for b_ in body(app, "/v1/completions") if b_["temperature"] == 0] == [1]
        with pytest.raises(RuntimeError, match="NCCLWeightSync"):
            generator.update_weights([])
        generator.close()


def test_should_stop_cancels_a_generation_still_running():
    from scirl.inference.base import GenerationCancelled

    gate = threading.Event()
    app = fake_vllm(gate=gate)
    with app as srv:
        generator = RemoteGenerator([srv.url], _Tokenizer(), model_name="m", timeout_s=30, max_concurrency=2)
        try:
            with pytest.raises(GenerationCancelled):
                generator.generate(
                    [[1], [2], [3], [4]],
                    SamplingParams(max_tokens=2, seed=0),
                    should_stop=lambda: len(body(app, "/v1/completions")) == 2,
                )
        finally:
            gate.set()  # the two requests already sent finish, unread
            generator.close()
    assert len(body(app, "/v1/completions")) == 2  # the queued two were never sent


class _Tokenizer:
    eos_token_id = 2
    name_or_path = ""


def test_server_command_cpu_gpu_and_bad_combinations():
    argv, env = server_command(
        "m", port=8001, served_model_name="pol", dtype="float32", max_model_len=512, device="cpu", kv_cache_gib=0.5
    )
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    # dev routes; no usage report to vLLM's stats server; "m" is no local directory, so the hub stays reachable
    # (and vLLM's own sampler where FlashInfer is missing: test_engines_and_servers_use_vllms_own_sampler_...)
    env.pop("VLLM_USE_FLASHINFER_SAMPLER", None)
    # on CPU the engine process runs the model itself (no second interpreter for vLLM's one worker)
    assert env == {
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }
    flags = " ".join(argv)
    assert "--logprobs-mode processed_logprobs" in flags and "--enforce-eager" in flags
    assert f"--kv-cache-memory-bytes {1 << 29}" in flags and "--no-enable-chunked-prefill" in flags
    assert "--weight-transfer-config" not in flags and "--data-parallel-size" not in flags

    argv, env = server_command(
        "m",
        port=8001,
        served_model_name="pol",
        dtype="bfloat16",
        max_model_len=4096,
        device="cuda",
        data_parallel_size=6,
        weight_sync="nccl",
        gpu_memory_utilization=0.8,
    )
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env  # a GPU server keeps vLLM's own process layout
    flags = " ".join(argv)
    assert "--data-parallel-size 6" in flags and "--gpu-memory-utilization 0.8" in flags
    assert argv[argv.index("--weight-transfer-config") + 1] == '{"backend": "nccl"}'
    assert "--enforce-eager" not in flags and "--no-enable-chunked-prefill" not in flags

    for bad in (
        dict(device="cpu", weight_sync="nccl"),
        dict(device="cpu", data_parallel_size=2),
        dict(device="tpu"),
        dict(device="cuda", weight_sync="ipc"),
    ):
        with pytest.raises(ValueError):
            server_command("m", port=1, served_model_name="p", dtype="float32", max_model_len=8, **bad)


def test_client_urls_with_or_without_v1():
    assert ServerClient("http://h:1/v1/").url == ServerClient("http://h:1").url == "http://h:1"
    assert (
        str(ServerError("http://h:1", "/x", "status 500", "line one\nline two"))
        == "http://h:1/x: status 500: line one line two"
    )


def test_engines_and_servers_use_vllms_own_sampler_where_flashinfer_is_missing(monkeypatch):
    """vLLM's GPU sampler imports FlashInfer unless VLLM_USE_FLASHINFER_SAMPLER=0: a server started without
    the package gets the variable; with FlashInfer installed, or the variable set by the user, nothing is added."""
    import importlib.util

    from scirl.inference import vllm as vllm_module

    real_find_spec = importlib.util.find_spec
    monkeypatch.delenv("VLLM_USE_FLASHINFER_SAMPLER", raising=False)
    for installed in (False, True):
        monkeypatch.setattr(
            vllm_module.importlib.util,
            "find_spec",
            lambda name, *a, installed=installed: (
                object()
                if name == "flashinfer" and installed
                else (None if name == "flashinfer" else real_find_spec(name, *a))
            ),
        )
        _, env = server_command(
            "m", port=8000, served_model_name="m", dtype="bfloat16", max_model_len=64, device="cuda"
        )
        assert env.get("VLLM_USE_FLASHINFER_SAMPLER") == (None if installed else "0")
    monkeypatch.setenv("VLLM_USE_FLASHINFER_SAMPLER", "1")
    assert (
        "VLLM_USE_FLASHINFER_SAMPLER"
        not in server_command("m", port=8000, served_model_name="m", dtype="bfloat16", max_model_len=64, device="cuda")[
            1
        ]
    )
