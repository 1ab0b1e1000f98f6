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

from scirl.errors import PreflightError


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
                held.append(claim(host, first_server_port + i, "deployment.port" if i == 0 else f"deployment.port + {i}",
                                  "set deployment.port = 0 (free ports) or free it"))
        else:
            held += [claim(host, 0, "a server port", "") for _ in range(n_servers)]
        held.append(claim(host, nccl_port, "deployment.nccl_port", "set deployment.nccl_port = 0 (a free port) or free it"))
        if rendezvous:
            held.append(claim("127.0.0.1", 0, "the rendezvous port", ""))
        ports = [sock.getsockname()[1] for sock in held]
    finally:
        for sock in held:
            sock.close()
    return Ports(host, ports[:n_servers], ports[n_servers], ports[n_servers + 1] if rendezvous else None)


def pick(host: str, port: int, what: str, fix: str) -> int:
    """``port`` checked free on ``host``, or (0) a free one; a PreflightError names a taken one."""
    with claim(host, port, what, fix) as sock:
        return sock.getsockname()[1]


def claim(host: str, port: int, what: str, fix: str) -> socket.socket:
    """A socket bound to ``host:port`` (0: a free port), or a PreflightError naming the port and its holder."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    # a port left in TIME_WAIT by a finished run is free to reuse; one with a live listener still fails
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        holder = port_holder(port) if port else None
        by = f" by {holder}" if holder else ""
        raise PreflightError(f"{what} {port} on {host} is in use{by}: {exc.strerror or exc}; fix: {fix or 'retry'}") from None
    return sock


def port_holder(port: int) -> str | None:
    """``pid N (command line)`` of a process listening on TCP ``port``, from ``/proc`` (None where it
    cannot be seen: another user's process, or no ``/proc``)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            # local_address is HEXIP:HEXPORT; state 0A is LISTEN; field 9 is the socket's inode
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return None
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in inodes for fd in fds):
                cmdline = " ".join(Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").replace("\0", " ").split())
                return f"pid {pid} ({cmdline[:120]})"  # whitespace collapsed: the error stays one line
        except OSError:  # gone meanwhile, or not ours to look at
            continue
    return None


def urls(ports: Ports) -> list[str]:
    """The servers' base URLs as the trainer reaches them (a wildcard listen address is reached on loopback)."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(ports.host, ports.host)
    host = f"[{host}]" if ":" in host else host
    return [f"http://{host}:{port}" for port in ports.servers]


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
