"""Ports: one checked free (or a free one picked) before anything listens on it, who holds a taken
one, and an address with its port as URLs write it. No port is a constant: a fixed port that collided
silently once cost a run its budget."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from scirl.errors import PreflightError


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
        raise PreflightError(
            f"{what} {port} on {host} is in use{by}: {exc.strerror or exc}; fix: {fix or 'retry'}"
        ) from None
    return sock


def host_port(host: str, port: int) -> str:
    """``host:port``, an IPv6 address in brackets (``[::1]:8000``), as URLs and torchrun take it."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


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
                cmdline = " ".join(
                    Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").replace("\0", " ").split()
                )
                return f"pid {pid} ({cmdline[:120]})"  # whitespace collapsed: the error stays one line
        except OSError:  # gone meanwhile, or not ours to look at
            continue
    return None
