"""``scirl inference``: one vLLM server for a run's model in the foreground, started exactly as the
launcher starts its servers (``plan.server_process``: the same flags, dtype, memory settings and
environment), for a trainer elsewhere to reach through ``--inference.urls``.

It says the URL to give the trainer at once, waits until the server answers (a line every few seconds
while it loads), and then only watches: Ctrl-C or SIGTERM stops the server's whole process tree, and a
server that exits on its own ends the command with its status.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from dataclasses import dataclass

from scirl.deploy import preflight
from scirl.deploy.plan import ServerProcess, ServerSlot, cpu_core, server_process
from scirl.deploy.supervisor import Supervisor
from scirl.errors import DeployError, PreflightError
from scirl.inference.client import HEALTH_TIMEOUT_S, ServerClient, ServerError, wait_until_ready
from scirl.net import host_port, pick

STOP_GRACE_S = 30  # a stopped server's engines get this long before SIGKILL
WILDCARDS = {"0.0.0.0": "127.0.0.1", "::": "::1"}  # listening on every address: probed on loopback


@dataclass(frozen=True)
class Server:
    process: ServerProcess
    url: str  # where a trainer reaches it
    local_url: str  # where this machine asks it whether it is ready


def server_for(cfg, *, host: str, port: int, gpus: int | None = None) -> Server:
    """One server for ``cfg``'s model on ``host:port`` (0: a free port, picked now; a given one is checked
    free), data parallel over ``gpus`` GPUs (None: every visible one; none on a CPU)."""
    cuda = preflight.on_cuda(cfg.device)
    if not cuda and gpus:
        raise PreflightError(
            f"--gpus {gpus}: this server runs on the CPU (no CUDA device here, or device = cpu); fix: leave out --gpus"
        )
    chosen = preflight.plan_gpus(gpus or len(preflight.visible_gpus()), 0).infer if cuda else []
    if cuda and not chosen:
        raise PreflightError("no GPU is visible for the server; fix: set CUDA_VISIBLE_DEVICES or --device cpu")
    port = pick(host, port, "--port", "choose another --port, or 0 for a free one")
    slot = ServerSlot(
        0,
        host,
        port,
        chosen,
        len(chosen) or 1,
        cfg.deployment.weight_sync_on(cuda),
        cfg,
        cpu=None if cuda else cpu_core(0),
    )
    reach = socket.getfqdn() if host in WILDCARDS else host  # the trainer, elsewhere, reaches this machine by name
    return Server(
        server_process(slot), f"http://{host_port(reach, port)}", f"http://{host_port(WILDCARDS.get(host, host), port)}"
    )


def serve(server: Server, cfg) -> int:
    """Run the server until it exits or this command is stopped; the exit status."""
    supervisor = Supervisor()
    supervisor.install_signal_handlers()
    try:
        say(f"serving {cfg.model} at {server.url}; give the trainer --inference.urls {server.url}")
        process = server.process
        child = supervisor.start("the server", process.argv, {**os.environ, **process.env}, None, cpu=process.cpu)
        started = time.monotonic()
        client = ServerClient(server.local_url, timeout_s=HEALTH_TIMEOUT_S)
        try:
            wait_until_ready(
                [client],
                cfg.deployment.startup_timeout_s,
                say=say,
                alive=lambda: child.exited() is None and not supervisor.stop_requested.is_set(),
            )
        except ServerError as exc:
            if supervisor.stop_requested.is_set():
                return supervisor.stopped_status()
            if child.exited() is not None:
                raise DeployError(
                    f"the server exited with status {child.exited()} before it was ready (its output is above)"
                ) from None
            raise DeployError(
                f"the server was not ready within deployment.startup_timeout_s = "
                f"{cfg.deployment.startup_timeout_s:g}s ({exc})"
            ) from None
        finally:
            client.close()
        say(f"ready after {time.monotonic() - started:.0f}s: {server.url}")
        if supervisor.wait_for_exit_or_stop() is None:
            say("stopping the server")
            return supervisor.stopped_status()
        code = child.exited()
        say(f"the server exited with status {code}")
        return code if code >= 0 else 128 - code
    finally:
        supervisor.stop([child for child in supervisor.children if child.exited() is None], STOP_GRACE_S)
        supervisor.close()


def say(text: str) -> None:
    print(f"scirl inference: {text}", file=sys.stderr, flush=True)
