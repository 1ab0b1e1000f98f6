"""The prime-rl plug-in: the `sciknoweval` verifiers taskset and `scirl export prime-rl`.

The taskset package lives in packages/sciknoweval and is not pip-installed by
the test extra, so this file puts it on sys.path, the way prime-rl's uv
workspace makes it importable.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
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
from scirl.task import reward  # noqa: E402
from scirl.cli import main as cli_main  # noqa: E402
from scirl.task.data import question_from_row  # noqa: E402
from scirl.primerl.export import (  # noqa: E402
    BASE_PORT_SEARCH,
    DEFAULT_EPHEMERAL_RANGE,
    DEFAULT_MODEL,
    DEFAULT_TARGET,
    DROP_PATH,
    EXPECTED_TRAIN_TASKS,
    TARGETS,
    UV_SYNC,
    Ports,
    choose_ports,
    grpo_toml,
    port_is_free,
)
from scirl.task.prompt import build_messages  # noqa: E402
from scirl.synth.questions import write_jsonl  # noqa: E402

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


def test_a_scirl_run_or_checkpoint_gives_the_taskset_its_data_settings(data_file, tmp_path):
    """`run = RUN_DIR` (its config.toml) or a checkpoint copied out of it (the run_config.toml it carries): the
    taskset's eval split is the questions that run held out, under its own split settings; a key given wins."""
    from scirl.run.config_io import load_config, write_config
    from scirl.task.data import load_splits

    cfg = load_config(["--data.source", str(data_file), "--data.eval-per-domain", "3", "--data.split-seed", "7"])
    write_config(cfg, tmp_path / "run" / "config.toml")
    write_config(cfg, tmp_path / "copied_step_3" / "run_config.toml")
    held_out = {q.id for q in load_splits(str(data_file), eval_per_domain=3, seed=7).eval}
    for run in (tmp_path / "run", tmp_path / "copied_step_3"):
        config = SciKnowEvalConfig(id="sciknoweval", run=str(run), split="eval")
        assert (config.eval_per_domain, config.split_seed, config.data) == (3, 7, str(data_file))
        assert {t.data.qid for t in vf.load_taskset(config)} == held_out
    assert SciKnowEvalConfig(id="sciknoweval", run=str(tmp_path / "run"), eval_per_domain=4).eval_per_domain == 4
    with pytest.raises(ValidationError, match="neither a scirl run directory nor a scirl checkpoint"):
        SciKnowEvalConfig(id="sciknoweval", run=str(tmp_path))


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
    # anchors, so that a reward that agrees with a broken scirl.task.reward still fails
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


def test_epoch_shuffle_permutes_options_as_scirl_does_and_scores_the_shown_order(data_file):
    from scirl.task.shuffle import epoch_order, permute

    plain = {t.key: t for t in load(data_file)}
    shuffled = load(data_file, shuffle_options="epoch", shuffle_seed=3)
    assert [t.key for t in shuffled] == [t.key for t in load(data_file, shuffle_seed=3)]  # same tasks, same order
    moved = 0
    for task in shuffled:
        row = plain[task.key].data
        q = question_from_row({"question": row.question, "choices": {"text": row.options, "label": row.labels},
                               "answerKey": row.answer_key, "type": row.mcq_type, "domain": row.domain})
        shown = permute(q, epoch_order(q, 3, 0))  # scirl's epoch 0 under seed 3: the same seeding rule
        assert (task.data.options, task.data.answer_key, task.data.option_order) == (
            list(shown.options), shown.answer_key, list(shown.option_order))
        assert task.data.prompt == build_messages(shown)[1]["content"]
        # the gold label follows its text, and the reward reads the shown letter
        assert task.data.options[task.data.labels.index(task.data.answer_key)] == row.options[row.labels.index(row.answer_key)]
        assert score(task, task.data.answer_key).reward == 1.0
        moved += task.data.answer_key != row.answer_key
    assert moved >= len(shuffled) // 2
    # the env server rebuilds the shown question from the wire data
    wire = json.loads(json.dumps(shuffled[0].data.model_dump(mode="json")))
    rebuilt = SciKnowEvalTask(SciKnowEvalData.model_validate(wire), vf.TaskConfig())
    for reply in replies_for(shuffled[0]):
        assert score(rebuilt, reply).reward == score(shuffled[0], reply).reward


def test_format_control_rewards_any_strict_letter_and_logs_strict_accuracy(data_file):
    task = load(data_file, reward_mode="format")[0]
    gold = task.data.answer_key
    wrong = next(label for label in task.data.labels if label != gold)
    for reply, paid, correct in ((gold, 1.0, 1.0), (wrong, 1.0, 0.0), (f"The answer is {gold}.", 0.0, 0.0)):
        trace = score(task, reply)
        assert (trace.reward, trace.metrics["correct_strict"]) == (paid, correct), reply


def test_settings_the_taskset_cannot_express_are_refused(data_file, tmp_path, capsys):
    for bad in ({"shuffle_options": "rollout"}, {"reward_mode": "random"}):
        with pytest.raises(ValidationError):
            SciKnowEvalConfig.model_validate({"id": "sciknoweval", **bad})
    for flags in (["--shuffle-options", "rollout"], ["--reward-mode", "random"], ["--algorithm", "sdpo"]):
        assert cli_main(["export", "prime-rl", "--out", str(tmp_path / "x"), *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith("scirl export:") and "cannot be exported" in err and err.count("\n") == 1
    assert not (tmp_path / "x").exists()  # refused before anything is written


def test_export_with_shuffle_and_a_control_reward(data_file, tmp_path):
    out = tmp_path / "export"
    assert cli_main(["export", "prime-rl", "--out", str(out), "--data", str(data_file),
                     "--shuffle-options", "epoch", "--reward-mode", "format"]) == 0
    cfg = tomllib.loads((out / "grpo.toml").read_text())
    taskset = cfg["orchestrator"]["train"]["source"][0]["env"]["taskset"]
    assert taskset == {"id": "sciknoweval", "split": "train", "data": str(data_file.resolve()),
                       "shuffle_options": "epoch", "reward_mode": "format"}
    config = SciKnowEvalConfig.model_validate(taskset)
    tasks = list(vf.load_taskset(config.model_copy(update={"eval_per_domain": EVAL_PER_DOMAIN})))
    assert tasks and all(t.data.option_order is not None and t.data.reward_mode == "format" for t in tasks)
    # only the taskset differs from the default export, which prime-rl validated (fixtures)
    base = cfg["inference"]["server"]["port"]
    assert without(cfg, ["orchestrator.train.source"]) == without(exported_toml(base, "main"), ["orchestrator.train.source"])


# --- the export ---------------------------------------------------------------------------------
#
# prime-rl is not on PyPI, so its resolution of the exported grpo.toml is recorded
# by scripts/check_primerl_config.sh (prime-rl's own RLConfig, at the commit named in
# each fixture) and checked here. A change to the export fails these tests until the
# fixtures are recorded again against prime-rl.

FIXTURES = {path.stem: json.loads(path.read_text()) for path in sorted((REPO / "tests" / "fixtures").glob("primerl_*.json"))}
# Where prime-rl took each resolved value from, in the exported TOML (checked against the fixtures below).
FACT_SOURCES = {
    "trainer.weight_broadcast.port": "weight_broadcast.port",
    "orchestrator.weight_broadcast.port": "weight_broadcast.port",
    "inference.server.port": "inference.server.port",
    "inference.backend_port": "inference.backend_port",
    "inference.vllm.data_parallel_rpc_port": "inference.vllm.data_parallel_rpc_port",
    "trainer.rollout_transport.port": "rollout_transport.port",
    "orchestrator.rollout_transport.port": "rollout_transport.port",
    "orchestrator.env_server_base_port": "orchestrator.env_server_base_port",
    "orchestrator.model.client.base_url": "orchestrator.model.client.base_url",
}
PORT_FACTS = ["trainer.weight_broadcast.port", "inference.server.port", "inference.backend_port", "router_metrics_port",
              "inference.vllm.data_parallel_rpc_port", "orchestrator.rollout_transport.port", "rollout_ready_port"]


def lookup(table: dict, dotted: str):
    for key in dotted.split("."):
        table = table[key]
    return table


def without(table: dict, dotted_paths) -> dict:
    table = json.loads(json.dumps(table))
    for dotted in dotted_paths:
        *parents, last = dotted.split(".")
        lookup(table, ".".join(parents)).pop(last) if parents else table.pop(last)
    return table


def exported_toml(base: int, ref: str) -> dict:
    return tomllib.loads(grpo_toml(Ports(base), target=TARGETS[ref]))


def test_fixtures_cover_every_target_at_its_commit():
    assert sorted((f["prime_rl_ref"], f["prime_rl_commit"]) for f in FIXTURES.values()) == sorted(
        (t.name, t.commit) for t in TARGETS.values())
    assert TARGETS[DEFAULT_TARGET].name == "main"


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_export_is_the_config_prime_rl_validated(name):
    fixture = FIXTURES[name]
    assert exported_toml(fixture["base_port"], fixture["prime_rl_ref"]) == fixture["exported"]


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_every_key_written_is_a_field_of_prime_rl_at_the_target_commit(name):
    fixture = FIXTURES[name]
    fields = fixture["fields"]

    def walk(table: dict, path: str) -> None:
        for key, value in table.items():
            if path:
                assert key in fields[path], f"{path}.{key} is not a field at prime-rl {fixture['prime_rl_commit'][:9]}"
            if path.endswith(".env") and key == "taskset":
                continue  # validated by our own config class
            if isinstance(value, list) and value and isinstance(value[0], dict):
                for item in value:
                    walk(item, f"{path}.{key}" if path else key)
            elif isinstance(value, dict):
                walk(value, f"{path}.{key}" if path else key)

    walk(exported_toml(10_500, fixture["prime_rl_ref"]), "")
    # the guide's filter list is no field any more at main, and main's flag was none at the guide's commit
    if fixture["prime_rl_ref"] == "main":
        assert "post_batch_filters" not in fields["orchestrator"]
        assert "filter_zero_advantages" in fields["orchestrator.train"]
    else:
        assert "filter_zero_advantages" not in fields["orchestrator.train"]


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_prime_rl_resolves_every_port_to_the_exported_block(name):
    fixture = FIXTURES[name]
    resolved, defaults, exported = fixture["resolved"], fixture["defaults"], fixture["exported"]
    ports = Ports(fixture["base_port"])
    # prime-rl took each port from the top-level / per-component setting the export writes
    for fact, source in FACT_SOURCES.items():
        assert resolved[fact] == lookup(exported, source), fact
    # so another base port moves the same settings and nothing else
    other = Ports(fixture["base_port"] + 500)
    moved = exported_toml(other.base, fixture["prime_rl_ref"])
    assert without(moved, set(FACT_SOURCES.values())) == without(exported, set(FACT_SOURCES.values()))
    assert [lookup(moved, s) for s in ("weight_broadcast.port", "inference.server.port", "orchestrator.model.client.base_url")] == [
        other.nccl, other.api, other.base_url]

    # the NCCL port is the exported one on both sides, not the 29501 default
    assert resolved["trainer.weight_broadcast.port"] == resolved["orchestrator.weight_broadcast.port"] == ports.nccl
    assert resolved["trainer.weight_broadcast.type"] == resolved["orchestrator.weight_broadcast.type"] == "nccl"
    assert defaults["trainer.weight_broadcast.port"] == 29501
    # every port prime-rl opens is moved off its default, distinct, outside the ephemeral range
    opened = [resolved[f] for f in PORT_FACTS] + resolved["env_server_ports"]
    assert opened == [ports.nccl, ports.api, ports.backend, ports.router_metrics, ports.dp_rpc, ports.rollout,
                      ports.rollout + 1, ports.env_servers]
    assert resolved["router_metrics_port"] == resolved["inference.server.port"] + fixture["launcher_constants"]["router_metrics_offset"]
    assert all(resolved[f] != defaults[f] for f in PORT_FACTS)
    assert len(set(opened)) == len(opened)
    low, high = DEFAULT_EPHEMERAL_RANGE
    assert not any(low <= p <= high for p in opened)
    assert set(opened) <= set(ports.all().values())
    # the client talks to the router's port and its admin calls go to the engine
    assert resolved["orchestrator.model.client.base_url"] == f"http://localhost:{ports.api}/v1"
    assert resolved["orchestrator.model.client.admin_base_url"] == [f"http://localhost:{ports.backend}/v1"]


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_prime_rl_resolves_the_guides_run(name):
    resolved, defaults = FIXTURES[name]["resolved"], FIXTURES[name]["defaults"]
    assert resolved["trainer.model.name"] == resolved["orchestrator.model.name"] == resolved["inference.vllm.model"] == DEFAULT_MODEL
    assert (resolved["orchestrator.batch_size"], resolved["orchestrator.group_size"]) == (128, 16)
    assert resolved["trainer.optim.lr"] == 5e-6
    assert resolved["seq_len"] == [4096, 4096]
    assert resolved["orchestrator.train.sampling.max_completion_tokens"] == 256
    assert resolved["deployment"] == [2, 6] and resolved["inference.vllm.data_parallel_size"] == 6
    assert resolved["max_steps"] == [30, 30]  # the README's --max-steps 30 over the file's 400
    assert resolved["taskset"] == "SciKnowEvalConfig"
    # zero-advantage rollouts are trained on, as in the guide, where prime-rl's default drops them
    if FIXTURES[name]["prime_rl_ref"] == "main":
        assert resolved["orchestrator.train.filter_zero_advantages"] is False
        assert defaults["orchestrator.train.filter_zero_advantages"] is True
    else:
        filters = resolved["orchestrator.post_batch_filters"]
        assert [f["type"] for f in filters] == ["gibberish", "repetition", "zero_advantage"]
        assert filters[2] == {"type": "zero_advantage", "enforce": False}
        assert defaults["orchestrator.post_batch_filters"][2] == {"type": "zero_advantage", "enforce": True}


def test_package_accepts_prime_rls_own_verifiers_and_the_pypi_releases():
    from packaging.requirements import Requirement

    deps = tomllib.loads((PACKAGE_DIR / "pyproject.toml").read_text())["project"]["dependencies"]
    [spec] = [Requirement(d).specifier for d in deps if Requirement(d).name == "verifiers"]
    versions = {f["prime_rl_ref"]: f["verifiers"] for f in FIXTURES.values()}
    assert versions == {"main": "0.3.1.dev62", "guide": "0.3.1.dev42"}  # as prime-rl's submodule builds them
    for version in [*versions.values(), "0.4.0", "0.4.7"]:
        assert spec.contains(version, prereleases=True), version
    assert not spec.contains("0.5.0", prereleases=True)


def test_export_writes_package_config_and_readme(data_file, tmp_path):
    out = tmp_path / "export"
    assert cli_main(["export", "prime-rl", "--out", str(out), "--data", str(data_file)]) == 0

    for rel in ("sciknoweval/__init__.py", "sciknoweval/taskset.py", "README.md"):
        assert (out / "sciknoweval" / rel).read_bytes() == (PACKAGE_DIR / rel).read_bytes()
    assert not list((out / "sciknoweval").rglob("__pycache__"))
    package_text = (out / "sciknoweval" / "pyproject.toml").read_text()
    package_toml = tomllib.loads(package_text)
    assert package_toml["project"]["name"] == "sciknoweval"
    # uv takes scirl from deps/scirl in the prime-rl checkout: no path of the exporting machine
    drop = Path("/prime-rl") / DROP_PATH
    scirl_source = package_toml["tool"]["uv"]["sources"]["scirl"]
    assert (drop / scirl_source["path"]).resolve() == Path("/prime-rl/deps/scirl")
    assert str(REPO) not in package_text and str(tmp_path) not in package_text

    cfg = tomllib.loads((out / "grpo.toml").read_text())
    [source] = cfg["orchestrator"]["train"]["source"]
    assert source["env"]["taskset"] == {"id": "sciknoweval", "split": "train", "data": str(data_file.resolve())}
    SciKnowEvalConfig.model_validate(source["env"]["taskset"])
    base = cfg["inference"]["server"]["port"]
    assert without(cfg, ["orchestrator.train.source"]) == without(exported_toml(base, "main"), ["orchestrator.train.source"])
    ports = Ports(base)
    assert all(port_is_free(p) for p in ports.all().values())
    assert "559b44772e471d1538537b8805cc77f3824a5e64" in (out / "grpo.toml").read_text()

    text = (out / "README.md").read_text()
    for needed in (UV_SYNC, "uv run --no-sync rl", "--max-steps 30", DROP_PATH, "WANDB_API_KEY", "559b447",
                   f"{EXPECTED_TRAIN_TASKS:,} train tasks", "scirl dcp-to-hf", "vllm serve", "scirl eval",
                   "install scirl first", "--no-deps", "deps/scirl", "uv` and package-index access"):
        assert needed in text, needed
    for port in ports.all().values():
        assert str(port) in text

    # a second export refuses to overwrite unless told to
    assert cli_main(["export", "prime-rl", "--out", str(out)]) == 2
    assert cli_main(["export", "prime-rl", "--out", str(out), "--force", "--prime-rl-ref", "guide"]) == 0
    guide = tomllib.loads((out / "grpo.toml").read_text())
    assert "data" not in guide["orchestrator"]["train"]["source"][0]["env"]["taskset"]
    assert "post_batch_filters" in guide["orchestrator"] and "c7a6573" in (out / "README.md").read_text()


def test_export_base_port_is_checked(tmp_path, capsys):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        # a block whose NCCL port is taken
        if 1024 <= taken - 2 and taken + 21000 - 2 <= 65535 and not DEFAULT_EPHEMERAL_RANGE[0] <= taken + 21000 - 2:
            assert cli_main(["export", "prime-rl", "--out", str(tmp_path / "a"), "--base-port", str(taken - 2)]) == 2
            assert "not free" in capsys.readouterr().err
        # ports in the ephemeral range, or past 65535, are refused whether free or not
        for base in (40000, 20000, 60000):
            assert cli_main(["export", "prime-rl", "--out", str(tmp_path / "a"), "--base-port", str(base)]) == 2
            err = capsys.readouterr().err
            assert err.startswith("scirl export: base port") and err.count("\n") == 1
        assert not (tmp_path / "a" / "grpo.toml").exists()
    chosen = choose_ports()
    assert cli_main(["export", "prime-rl", "--out", str(tmp_path / "b"), "--base-port", str(chosen.base)]) == 0
    cfg = tomllib.loads((tmp_path / "b" / "grpo.toml").read_text())
    assert cfg["weight_broadcast"] == {"type": "nccl", "port": chosen.nccl}
    assert cfg["inference"]["server"]["port"] == chosen.api


def test_export_default_ports_skip_a_taken_block(tmp_path):
    first = choose_ports()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("", first.rollout))
        busy.listen()
        assert choose_ports().base > first.base
    assert first.base in BASE_PORT_SEARCH


def test_readme_check_command_keeps_a_hostile_data_path_literal(data_file, tmp_path):
    """The README's check line runs `$(...)` from --data nowhere: quoted for the shell and for Python."""
    hostile = tmp_path / "$(touch pwned)" / "it's `here`"
    hostile.mkdir(parents=True)
    rows = hostile / "rows.jsonl"
    shutil.copy(data_file, rows)
    out = tmp_path / "export"
    assert cli_main(["export", "prime-rl", "--out", str(out), "--data", str(rows)]) == 0
    [line] = [ln for ln in (out / "README.md").read_text().split("```bash\n")[3].split("\nuv run --no-sync rl")[:1]]
    assert line.startswith("uv run --no-sync python3 -c ")
    # run it as pasted, with `uv run --no-sync python3` standing for this interpreter
    script = f'uv() {{ shift 3; {shlex.quote(sys.executable)} "$@"; }}\n{line}\n'
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PACKAGE_DIR), str(REPO)])}
    result = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert not list(tmp_path.rglob("pwned"))
    expected = len(list(vf.load_taskset(SciKnowEvalConfig(id="sciknoweval", data=str(rows)))))
    assert result.stdout.strip() == f"{expected} train tasks"


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("PRIME_RL_CHECKOUT"), reason="set PRIME_RL_CHECKOUT to a prime-rl checkout")
def test_check_script_against_a_prime_rl_checkout():
    """CI with a prime-rl checkout: validate a fresh export with prime-rl's own config classes."""
    result = subprocess.run(["bash", str(REPO / "scripts" / "check_primerl_config.sh"), os.environ["PRIME_RL_CHECKOUT"]],
                            capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "FAIL" not in result.stdout


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


def test_data_errors_name_the_tasksets_data_key(monkeypatch):
    """scirl's hub hint says `--data`; inside prime-rl the knob is the taskset's `data` key."""
    from scirl.task.data import DataSourceError, hub_unreachable_message

    def no_hub(*args, **kwargs):
        raise DataSourceError(hub_unreachable_message("hicai-zju/SciKnowEval", "no network"))

    monkeypatch.setattr("sciknoweval.taskset.load_splits", no_hub)
    with pytest.raises(DataSourceError, match=r"(?s)--data.*taskset's `data` key.*source\.env\.taskset"):
        list(vf.load_taskset(SciKnowEvalConfig(id="sciknoweval")))
    monkeypatch.undo()
    with pytest.raises(DataSourceError, match=r"(?s)neither the hub id.*taskset's `data` key"):
        list(vf.load_taskset(SciKnowEvalConfig(id="sciknoweval", data="/nonexistent/rows.jsonl")))


# --- prime-rl DCP checkpoint -> HF model (`scirl dcp-to-hf`) ------------------------------------


def write_primerl_checkpoint(model_dir: Path, run_dir: Path, step: int = 3) -> dict:
    """A trainer checkpoint in prime-rl's layout, of the tiny model after one AdamW step.

    prime-rl (src/prime_rl/trainer/ckpt.py at 559b447) saves
    ``{"app": AppState}`` with ``dcp.save`` into ``<run>/checkpoints/step_N/trainer``;
    AppState's state dict is ``{"model", "optimizers", "scheduler", "progress"}`` with the
    model and optimizer from ``get_state_dict``. The launcher writes the resolved
    trainer config to ``<run>/configs/trainer.json``.
    """
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    model_sd, optim_sd = get_state_dict(model, [optimizer])
    state = {"app": {"model": model_sd, "optimizers": optim_sd, "scheduler": {"last_epoch": step},
                     "progress": {"step": step, "total_tokens": 5}}}
    dcp.save(state, checkpoint_id=run_dir / "checkpoints" / f"step_{step}" / "trainer", no_dist=True)
    (run_dir / "configs").mkdir(parents=True)
    (run_dir / "configs" / "trainer.json").write_text(json.dumps({"model": {"name": str(model_dir)}}))
    return {name: t.detach().clone() for name, t in model_sd.items()}


@pytest.fixture(scope="module")
def primerl_run(tiny_model_dir, tmp_path_factory):
    run = tmp_path_factory.mktemp("primerl_run") / "grpo-cold-start"
    return run, write_primerl_checkpoint(tiny_model_dir, run)


def test_dcp_to_hf_writes_the_trained_weights_as_an_hf_model(primerl_run, tiny_model_dir, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run, trained = primerl_run
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).state_dict()
    assert not torch.equal(base["model.layers.0.mlp.up_proj.weight"], trained["model.layers.0.mlp.up_proj.weight"])

    out = tmp_path / "hf32"
    # the base model comes from the run's configs/trainer.json
    assert cli_main(["dcp-to-hf", str(run / "checkpoints" / "step_3"), "--out", str(out), "--dtype", "float32"]) == 0
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    assert set(loaded) == set(trained)
    for name, tensor in trained.items():
        assert torch.equal(loaded[name], tensor), name
    assert AutoTokenizer.from_pretrained(out).chat_template == AutoTokenizer.from_pretrained(tiny_model_dir).chat_template
    assert not (tmp_path / "hf32.tmp").exists()

    # the default: bf16 weights and a config that says so (vLLM's dtype "auto" reads it)
    out16 = tmp_path / "hf16"
    assert cli_main(["dcp-to-hf", str(run / "checkpoints" / "step_3" / "trainer"), "--out", str(out16),
                     "--base", str(tiny_model_dir)]) == 0
    model16 = AutoModelForCausalLM.from_pretrained(out16)
    assert model16.dtype == torch.bfloat16
    for name, tensor in model16.state_dict().items():
        assert torch.equal(tensor, trained[name].to(torch.bfloat16)), name


def test_dcp_to_hf_sharded_output_loads(primerl_run, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from scirl.primerl.dcp_convert import convert

    run, trained = primerl_run
    result = convert(run / "checkpoints" / "step_3", tmp_path / "sharded", dtype="float32", shard_bytes=64 * 1024)
    assert result.shards > 1 and (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "sharded", dtype=torch.float32).state_dict()
    assert all(torch.equal(loaded[n], t) for n, t in trained.items())


def test_dcp_to_hf_output_is_evaluated_by_scirl_eval(primerl_run, data_file, tmp_path):
    run, _ = primerl_run
    out = tmp_path / "hf"
    assert cli_main(["dcp-to-hf", str(run / "checkpoints" / "step_3"), "--out", str(out)]) == 0
    results = tmp_path / "eval.json"
    assert cli_main(["eval", "--model", str(out), "--data", str(data_file), "--eval-per-domain", "5", "--limit", "3",
                     "--max-tokens", "4", "--device", "cpu", "--no-progress", "--out", str(results)]) == 0
    assert json.loads(results.read_text())["counts"]["answered"] == 3


def test_dcp_to_hf_refuses_cut_short_and_unnamed_checkpoints(primerl_run, tmp_path, capsys):
    run, _ = primerl_run
    cut = tmp_path / "step_9" / "trainer"
    shutil.copytree(run / "checkpoints" / "step_3" / "trainer", cut)
    (cut / ".metadata").unlink()  # what a timeout during the final save leaves
    assert cli_main(["dcp-to-hf", str(cut.parent), "--out", str(tmp_path / "a"), "--base", "x"]) == 2
    err = capsys.readouterr().err
    assert "cut short" in err and err.count("\n") == 1
    # no run config beside it and no --base: nothing says which config and tokenizer to use
    lone = tmp_path / "lone" / "step_3"
    shutil.copytree(run / "checkpoints" / "step_3", lone)
    assert cli_main(["dcp-to-hf", str(lone), "--out", str(tmp_path / "b")]) == 2
    assert "--base" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_other_sets_and_their_exports_load_in_the_taskset(tmp_path):
    from scirl.synth import other_formats as synthetic_formats
    arc = write_jsonl(synthetic_formats.generate_format_rows("arc", n=60, seed=1), tmp_path / "arc.jsonl")
    direct = load(arc, split="train")
    assert {len(t.data.options) for t in direct} == {3, 4, 5}  # no option count is dropped as "not MCQ"
    assert [t.data.qid for t in load(arc, split="train", data_format="arc")] == [t.data.qid for t in direct]
    out = tmp_path / "exported.jsonl"
    assert cli_main(["data", "export", "--data", str(arc), "--split", "train", "--out", str(out),
                     "--eval-per-domain", str(EVAL_PER_DOMAIN)]) == 0
    config = SciKnowEvalConfig(id="sciknoweval", data=str(out), eval_per_domain=0, data_format="sciknoweval")
    assert sorted(t.data.qid for t in vf.load_taskset(config)) == sorted(t.data.qid for t in direct)
    mapped = load(arc, split="train", data_columns="question=question,options=choices,answer=answerKey")
    assert sorted(t.data.answer_key for t in mapped) == sorted(t.data.answer_key for t in direct)
    for bad in ({"data_format": "csv"}, {"data_columns": "question=Q"}):
        with pytest.raises(ValidationError):
            SciKnowEvalConfig(id="sciknoweval", **bad)


def test_export_reads_the_data_as_scirl_train_does_and_passes_its_format_on(tmp_path, capsys):
    """`--data` that does not exist was written into grpo.toml (exit 0); a format or a column mapping could not be
    passed on. Now the export reads --data first (one line, exit 2, nothing written) and the taskset gets the
    format, the columns and the split settings, under scirl eval's names for them."""
    from scirl.synth import other_formats as synthetic_formats

    missing = tmp_path / "missing.jsonl"
    assert cli_main(["export", "prime-rl", "--out", str(tmp_path / "x"), "--data", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("scirl export:") and str(missing) in err and err.count("\n") == 1
    assert not (tmp_path / "x").exists()

    arc = write_jsonl(synthetic_formats.generate_format_rows("arc", n=60, seed=1), tmp_path / "arc.jsonl")
    out = tmp_path / "export"
    columns = "question=question,options=choices,answer=answerKey"
    assert cli_main(["export", "prime-rl", "--out", str(out), "--data", str(arc), "--data-columns", columns,
                     "--eval-per-domain", str(EVAL_PER_DOMAIN), "--split-seed", "3"]) == 0
    assert "taskset:" in capsys.readouterr().err
    taskset = tomllib.loads((out / "grpo.toml").read_text())["orchestrator"]["train"]["source"][0]["env"]["taskset"]
    assert taskset == {"id": "sciknoweval", "split": "train", "data": str(arc.resolve()), "data_columns": columns,
                       "eval_per_domain": EVAL_PER_DOMAIN, "split_seed": 3}
    exported = [t.data.qid for t in vf.load_taskset(SciKnowEvalConfig.model_validate(taskset))]
    assert exported == [t.data.qid for t in load(arc, data_columns=columns, split_seed=3)]
    assert "split_seed=3" in (out / "README.md").read_text()  # the install check loads the same tasks
    assert cli_main(["export", "prime-rl", "--out", str(out), "--force", "--data", str(arc), "--data-format", "arc"]) == 0
    taskset = tomllib.loads((out / "grpo.toml").read_text())["orchestrator"]["train"]["source"][0]["env"]["taskset"]
    assert taskset["data_format"] == "arc" and "data_columns" not in taskset
