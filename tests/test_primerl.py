"""The prime-rl plug-in: the `sciknoweval` verifiers taskset and `scirl export prime-rl`.

The taskset package lives in packages/sciknoweval and is not pip-installed by
the test extra, so this file puts it on sys.path, the way prime-rl's uv
workspace makes it importable.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE_DIR = REPO / "packages" / "sciknoweval"
sys.path.insert(0, str(PACKAGE_DIR))

import verifiers.v1 as vf  # noqa: E402
from pydantic import ValidationError  # noqa: E402

import sciknoweval  # noqa: E402
from sciknoweval import SciKnowEvalConfig, SciKnowEvalTaskset  # noqa: E402
from sciknoweval.taskset import SciKnowEvalData, SciKnowEvalTask  # noqa: E402
from scirl import reward  # noqa: E402
from scirl.cli import main as cli_main  # noqa: E402
from scirl.data import question_from_row  # noqa: E402
from scirl.export_primerl import UV_SYNC  # noqa: E402
from scirl.prompt import build_messages  # noqa: E402
from scirl.synthetic import write_jsonl  # noqa: E402

EVAL_PER_DOMAIN = 5


@pytest.fixture(scope="module")
def data_file(synthetic_rows, tmp_path_factory):
    return write_jsonl(synthetic_rows, tmp_path_factory.mktemp("primerl") / "rows.jsonl")


def load(data_file, **overrides) -> list[SciKnowEvalTask]:
    """The tasks as verifiers hands them out: resolved by id, iterated (which sets idx)."""
    config = SciKnowEvalConfig(id="sciknoweval", data=str(data_file), eval_per_domain=EVAL_PER_DOMAIN, **overrides)
    return list(vf.load_taskset(config))


def exported_questions(data_file, split, tmp_path):
    out = tmp_path / f"{split}.jsonl"
    rc = cli_main(["data", "export", "--data", str(data_file), "--split", split, "--out", str(out),
                   "--eval-per-domain", str(EVAL_PER_DOMAIN)])
    assert rc == 0
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    return [question_from_row(row) for row in rows]


def make_trace(task: SciKnowEvalTask, reply: str) -> vf.Trace:
    """A finished single-turn trace, built as verifiers' rollout builds one, with `reply` as the model's answer."""
    return vf.Trace(
        task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
        agent=vf.AgentInfo(config=vf.AgentConfig()),
        nodes=[
            vf.MessageNode(message=vf.SystemMessage(content=task.data.system_prompt)),
            vf.MessageNode(parent=0, message=vf.UserMessage(content=task.data.prompt)),
            vf.MessageNode(parent=1, message=vf.AssistantMessage(content=reply), sampled=True),
        ],
    )


def score(task: SciKnowEvalTask, reply: str) -> vf.Trace:
    trace = make_trace(task, reply)
    asyncio.run(task.score(trace))
    return trace


# --- the taskset ------------------------------------------------------------------------------


def test_package_exports_exactly_one_taskset_and_id_resolves_to_it():
    tasksets = [name for name in sciknoweval.__all__
                if isinstance(getattr(sciknoweval, name), type) and issubclass(getattr(sciknoweval, name), vf.Taskset)]
    assert tasksets == ["SciKnowEvalTaskset"]
    assert vf.taskset_config_type("sciknoweval") is SciKnowEvalConfig
    assert SciKnowEvalTaskset.task_type() is SciKnowEvalTask
    assert SciKnowEvalTask.data_type() is SciKnowEvalData


def test_config_rejects_unknown_keys_and_bad_values():
    with pytest.raises(ValidationError):
        SciKnowEvalConfig.model_validate({"id": "sciknoweval", "splt": "eval"})
    for bad in ({"split": "test"}, {"reward_mode": "fuzzy"}, {"split_method": "random"}, {"eval_per_domain": -1}):
        with pytest.raises(ValidationError):
            SciKnowEvalConfig.model_validate({"id": "sciknoweval", **bad})


@pytest.mark.parametrize("split", ["train", "eval"])
def test_tasks_equal_scirl_data_export_question_for_question(data_file, split, tmp_path):
    tasks = load(data_file, split=split)
    questions = {q.id: q for q in exported_questions(data_file, split, tmp_path)}
    assert sorted(t.key for t in tasks) == sorted(questions)
    if split == "eval":
        assert len(tasks) == 4 * EVAL_PER_DOMAIN
    for task in tasks:
        q = questions[task.key]
        system, user = build_messages(q)
        assert task.data.system_prompt == system["content"]
        assert task.data.prompt == user["content"]
        assert (task.data.answer_key, task.data.labels, task.data.options, task.data.domain) == (
            q.answer_key, list(q.labels), list(q.options), q.domain)


def test_train_and_eval_are_disjoint_and_keys_unique(data_file):
    train, eval_ = load(data_file, split="train"), load(data_file, split="eval")
    train_keys, eval_keys = [t.key for t in train], [t.key for t in eval_]
    assert len(set(train_keys)) == len(train_keys) and len(set(eval_keys)) == len(eval_keys)
    assert not set(train_keys) & set(eval_keys)
    assert [t.data.idx for t in train] == list(range(len(train)))


def test_order_is_a_seeded_shuffle_independent_of_file_order(data_file, synthetic_rows, tmp_path):
    keys = [t.key for t in load(data_file)]
    assert keys == [t.key for t in load(data_file)]
    assert keys != sorted(keys)  # shuffled: prime-rl cycles tasks in load order
    assert keys != [t.key for t in load(data_file, shuffle_seed=1)]
    reversed_file = write_jsonl(list(reversed(synthetic_rows)), tmp_path / "reversed.jsonl")
    assert keys == [t.key for t in load(reversed_file)]


def replies_for(task: SciKnowEvalTask) -> list[str]:
    gold = task.data.answer_key
    wrong = next(label for label in task.data.labels if label != gold)
    gold_text = task.data.options[task.data.labels.index(gold)]
    return [
        gold, f"({gold})", f"{gold}.", wrong, "", f"Answer: {gold}", f"answer: {wrong}",
        f"The answer is {gold}.", f"**{gold}**", f"\\boxed{{{gold}}}", f"{gold}. {gold_text}",
        f"<think>Maybe {wrong}. No, {wrong} is wrong.</think>\n{gold}",
        f"<think>it is {gold}", f"Let me think.\nAnswer: {gold}", f"{gold} or {wrong}", gold_text,
        f"{wrong}\nActually the answer is {gold}",
    ]


@pytest.mark.parametrize("mode", ["strict", "lenient"])
def test_rewards_equal_scirl_reward_over_a_table_of_replies(data_file, mode):
    tasks = load(data_file, reward_mode=mode)
    checked = 0
    for task in tasks[:6]:
        q = question_from_row({
            "question": task.data.question, "choices": {"text": task.data.options, "label": task.data.labels},
            "answerKey": task.data.answer_key, "type": task.data.mcq_type, "domain": task.data.domain,
        })
        assert q.id == task.key
        for reply in replies_for(task):
            trace = score(task, reply)
            expected = reward.score(reply, q, mode)
            assert trace.rewards["correct"].score == expected.reward, (mode, reply)
            assert trace.reward == expected.reward
            assert trace.metrics["parsed"] == float(expected.parsed)
            assert trace.metrics["correct_lenient"] == reward.score(reply, q, "lenient").reward
            checked += 1
    assert checked == 6 * len(replies_for(tasks[0]))
    # anchors, so that a reward that agrees with a broken scirl.reward still fails
    task, gold = tasks[0], tasks[0].data.answer_key
    wrong = next(label for label in task.data.labels if label != gold)
    assert score(task, gold).reward == 1.0
    assert score(task, wrong).reward == 0.0
    assert score(task, f"<think>{wrong}? {wrong}.</think>\n{gold}").reward == 1.0
    assert score(task, f"<think>{wrong}</think>{wrong}").reward == 0.0
    assert score(task, f"The answer is {gold}.").reward == (1.0 if mode == "lenient" else 0.0)


def test_env_server_path_rebuilds_the_task_from_wire_data_and_scores_the_same(data_file):
    """The env server validates the shipped task data into our TaskData type and scores without loading data."""
    task = load(data_file)[0]
    wire = json.loads(json.dumps(task.data.model_dump(mode="json")))
    rebuilt = SciKnowEvalTask(SciKnowEvalData.model_validate(wire), vf.TaskConfig())
    assert rebuilt.key == task.key and rebuilt.hash == task.hash
    for reply in replies_for(task):
        assert score(rebuilt, reply).reward == score(task, reply).reward


# --- the export -------------------------------------------------------------------------------


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return False
        return True


def test_export_writes_package_config_and_readme(data_file, tmp_path):
    out = tmp_path / "export"
    assert cli_main(["export", "prime-rl", "--out", str(out), "--data", str(data_file)]) == 0

    for rel in ("sciknoweval/__init__.py", "sciknoweval/taskset.py", "README.md"):
        assert (out / "sciknoweval" / rel).read_bytes() == (PACKAGE_DIR / rel).read_bytes()
    assert not list((out / "sciknoweval").rglob("__pycache__"))
    package_toml = tomllib.loads((out / "sciknoweval" / "pyproject.toml").read_text())
    assert package_toml["project"]["name"] == "sciknoweval"
    assert "verifiers>=0.4.0,<0.5" in package_toml["project"]["dependencies"]
    # running from this checkout, uv is told to take scirl from it (scirl is not on PyPI)
    assert package_toml["tool"]["uv"]["sources"]["scirl"] == {"path": str(REPO), "editable": True}

    cfg = tomllib.loads((out / "grpo.toml").read_text())
    assert (cfg["max_steps"], cfg["seq_len"]) == (400, 4096)
    assert cfg["deployment"] == {"num_train_gpus": 2, "num_infer_gpus": 6}
    assert cfg["model"]["name"] == "PrimeIntellect/Qwen3-8B"
    assert cfg["trainer"]["model"]["attn"] == "flash_attention_2"
    assert cfg["trainer"]["optim"]["lr"] == 5e-6
    orch = cfg["orchestrator"]
    assert (orch["batch_size"], orch["group_size"]) == (128, 16)
    assert orch["post_batch_filters"] == [{"type": "gibberish"}, {"type": "repetition"},
                                          {"type": "zero_advantage", "enforce": False}]
    assert orch["train"]["sampling"]["max_completion_tokens"] == 256
    [source] = orch["train"]["source"]
    assert source["name"] == "sciknoweval"
    assert source["env"]["taskset"] == {"id": "sciknoweval", "split": "train", "data": str(data_file.resolve())}
    assert source["env"]["agent"] == {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}}
    assert orch["renderer"]["name"] == "prime-qwen3"
    assert cfg["inference"]["vllm"]["data_parallel_size"] == cfg["deployment"]["num_infer_gpus"]
    assert cfg["ckpt"] == {} and cfg["monitors"]["wandb"]["project"]

    trainer_wb, orch_wb = cfg["trainer"]["weight_broadcast"], orch["weight_broadcast"]
    assert trainer_wb == orch_wb and trainer_wb["type"] == "nccl"
    assert port_is_free(trainer_wb["port"])

    # the taskset section validates against the package's own config class
    SciKnowEvalConfig.model_validate(source["env"]["taskset"])

    text = (out / "README.md").read_text()
    assert UV_SYNC in text and "uv sync --all-packages --extra flash-attn --extra disagg" in text
    assert "uv run --no-sync rl" in text and "--max-steps 30" in text
    assert "deps/prime-envs/environments/science/sciknoweval" in text
    assert str(trainer_wb["port"]) in text

    # a second export refuses to overwrite unless told to
    assert cli_main(["export", "prime-rl", "--out", str(out)]) == 1
    assert cli_main(["export", "prime-rl", "--out", str(out), "--force"]) == 0
    assert "data" not in tomllib.loads((out / "grpo.toml").read_text())["orchestrator"]["train"]["source"][0]["env"]["taskset"]


def test_export_port_requested_is_checked(tmp_path):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        assert cli_main(["export", "prime-rl", "--out", str(tmp_path / "a"), "--port", str(taken)]) == 1
        assert not (tmp_path / "a" / "grpo.toml").exists()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        free = probe.getsockname()[1]
    assert cli_main(["export", "prime-rl", "--out", str(tmp_path / "b"), "--port", str(free)]) == 0
    cfg = tomllib.loads((tmp_path / "b" / "grpo.toml").read_text())
    assert cfg["trainer"]["weight_broadcast"]["port"] == cfg["orchestrator"]["weight_broadcast"]["port"] == free


@pytest.mark.slow
def test_export_works_from_an_installed_scirl_wheel(data_file, tmp_path):
    """Built as a wheel and installed (unpacked) elsewhere, scirl still ships the plug-in's files."""
    pytest.importorskip("setuptools", minversion="70.1")  # builds wheels without the `wheel` package
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(REPO / "scirl", src / "scirl", symlinks=True, ignore=ignore)
    shutil.copytree(PACKAGE_DIR, src / "packages" / "sciknoweval", ignore=ignore)
    subprocess.run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist")], cwd=src, check=True, capture_output=True, timeout=300)
    [wheel] = (tmp_path / "dist").glob("scirl-*.whl")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)

    out = tmp_path / "export"
    code = (
        "import sys, scirl; from pathlib import Path\n"
        f"assert Path(scirl.__file__).is_relative_to({str(site)!r}), scirl.__file__\n"
        "from scirl.cli import main\n"
        f"sys.exit(main(['export', 'prime-rl', '--out', {str(out)!r}, '--data', {str(data_file)!r}]))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    for rel in ("sciknoweval/__init__.py", "sciknoweval/taskset.py", "README.md"):
        assert (out / "sciknoweval" / rel).read_bytes() == (PACKAGE_DIR / rel).read_bytes()
    # an installed scirl knows no checkout: the user is told to say where uv finds scirl
    assert "set its location" in result.stderr
    assert "scirl" not in tomllib.loads((out / "sciknoweval" / "pyproject.toml").read_text()).get("tool", {}).get("uv", {}).get("sources", {})
    assert "Set scirl's location first" in (out / "README.md").read_text()
    tomllib.loads((out / "grpo.toml").read_text())

    # the exported package itself imports and loads tasks
    code = (
        f"import sys; sys.path.insert(0, {str(out / 'sciknoweval')!r})\n"
        "import verifiers.v1 as vf, sciknoweval\n"
        f"assert sciknoweval.__file__.startswith({str(out)!r})\n"
        f"cfg = sciknoweval.SciKnowEvalConfig(id='sciknoweval', data={str(data_file)!r}, eval_per_domain=5)\n"
        "print(len(list(vf.load_taskset(cfg))))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout.strip()) == len(load(data_file))
