"""``scirl train`` with ``deployment.num_infer_gpus > 0``: preflight, ports, the vLLM servers, the
trainer, and supervision, from one command.

Order, and why: every check that can refuse the run comes before anything starts (a refusal after
the servers spent minutes loading an 8B model wastes them); the servers start before the trainer,
which needs them from its first step; the launcher then only watches. The first component to fail
ends the run: every child is stopped and that component's last log lines are shown.

The run directory stays the trainer's: it takes the lock and applies ``--resume`` / ``--clean``
(``rundir.prepare``). The launcher only adds ``logs/inference_<i>.log``, ``logs/trainer.log`` and
``ports.json``, none of which makes a directory count as holding a run or is removed by ``--clean``.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from scirl.deploy import ports as ports_lib
from scirl.deploy import preflight
from scirl.deploy.plan import (
    TRAINER,
    ServerSlot,
    cpu_core,
    server_process,
    torchrun_command,
    trainer_command,
    vllm_server_command,
)
from scirl.deploy.supervisor import Child, Supervisor
from scirl.errors import DeployError, PreflightError
from scirl.inference.client import HEALTH_TIMEOUT_S, ServerClient, ServerError
from scirl.inference.client import wait_until_ready as wait_for_servers
from scirl.run import allocator, rundir

STOP_GRACE_S = 30  # a server, or a trainer stopped because another component failed: seconds before SIGKILL
PORTS_FILE = "ports.json"


@dataclass(frozen=True)
class Plan:
    """What the checks decided: where each part runs and on which ports."""

    gpus: preflight.GpuPlan | None  # None on a machine without GPUs
    ports: ports_lib.Ports
    weight_sync: str  # "nccl" or "filesystem"
    checkpoint_bytes: int | None  # one checkpoint's size, when the model could be sized


def launch(
    cfg,
    config_args: list[str],
    *,
    resume: bool = False,
    clean: bool = False,
    server_command=None,
    trainer_program: list[str] = TRAINER,
) -> int:
    """Run the deployment; return the exit status. ``config_args`` are the ``@ file.toml`` and flag
    arguments as the user gave them: the trainer resolves the same config from them. ``server_command``
    (a ``ServerSlot`` -> (argv, env) function) and ``trainer_program`` replace vLLM and ``-m scirl train``
    (tests stand in small programs for them); without ``server_command``, vLLM's."""
    supervisor = Supervisor()
    supervisor.install_signal_handlers()  # from the start: a Ctrl-C during the checks is a stop, not a traceback
    try:
        plan = check(cfg, resume=resume, clean=clean, vllm=server_command is None)
        logs = write_run_files(cfg, plan.ports, fresh=not resume)
        if supervisor.stop_requested.is_set():
            return supervisor.stopped_status()
        servers = start_servers(supervisor, cfg, plan, server_command or vllm_server_command, logs)
        if not wait_until_ready(supervisor, servers, ports_lib.urls(plan.ports), plan.weight_sync, cfg):
            return supervisor.stopped_status()
        argv = trainer_argv(
            cfg, config_args, plan.ports, plan.weight_sync, resume=resume, clean=clean, program=trainer_program
        )
        env = trainer_environment(cfg, plan.gpus)
        if supervisor.stop_requested.is_set():
            return supervisor.stopped_status()
        say(f"trainer: {shlex.join(argv)}")
        trainer = supervisor.start(
            "trainer",
            argv,
            env,
            logs / "trainer.log",
            echo=True,
            signal_ranks=cfg.deployment.num_train_gpus > 1,
            stop_line=rundir.STOPPED_LINE,
        )
        return supervise(supervisor, trainer, preflight.checkpoint_seconds(plan.checkpoint_bytes))
    finally:
        supervisor.stop([child for child in supervisor.children if child.exited() is None], STOP_GRACE_S)
        supervisor.close()


def trainer_environment(cfg, gpus) -> dict[str, str]:
    """The trainer's (torchrun's) environment: this process's, its GPUs, and where it trains on CUDA the caching
    allocator's expandable segments (``scirl.run.allocator``), which the servers' environment does not get."""
    env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": ",".join(gpus.train)} if gpus else {})}
    if cfg.device != "cpu":
        env.update(allocator.trainer_env(env, holds_engine=False))
    return env


def check(cfg, *, resume: bool, clean: bool, vllm: bool) -> Plan:
    """Every check that can refuse the run, before anything starts. Ports first: a taken one is
    reported in well under a second."""
    deployment = cfg.deployment
    run_dir = Path(cfg.output_dir)
    rundir.check(run_dir, resume=resume, clean=clean)
    rundir.lock(run_dir).close()  # a live run there: refused now, not after the servers have loaded
    cuda = preflight.on_cuda(cfg.device)
    n_servers = 1 if cuda else deployment.num_infer_gpus  # on GPUs: one server, vLLM's data parallelism inside
    ports = ports_lib.allocate(
        deployment.host,
        first_server_port=deployment.port,
        n_servers=n_servers,
        nccl_port=deployment.nccl_port,
        rendezvous=deployment.num_train_gpus > 1,
    )
    if vllm:
        preflight.check_packages(cuda)
    gpus = preflight.plan_gpus(deployment.num_infer_gpus, deployment.num_train_gpus) if cuda else None
    mode = deployment.weight_sync_on(cuda)
    return Plan(gpus, ports, mode, preflight.check_disk(cfg, mode))


def write_run_files(cfg, ports, *, fresh: bool) -> Path:
    """``ports.json`` and a header in each log; returns the logs folder. A resumed run appends to its
    earlier logs; any other run starts them over."""
    run_dir = Path(cfg.output_dir)
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    ports_lib.write(ports, run_dir / PORTS_FILE)
    header = f"--- scirl train launcher, {time.strftime('%Y-%m-%d %H:%M:%S')} ---\n"
    for name in [f"inference_{i}.log" for i in range(len(ports.servers))] + ["trainer.log"]:
        with (logs / name).open("w" if fresh else "a", encoding="utf-8") as f:
            f.write(header)
    return logs


def start_servers(supervisor: Supervisor, cfg, plan: Plan, server_command, logs: Path) -> list[Child]:
    """On GPUs, one server over all inference GPUs; on CPUs, one server per port, each pinned to a core
    of its own where there are enough (``plan.server_process``)."""
    gpus, ports = plan.gpus, plan.ports
    servers = []
    for i, port in enumerate(ports.servers):
        slot = ServerSlot(
            i,
            ports.host,
            port,
            gpus.infer if gpus else [],
            len(gpus.infer) if gpus else 1,
            plan.weight_sync,
            cfg,
            cpu=None if gpus else cpu_core(i),
        )
        process = server_process(slot, server_command)
        servers.append(
            supervisor.start(
                f"inference server {i}",
                process.argv,
                {**os.environ, **process.env},
                logs / f"inference_{i}.log",
                cpu=process.cpu,
            )
        )
    urls = ", ".join(ports_lib.urls(ports))
    say(f"started {len(servers)} inference server(s) at {urls} (logs: {logs}/inference_*.log)")
    return servers


def wait_until_ready(
    supervisor: Supervisor, servers: list[Child], urls: list[str], weight_sync: str, cfg, *, report=None
) -> bool:
    """Wait until every server answers, then check each takes weights the planned way. False when a
    stop was requested meanwhile. One deadline for all (they start in parallel), a line every few
    seconds naming those not ready yet; a server that exits ends the wait at once."""
    started = time.monotonic()
    report = report or say  # the line a wait prints: scirl train's, or the caller's

    def alive() -> bool:
        return not supervisor.stop_requested.is_set() and supervisor.first_exit() is None

    # only short questions go to these clients: each bounded by seconds, not by a generation request's timeout
    clients = [ServerClient(url, timeout_s=min(HEALTH_TIMEOUT_S, cfg.deployment.request_timeout_s)) for url in urls]
    by_url = {client.url: server for client, server in zip(clients, servers)}
    try:
        try:
            wait_for_servers(clients, cfg.deployment.startup_timeout_s, alive=alive, say=report)
        except ServerError as exc:
            if supervisor.stop_requested.is_set():
                return False
            gone = supervisor.first_exit()
            if gone is not None and gone in servers:
                raise failure(gone, "before it was ready") from None
            if gone is not None:  # a trainer started beside the servers (a multi-node job) failed meanwhile
                raise failure(gone, "while the servers were starting", max(gone.exited(), 1)) from None
            server = by_url[exc.url]
            raise DeployError(
                f"{server.name} was not ready within deployment.startup_timeout_s = "
                f"{cfg.deployment.startup_timeout_s:g}s ({exc}); its last log lines ({server.log}):\n"
                f"{server.tail()}"
            ) from None
        for client in clients:
            server = by_url[client.url]
            try:
                problem = client.check_weight_sync_support(weight_sync)
            except ServerError as exc:
                raise DeployError(
                    f"{server.name} did not say whether it takes {weight_sync} weight sync: {exc}"
                ) from None
            if problem:
                raise PreflightError(f"{server.name}: {problem}")
    finally:
        for client in clients:
            client.close()
    report(f"inference server(s) ready after {time.monotonic() - started:.0f}s")
    return True


def supervise(supervisor: Supervisor, trainer: Child, checkpoint_grace_s: float) -> int:
    """Until the trainer ends: 0 when it finished; a stop request goes to it (it checkpoints and exits);
    any component's failure raises, naming it."""
    child = supervisor.wait_for_exit_or_stop()
    if child is None:
        say(
            f"stopping: asked the trainer to checkpoint and exit (up to {checkpoint_grace_s:.0f}s; "
            "a second Ctrl-C stops at once)"
        )
        supervisor.request_stop(trainer)
        if not supervisor.wait_for(trainer, checkpoint_grace_s):
            say("the trainer did not stop in time; stopping it now")
            return supervisor.stopped_status()
        trainer.drain()
        if trainer.exited() == 0:  # the signal came during the last step: the run finished, checkpoint and all
            return 0
        if trainer.stop_confirmed is None:  # killed before its loop began, or failed while stopping
            say(
                f"the trainer exited with {exit_text(trainer.exited())} without confirming a checkpoint; "
                f"its log: {trainer.log}"
            )
        return supervisor.stopped_status()
    if child is trainer and child.exited() == 0:
        return 0
    if child is trainer:
        raise failure(child, "", status=child.exited() if child.exited() > 0 else 1)
    raise failure(child, "while the run was going")


def failure(child: Child, when: str, status: int = 1) -> DeployError:
    return DeployError(
        f"{child.name} exited with {exit_text(child.exited())}{' ' + when if when else ''}; stopping "
        f"the run. Its last log lines ({child.log}):\n{child.tail()}",
        status,
    )


def exit_text(code: int) -> str:
    return (
        f"exit code {code}" if code >= 0 else f"signal {-code}" + (" (SIGKILL: out of memory?)" if code == -9 else "")
    )


def trainer_argv(
    cfg, config_args: list[str], ports, mode: str, *, resume: bool, clean: bool, program: list[str] = TRAINER
) -> list[str]:
    """The trainer's command: the user's config arguments, plus where the servers are and how weights
    reach them. One rank: ``python -m scirl train ...``; more: torchrun on the rendezvous port picked here."""
    args = trainer_command(
        config_args,
        ports_lib.urls(ports),
        ports.nccl,
        mode,
        resume_dir=str(cfg.output_dir) if resume else None,
        clean=clean,
        program=program,
    )
    ranks = cfg.deployment.num_train_gpus
    if ranks == 1:
        return [sys.executable, *args]
    return torchrun_command(nnodes=1, nproc_per_node=ranks, endpoint=f"127.0.0.1:{ports.rendezvous}") + args


def forget_launched_servers(saved: dict, run_dir: Path) -> dict:
    """A resumed run's saved config without the servers its launcher started last time (their URLs and
    NCCL port, as ``ports.json`` recorded them): those are gone, and a resume starts new ones."""
    recorded = ports_lib.read(run_dir / PORTS_FILE)
    if not recorded:
        return saved
    saved = json.loads(json.dumps(saved))  # a copy, nested dicts included
    inference, deployment = saved.get("inference", {}), saved.get("deployment", {})
    if inference.get("urls") == recorded.get("urls"):
        inference.pop("urls", None)
    if deployment.get("nccl_port") == recorded.get("nccl"):
        deployment.pop("nccl_port", None)
    return saved


def say(text: str) -> None:
    print(f"scirl train: {text}", file=sys.stderr, flush=True)
