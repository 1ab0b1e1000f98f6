"""Shared session-scoped fixtures (only add fixtures here; others rely on the existing names), the order in which
the test files are handed to the workers, and the slow marker on every end-to-end test.

The folders follow the package (tests/trainer/ for scirl/trainer/, ...); tests/e2e/ holds what starts whole
commands, servers or runs; tests/fakes/ the stand-ins for other programs (one fake OpenAI-compatible server among
them), tests/helpers/ the test utilities, both importable from any folder (pyproject's ``pythonpath``). The fast lane
is ``pytest -m "not slow" tests``."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import pytest
import torch

# `make test` runs two workers on a 2-core machine. Each computes on one thread, and so do the processes its tests
# start (they inherit OMP_NUM_THREADS): two workers of two OpenMP threads each on two cores spin-wait on each
# other. (vLLM CPU servers run their model in their engine process, unpinned: ``server_command``.) A caller's
# own setting wins.
# the training runs' fixtures (a tiny letter model, its questions, one thread), for any test that names them
pytest_plugins = ["helpers.train_runs"]

WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if WORKER and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

# The slowest files, slowest first, by their path under tests/ (their seconds in one `make test` run on 2 cores shared
# with other work, a load of ~5: relative figures; a session fixture counts in the first file that asks for it; runs
# whose process is not the point run inside the worker: ``tests/helpers/in_process.py``). `make test` hands whole
# files to two workers in this order (`--no-loadscope-reorder`: xdist's default reorders files by their number of
# tests, which put the few-test, minutes-long vLLM files last on one worker while the other sat idle for 3.5
# minutes). Starting with the longest ones keeps one worker from ending its share minutes before the other.
SLOWEST_FIRST = [
    "e2e/test_docs.py",  # 229 s
    "e2e/test_gpu_check_cpu.py",  # 220 s (every stage of the GPU check: one call)
    "e2e/test_train_servers.py",  # 211 s
    "e2e/test_slurm_job.py",  # 168 s
    "e2e/test_train_vllm.py",  # 136 s
    "e2e/test_train_ranks.py",  # 85 s
    "run/test_checkpoint.py",  # 76 s (kill -9 at each phase of a background write: a process each)
    "trainer/test_packing.py",  # 74 s (flex attention compiled by inductor: more with its cache cold)
    "e2e/test_vllm_server.py",  # 67 s
    "trainer/test_compilation.py",  # 61 s (inductor's compiles: more with its cache cold)
    "e2e/test_vllm_serve.py",  # 49 s
    "inference/test_inference_hf.py",  # 44 s
    "run/test_checkpoint_ranks.py",  # 43 s
    "e2e/test_train_resume.py",  # 38 s
    "e2e/test_sdpo_train.py",  # 36 s
    "inference/test_server_readiness.py",  # 35 s
    "primerl/test_export.py",  # 33 s
    "e2e/test_demo.py",  # 28 s
    "deploy/test_deploy.py",  # 27 s
    "trainer/test_fsdp_load.py",  # 24 s
    "weights/test_weight_buckets.py",  # 23 s
    "run/test_memory_plan_fsdp.py",  # 21 s
    "e2e/test_train_resume_config.py",  # 21 s
    "inference/test_serve.py",  # 19 s
    "commands/test_refusals.py",  # 19 s
    "task/test_reward.py",  # 18 s
    "deploy/test_multinode.py",  # 17 s
    "e2e/test_eval_run.py",  # 16 s
    "eval/test_eval_client.py",  # 15 s
    "trainer/test_compute_copy.py",  # 15 s
    "trainer/test_lora.py",  # 12 s
    "run/test_train_eval.py",  # 11 s
    "weights/test_gpu_contracts.py",  # 11 s
    "trainer/test_head.py",  # 10 s
    "inference/test_inference_vllm.py",  # 10 s
]
TESTS = Path(__file__).resolve().parent
E2E = TESTS / "e2e"


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items):
    """Marks every test under tests/e2e/ ``slow`` (the fast lane, ``-m "not slow"``, leaves out the end-to-end
    files and the slow tests elsewhere); the slowest files first (a stable sort: the rest keep their order); each
    file's tests keep theirs."""
    rank = {path: i for i, path in enumerate(SLOWEST_FIRST)}

    def under_tests(item) -> str:
        # resolved: a clone whose tests/ links here (the docs' pages run in one) sees its own paths
        path = item.path.resolve()
        return path.relative_to(TESTS).as_posix() if path.is_relative_to(TESTS) else path.as_posix()

    for item in items:
        if item.path.resolve().is_relative_to(E2E):
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: rank.get(under_tests(item), len(rank)))


def cpu_description() -> str:
    """The CPU model and the kernels torch picked for it: which code computed a float that disagrees."""
    model = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return (
        f"CPU: {model}; torch {torch.__version__} CPU capability {torch.backends.cpu.get_cpu_capability()}; "
        f"AMX tiles: {torch.cpu._is_amx_tile_supported()}; threads: {torch.get_num_threads()}"
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed ``recorded`` test (one that compares with numbers computed elsewhere) says which CPU and
    kernels ran it, so a report from another machine names the arithmetic that differed."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and item.get_closest_marker("recorded") is not None:
        report.sections.append(("machine", cpu_description()))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Qwen3 model directory with an offline tokenizer, built once per test session."""
    from scirl.synth.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture(scope="session")
def synthetic_rows():
    """SciKnowEval-schema rows from the offline generator."""
    from scirl.synth.questions import generate_rows

    return generate_rows(n_per_domain=20, seed=0)
