"""What runs where, as data: each inference server's command line and environment, the trainer's command
line, and for a run over several nodes, which node runs what, on which ports, logging where.

Nothing here starts a process or knows a scheduler. The single-node launcher (``launch``), ``scirl
inference`` and a multi-node job (``job``) start what this plans; how a part reaches its node is a
scheduler's renderer (``slurm``: ``srun`` on the node), so another scheduler is another renderer.
"""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from scirl.inference.vllm_command import server_command
from scirl.net import host_port
from scirl.run.config import DEDICATED_GPU_SHARE

TRAINER = ["-m", "scirl", "train"]  # what torchrun or python runs, before the config arguments
SERVED_MODEL_NAME = "policy"  # the trainer asks a server for its model's name; this one says what it serves


# ---------------------------------------------------------------------------------------------
# one inference server


@dataclass(frozen=True)
class ServerSlot:
    """One inference server to start: where it listens and what it runs on."""

    index: int
    host: str
    port: int
    gpus: list[str]  # its CUDA_VISIBLE_DEVICES entries; empty on a machine without GPUs
    data_parallel_size: int  # engines behind this one server (vLLM's --data-parallel-size)
    weight_sync: str  # "nccl" or "filesystem": how it will take new weights
    cfg: object  # the run's TrainConfig (model, max_model_len, dtype, ...)
    cpu: int | None = None  # a CPU server's core of its own (None: unpinned, or on GPUs)


@dataclass(frozen=True)
class ServerProcess:
    """What starting one server takes: its argv, the variables added to the caller's environment,
    and the core it is pinned to (None: not pinned)."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    cpu: int | None = None

    def shell(self) -> str:
        """The same as one shell line: ``K=V ... [taskset -c CORE] ARGV``."""
        pin = ["taskset", "-c", str(self.cpu)] if self.cpu is not None else []
        return shlex.join([f"{key}={value}" for key, value in self.env.items()] + pin + list(self.argv))


def vllm_server_command(slot: ServerSlot) -> tuple[list[str], dict[str, str]]:
    """A vLLM OpenAI server for the run's model, computing in the trainer's dtype (its sampling
    logprobs are what the trainer recomputes). The trainer pushes its weights before the first batch,
    so a resumed run's servers may start from ``model`` too."""
    cfg, cuda = slot.cfg, bool(slot.gpus)
    dtype = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if cuda else "float32")
    return server_command(
        cfg.model,
        port=slot.port,
        host=slot.host,
        served_model_name=SERVED_MODEL_NAME,
        dtype=dtype,
        max_model_len=cfg.inference.max_model_len or cfg.seq_len,
        device="cuda" if cuda else "cpu",
        data_parallel_size=slot.data_parallel_size,
        weight_sync=slot.weight_sync,
        gpu_memory_utilization=cfg.inference.gpu_memory_utilization or DEDICATED_GPU_SHARE,
        enforce_eager=cfg.inference.enforce_eager,
        kv_cache_gib=cfg.inference.kv_cache_gib,
        seed=cfg.seed,
    )


def server_process(slot: ServerSlot, command=vllm_server_command) -> ServerProcess:
    """Everything a server is started with: ``command``'s argv and environment (vLLM's, or a test's
    stand-in), plus its placement: its GPUs, or on a CPU one OpenMP thread on a core of its own (two
    engines sharing cores run 20-40x slower; the core is the process's CPU affinity, ``taskset`` in the printed
    line: the server's engine runs its model itself, and vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` binds only the
    workers of its multiprocessing executor).
    The launcher and ``scirl inference`` both start this."""
    argv, env = command(slot)
    placement = {"CUDA_VISIBLE_DEVICES": ",".join(slot.gpus)} if slot.gpus else {"OMP_NUM_THREADS": "1"}
    return ServerProcess(list(argv), {**env, **placement}, None if slot.gpus else slot.cpu)


def cpu_core(index: int) -> int:
    """The core CPU server ``index`` is pinned to: this process's cores in turn."""
    cores = sorted(os.sched_getaffinity(0))
    return cores[index % len(cores)]


# ---------------------------------------------------------------------------------------------
# the trainer


def trainer_command(
    config_args: list[str],
    urls: list[str],
    nccl_port: int,
    weight_sync: str,
    *,
    resume_dir: str | None = None,
    clean: bool = False,
    program: list[str] = TRAINER,
) -> list[str]:
    """``scirl train``'s arguments for a trainer on servers: the user's config arguments, then where the
    servers are and how weights reach them (no interpreter: one rank or torchrun puts it in front)."""
    args = [*program, *config_args]
    args += ["--resume", resume_dir] if resume_dir is not None else []
    args += ["--clean"] if clean else []
    return args + [
        "--inference.urls",
        ",".join(urls),
        "--deployment.nccl-port",
        str(nccl_port),
        "--deployment.weight-sync",
        weight_sync,
    ]


def torchrun_command(
    *,
    nnodes: int,
    nproc_per_node: int,
    endpoint: str,
    rdzv_id: str | None = None,
    local_addr: str | None = None,
    is_host: bool | None = None,
    python: str = sys.executable,
) -> list[str]:
    """torchrun with a c10d rendezvous at ``endpoint``. Across nodes each node also says its own address
    (``--local-addr``: the workers' MASTER_ADDR when it holds rank 0, never a name that may resolve to
    127.0.1.1) and whether it hosts the rendezvous store (``is_host``: explicit, so two nodes whose
    addresses both look local, as in a test on one machine, do not both try)."""
    argv = [
        python,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(nnodes),
        "--nproc-per-node",
        str(nproc_per_node),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        endpoint,
    ]
    argv += ["--rdzv-id", rdzv_id] if rdzv_id else []
    argv += ["--rdzv-conf", f"is_host={int(is_host)}"] if is_host is not None else []
    return argv + (["--local-addr", local_addr] if local_addr else [])


# ---------------------------------------------------------------------------------------------
# a run over several nodes


@dataclass(frozen=True)
class Node:
    name: str  # as the scheduler's node list names it
    address: str  # where the other nodes reach it (its servers listen there)


@dataclass(frozen=True)
class Part:
    """One process to start on one node: an inference server, or the trainer's torchrun of that node."""

    role: str  # "inference" or "trainer"
    number: int  # the node's place in the job, from 1
    node: Node
    argv: list[str]
    log: Path

    @property
    def name(self) -> str:
        what = "inference server" if self.role == "inference" else "trainer"
        return f"{what} on node {self.number} ({self.node.name})"


@dataclass(frozen=True)
class JobPorts:
    server: int  # every inference node's server listens on it
    rendezvous: int  # torchrun's c10d store, on the first trainer node
    nccl: int  # the NCCL weight group, on trainer rank 0


@dataclass(frozen=True)
class JobPlan:
    attempt: str  # names this attempt's log folder
    nodes: list[Node]
    servers: list[Part]
    trainers: list[Part]
    urls: list[str]
    rendezvous: str  # host:port of torchrun's store
    ports: JobPorts
    weight_sync: str

    def record(self) -> dict:
        """``ports.json``: the keys the single-node launcher writes (``servers``, ``nccl``, ``rendezvous``,
        ``urls``: a resume drops those URLs from the saved config), plus where each node is and does what."""
        roles = {part.node.name: part.role for part in self.servers + self.trainers}
        return {
            "attempt": self.attempt,
            "servers": [self.ports.server] * len(self.servers),
            "nccl": self.ports.nccl,
            "rendezvous": self.ports.rendezvous,
            "rendezvous_endpoint": self.rendezvous,
            "urls": self.urls,
            "nodes": [{"name": n.name, "address": n.address, "role": roles[n.name]} for n in self.nodes],
        }


def layout(n_nodes: int, infer_nodes: int, gpus_per_node: int) -> list[str]:
    """Which node runs what, in words (the job script's header and the job's first lines)."""

    def span(first: int, last: int) -> str:
        return f"node {first}" if first == last else f"nodes {first}-{last}"

    engines = f"data parallel over the node's {gpus_per_node} GPUs" if gpus_per_node else "one CPU engine"
    ranks = f"{gpus_per_node} ranks per node" if gpus_per_node else "one rank per node"
    each = " on each" if infer_nodes > 1 else ""
    return [
        f"{span(1, infer_nodes)}: a vLLM server{each} (scirl inference), {engines}",
        f"{span(infer_nodes + 1, n_nodes)}: the trainer under torchrun, {ranks}, c10d rendezvous on node "
        f"{infer_nodes + 1}; the orchestrator on global rank 0",
    ]


def plan_job(
    config_args: list[str],
    nodes: list[Node],
    *,
    infer_nodes: int,
    gpus_per_node: int,
    ports: JobPorts,
    weight_sync: str,
    run_dir: Path,
    logs: Path,
    attempt: str,
    resume: bool,
    python: str = sys.executable,
) -> JobPlan:
    """The first ``infer_nodes`` nodes serve (one ``scirl inference`` each, listening on the node's own
    address), the rest train (torchrun across them, ``gpus_per_node`` ranks each, one on CPUs). Every
    address comes from ``nodes``. ``config_args`` are ``scirl train``'s (``@ file.toml ...``, or ``--resume
    RUN_DIR ...``); with ``resume`` the trainer continues ``run_dir``, and the servers read its saved config."""
    serving, training = nodes[:infer_nodes], nodes[infer_nodes:]
    urls = [f"http://{host_port(node.address, ports.server)}" for node in serving]
    resumed_args = "--resume" in config_args
    served_config = ["@", str(run_dir / "config.toml")] if resumed_args else config_args
    gpu_args = ["--gpus", str(gpus_per_node)] if gpus_per_node else []
    server_args = ["--deployment.weight-sync", weight_sync, "--port", str(ports.server), *gpu_args]  # as the trainer's
    servers = [
        Part(
            "inference",
            i + 1,
            node,
            [python, "-m", "scirl", "inference", *served_config, "--host", node.address, *server_args],
            logs / f"inference_node{i + 1}.log",
        )
        for i, node in enumerate(serving)
    ]
    endpoint = host_port(training[0].address, ports.rendezvous)
    train = trainer_command(
        config_args, urls, ports.nccl, weight_sync, resume_dir=str(run_dir) if resume and not resumed_args else None
    )
    trainers = []
    for j, node in enumerate(training):
        number = infer_nodes + j + 1
        torchrun = torchrun_command(
            nnodes=len(training),
            nproc_per_node=max(gpus_per_node, 1),
            endpoint=endpoint,
            rdzv_id=attempt,
            local_addr=node.address,
            is_host=j == 0,
            python=python,
        )
        trainers.append(Part("trainer", number, node, torchrun + train, logs / f"trainer_node{number}.log"))
    return JobPlan(attempt, list(nodes), servers, trainers, urls, endpoint, ports, weight_sync)
