"""Every port a deployment uses: picked free at start (bind port 0), or checked when the config names
one, and recorded in ``<run_dir>/ports.json``.

No port is a constant: two runs on one machine, or a run right after another, never collide on a
default (a fixed NCCL port that collided silently cost a whole run its budget). A taken port is a
one-line error that names the port and, where ``/proc`` shows it, the process holding it.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import asdict, dataclass
from pathlib import Path

from scirl.net import claim, host_port


@dataclass(frozen=True)
class Ports:
    host: str
    servers: list[int]  # one per inference server, in server order
    nccl: int  # the weight broadcast's rendezvous (the trainer's rank 0 listens on it)
    rendezvous: int | None  # torchrun's rendezvous; None for a single trainer process


def allocate(host: str, *, first_server_port: int, n_servers: int, nccl_port: int, rendezvous: bool) -> Ports:
    """Check the ports the config names and pick the rest. Every picked socket stays bound until all
    are picked, so no two picks get the same port."""
    held: list[socket.socket] = []
    try:
        if first_server_port:
            for i in range(n_servers):
                held.append(
                    claim(
                        host,
                        first_server_port + i,
                        "deployment.port" if i == 0 else f"deployment.port + {i}",
                        "set deployment.port = 0 (free ports) or free it",
                    )
                )
        else:
            held += [claim(host, 0, "a server port", "") for _ in range(n_servers)]
        held.append(
            claim(host, nccl_port, "deployment.nccl_port", "set deployment.nccl_port = 0 (a free port) or free it")
        )
        if rendezvous:
            held.append(claim("127.0.0.1", 0, "the rendezvous port", ""))
        ports = [sock.getsockname()[1] for sock in held]
    finally:
        for sock in held:
            sock.close()
    return Ports(host, ports[:n_servers], ports[n_servers], ports[n_servers + 1] if rendezvous else None)


def urls(ports: Ports) -> list[str]:
    """The servers' base URLs as the trainer reaches them (a wildcard listen address is reached on loopback)."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(ports.host, ports.host)
    return [f"http://{host_port(host, port)}" for port in ports.servers]


def write(ports: Ports, path: Path) -> None:
    """``ports.json``: every port of the run and the server URLs (written whole: temp file, then rename)."""
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({**asdict(ports), "urls": urls(ports)}, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
