"""The GPU path's contracts, checked on a CPU with stand-ins that behave as the real APIs do (read from
torch's and vLLM's source): a CUDA device without an index, a trainer whose compute dtype is not bf16,
a host whose name resolves to 127.0.1.1, and vLLM's usage report on a machine without network.

Which of these paths have run on real GPUs is listed in the README's GPU section.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import scirl
from fakes.nccl import FakeCommunicator, received_by_vllm
from fakes.openai_server import body, fake_vllm
from scirl import algorithms

DEMO_BASE = Path(scirl.__file__).parent / "assets" / "demo-base"


# ---- one GPU: the device needs its index ----


def test_a_single_process_on_cuda_gets_an_indexed_device(monkeypatch):
    """``torch.cuda.set_device(torch.device("cuda"))`` raises ("Expected a torch.device with a specified
    index or an integer"): every single-GPU run used to crash at start-up."""
    from torch.cuda._utils import _get_device_index

    from scirl import distributed

    chosen = []

    def set_device(device):  # torch's own argument check, then what setDevice would get
        chosen.append(_get_device_index(device))

    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for variable in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(variable, raising=False)
    for asked in ("cuda", "auto"):
        dist, device = distributed.setup(asked)
        assert device == torch.device("cuda:0") and dist.world_size == 1
    dist, device = distributed.setup("cuda:3")  # asked for by index: kept
    assert device == torch.device("cuda:3")
    assert chosen == [0, 0, 3]


# ---- the wire dtype is the trainer's ----


def test_a_float32_run_pushes_float32_weights_over_nccl(monkeypatch, tmp_path):
    """The servers compute in the trainer's dtype (the launcher starts them so): a float32 run's weights
    used to travel as bf16, and sampler and trainer drifted apart by bf16 rounding. What vLLM's own packed
    receiver unpacks from the push's buckets is compared."""
    from transformers import AutoTokenizer

    import scirl.weights.nccl as nccl
    from scirl.distributed import Dist
    from scirl.run.config import TrainConfig
    from scirl.trainer import Trainer
    from scirl.trainer.model import load_model
    from scirl.weights.check import WeightCheck
    from scirl.weights.servers import start_server_sink

    opened = []
    monkeypatch.setattr(nccl, "_open_nccl_endpoint", lambda *args: opened.append(FakeCommunicator(*args)) or opened[-1])
    server = fake_vllm()
    with server as srv:
        cfg = TrainConfig(
            model=str(DEMO_BASE),
            device="cpu",
            dtype="float32",
            output_dir=str(tmp_path),
            inference={"urls": [srv.url]},
            deployment={"weight_sync": "nccl", "verify_interval": 0},
        )
        model = load_model(str(DEMO_BASE), torch.device("cpu"), Dist(), torch.float32)
        trainer = Trainer(
            model,
            cfg.optim,
            algorithms.build(cfg),
            temperature=1.0,
            device=torch.device("cpu"),
            dist=Dist(),
            dtype=torch.float32,
        )
        start_server_sink(
            trainer,
            AutoTokenizer.from_pretrained(DEMO_BASE),
            cfg.deployment,
            cfg.inference.urls,
            run_dir=tmp_path,
            start_step=0,
            check=WeightCheck(trainer, ([1, 2, 3], 1), interval=0),
            replicas=[],
            between_batches=lambda version, push: push(),
        )
        info = body(server, "/update_weights")[0]["update_info"]
        init = body(server, "/init_weight_transfer_engine")[0]["init_info"]
    assert set(info["dtype_names"]) == {"float32"}
    sent = received_by_vllm([tensor for _, _, tensor in opened[0].sent], init, info, monkeypatch)
    for name, weight in model.state_dict().items():  # bit for bit
        assert sent[name].dtype == torch.float32 and torch.equal(sent[name], weight), name
    # tied embeddings: the head goes too, or vLLM keeps its old one
    assert torch.equal(sent["lm_head.weight"], model.state_dict()["model.embed_tokens.weight"])


# ---- where the servers reach the trainer ----


class MultiHomedHost:
    """A machine with a loopback, an office LAN and a cluster network, whose hostname resolves to
    127.0.1.1 (stock Debian/Ubuntu /etc/hosts). ``socket()`` stands in for the UDP socket the kernel
    routes: connecting picks the interface by the destination's network."""

    ROUTES = {"10.": "10.0.0.7", "192.168.": "192.168.1.20", "127.": "127.0.0.1"}

    def gethostname(self):
        return "trainer-node"

    def gethostbyname(self, name):
        return "127.0.1.1"

    def socket(self, family, kind):
        host = self

        class RoutedSocket:
            def connect(self, address):
                self.source = next(src for prefix, src in host.ROUTES.items() if address[0].startswith(prefix))

            def getsockname(self):
                return (self.source, 40000)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

        return RoutedSocket()


def test_the_nccl_address_is_the_interface_that_routes_to_the_servers(monkeypatch):
    import scirl.weights.servers as servers
    from scirl.errors import TrainError

    host = MultiHomedHost()
    for name in ("gethostname", "gethostbyname", "socket"):
        monkeypatch.setattr(servers.socket, name, getattr(host, name))
    assert servers.nccl_master_address(["http://10.0.3.1:8000", "http://10.0.3.2:8000"]) == "10.0.0.7"
    assert servers.nccl_master_address(["http://192.168.1.5:8000"]) == "192.168.1.20"
    assert servers.nccl_master_address(["http://127.0.0.1:8000", "http://localhost:8001"]) == "127.0.0.1"
    assert servers.nccl_master_address(["http://10.0.3.1:8000"], "10.9.9.9") == "10.9.9.9"  # deployment.nccl_address
    with pytest.raises(TrainError, match="different interfaces.*deployment.nccl_address"):
        servers.nccl_master_address(["http://10.0.3.1:8000", "http://192.168.1.5:8000"])


# ---- offline: no usage report ----


@pytest.mark.slow
def test_vllm_engines_started_by_scirl_send_no_usage_report(tmp_path):
    """vLLM posts usage statistics to its server at start-up unless told not to; a training machine is
    often offline. Asked of vLLM itself, in a fresh process, after scirl's import of it."""
    pytest.importorskip("vllm")
    code = (
        "import json; from scirl.inference.vllm import import_vllm; import_vllm(); "
        "from vllm.usage.usage_lib import is_usage_stats_enabled; print(json.dumps(is_usage_stats_enabled()))"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_NO_USAGE_STATS", "DO_NOT_TRACK", "VLLM_DO_NOT_TRACK")}
    env["HOME"] = str(tmp_path)  # no do-not-track file of the user's
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) is False


def test_a_local_model_server_never_asks_the_hub():
    from scirl.inference.vllm_command import server_command

    _, env = server_command(
        str(DEMO_BASE), port=1, served_model_name="p", dtype="float32", max_model_len=64, device="cpu"
    )
    assert env["HF_HUB_OFFLINE"] == "1" and env["VLLM_NO_USAGE_STATS"] == "1" and env["DO_NOT_TRACK"] == "1"
