"""Beyond one node, the quick parts: ``scirl inference`` runs what the launcher runs, a job's plan takes every
address from its node list, ``scirl slurm``'s script and refusals, the stand-ins keep Slurm's contract, a
server that cannot see the trainer's ``broadcasts/`` is refused at start, and one stop delivered twice (as
Slurm and torchrun both deliver it) costs no checkpoint. The whole job with real processes is
``tests/e2e/test_slurm_job.py``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import scirl
from fakes import slurm_fakes
from helpers.server_process import free_port, stop
from scirl.cli import main
from scirl.deploy import launch, plan, ports, supervisor
from scirl.errors import PreflightError
from scirl.run.config_io import load_config

DEMO_BASE = Path(scirl.__file__).parent / "assets" / "demo-base"
DEMO_CONFIG = Path(scirl.__file__).parent / "configs" / "demo.toml"
FAKES = Path(__file__).parents[1] / "fakes" / "deploy_fakes.py"


class RecordingSupervisor:
    """Stands in for the launcher's supervisor: records what it would start."""

    def __init__(self):
        self.started = []

    def start(self, name, argv, env, log, *, cpu=None, **options):
        self.started.append({"argv": argv, "env": env, "cpu": cpu})


def parse_shell_line(line: str) -> tuple[dict[str, str], int | None, list[str]]:
    """``K=V ... [taskset -c CORE] ARGV`` -> (env, core, argv)."""
    words = shlex.split(line)
    env = {}
    while words and "=" in words[0] and words[0].split("=", 1)[0].isidentifier():
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    core = None
    if words[:2] == ["taskset", "-c"]:
        core, words = int(words[2]), words[3:]
    return env, core, words


def test_scirl_inference_prints_the_command_the_launcher_runs(capsys, tmp_path):
    args = [
        "@",
        str(DEMO_CONFIG),
        "--model",
        str(DEMO_BASE),
        "--output-dir",
        str(tmp_path / "run"),
        "--inference.kv-cache-gib",
        "0.25",
        "--deployment.num-infer-gpus",
        "1",
    ]
    port = free_port()
    assert main(["inference", *args, "--port", str(port), "--print-command"]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) == 1
    env, core, argv = parse_shell_line(printed[0])

    recorder = RecordingSupervisor()  # what the launcher starts for the same config and port
    picked = launch.Plan(None, ports.Ports("127.0.0.1", [port], free_port(), None), "filesystem", None)
    launch.start_servers(recorder, load_config(args), picked, plan.vllm_server_command, tmp_path / "logs")
    [started] = recorder.started
    assert argv == started["argv"] and core == started["cpu"]
    assert all(started["env"][key] == value for key, value in env.items())
    assert {k: v for k, v in started["env"].items() if os.environ.get(k) != v}.items() <= env.items()
    assert argv[argv.index("--port") + 1] == str(port) and argv[argv.index("--model") + 1] == str(DEMO_BASE)
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["OMP_NUM_THREADS"] == "1"


def test_scirl_inference_refuses_bad_input_in_one_line(capsys):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert main(["inference", "@", str(DEMO_CONFIG), "--port", str(port), "--print-command"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--port {port} on 127.0.0.1 is in use" in err[0]
    assert main(["inference", "@", str(DEMO_CONFIG), "--gpus", "2", "--print-command"]) == 2  # a CPU config
    assert "leave out --gpus" in capsys.readouterr().err


def job_plan(nodes: list[str], gpus_per_node: int = 0, resume: bool = False, config_args=None) -> plan.JobPlan:
    return plan.plan_job(
        config_args or ["@", "x.toml", "--output-dir", "/runs/a"],
        [plan.Node(f"n{i}", address) for i, address in enumerate(nodes)],
        infer_nodes=2,
        gpus_per_node=gpus_per_node,
        ports=plan.JobPorts(8000, 29400, 29500),
        weight_sync="nccl",
        run_dir=Path("/runs/a"),
        logs=Path("/runs/a/logs/job-7"),
        attempt="job-7",
        resume=resume,
        python="/py",
    )


def test_a_job_plan_takes_every_address_from_its_node_list():
    planned = job_plan(["10.0.0.5", "10.0.0.6", "10.0.0.7", "10.0.0.8"], gpus_per_node=8)
    assert planned.urls == ["http://10.0.0.5:8000", "http://10.0.0.6:8000"] and planned.rendezvous == "10.0.0.7:29400"
    for part, address in zip(planned.servers, ["10.0.0.5", "10.0.0.6"]):
        assert part.argv[:4] == ["/py", "-m", "scirl", "inference"]
        assert part.argv[-8:] == [
            "--host",
            address,
            "--deployment.weight-sync",
            "nccl",
            "--port",
            "8000",
            "--gpus",
            "8",
        ]  # data parallel over the node, taking weights as the trainer sends them
    hosts = []
    for part, address in zip(planned.trainers, ["10.0.0.7", "10.0.0.8"]):
        argv = part.argv
        assert argv[argv.index("--nnodes") + 1] == "2" and argv[argv.index("--nproc-per-node") + 1] == "8"
        assert argv[argv.index("--local-addr") + 1] == address and argv[argv.index("--rdzv-id") + 1] == "job-7"
        hosts.append(argv[argv.index("--rdzv-conf") + 1])
        assert argv[argv.index("--inference.urls") + 1] == "http://10.0.0.5:8000,http://10.0.0.6:8000"
        assert argv[argv.index("--deployment.nccl-port") + 1] == "29500"
    assert hosts == ["is_host=1", "is_host=0"]  # the store on the first trainer node only
    words = [word for part in planned.servers + planned.trainers for word in part.argv]
    assert not any("127.0.0.1" in word or "localhost" in word for word in words)
    assert [p.name for p in planned.servers + planned.trainers] == [
        "inference server on node 1 (n0)",
        "inference server on node 2 (n1)",
        "trainer on node 3 (n2)",
        "trainer on node 4 (n3)",
    ]
    assert [p.log.name for p in planned.trainers] == ["trainer_node3.log", "trainer_node4.log"]
    record = planned.record()
    assert record["urls"] == planned.urls and record["nccl"] == 29500 and record["rendezvous"] == 29400
    assert [n["role"] for n in record["nodes"]] == ["inference", "inference", "trainer", "trainer"]
    six = job_plan(["fd00::1", "fd00::2", "fd00::3"])
    assert six.urls[0] == "http://[fd00::1]:8000" and six.rendezvous == "[fd00::3]:29400"


def test_a_resumed_job_continues_the_run_and_its_servers_read_the_saved_config():
    resumed = job_plan(["10.0.0.1", "10.0.0.2", "10.0.0.3"], resume=True)  # the script's --resume
    assert resumed.servers[0].argv[4:7] == ["@", "x.toml", "--output-dir"]
    train = resumed.trainers[0].argv
    assert train[train.index("train") + 1 :][:6] == ["@", "x.toml", "--output-dir", "/runs/a", "--resume", "/runs/a"]
    again = job_plan(["10.0.0.1", "10.0.0.2", "10.0.0.3"], resume=True, config_args=["--resume", "/runs/a"])
    assert again.servers[0].argv[4:6] == ["@", "/runs/a/config.toml"]  # scirl slurm --resume: the saved config
    assert again.trainers[0].argv.count("--resume") == 1


def test_a_node_name_that_resolves_to_loopback_is_refused(monkeypatch):
    from scirl.deploy import job

    assert job.node_address("127.0.0.2") == "127.0.0.2"  # an address is its own
    monkeypatch.setattr(job.socket, "getaddrinfo", lambda *a, **k: [(2, 1, 6, "", ("127.0.1.1", 0))])
    with pytest.raises(PreflightError, match="gpu7 resolves to 127.0.1.1 here, a loopback address"):
        job.node_address("gpu7")
    monkeypatch.setattr(job.socket, "getaddrinfo", lambda *a, **k: [(2, 1, 6, "", ("10.1.2.3", 0))])
    assert job.node_address("gpu7") == "10.1.2.3"


def slurm(*args: str) -> int:
    """``scirl slurm`` in this process (the demo's config and model), its exit status."""
    try:
        return main(["slurm", "@", str(DEMO_CONFIG), "--model", str(DEMO_BASE), *args])
    except SystemExit as exc:  # a usage error
        return exc.code


def test_scirl_slurm_writes_a_job_script_with_its_layout_and_refuses_bad_shapes(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "job.sbatch"
    assert (
        slurm(
            "--output-dir",
            "run",
            "--nodes",
            "2",
            "--infer-nodes",
            "1",
            "--gpus-per-node",
            "8",
            "--partition",
            "gpu",
            "--account",
            "lab",
            "--time",
            "04:00:00",
            "--out",
            str(out),
        )
        == 0
    )
    text = out.read_text()
    assert subprocess.run(["bash", "-n", str(out)]).returncode == 0
    for line in (
        "#SBATCH --nodes=2",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=lab",
        "#SBATCH --time=04:00:00",
        f"#SBATCH --output={tmp_path / 'run' / 'logs' / 'slurm-%j.out'}",
        'NODES=$(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        f"cd {tmp_path}",
    ):
        assert line in text.splitlines()
    assert "#SBATCH --signal=B:TERM@" in text and "--on-node 'srun --nodes=1 --ntasks=1 --nodelist={node}" in text
    assert '$RESUME "$@" -- @ ' in text and f"sbatch {out} --resume" in text
    assert (tmp_path / "run" / "logs").is_dir() and os.access(out, os.X_OK)
    capsys.readouterr()

    for bad, words in (
        (["--nodes", "2", "--infer-nodes", "2"], "leaves no node for the trainer"),
        (["--nodes", "3", "--infer-nodes", "0"], "--infer-nodes must be at least 1"),
    ):
        assert slurm(*bad, "--out", str(out)) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and words in err
    (tmp_path / "run" / "config.toml").write_text("")
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1}\n')
    assert slurm("--output-dir", "run", "--nodes", "2", "--infer-nodes", "1", "--out", str(out)) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--resume" in err
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm-here"))
    assert slurm("--output-dir", "fresh", "--nodes", "2", "--infer-nodes", "1", "--out", str(out), "--submit") == 2
    assert "cannot run sbatch" in capsys.readouterr().err.strip().splitlines()[-1]


def test_the_slurm_stand_ins_keep_the_contract_the_job_relies_on(tmp_path):
    """srun runs one task per node with that node's variables and, with --kill-on-bad-exit=1, ends the
    step's other tasks when one fails; scancel ends every process of the job; scontrol expands a hostlist."""
    env = {**os.environ, **slurm_fakes.install(tmp_path / "bin", tmp_path / "state", ["10.9.0.1", "10.9.0.2"])}
    assert slurm_fakes.expand("gpu[001-003,7],cpu1") == ["gpu001", "gpu002", "gpu003", "gpu7", "cpu1"]
    script = tmp_path / "job.sh"
    script.write_text(f"""#!/bin/bash
#SBATCH --nodes=2
#SBATCH --output={tmp_path}/out-%j.txt
scontrol show hostnames
srun --nodes=2 --ntasks=2 --nodelist=10.9.0.1,10.9.0.2 --kill-on-bad-exit=1 bash -c \\
  'echo "task $SLURM_PROCID on $SLURMD_NODENAME"
   [ $SLURM_PROCID = 0 ] && touch {tmp_path}/task-0-said && exec sleep 120
   until [ -e {tmp_path}/task-0-said ]; do sleep 0.1; done; exit 3'  # task 1 fails once task 0 has said its line
echo "srun exit $?"
srun --nodelist=10.9.0.2 sleep 120 &
until [ -e "$FAKE_SLURM_STATE/job_$SLURM_JOB_ID.step_1" ]; do sleep 0.1; done  # the step's task runs
scancel $SLURM_JOB_ID
wait
""")
    done = subprocess.run(["sbatch", str(script)], env=env, capture_output=True, text=True, timeout=30)
    job = done.stdout.split()[-1]
    deadline = time.monotonic() + 60
    while not (tmp_path / "state" / f"job_{job}.status").is_file() or slurm_fakes.job_processes(
        job, tmp_path / "state"
    ):
        assert time.monotonic() < deadline, "the stand-in job did not end"
        time.sleep(0.1)
    out = (tmp_path / f"out-{job}.txt").read_text()
    assert out.startswith("10.9.0.1\n10.9.0.2\n")
    assert "task 0 on 10.9.0.1" in out and "task 1 on 10.9.0.2" in out
    assert "srun: error: 10.9.0.2: task 1: Exited with exit code 3" in out and "srun exit 143" in out  # task 0 ended
    assert (tmp_path / "state" / f"job_{job}.status").read_text() == str(-signal.SIGTERM)  # cancelled
    # the background step's one task ran before the cancel (and ended with the job's every process: the wait above)
    assert len((tmp_path / "state" / f"job_{job}.step_1").read_text().split()) == 1


def start_job(tmp_path: Path, *, server_mode: str = "ok") -> tuple[subprocess.Popen, Path, Path]:
    """``scirl job`` on three "nodes", with stand-ins for its parts (tests/fakes/deploy_fakes.py on-node): (the job's
    process, the stand-ins' records, the file its end-job command touches)."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("the job's preflight wants vLLM installed")
    record, ended = tmp_path / "record", tmp_path / "job-ended"
    record.mkdir()
    on_node = f"{sys.executable} {FAKES} on-node --record {record} --server-mode {server_mode} {{node}} --"
    argv = [
        sys.executable,
        "-m",
        "scirl",
        "job",
        "--node-names",
        "127.0.0.1 127.0.0.2 127.0.0.3",
        "--infer-nodes",
        "1",
        "--attempt",
        "job-7",
        "--on-node",
        on_node,
        "--end-job",
        f"touch {ended}",
        "--",
        "@",
        str(DEMO_CONFIG),
        "--model",
        str(DEMO_BASE),
        "--output-dir",
        str(tmp_path / "run"),
        "--deployment.startup-timeout-s",
        "60",
    ]
    job = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    return job, record, ended


def finish(job: subprocess.Popen) -> tuple[int, str]:
    try:
        _, err = job.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        pytest.fail(f"the job did not end: {job.communicate()}")
    return job.returncode, err


def recorded_pids(record: Path) -> list[int]:
    rows = [json.loads(p.read_text()) for p in record.glob("*.json")]
    return [row["pid"] for row in rows] + [pid for row in rows for pid in row.get("server_processes", [])]


@pytest.mark.slow
def test_a_stop_asks_every_trainer_node_once_to_checkpoint_and_leaves_nothing_running(tmp_path):
    """SIGTERM to the job (sbatch --signal=B:TERM@... sends it before the time limit) reaches each trainer
    node's part once; the servers are stopped after the trainer, and the allocation is left to end itself."""
    job, record, ended = start_job(tmp_path)
    deadline = time.monotonic() + 60
    while not all((record / f"trainer_{rank}.json").is_file() for rank in (0, 1)):
        assert job.poll() is None and time.monotonic() < deadline, finish(job)
        time.sleep(0.1)
    job.send_signal(signal.SIGTERM)
    code, err = finish(job)
    assert code == 128 + signal.SIGTERM, err
    assert all((record / f"sigterm_{rank}.json").is_file() for rank in (0, 1))
    assert "asked the trainer to checkpoint and exit" in err and not ended.exists()
    recorded = json.loads((tmp_path / "run" / "ports.json").read_text())
    assert recorded["urls"] == [f"http://127.0.0.1:{recorded['servers'][0]}"] and recorded["attempt"] == "job-7"
    assert {p.name for p in (tmp_path / "run" / "logs" / "job-7").iterdir()} == {
        "inference_node1.log",
        "trainer_node2.log",
        "trainer_node3.log",
    }
    assert [pid for pid in recorded_pids(record) if supervisor.alive(pid)] == []


@pytest.mark.slow
def test_a_server_that_fails_at_start_ends_the_job_naming_it(tmp_path):
    job, record, ended = start_job(tmp_path, server_mode="exit")
    code, err = finish(job)
    assert code == 1
    assert "scirl job: inference server on node 1 (127.0.0.1) exited with exit code 3 before it was ready" in err
    assert "fake model load failed" in err and ended.is_file()  # its last log lines, then the whole job ended
    assert [pid for pid in recorded_pids(record) if supervisor.alive(pid)] == []


@pytest.mark.slow
def test_a_server_that_cannot_see_the_trainers_broadcasts_is_refused_at_start_in_one_line(tmp_path):
    """A server on a node without the trainer's file system (here one whose root is elsewhere) is refused
    at the run's first push, before step 1, in one line naming it and the path it could not load."""
    from scirl.demo.run import write_questions

    questions = write_questions(tmp_path / "questions.jsonl", 10, 10, 0)
    elsewhere = tmp_path / "another-node"
    elsewhere.mkdir()
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, str(FAKES), "vllm-view", "--port", str(port), "--root", str(elsewhere)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    run = tmp_path / "run"
    try:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "scirl",
                "train",
                "@",
                str(DEMO_CONFIG),
                "--model",
                str(DEMO_BASE),
                "--data.source",
                str(questions),
                "--data.eval-per-domain",
                "10",
                "--batch-size",
                "16",
                "--group-size",
                "4",
                "--output-dir",
                str(run),
                "--inference.urls",
                url,
                "--deployment.weight-sync",
                "filesystem",
                "--deployment.startup-timeout-s",
                "60",
            ],
            capture_output=True,
            text=True,
            timeout=240,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    finally:
        stop(server)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(
        f"scirl train: inference server {url} cannot load the weights this trainer has just "
        f"written to {run / 'broadcasts' / 'step_0'} (status 500: "
    ), last
    assert "--deployment.weight-sync nccl" in last and "Traceback" not in done.stderr
    assert (run / "broadcasts" / "step_0" / "model.safetensors").is_file()  # written here, not seen there
    assert not (run / "metrics.jsonl").exists()


def test_one_stop_delivered_twice_at_once_is_one_stop_and_a_later_second_one_ends_the_process():
    code = """
import os, signal
from scirl.distributed import StopRequest
stop = StopRequest()
stop.install()
os.kill(os.getpid(), signal.SIGTERM)
os.kill(os.getpid(), signal.SIGTERM)  # what slurmstepd and torchrun deliver for one stop
print("still running after", stop.signum, flush=True)
stop.first_at -= 60  # a second signal a minute later
os.kill(os.getpid(), signal.SIGTERM)
print("not reached", flush=True)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout == f"still running after {int(signal.SIGTERM)}\n"
    assert done.returncode == -signal.SIGTERM
