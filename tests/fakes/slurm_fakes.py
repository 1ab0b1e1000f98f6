"""Stand-ins for Slurm's commands on one machine without Slurm, where each "node" is an address of this
machine (every 127.x.y.z is loopback on Linux). ``install(bin_dir, state_dir, nodes)`` puts ``sbatch``,
``srun``, ``scontrol`` and ``scancel`` on a PATH; each keeps the contract of the real command that scirl's
job script relies on (Slurm's man pages):

``sbatch SCRIPT [ARGS]``
    reads the script's ``#SBATCH --nodes/--output/--job-name`` lines, allocates the first N nodes, runs
    ``bash SCRIPT ARGS`` in the submission directory with the job's environment (``SLURM_JOB_ID``,
    ``SLURM_JOB_NODELIST`` as a hostlist expression, ``SLURMD_NODENAME`` of the first node, ...) and its
    output in the ``--output`` file (``%j``: the job id), and answers ``Submitted batch job N`` at once.
    The job's end is recorded for the test in ``STATE/job_N.status`` (the exit status; a negative one
    is a signal).
``scontrol show hostnames [LIST]``
    one name per line from a hostlist expression (``tux[1-3,7]``, zero padding kept), by default
    ``$SLURM_JOB_NODELIST``.
``srun [--nodes=N] [--ntasks=N] [--nodelist=LIST | --relative=I] [--kill-on-bad-exit[=0|1]] [...] CMD``
    inside an allocation only: one task per node of the step, each in a session of its own with the
    variables a task gets (``SLURMD_NODENAME``, ``SLURM_NODEID``, ``SLURM_PROCID``, ``SLURM_LOCALID``,
    ``SLURM_STEP_ID``, ``SLURM_STEP_NODELIST``, ...), their output on srun's. Signals sent to srun reach
    every process of the step's tasks (slurmstepd signals the step's whole container). Once the tasks run,
    the step is recorded for the test in ``STATE/job_N.step_S`` (S from 0, the tasks' pids). With
    ``--kill-on-bad-exit=1``, a task that exits non-zero terminates the step: the others get SIGTERM, then
    SIGKILL after KILL_WAIT_S. srun reports each failed task (``srun: error: NODE: task T: ...``) and exits
    with the highest exit status (128 + signal for a signalled task). Unknown options are refused.
``scancel JOBID``
    answers at once; every process of the job (those with ``SLURM_JOB_ID=JOBID``) then gets SIGCONT and
    SIGTERM, and SIGKILL after KILL_WAIT_S (slurm.conf's KillWait, shortened for tests).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
KILL_WAIT_S = 5.0
FORWARDED = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGCONT,
)


def install(bin_dir: Path, state_dir: Path, nodes: list[str]) -> dict[str, str]:
    """The commands in ``bin_dir``; returns the environment a submission needs (PATH first)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    state_dir.mkdir(parents=True, exist_ok=True)
    for command in ("sbatch", "srun", "scontrol", "scancel"):
        path = bin_dir / command
        path.write_text(f'#!/bin/sh\nexec {sys.executable} {HERE} {command} "$@"\n')
        path.chmod(0o755)
    return {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "FAKE_SLURM_STATE": str(state_dir),
        "FAKE_SLURM_NODES": ",".join(nodes),
    }


# ---- hostlists ----


def expand(hostlist: str) -> list[str]:
    """``a[1-3,7],b`` -> a1 a2 a3 a7 b (zero padding kept)."""
    names = []
    for prefix, ranges, suffix in re.findall(r"([^,\[]*)(?:\[([^\]]*)\])?([^,\[]*),?", hostlist):
        if not (prefix or ranges or suffix):
            continue
        if not ranges:
            names.append(prefix + suffix)
            continue
        for item in ranges.split(","):
            first, _, last = item.partition("-")
            for number in range(int(first), int(last or first) + 1):
                names.append(f"{prefix}{str(number).zfill(len(first))}{suffix}")
    return names


def compress(names: list[str]) -> str:
    """The reverse, for names that share a prefix and end in a number (as Slurm writes SLURM_JOB_NODELIST)."""
    groups: dict[str, list[str]] = {}
    for name in names:
        prefix, number = re.match(r"(.*?)(\d*)$", name).groups()
        groups.setdefault(prefix, []).append(number)
    parts = []
    for prefix, numbers in groups.items():
        parts.append(f"{prefix}{numbers[0]}" if len(numbers) == 1 else f"{prefix}[{','.join(numbers)}]")
    return ",".join(parts)


# ---- sbatch ----


def sbatch(argv: list[str]) -> int:
    script, args = Path(argv[0]).resolve(), argv[1:]
    options = dict(re.findall(r"^#SBATCH --([a-z-]+)=(\S+)", script.read_text(), flags=re.M))
    state = Path(os.environ["FAKE_SLURM_STATE"])
    job_id = str(next_number(state / "job_ids"))
    nodes = os.environ["FAKE_SLURM_NODES"].split(",")[: int(options.get("nodes", "1"))]
    env = {
        **os.environ,
        "SLURM_JOB_ID": job_id,
        "SLURM_JOBID": job_id,
        "SLURM_JOB_NODELIST": compress(nodes),
        "SLURM_NODELIST": compress(nodes),
        "SLURM_JOB_NUM_NODES": str(len(nodes)),
        "SLURM_NNODES": str(len(nodes)),
        "SLURM_JOB_NAME": options.get("job-name", script.name),
        "SLURM_SUBMIT_DIR": os.getcwd(),
        "SLURMD_NODENAME": nodes[0],
        "SLURM_NODEID": "0",
        "SLURM_CLUSTER_NAME": "stand-in",
    }
    output = Path(options.get("output", f"slurm-{job_id}.out").replace("%j", job_id))
    # the job's own record keeper, outside the job (no SLURM_JOB_ID): scancel of the job does not end it
    subprocess.Popen(
        [
            sys.executable,
            str(HERE),
            "run-batch",
            json.dumps(
                {
                    "env": env,
                    "argv": ["bash", str(script), *args],
                    "output": str(output),
                    "state": str(state),
                    "job": job_id,
                }
            ),
        ],
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    print(f"Submitted batch job {job_id}")
    return 0


def run_batch(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    with open(spec["output"], "ab") as out:
        proc = subprocess.Popen(
            spec["argv"],
            env=spec["env"],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    status = proc.wait()
    record = Path(spec["state"]) / f"job_{spec['job']}.status"
    record.with_suffix(".tmp").write_text(str(status))
    os.replace(record.with_suffix(".tmp"), record)
    return 0


def next_number(path: Path) -> int:
    import fcntl

    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        number = int(f.read().strip() or "0") + 1
        f.seek(0)
        f.truncate()
        f.write(str(number))
    return number


# ---- scontrol ----


def scontrol(argv: list[str]) -> int:
    if argv[:2] != ["show", "hostnames"]:
        print(f"scontrol (stand-in): only 'show hostnames' is supported, got {argv}", file=sys.stderr)
        return 1
    hostlist = argv[2] if len(argv) > 2 else os.environ.get("SLURM_JOB_NODELIST", "")
    print("\n".join(expand(hostlist)))
    return 0


# ---- srun ----

SRUN_OPTIONS = {
    "-N": "nodes",
    "--nodes": "nodes",
    "-n": "ntasks",
    "--ntasks": "ntasks",
    "-w": "nodelist",
    "--nodelist": "nodelist",
    "-r": "relative",
    "--relative": "relative",
    "-J": "job-name",
    "--job-name": "job-name",
    "--ntasks-per-node": "ntasks-per-node",
    "--gpus-per-node": "gpus-per-node",
    "--export": "export",
}
SRUN_FLAGS = {
    "-K": "kill-on-bad-exit",
    "--kill-on-bad-exit": "kill-on-bad-exit",
    "--overlap": "overlap",
    "--exact": "exact",
}


def parse_srun(argv: list[str]) -> tuple[dict, list[str]]:
    options, i = {}, 0
    while i < len(argv) and argv[i].startswith("-"):
        name, eq, value = argv[i].partition("=")
        if name in SRUN_FLAGS:
            options[SRUN_FLAGS[name]] = value if eq else "1"
        elif name in SRUN_OPTIONS:
            if not eq:
                i += 1
                value = argv[i]
            options[SRUN_OPTIONS[name]] = value
        elif name.startswith("-K") and name[2:].isdigit():  # -K1, -K0
            options["kill-on-bad-exit"] = name[2:]
        else:
            raise SystemExit(f"srun: unrecognized option '{argv[i]}' (stand-in)")
        i += 1
    if i == len(argv):
        raise SystemExit("srun: fatal: No command given to execute.")
    return options, argv[i:]


def srun(argv: list[str]) -> int:
    if "SLURM_JOB_ID" not in os.environ or "SLURM_JOB_NODELIST" not in os.environ:
        print("srun: error: no job allocation here (stand-in: runs inside a job only)", file=sys.stderr)
        return 1
    options, command = parse_srun(argv)
    job_nodes = expand(os.environ["SLURM_JOB_NODELIST"])
    if "nodelist" in options:
        nodes = expand(options["nodelist"])
        if not set(nodes) <= set(job_nodes):
            print(f"srun: error: Requested node configuration is not available: {options['nodelist']}", file=sys.stderr)
            return 1
    else:
        first = int(options.get("relative", 0))
        nodes = job_nodes[first : first + int(options.get("nodes", len(job_nodes) - first))]
    if int(options.get("ntasks", len(nodes))) != len(nodes) or options.get("ntasks-per-node", "1") != "1":
        print("srun: error: the stand-in runs one task per node", file=sys.stderr)
        return 1
    job, state = os.environ["SLURM_JOB_ID"], Path(os.environ["FAKE_SLURM_STATE"])
    step = str(next_number(state / f"job_{job}.steps") - 1)
    tasks: list[subprocess.Popen] = []
    received: list[int] = []

    def forward(signum, frame):
        received.append(signum)
        for task in list(tasks):
            signal_task(task, signum)

    for sig in FORWARDED:  # before any task starts: a signal from then on reaches every task of the step
        signal.signal(sig, forward)
    for i, node in enumerate(nodes):
        if received:  # stopped before every task started: start no more
            break
        tasks.append(start_task(command, node, i, nodes, job, step))
    if received:  # one that came while a task was starting, before it was in the list
        for task in tasks:
            signal_task(task, received[-1])
    record = state / f"job_{job}.step_{step}"
    record.with_suffix(".tmp").write_text(" ".join(str(task.pid) for task in tasks))
    os.replace(record.with_suffix(".tmp"), record)
    return wait_tasks(tasks, nodes, kill_on_bad_exit=options.get("kill-on-bad-exit", "0") != "0", step=f"{job}.{step}")


def start_task(command: list[str], node: str, index: int, nodes: list[str], job: str, step: str) -> subprocess.Popen:
    env = {
        **os.environ,
        "SLURMD_NODENAME": node,
        "SLURM_NODEID": str(index),
        "SLURM_PROCID": str(index),
        "SLURM_LOCALID": "0",
        "SLURM_STEP_ID": step,
        "SLURM_STEPID": step,
        "SLURM_STEP_NODELIST": compress(nodes),
        "SLURM_STEP_NUM_NODES": str(len(nodes)),
        "SLURM_STEP_NUM_TASKS": str(len(nodes)),
        "SLURM_NTASKS": str(len(nodes)),
        "SLURM_NPROCS": str(len(nodes)),
        "SLURM_TOPOLOGY_ADDR": node,
    }
    return subprocess.Popen(command, env=env, start_new_session=True)


def signal_task(task: subprocess.Popen, signum: int) -> None:
    """Every process of a task (its session: what slurmstepd's container holds)."""
    for pid in session_members(task.pid):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def session_members(sid: int) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == sid:
                    members.append(int(entry))
            except OSError:
                continue
    return members


def wait_tasks(tasks: list[subprocess.Popen], nodes: list[str], *, kill_on_bad_exit: bool, step: str) -> int:
    reported: set[int] = set()
    terminating = False
    while True:
        for i, task in enumerate(tasks):
            code = task.poll()
            if code is not None and code != 0 and i not in reported:
                reported.add(i)
                what = (
                    f"Exited with exit code {code}"
                    if code > 0
                    else {9: "Killed", 15: "Terminated"}.get(-code, f"Signal {-code}")
                )
                print(f"srun: error: {nodes[i]}: task {i}: {what}", file=sys.stderr, flush=True)
                if kill_on_bad_exit and not terminating:
                    terminating = True
                    print(f"srun: Terminating StepId={step}", file=sys.stderr, flush=True)
                    end_step(tasks)
        if all(task.poll() is not None for task in tasks):
            return max((code if code >= 0 else 128 - code) for code in (task.returncode for task in tasks))
        time.sleep(0.1)


def end_step(tasks: list[subprocess.Popen]) -> None:
    for task in tasks:
        signal_task(task, signal.SIGTERM)
    deadline = time.monotonic() + KILL_WAIT_S
    while any(task.poll() is None for task in tasks) and time.monotonic() < deadline:
        time.sleep(0.1)
    for task in tasks:
        if task.poll() is None:
            signal_task(task, signal.SIGKILL)


# ---- scancel ----


def scancel(argv: list[str]) -> int:
    if len(argv) != 1 or not argv[0].isdigit():
        print(f"scancel (stand-in): only 'scancel JOBID' is supported, got {argv}", file=sys.stderr)
        return 1
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}  # the sweep is not part of the job
    subprocess.Popen(
        [sys.executable, str(HERE), "sweep", argv[0]],
        env=env,
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return 0


def job_processes(job: str, state: Path | str | None = None) -> list[int]:
    """Every live process of job ``job`` of this stand-in cluster (its environment has ``SLURM_JOB_ID=job`` and
    the cluster's ``FAKE_SLURM_STATE``, ``state`` or this process's: two suites on one machine both number their
    jobs from 1), this one aside."""
    state = state or os.environ["FAKE_SLURM_STATE"]
    markers = {f"SLURM_JOB_ID={job}".encode(), f"FAKE_SLURM_STATE={state}".encode()}
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                if markers <= set(Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")):
                    found.append(int(entry))
            except OSError:
                continue
    return found


def sweep(argv: list[str]) -> int:
    job = argv[0]
    for sig in (signal.SIGCONT, signal.SIGTERM):
        for pid in job_processes(job):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + KILL_WAIT_S
    while job_processes(job) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in job_processes(job):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return 0


if __name__ == "__main__":
    commands = {
        "sbatch": sbatch,
        "run-batch": run_batch,
        "scontrol": scontrol,
        "srun": srun,
        "scancel": scancel,
        "sweep": sweep,
    }
    sys.exit(commands[sys.argv[1]](sys.argv[2:]))
