"""A run over several nodes, from inside its allocation (``scirl job``: what ``scirl slurm``'s script runs
on the job's first node). The nodes are the scheduler's; everything else is decided here when the job
starts: the plan (``plan.plan_job``: which node runs what; every address from the node list), the ports
(picked free on this node, checked again by each part on its own, and written to ``ports.json``), one
log per part and node under ``logs/<attempt>/``. Each part is started on its node through the
scheduler's launcher, a command template (for Slurm ``srun ... --nodelist={node}``, ``slurm.ON_NODE``):
the servers and, beside them on its own nodes, the trainer (which waits for them before it loads its
model); all are supervised as the single-node launcher supervises its children (``launch``).

The first part to fail ends the job: its name, exit status and last log lines go to this process's
output (the job's log), every part is stopped with its whole process tree, and the scheduler is asked
to end the allocation (``end_job``, ``scancel`` of the job), so that nothing outlives it on any node.
A stop request (SIGTERM: ``sbatch --signal=B:TERM@...`` sends one before the time limit) asks the
trainer to checkpoint and exit first.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from scirl.deploy import ports as ports_lib
from scirl.deploy import preflight
from scirl.deploy.launch import PORTS_FILE, STOP_GRACE_S, exit_text, failure, wait_until_ready
from scirl.deploy.plan import JobPlan, JobPorts, Node, Part, layout, plan_job
from scirl.deploy.supervisor import POLL_S, Child, Supervisor
from scirl.errors import DeployError, PreflightError, RunDirError
from scirl.files import write_text_atomic
from scirl.run import rundir

SETTLE_S = 5.0  # once a trainer node failed: how long the others get to end on their own and log their side
END_JOB_TIMEOUT_S = 30  # the scheduler's own command (scancel) answers in well under this


@dataclass(frozen=True)
class JobSpec:
    node_names: list[str]  # the allocation's nodes, in its order
    infer_nodes: int  # the first ones serve, the rest train
    gpus_per_node: int  # 0: CPUs only (one engine per server, one rank per trainer node)
    attempt: str  # names this attempt's log folder: logs/<attempt>/
    on_node: str  # a command prefix that runs what follows on node {node}; {part} names the part
    end_job: str | None  # a command that ends the whole allocation (None: only this job's own stop)
    resume: bool  # continue the run directory (its last verified checkpoint)


def run_job(cfg, config_args: list[str], spec: JobSpec) -> int:
    """The job's exit status. ``config_args`` are ``scirl train``'s: ``@ file.toml ...`` or ``--resume RUN ...``."""
    supervisor = Supervisor()
    supervisor.install_signal_handlers()  # from the start: a stop during the checks is a stop, not a traceback
    status = 1
    try:
        status = run_parts(supervisor, cfg, config_args, spec)
        return status
    except (DeployError, PreflightError, RunDirError) as exc:
        say(str(exc))
        status = exc.status
        return status
    finally:
        supervisor.stop([child for child in supervisor.children if child.exited() is None], STOP_GRACE_S)
        supervisor.close()
        if status != 0 and supervisor.children and spec.end_job and not supervisor.stop_requested.is_set():
            end_job(spec.end_job)


def run_parts(supervisor: Supervisor, cfg, config_args: list[str], spec: JobSpec) -> int:
    plan, checkpoint_bytes = prepare(cfg, config_args, spec)
    if supervisor.stop_requested.is_set():
        return supervisor.stopped_status()
    servers = [start(supervisor, part, spec) for part in plan.servers]
    say(f"started {len(servers)} inference server(s): {', '.join(plan.urls)} (logs: {plan.servers[0].log.parent})")
    # the trainer starts beside them, on nodes of its own: its imports, rendezvous and data take their time while
    # the servers load, and it waits for them itself before it loads its model
    trainers = [start(supervisor, part, spec) for part in plan.trainers]
    say(
        f"started the trainer on {len(trainers)} node(s), c10d rendezvous at {plan.rendezvous}: "
        f"{shlex.join(plan.trainers[0].argv)}"
    )
    grace_s = preflight.checkpoint_seconds(checkpoint_bytes)
    if not wait_until_ready(supervisor, servers, plan.urls, plan.weight_sync, cfg, report=say):
        return stop_trainer(supervisor, trainers, grace_s)  # a stop while the servers load
    return supervise(supervisor, servers, trainers, grace_s)


def prepare(cfg, config_args: list[str], spec: JobSpec) -> tuple[JobPlan, int | None]:
    """Every check that can refuse the job before a part starts, then the plan and ``ports.json``."""
    run_dir = Path(cfg.output_dir).absolute()
    if len(spec.node_names) < spec.infer_nodes + 1:
        raise PreflightError(
            f"the allocation has {len(spec.node_names)} node(s): {spec.infer_nodes} for inference "
            "and at least one for the trainer are needed; fix: ask for more nodes"
        )
    if len(set(spec.node_names)) != len(spec.node_names):
        raise PreflightError(f"a node is listed twice: {' '.join(spec.node_names)}")
    nodes = [Node(name, node_address(name)) for name in spec.node_names]
    resuming = spec.resume or "--resume" in config_args
    rundir.check(run_dir, resume=resuming, clean=False)
    if resuming and not (run_dir / "config.toml").is_file():
        raise PreflightError(f"--resume: {run_dir} holds no run to continue (no config.toml); fix: leave out --resume")
    rundir.lock(run_dir).close()  # a live run there: refused now, not after the servers have loaded
    cuda = preflight.on_cuda(cfg.device)
    preflight.check_packages(cuda)
    mode = cfg.deployment.weight_sync_on(cuda)
    checkpoint_bytes = preflight.check_disk(cfg, mode)
    picked = ports_lib.allocate(
        "0.0.0.0",
        first_server_port=cfg.deployment.port,
        n_servers=1,
        nccl_port=cfg.deployment.nccl_port,
        rendezvous=True,
    )
    plan = plan_job(
        config_args,
        nodes,
        infer_nodes=spec.infer_nodes,
        gpus_per_node=spec.gpus_per_node,
        ports=JobPorts(picked.servers[0], picked.rendezvous, picked.nccl),
        weight_sync=mode,
        run_dir=run_dir,
        logs=run_dir / "logs" / spec.attempt,
        attempt=spec.attempt,
        resume=spec.resume,
    )
    (run_dir / "logs" / spec.attempt).mkdir(parents=True, exist_ok=True)
    write_text_atomic(run_dir / PORTS_FILE, json.dumps(plan.record(), indent=2) + "\n")
    say(
        f"{spec.attempt}: {'resuming' if resuming else 'starting'} {run_dir} on {len(nodes)} nodes "
        f"({', '.join(f'{n.name} = {n.address}' for n in nodes)}); ports in {run_dir / PORTS_FILE}"
    )
    for line in layout(len(nodes), spec.infer_nodes, spec.gpus_per_node):
        say(line)
    return plan, checkpoint_bytes


def node_address(name: str) -> str:
    """Where the other nodes reach node ``name``: the name itself when it is an address, else what it
    resolves to here. A name that resolves to a loopback address (Debian's 127.0.1.1 for a machine's own
    name) is refused: no other node reaches it there."""
    try:
        ipaddress.ip_address(name)
        return name
    except ValueError:
        pass
    try:
        found = [info[4][0] for info in socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)]
    except socket.gaierror as exc:
        raise PreflightError(
            f"node {name}: the name does not resolve here ({exc.strerror}); fix: the cluster's DNS or /etc/hosts"
        ) from None
    address = next((a for a in found if ":" not in a), found[0])  # IPv4 where there is one
    if ipaddress.ip_address(address).is_loopback:
        raise PreflightError(
            f"node {name} resolves to {address} here, a loopback address no other node reaches; "
            f"fix: map {name} to its network address in /etc/hosts or the cluster's DNS"
        )
    return address


def start(supervisor: Supervisor, part: Part, spec: JobSpec) -> Child:
    """``part`` on its node, through the scheduler's launcher; its output (the launcher's included) in its log."""
    argv = shlex.split(spec.on_node.format(node=part.node.name, part=f"scirl-{part.role}{part.number}")) + part.argv
    part.log.parent.mkdir(parents=True, exist_ok=True)
    with part.log.open("a", encoding="utf-8") as log:
        log.write(
            f"--- scirl job {spec.attempt}, {time.strftime('%Y-%m-%d %H:%M:%S')}: {part.name}: {shlex.join(argv)} ---\n"
        )
    return supervisor.start(part.name, argv, dict(os.environ), part.log)


def supervise(supervisor: Supervisor, servers: list[Child], trainers: list[Child], checkpoint_grace_s: float) -> int:
    """Until every trainer node finished (0), a part failed (raised, naming it), or a stop was asked for."""
    while True:
        failed = [c for c in servers if c.exited() is not None] + [c for c in trainers if c.exited() not in (None, 0)]
        if failed:
            raise (
                trainer_failure(failed[0], trainers)
                if failed[0] in trainers
                else failure(failed[0], "while the run was going")
            )
        if all(child.exited() == 0 for child in trainers):
            say("the trainer finished; stopping the inference servers")
            return 0
        if supervisor.stop_requested.is_set():
            return stop_trainer(supervisor, trainers, checkpoint_grace_s)
        supervisor.stop_requested.wait(POLL_S)


def trainer_failure(first: Child, trainers: list[Child]) -> DeployError:
    """The trainer failed on ``first``'s node. The other nodes' ranks usually fail right after (a peer
    gone mid-collective): they get a few seconds to end and log their side, and every failed node is named
    with its last log lines, ``first`` first."""
    deadline = time.monotonic() + SETTLE_S
    while any(child.exited() is None for child in trainers) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    others = [c for c in trainers if c is not first and c.exited() not in (None, 0)]
    report = [str(failure(first, "", status=first.exited() if first.exited() > 0 else 1))]
    report += [
        f"{c.name} exited with {exit_text(c.exited())} too. Its last log lines ({c.log}):\n{c.tail()}" for c in others
    ]
    return DeployError("\n".join(report), first.exited() if first.exited() > 0 else 1)


def stop_trainer(supervisor: Supervisor, trainers: list[Child], checkpoint_grace_s: float) -> int:
    """A stop request: each trainer node's launcher gets one SIGTERM (srun forwards it to torchrun, which
    hands it to its ranks: they checkpoint and exit), then up to ``checkpoint_grace_s`` to end."""
    say(f"stopping: asked the trainer to checkpoint and exit (up to {checkpoint_grace_s:.0f}s)")
    for child in trainers:
        if child.exited() is None:
            supervisor.request_stop(child)
    deadline = time.monotonic() + checkpoint_grace_s
    while any(child.exited() is None for child in trainers) and time.monotonic() < deadline and supervisor.signals < 2:
        time.sleep(POLL_S)
    if all(child.exited() == 0 for child in trainers):  # the last step finished meanwhile
        return 0
    return supervisor.stopped_status()


def end_job(command: str) -> None:
    """The scheduler ends the whole allocation: whatever a stop of the parts could not reach goes too."""
    say(f"ending the job: {command}")
    try:
        subprocess.run(shlex.split(command), stdin=subprocess.DEVNULL, timeout=END_JOB_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        say(f"could not end the job with {command!r}: {exc}")


def say(text: str) -> None:
    print(f"scirl job: {text}", file=sys.stderr, flush=True)
