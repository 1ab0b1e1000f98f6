"""Training config: TOML files plus dotted overrides, errors that name the field, the shipped configs."""

from pathlib import Path

import pytest

from scirl.errors import ConfigError
from scirl.run.config import TrainConfig
from scirl.run.config_io import load_config, read_toml, validate, write_config

ROOT = Path(__file__).resolve().parents[2]


def test_overrides_kebab_snake_equals_and_bools():
    cfg = load_config(
        [
            "--max-steps",
            "7",
            "--output_dir=out/x",
            "--optim.lr",
            "1e-5",
            "--optim.betas",
            "[0.9, 0.95]",
            "--filters.zero-advantage.no-enforce",
            "--wandb.enabled",
            "--advantage.std-normalize",
            "true",
            "--ckpt.interval",
            "3",
            "--reward.mode",
            "lenient",
        ]
    )
    assert cfg.max_steps == 7 and cfg.output_dir == "out/x"
    assert cfg.optim.lr == 1e-5 and cfg.optim.betas == (0.9, 0.95)
    assert cfg.filters.zero_advantage.enforce is False and cfg.filters.gibberish.enforce is True
    assert cfg.wandb.enabled is True and cfg.advantage.std_normalize is True
    assert cfg.ckpt.interval == 3 and cfg.reward.mode == "lenient"


def test_files_merge_left_to_right_and_flags_win(tmp_path):
    a = tmp_path / "a.toml"
    a.write_text("max_steps = 5\nbatch_size = 32\n[optim]\nlr = 1e-4\nweight_decay = 0.0\n")
    b = tmp_path / "b.toml"
    b.write_text("[optim]\nlr = 2e-4\n")
    cfg = load_config(["@", str(a), f"@{b}", "--batch-size", "64"])
    assert cfg.max_steps == 5 and cfg.batch_size == 64
    assert cfg.optim.lr == 2e-4 and cfg.optim.weight_decay == 0.0  # deep merge keeps a's other keys


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--optim.lrr", "1"], "optim.lr"),  # unknown key: named, with a suggestion
        (["--not-a-field", "1"], "not_a_field"),
        (["--max-steps", "many"], "max_steps"),
        (["--optim.lr", "-1"], "optim.lr"),
        (["--batch-size", "10", "--group-size", "4"], "divisible by group_size"),
        (["--reward.mode", "fuzzy"], "reward.mode"),
        (["--data.split", "test"], "data.split"),  # not a traceback after the data has loaded
        (
            ["--group-size", "1", "--batch-size", "8"],
            "group_size",
        ),  # every advantage would be 0: 10 idle steps, then an error
        (["--optim", "3"], "section"),
        (["--no-max-steps"], "true/false"),
        (["--max-steps"], "needs a value"),
        (["loose-word"], "unexpected argument"),
        (["--micro-batch-tokens", "0"], "micro_batch_tokens"),  # and no micro_batch_size: unbounded micro-batches
        # values that can only be mistakes (issue 12, item 3): refused here, not as NaN losses or an AdamW crash
        (["--optim.lr", "inf"], "optim.lr"),
        (["--optim.lr", "nan"], "optim.lr"),
        (["--optim.lr", "1e400"], "optim.lr"),  # overflows to inf
        (["--optim.lr", "2"], "optim.lr"),
        (["--temperature", "1e300"], "temperature"),
        (["--temperature", "11"], "temperature"),
        (["--optim.betas", "[2, -5]"], "optim.betas"),
        (["--optim.betas", "[0.9, 1.0]"], "optim.betas"),
        (["--optim.betas", "[0.9, NaN]"], "optim.betas"),
        (["--optim.weight-decay", "-inf"], "optim.weight_decay"),
        (["--optim.lr", "0.5", "--optim.weight-decay", "3"], "lr \\* weight_decay"),
        (["--optim.max-norm", "nan"], "optim.max_norm"),
        (["--loss.kl-tau", "inf"], "loss.kl_tau"),
        (["--filters.gibberish.logprob-offset", "nan"], "logprob_offset"),
        (["--advantage.eps", "inf"], "advantage.eps"),
        (["--top-p", "nan"], "top_p"),
        (["--seed", "-1"], "seed"),
        (["--data.split-seed", str(2**64)], "data.split_seed"),
        (["--data.seed", "3"], "--data.seed: it is now --data.split-seed"),  # renamed: the flag names its new name
        (["--output-dir", ""], "output_dir"),
        (["--model", ""], "model"),
        (["--data.shuffle-options", "always"], "data.shuffle_options"),
        (["--reward.mode", "coin"], "reward.mode"),
    ],
)
def test_bad_values_and_unknown_keys_name_the_field(argv, fragment):
    with pytest.raises(ConfigError, match=fragment.replace(".", r"\.") if "." in fragment else fragment):
        load_config(argv)


def test_unknown_key_in_a_file_names_file_and_field(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[optim]\nlearning_rate = 1e-5\n")
    with pytest.raises(ConfigError) as exc:
        load_config(["@", str(path)])
    assert "optim.learning_rate" in str(exc.value) and "bad.toml" in str(exc.value)
    with pytest.raises(ConfigError, match="not found"):
        load_config(["@", str(tmp_path / "missing.toml")])


def test_an_old_config_with_data_seed_reads_it_as_the_split_seed(tmp_path, capsys):
    """`[data] seed` was renamed `split_seed` (the name scirl eval and scirl data give it): an old run's
    config.toml, the base of its --resume, must still load, with one line saying so; both names is an error."""
    old = tmp_path / "config.toml"
    old.write_text("[data]\nseed = 7\neval_per_domain = 5\n")
    cfg = load_config(["@", str(old)])
    assert (cfg.data.split_seed, cfg.data.eval_per_domain) == (7, 5)
    notes = capsys.readouterr().err.splitlines()
    assert len(notes) == 1 and "seed" in notes[0] and "split_seed" in notes[0] and str(old) in notes[0]
    assert "split_seed = 7" in (write_config(cfg, tmp_path / "new.toml")).read_text()
    old.write_text("[data]\nseed = 7\nsplit_seed = 8\n")
    with pytest.raises(ConfigError, match="both seed and split_seed"):
        load_config(["@", str(old)])


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(["--max-steps", "3", "--wandb.name", "run-1", "--ckpt.keep", "2"])
    path = write_config(cfg, tmp_path / "config.toml")
    assert validate(read_toml(path)) == cfg
    # None fields are left out of the TOML and come back as their None default
    saved = read_toml(path)
    assert "interval" not in saved["ckpt"] and "interval" not in saved["eval"]
    assert "nccl_address" not in saved["deployment"]


@pytest.mark.parametrize("name", ["sciknoweval-qwen3-8b.toml", "demo.toml"])
def test_shipped_configs_validate(name):
    cfg = load_config(["@", str(ROOT / "configs" / name)])
    assert cfg.batch_size % cfg.group_size == 0


def test_guide_config_has_the_guides_values():
    cfg = load_config(["@", str(ROOT / "configs" / "sciknoweval-qwen3-8b.toml")])
    assert (cfg.model, cfg.batch_size, cfg.group_size, cfg.max_completion_tokens, cfg.seq_len) == (
        "PrimeIntellect/Qwen3-8B",
        128,
        16,
        256,
        4096,
    )
    assert cfg.optim.lr == 5e-6 and cfg.max_steps == 30
    assert cfg.filters.zero_advantage.enforce is False
    assert cfg.filters.gibberish.enforce and cfg.filters.repetition.enforce
    assert (cfg.loss.mask_low, cfg.loss.mask_high, cfg.loss.kl_tau) == (0.2, 0.2, 1e-3)
    assert cfg.reward.mode == "strict" and cfg.wandb.enabled is False


def test_defaults_follow_prime_rl():
    cfg = TrainConfig()
    assert cfg.optim.weight_decay == 0.01 and cfg.optim.max_norm == 1.0
    assert cfg.filters.gibberish.token_id_threshold == 100_000 and cfg.filters.gibberish.logprob_offset == 2.0
    assert cfg.filters.repetition.window == 3000 and cfg.filters.repetition.prob_threshold == 0.99
    assert cfg.advantage.std_normalize is False


def test_cli_dry_run_prints_the_resolved_config(capsys):
    from scirl.commands.train import main

    assert main(["@", str(ROOT / "configs" / "demo.toml"), "--max-steps", "2", "--dry-run"]) == 0
    assert "max_steps = 2" in capsys.readouterr().out
    assert main(["--optim.lrr", "1", "--dry-run"]) == 2
    assert "optim.lr" in capsys.readouterr().err


def test_non_finite_floats_in_a_toml_file_are_refused(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("temperature = nan\n[optim]\nlr = inf\n[loss]\nmask_low = -inf\n")
    with pytest.raises(ConfigError) as exc:
        load_config(["@", str(path)])
    text = str(exc.value)
    assert "temperature" in text and "optim.lr" in text and "loss.mask_low" in text and "finite" in text


def test_inference_section_parses_from_flags_and_round_trips(tmp_path):
    cfg = load_config(
        [
            "--inference.backend",
            "vllm",
            "--inference.sleep-level",
            "1",
            "--inference.max-model-len",
            "1024",
            "--inference.enforce-eager",
            "--inference.gpu-memory-utilization",
            "0.3",
            "--inference.kv-cache-gib",
            "0.5",
        ]
    )
    inf = cfg.inference
    assert (inf.backend, inf.sleep_level, inf.max_model_len, inf.enforce_eager) == ("vllm", 1, 1024, True)
    assert (inf.gpu_memory_utilization, inf.kv_cache_gib) == (0.3, 0.5)
    assert validate(read_toml(write_config(cfg, tmp_path / "c.toml"))).inference == inf
    defaults = TrainConfig().inference
    assert (defaults.backend, defaults.max_model_len, defaults.sleep_level, defaults.gpu_memory_utilization) == (
        "auto",
        None,
        2,
        None,
    )


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--inference.backend", "sglang"], "inference.backend"),
        (["--inference.gpu-memory-utilization", "1.5"], "inference.gpu_memory_utilization"),
        (["--inference.gpu-memory-utilization", "0"], "inference.gpu_memory_utilization"),
        (["--inference.sleep-level", "3"], "inference.sleep_level"),
        (["--inference.kv-cache-gib", "0"], "inference.kv_cache_gib"),
    ],
)
def test_inference_section_refuses_bad_values(argv, fragment):
    with pytest.raises(ConfigError, match=fragment.replace(".", r"\.")):
        load_config(argv)


def leaf_fields(model, prefix=""):
    """(dotted name, pydantic field) of every setting of the config, sections walked."""
    from pydantic import BaseModel

    for name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            yield from leaf_fields(field.annotation, f"{prefix}{name}.")
        else:
            yield prefix + name, field


def test_train_help_lists_every_field_with_its_default_and_what_it_means(capsys):
    """`scirl train --help` pointed to --dry-run (issue 49); it lists the config's sections and fields, read from
    the config classes, so a field added there is listed, and one without a description is caught here."""
    import json

    from scirl.cli import main

    with pytest.raises(SystemExit) as done:
        main(["train", "--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # descriptions are wrapped
    fields = list(leaf_fields(TrainConfig))
    assert len(fields) > 90
    for name, field in fields:
        default = field.get_default(call_default_factory=True)
        shown = "unset" if default is None else json.dumps(list(default) if isinstance(default, tuple) else default)
        assert field.description, f"{name} has no description"
        assert f"--{name.replace('_', '-')} {shown}: {' '.join(field.description.split())}" in text, name
    for section in ("[optim]", "[data]", "[filters.gibberish]", "[deployment]", "[sdpo]", "[loss]"):
        assert section in text


def test_each_registered_algorithm_has_its_section_declared_on_the_config():
    """``TrainConfig`` declares the algorithms' sections as fields in its class body (a type checker reads them
    there); the registry (``scirl.algorithms``) names them: an algorithm registered without its field, or a field
    left behind by one removed, fails here."""
    import ast
    import inspect

    from scirl import algorithms
    from scirl.algorithms import sections
    from scirl.run import config

    tree = ast.parse(inspect.getsource(config))
    body = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "TrainConfig").body
    in_body = {node.target.id for node in body if isinstance(node, ast.AnnAssign)}
    declared = {
        name: field.annotation
        for name, field in TrainConfig.model_fields.items()
        if getattr(field.annotation, "__module__", None) == sections.__name__
    }
    assert declared == algorithms.config_sections() and declared.keys() <= in_body
    cfg = TrainConfig()
    for name, model in declared.items():
        assert getattr(cfg, name) == model()
