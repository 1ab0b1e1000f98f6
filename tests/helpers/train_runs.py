"""What the tests of training runs share: the letter model and the questions they train on, the arguments of a
short run (and of one with the vLLM engine), its rows, weights and trainer state read back, runs in this process,
as a process and under torchrun, and small hand-made samples for the trainer's step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import scirl
from scirl.rollouts.contract import Sample
from scirl.run.config_io import load_config

DEMO_BASE = Path(scirl.__file__).parent / "assets" / "demo-base"

# An uninterrupted run vs a killed-then-resumed one. What follows from the sampled tokens and the data
# position must be identical; what the trainer computes is compared with a tolerance, since the two runs
# are different processes whose float reductions may round differently (a loss that is mathematically 0
# came out 1.15e-16 in one and 1.51e-16 in the other). These are float32 sums over ~100 tokens: a
# tolerance of 1e-6 absolute (float32 rounding of per-token terms near 0) and 1e-5 relative.
EXACT_KEYS = ("reward/mean", "reward/std", "reward/mean_all", "trainable/count", "tokens/completion", "epoch")
COMPUTED_KEYS = ("loss", "grad_norm", "entropy", "mismatch_kl")


def assert_same_rows(expected: list[dict], got: list[dict]) -> None:
    assert [m["step"] for m in got] == [m["step"] for m in expected]
    for want, have in zip(expected, got):
        for key in EXACT_KEYS:
            assert have.get(key) == want.get(key), (want["step"], key)
        for key in COMPUTED_KEYS:
            assert (key in have) == (key in want), (want["step"], key)
            if key in want:
                assert have[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), (want["step"], key)


@pytest.fixture(scope="module")
def letter_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model, nudged to answer a letter and stop, so rewards vary within groups and training moves weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    suffix = tok.encode("<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    rows = [suffix + tok.encode(letter, add_special_tokens=False) + [tok.eos_token_id] for letter in "ABCD" * 2]
    ids = torch.tensor(rows)
    labels = ids.clone()
    labels[:, : len(suffix)] = -100
    opt = torch.optim.AdamW(model.parameters(), lr=2e-2)
    for _ in range(30):
        model(input_ids=ids, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    out = tmp_path_factory.mktemp("letter_model")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    from scirl.synth.questions import generate_rows, write_jsonl

    return write_jsonl(generate_rows(n_per_domain=12, seed=1), tmp_path_factory.mktemp("data") / "rows.jsonl")


def train_args(model, data, out, max_steps=3, extra=()):
    return [
        "--model",
        str(model),
        "--data.source",
        str(data),
        "--data.eval-per-domain",
        "2",
        "--output-dir",
        str(out),
        "--max-steps",
        str(max_steps),
        "--batch-size",
        "16",
        "--group-size",
        "8",
        "--micro-batch-size",
        "8",
        "--max-completion-tokens",
        "4",
        "--seq-len",
        "512",
        "--optim.lr",
        "1e-2",
        "--seed",
        "3",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--filters.zero-advantage.no-enforce",
        "--ckpt.interval",
        "2",
        *extra,
    ]


@pytest.fixture
def one_thread():
    # identical float results in this process and in the subprocesses (OMP_NUM_THREADS=1)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def run_in_process(argv, **kwargs) -> int:
    from scirl.run.train import train

    return train(load_config(argv), show_progress=False, **kwargs)


def final_weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    """A checkpoint's serving weights, from every file (several ranks each write their share)."""
    from safetensors.torch import load_file

    files = sorted((run_dir / "weights" / f"step_{step}").glob("model*.safetensors"))
    return {name: tensor for f in files for name, tensor in load_file(f).items()}


def trainer_state(run_dir: Path, step: int) -> dict:
    """A checkpoint's trainer state, whole, as one nested dict ("model", "optimizer", "algorithm")."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(run_dir / "weights" / f"step_{step}" / "trainer_state", Path(tmp) / "state.pt")
        return torch.load(Path(tmp) / "state.pt", weights_only=False)


def wait_for(predicate, proc, timeout=240.0, what=""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            raise AssertionError(f"training exited ({proc.returncode}) before {what}:\n{proc.stdout.read()}")
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"timed out waiting for {what}")


def start(argv, env_extra=None) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **(env_extra or {})}
    return subprocess.Popen(
        [sys.executable, "-m", "scirl", "train", *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def fixed_samples(n=5, seed=0, shortest_prompt=4):
    """``n`` samples with prompts of growing length and completions of 1-5 tokens, each its own group."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        n_prompt, n_completion = shortest_prompt + i, 1 + (i * 3) % 5
        samples.append(
            Sample(
                prompt_ids=torch.randint(10, 500, (n_prompt,), generator=g).tolist(),
                completion_ids=torch.randint(10, 500, (n_completion,), generator=g).tolist(),
                logprobs=(-torch.rand(n_completion, generator=g) * 5).tolist(),
                advantage=float(torch.randn(1, generator=g)),
                group=i,
            )
        )
    return samples


@pytest.fixture(scope="module")
def one_step_run(letter_model_dir, data_file, tmp_path_factory):
    """A finished one-step run (checkpoint 1); tests copy it before resuming."""
    run_dir = tmp_path_factory.mktemp("one_step") / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert run_in_process(train_args(letter_model_dir, data_file, run_dir, max_steps=1)) == 0
    finally:
        torch.set_num_threads(threads)
    return run_dir


def copy_run(run_dir: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(run_dir, tmp_path / "run"))


def torchrun(*args: str, timeout: float = 240) -> None:
    """``torchrun --standalone --nproc-per-node 2 ARGS`` on one thread a rank; fails the test with its output unless
    it exits 0."""
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def torchrun_train(argv: list[str], timeout: float = 240) -> None:
    """``scirl train ARGV`` on 2 torchrun ranks."""
    torchrun("-m", "scirl", "train", *argv, timeout=timeout)


def assert_forwards_compute_the_unique_tokens(run_dir: Path, model_dir) -> None:
    """Each step's ``train/forward_tokens`` is within 10% of the unique tokens of its batches, counted here from
    the step's rollout records (each trained group's prompt once: a group is one rank's; every trained completion's
    tokens), and its ``train/padding_tokens`` at most 5% of them: the trainer computes each prompt once per group
    and nothing on padding."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for m in rows(run_dir):
        records = [
            json.loads(line) for line in (run_dir / "rollouts" / f"step_{m['step']}.jsonl").read_text().splitlines()
        ]
        trained = [r for r in records if not r["dropped"]]
        prompts = {(r["rank"], r["group"], r["prompt"]) for r in trained}
        unique = sum(len(tokenizer(p, add_special_tokens=False).input_ids) for _, _, p in prompts) + sum(
            r["num_tokens"] for r in trained
        )
        assert abs(m["train/forward_tokens"] - unique) <= 0.1 * unique, (m["step"], m["train/forward_tokens"], unique)
        assert m["train/padding_tokens"] <= 0.05 * unique, (m["step"], m["train/padding_tokens"], unique)
        assert m["train/loss_tokens"] == sum(r["num_tokens"] for r in trained)


def vllm_args(data, out, max_steps=3, extra=()):
    return [
        "--model",
        str(DEMO_BASE),
        "--data.source",
        str(data),
        "--data.eval-per-domain",
        "4",
        "--output-dir",
        str(out),
        "--max-steps",
        str(max_steps),
        "--batch-size",
        "32",
        "--group-size",
        "8",
        "--micro-batch-size",
        "32",
        "--max-completion-tokens",
        "8",
        "--seq-len",
        "512",
        "--optim.lr",
        "1e-3",
        "--seed",
        "5",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--filters.zero-advantage.no-enforce",
        "--inference.backend",
        "vllm",
        "--inference.enforce-eager",
        "--inference.kv-cache-gib",
        "1",
        *extra,
    ]


def samples_with_teachers(seed=0):
    """Two groups, one completion without a teacher; group 0's teacher prompts differ per completion, group 1's
    two completions were shown the same solution (one teacher prompt)."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for group_index, lengths in enumerate(((3, 1, 4), (2, 2))):
        prompt = torch.randint(10, 500, (6 + group_index,), generator=g).tolist()
        shared = torch.randint(10, 500, (11,), generator=g).tolist()
        for k, n in enumerate(lengths):
            teacher = None if (group_index, k) == (0, 1) else torch.randint(10, 500, (9 + k,), generator=g).tolist()
            teacher = shared if group_index == 1 else teacher
            samples.append(
                Sample(
                    prompt,
                    torch.randint(10, 500, (n,), generator=g).tolist(),
                    (-torch.rand(n, generator=g) * 3).tolist(),
                    float(torch.randn(1, generator=g)),
                    group_index,
                    teacher,
                )
            )
    return samples
