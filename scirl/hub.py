"""The Hugging Face Hub from here: offline by choice, reachable, or not, found out in seconds and said in one line.

``huggingface_hub`` and ``datasets`` retry a hub they cannot reach for tens of seconds per file (without hub
access a training run with a hub model id waited 51 s before its error); one request with a deadline answers
first. ``HF_HUB_OFFLINE=1`` skips it: the local cache then answers alone.
"""

from __future__ import annotations

import os
import threading

import httpx

PROBE_TIMEOUT_S = 5.0
OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


def offline() -> bool:
    """Whether the environment says to use the local cache only (``HF_HUB_OFFLINE=1`` or ``HF_DATASETS_OFFLINE=1``)."""
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on") for v in OFFLINE_VARIABLES)


def endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def answer_problem(response) -> str | None:
    """None when ``response`` comes from the hub itself: 200 with the repository's JSON, or a JSON
    error (401/403/404: a wrong id or a gated repository, which the loader then reports precisely).
    Anything else (an empty 404 from a proxy, a 5xx, an HTML page) means no usable hub."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if response.status_code == 200 and isinstance(body, dict) and "id" in body:
        return None
    if response.status_code in (401, 403, 404) and isinstance(body, dict) and "error" in body:
        return None
    return f"HTTP {response.status_code} from {response.url} is not an answer from the hub"


def probe(api_path: str, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """None if the hub answers ``GET /api/<api_path>`` (``models/ORG/NAME``, ``datasets/ORG/NAME``) within
    ``timeout`` seconds, else the reason it did not.

    The request runs in a daemon thread so that even a DNS lookup that hangs (which no socket timeout covers)
    cannot make the caller wait longer than ``timeout``."""
    url = f"{endpoint()}/api/{api_path}"
    outcome: dict[str, str | None] = {}

    def request() -> None:
        try:
            response = httpx.get(url, timeout=timeout, follow_redirects=True)
            outcome["error"] = answer_problem(response)
        except Exception as e:  # any network failure means "no hub access"
            outcome["error"] = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__

    thread = threading.Thread(target=request, daemon=True)
    thread.start()
    thread.join(timeout + 0.5)
    if thread.is_alive() or "error" not in outcome:
        return f"no answer from {endpoint()} within {timeout:.0f} s"
    return outcome["error"]


def unreachable(what: str, reason: str, local: str, cached: bool | None = None) -> str:
    """One line: ``what`` (``'org/name'``, ``model 'org/name'``) cannot be had from the hub (``reason``), then the
    two ways on: ``local``, the local alternative, and the local cache (``cached``: whether it holds ``what``, None:
    not known). Under ``HF_HUB_OFFLINE`` the cache was the way, and it lacks ``what``."""
    reason = " ".join(reason.split())
    if offline():
        return (
            f"{what} is not in the local Hugging Face cache, and HF_HUB_OFFLINE=1 keeps the hub out ({reason}); "
            f"fix: {local}, or unset HF_HUB_OFFLINE where the hub is reachable"
        )
    cache = {
        True: "set HF_HUB_OFFLINE=1 to use its copy in the local cache",
        False: "set HF_HUB_OFFLINE=1 once the local cache holds it (downloaded where the hub is reachable)",
        None: "set HF_HUB_OFFLINE=1 to use the local cache if it holds it",
    }[cached]
    return f"cannot reach the Hugging Face Hub to load {what} ({reason}); fix: {local}, or {cache}"
