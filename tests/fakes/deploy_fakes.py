"""Stand-ins for the launcher's tests (``tests/deploy/test_deploy.py``, the demo's in ``tests/e2e/test_demo.py``):
real processes, no vLLM, no model.

``python deploy_fakes.py server --port P --mode ok|never|exit [--die-when FILE] [--dev-routes yes|no]``
    the fake OpenAI server (``openai_server.py``) answering ``/health`` (200 with ``ok``, 503 with ``never``;
    ``exit`` fails at start) and, unless ``--dev-routes no``, vLLM's dev routes (the client's weight-sync check
    asks one); it dies (exit 7) once FILE exists.
``python deploy_fakes.py trainer --record DIR --behave ok|crash|refuse|wait|demo [config args...]``
    a trainer that records its argv and rank, waits until every server in ``--inference.urls`` answers, then
    finishes, crashes, refuses its input (exit 2), waits for SIGTERM (recorded), says it stopped after step 1 and
    exits 143 as ``scirl train`` does, or (``demo``) leaves the weights and metrics a finished run leaves.
``python deploy_fakes.py vllm-view --port P --root DIR``
    the fake OpenAI server answering the routes a trainer's start asks of a vLLM server (``/health``, ``/v1/models``,
    ``/collective_rpc reload_weights``, ...) as vLLM 0.32 does, whose file system is DIR's: it sees a path
    ``/a/b`` at ``DIR/a/b``, as a node that does not mount the trainer's file system sees another one. A
    reload from a path it cannot see gets vLLM's own answer for a missing path.
``python deploy_fakes.py on-node --record DIR [--server-mode M] [--behave B] NODE -- PART_ARGV...``
    a multi-node job's per-node launcher (``scirl job --on-node``) with the two first fakes in place of the
    part it is given: ``scirl inference ... --host H --port P`` becomes ``server`` on H:P, torchrun's
    ``scirl train ...`` becomes ``trainer`` (rank 0 on the node that hosts the rendezvous).
``python deploy_fakes.py launch SPEC.json``
    ``scirl train``'s deployment path with the two above in place of vLLM and ``-m scirl train`` (or
    with the real vLLM server: ``"vllm": true`` in SPEC).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve()
WAIT_LIMIT_S = 300  # no fake waits forever, even if a test forgets it


def record(directory: str | None, name: str, data: dict) -> None:
    if directory:
        path = Path(directory) / name
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)  # whole or absent: a test polls for it


def server(argv: list[str]) -> int:
    from fakes.openai_server import FakeOpenAI, VLLMRoutes

    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--mode", default="ok")
    parser.add_argument("--die-when")
    parser.add_argument("--record")
    parser.add_argument("--dev-routes", default="yes")
    args = parser.parse_args(argv)
    record(
        args.record,
        f"server_{args.index}.json",
        {"pid": os.getpid(), "env": dict(os.environ), "affinity": sorted(os.sched_getaffinity(0))},
    )
    print(f"fake server {args.index}: loading model", flush=True)
    if args.mode == "exit":
        print("ValueError: fake model load failed", flush=True)
        return 3

    with FakeOpenAI(
        ready=lambda: args.mode == "ok",
        vllm=VLLMRoutes() if args.dev_routes == "yes" else None,
        host=args.host,
        port=args.port,
    ):
        print(f"fake server {args.index}: listening on {args.port}", flush=True)
        deadline = time.monotonic() + WAIT_LIMIT_S
        while time.monotonic() < deadline:
            if args.die_when and os.path.exists(args.die_when):
                print("RuntimeError: fake engine core died", flush=True)
                os._exit(7)
            time.sleep(0.05)
    return 0


# vLLM 0.32's answer to POST /collective_rpc reload_weights with a weights_path that does not exist there
# (the path is taken for a hub repo id; vLLM writes '<path>' for it)
MISSING_PATH_ANSWER = {
    "error": {
        "message": "Call to collective_rpc method failed: Worker failed with error 'Repo id "
        "must be in the form 'repo_name' or 'namespace/repo_name': '<path>'. Use `repo_type` "
        "argument if needed.', please check the stack trace above for the root cause",
        "type": "InternalServerError",
        "param": None,
        "code": 500,
    }
}


def vllm_view(argv: list[str]) -> int:
    from fakes.openai_server import FakeOpenAI, Reply, VLLMRoutes

    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--root", required=True)
    args = parser.parse_args(argv)

    def reload_from_what_this_node_sees(request):
        if request.body.get("method") != "reload_weights":
            return Reply(404, {"detail": "Not Found"})
        seen = Path(args.root) / request.body["kwargs"]["weights_path"].lstrip("/")
        return None if seen.is_dir() else Reply(500, MISSING_PATH_ANSWER)

    with FakeOpenAI(
        model="policy",
        max_model_len=512,
        vllm=VLLMRoutes(),
        port=args.port,
        fail={"/collective_rpc": reload_from_what_this_node_sees},
    ):
        time.sleep(WAIT_LIMIT_S)
    return 0


def trainer(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--record", required=True)
    parser.add_argument("--behave", default="ok")
    parser.add_argument("--inference.urls", dest="urls", default="")
    parser.add_argument("--output-dir", default="")
    args, config_args = parser.parse_known_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    urls = [url for url in args.urls.split(",") if url]
    answers = [health(url) for url in urls]
    # as scirl train: a SIGTERM while it waits for its servers ends it at once; after that it asks for a checkpoint
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    record(
        args.record,
        f"trainer_{rank}.json",
        {
            "pid": os.getpid(),
            "argv": sys.argv,
            "urls": urls,
            "health": answers,
            "world_size": os.environ.get("WORLD_SIZE"),
            "server_processes": server_processes(urls),
        },
    )
    print(f"fake trainer rank {rank}: step 1 done", flush=True)
    if args.behave == "crash":
        print("Traceback (most recent call last):\ntorch.OutOfMemoryError: fake CUDA out of memory", flush=True)
        return 1
    if args.behave == "refuse":  # as scirl train refusing its input
        print("scirl train: fake refusal of a bad input", flush=True)
        return 2
    if args.behave == "demo":
        if rank == 0:
            leave_a_run(config_args + ["--output-dir", args.output_dir])
        return 0
    if args.behave == "wait":
        if not stop.wait(WAIT_LIMIT_S):
            return 9
        record(args.record, f"sigterm_{rank}.json", {"pid": os.getpid()})
        print(f"fake trainer rank {rank}: checkpoint saved after SIGTERM", flush=True)
        if rank == 0:  # as scirl train's rank 0 ends a stop
            from scirl.run.rundir import stopped_line

            print(stopped_line("SIGTERM", 1, Path(args.output_dir)), flush=True)
        return 128 + signal.SIGTERM
    return 0


def health(url: str) -> int:
    """``/health``'s status once the server answers: as scirl train, the trainer waits for a server that is
    still starting (in a multi-node job the trainer starts beside the servers)."""
    deadline = time.monotonic() + WAIT_LIMIT_S
    while True:
        try:
            return urllib.request.urlopen(url + "/health", timeout=10).status
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def leave_a_run(config_args: list[str]) -> None:
    """What ``scirl train`` leaves for the demo's last evaluation: the last step's weights (here the base
    model's, unchanged) and one metrics row per step."""
    import shutil

    from scirl.run.config_io import load_config

    cfg = load_config(config_args)
    out = Path(cfg.output_dir)
    shutil.copytree(cfg.model, out / "weights" / f"step_{cfg.max_steps}")
    with (out / "metrics.jsonl").open("w") as f:
        f.writelines(json.dumps({"step": step, "reward/mean": 0.5}) + "\n" for step in range(1, cfg.max_steps + 1))


def server_processes(urls: list[str]) -> list[int]:
    """Every process of each server's session (a vLLM server's engine processes too): the test checks
    that none outlives the run."""
    from scirl.net import port_holder

    pids = []
    for url in urls:
        holder = port_holder(int(url.rsplit(":", 1)[1]))
        if holder:
            session = os.getsid(int(holder.split()[1]))
            pids += [int(p) for p in os.listdir("/proc") if p.isdigit() and session_of(int(p)) == session]
    return pids


def session_of(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def on_node(argv: list[str]) -> int:
    split = argv.index("--")
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--record", required=True)
    parser.add_argument("--server-mode", default="ok")
    parser.add_argument("--behave", default="wait")
    parser.add_argument("node")
    args, part = parser.parse_args(argv[:split]), argv[split + 1 :]
    if "inference" in part:
        fake = [
            "server",
            "--host",
            part[part.index("--host") + 1],
            "--port",
            part[part.index("--port") + 1],
            "--mode",
            args.server_mode,
            "--record",
            args.record,
        ]
        os.execv(sys.executable, [sys.executable, str(HERE), *fake])
    rank = "0" if "is_host=1" in part else "1"
    train_args = part[part.index("train") + 1 :]
    os.execve(
        sys.executable,
        [sys.executable, str(HERE), "trainer", "--record", args.record, "--behave", args.behave, *train_args],
        {**os.environ, "RANK": rank, "WORLD_SIZE": "2"},
    )
    return 1  # not reached


def launch_options(spec: dict) -> dict:
    """The launcher's ``server_command`` and ``trainer_program``: the fakes above, as ``spec`` sets them up
    (``record``, and optionally ``behave``, ``server_modes``, ``dev_routes``, ``die_when``, ``vllm``)."""

    def server_command(slot):
        mode = spec.get("server_modes", {}).get(str(slot.index), "ok")
        argv = [
            sys.executable,
            str(HERE),
            "server",
            "--port",
            str(slot.port),
            "--index",
            str(slot.index),
            "--mode",
            mode,
            "--record",
            spec["record"],
            "--dev-routes",
            spec.get("dev_routes", "yes"),
        ]
        if str(slot.index) in spec.get("die_when", {}):
            argv += ["--die-when", spec["die_when"][str(slot.index)]]
        return argv, {}

    return {
        "server_command": None if spec.get("vllm") else server_command,
        "trainer_program": [str(HERE), "trainer", "--record", spec["record"], "--behave", spec.get("behave", "ok")],
    }


def launch(spec_path: str) -> int:
    from scirl.commands.train import deploy
    from scirl.run.config_io import load_config

    spec = json.loads(Path(spec_path).read_text())
    cfg = load_config(spec["args"])
    return deploy(
        cfg, spec["args"], resume=spec.get("resume", False), clean=spec.get("clean", False), **launch_options(spec)
    )


if __name__ == "__main__":
    sys.path[:0] = [str(HERE.parents[2]), str(HERE.parents[1])]  # scirl, and tests/ (the fake server)
    command, rest = sys.argv[1], sys.argv[2:]
    sys.exit(
        {
            "server": server,
            "vllm-view": vllm_view,
            "trainer": trainer,
            "on-node": on_node,
            "launch": lambda a: launch(a[0]),
        }[command](rest)
    )
