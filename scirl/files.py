"""Files that survive a crash: written whole or not at all, and flushed to the disk before they count.
A checkpoint, a weight snapshot a server on another node reads, and a config are all written so."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def seal_file(path: Path) -> dict[str, Any]:
    """fsync a written file and return its manifest entry (size, sha256)."""
    digest = hashlib.sha256()
    with open(path, "rb+") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
        os.fsync(f.fileno())
    return {"size": path.stat().st_size, "sha256": digest.hexdigest()}


def write_text_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` so a reader sees the old or the new content, never a mix."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def seal_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
