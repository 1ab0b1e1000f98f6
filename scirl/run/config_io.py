"""Reading and writing the training config: ``@ a.toml @ b.toml`` deep-merged left to right, then dotted
flags such as ``--max-steps 30 --optim.lr 1e-5 --filters.zero-advantage.no-enforce`` (the precedence
prime-rl users know), validated into a ``TrainConfig`` (``config.py``); and the resolved config back
to TOML for the run directory. Every problem is one ``ConfigError`` line naming the field.
"""

from __future__ import annotations

import difflib
import json
import sys
import textwrap
import types
import typing
from pathlib import Path
from typing import Any

import tomli_w
from pydantic import BaseModel, ValidationError

from scirl.errors import ConfigError
from scirl.run.config import TrainConfig
from scirl.run.rundir import RUN_CONFIG

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def deep_merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _nested_model(annotation) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def _accepts(annotation, kind) -> bool:
    """Whether ``annotation`` is ``kind`` or a union containing it."""
    if annotation is kind:
        return True
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_accepts(a, kind) for a in typing.get_args(annotation))
    return False


# (section, old name) -> new name: a file (a run's config.toml, the base of its --resume) is read under the new name
# with a note; a flag with the old name is refused, naming the new one
RENAMED = {("data", "seed"): "split_seed"}  # the split's seed, named as `scirl eval --split-seed` names it


def _field_path(path: list[str], flag: str):
    """Resolve ``["optim", "lr"]`` to the annotation of that field, or raise naming the bad part."""
    model: type[BaseModel] = TrainConfig
    for i, part in enumerate(path):
        fields = model.model_fields
        if part not in fields:
            renamed = RENAMED.get((".".join(path[:i]), part))
            if renamed is not None:
                new_flag = "--" + ".".join(path[:i] + [renamed]).replace("_", "-")
                raise ConfigError(f"unknown option {flag}: it is now {new_flag}")
            where = ".".join(path[:i]) or "the top level"
            hint = difflib.get_close_matches(part, list(fields), n=1)
            hint_text = f" (did you mean {'.'.join(path[:i] + hint).replace('_', '-')}?)" if hint else ""
            raise ConfigError(f"unknown option {flag}: no field {part!r} in {where}{hint_text}")
        annotation = fields[part].annotation
        if i < len(path) - 1:
            nested = _nested_model(annotation)
            if nested is None:
                raise ConfigError(f"unknown option {flag}: {'.'.join(path[: i + 1])} has no sub-fields")
            model = nested
    return annotation


def _parse_value(text: str, annotation) -> Any:
    """Turn a command-line string into a TOML-like value; pydantic then validates it against the field."""
    if text in ("None", "none", "null") and _accepts(annotation, type(None)):
        return None
    if typing.get_origin(annotation) in (tuple, list) or text.startswith("["):
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return [part.strip() for part in text.strip("[]").split(",") if part.strip()]
    return text


def field_reference(model: type[BaseModel] = TrainConfig, width: int = 110) -> str:
    """``scirl train --help``'s listing: every field as its flag, default and meaning, read from the config
    classes."""
    lines: list[str] = []

    def walk(section: type[BaseModel], prefix: str) -> None:
        fields = section.model_fields.items()
        plain = [(name, f) for name, f in fields if _nested_model(f.annotation) is None]
        if plain:
            about = (section.__dict__.get("__doc__") or "").strip().split("\n\n")[0]
            title = f"[{prefix[:-1]}]" if prefix else "top level"
            lines.extend(textwrap.wrap(f"{title}  {' '.join(about.split())}" if prefix and about else title, width))
        for name, f in plain:
            default = f.get_default(call_default_factory=True)
            shown = "unset" if default is None else json.dumps(list(default) if isinstance(default, tuple) else default)
            entry = f"--{(prefix + name).replace('_', '-')} {shown}" + (f": {f.description}" if f.description else "")
            lines.extend(textwrap.wrap(entry, width, initial_indent="  ", subsequent_indent="      "))
        for name, f in fields:
            if (nested := _nested_model(f.annotation)) is not None:
                walk(nested, f"{prefix}{name}.")

    walk(model, "")
    return "\n".join(lines)


def parse_overrides(argv: list[str]) -> tuple[list[Path], dict]:
    """Split ``@ file.toml`` references from ``--dotted.key value`` overrides; return (files, nested dict)."""
    files: list[Path] = []
    overrides: dict = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "@":
            if i + 1 >= len(argv):
                raise ConfigError("'@' must be followed by a TOML file")
            files.append(Path(argv[i + 1]))
            i += 2
            continue
        if arg.startswith("@"):
            files.append(Path(arg[1:]))
            i += 1
            continue
        if not arg.startswith("--") or arg == "--":
            raise ConfigError(f"unexpected argument {arg!r}: expected '@ file.toml' or '--some.field value'")
        key, has_value, value = arg[2:].partition("=")
        parts = [p.replace("-", "_") for p in key.split(".")]
        negate = False
        annotation = None
        try:
            annotation = _field_path(parts, arg.split("=")[0])
        except ConfigError:
            # --no-x / --filters.zero-advantage.no-enforce
            if parts[-1].startswith("no_"):
                try:
                    annotation = _field_path(parts[:-1] + [parts[-1][3:]], arg)
                    negate = True
                    parts = parts[:-1] + [parts[-1][3:]]
                except ConfigError:
                    annotation = None
            if annotation is None:
                raise
        flag_name = "--" + ".".join(parts).replace("_", "-")
        if _nested_model(annotation) is not None:
            raise ConfigError(f"{flag_name} is a section; set one of its fields, e.g. {flag_name}.<field> VALUE")
        if (
            _accepts(annotation, bool)
            and (negate or not has_value)
            and (
                negate
                or i + 1 >= len(argv)
                or argv[i + 1].startswith("-")
                or argv[i + 1] == "@"
                or argv[i + 1].lower() not in ("true", "false", "1", "0", "yes", "no")
            )
        ):
            if negate and has_value:
                raise ConfigError(f"{arg}: a --no-... flag takes no value")
            parsed: Any = not negate
            i += 1
        else:
            if negate:
                raise ConfigError(f"--no-... only applies to true/false fields, not {flag_name}")
            if not has_value:
                if i + 1 >= len(argv):
                    raise ConfigError(f"{flag_name} needs a value")
                value = argv[i + 1]
                i += 2
            else:
                i += 1
            parsed = _parse_value(value, annotation)
        node = overrides
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = parsed
    return files, overrides


def read_toml(path: Path, note_renamed: bool = True) -> dict:
    """A config file as a dict, renamed fields under their new names (said on stderr with ``note_renamed``)."""
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        with path.open("rb") as f:
            return renamed_fields(tomllib.load(f), path, note_renamed)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from exc
    except UnicodeDecodeError as exc:  # TOML is UTF-8; a Latin-1 comment is the usual culprit
        raise ConfigError(
            f"{path}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start}); "
            "TOML files must be UTF-8: save it as UTF-8"
        ) from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read it ({exc.strerror or exc})") from None


def renamed_fields(data: dict, path: Path, note: bool = True) -> dict:
    """``data`` with each ``RENAMED`` field under its new name, said in one line (an old run's config.toml must
    still resume); both names at once is an error."""
    for (section, old), new in RENAMED.items():
        table = data.get(section)
        if not isinstance(table, dict) or old not in table:
            continue
        if new in table:
            raise ConfigError(
                f"{path}: [{section}] has both {old} and {new}, the old and the new name of one field: keep {new}"
            )
        data = {**data, section: {(new if key == old else key): value for key, value in table.items()}}
        if note:
            print(f"note: {path}: [{section}] {old} is read as {new}, its new name", file=sys.stderr)
    return data


def _none_strings(data):
    """TOML has no null; like prime-rl, the string "None" stands for it."""
    if isinstance(data, dict):
        return {k: _none_strings(v) for k, v in data.items()}
    return None if data == "None" else data


def validate(data: dict, origin: str = "config") -> TrainConfig:
    try:
        return TrainConfig.model_validate(_none_strings(data))
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            field = ".".join(str(p) for p in err["loc"]) or "(top level)"
            msg = err["msg"]
            if err["type"] == "extra_forbidden":
                msg = "unknown field"
            problems.append(
                f"{field}: {msg}"
                + (
                    f" (got {err['input']!r})"
                    if err["type"] != "extra_forbidden" and not isinstance(err.get("input"), dict)
                    else ""
                )
            )
        # one line, however many fields are wrong: a CLI error is a single line
        raise ConfigError(f"invalid {origin}: " + "; ".join(problems)) from None


# inputs a file may name relative to itself ("./...", "../..."), so a config shipped beside its model works from any
# directory; every other relative path (output_dir, a flag's value) is relative to where the command runs
FILE_RELATIVE_FIELDS = (("model",), ("data", "source"))


def anchor_to_file(data: dict, path: Path) -> dict:
    """``model = "../scirl/assets/demo-base"`` in ``configs/demo.toml`` -> that directory's absolute path."""
    for *sections, name in FILE_RELATIVE_FIELDS:
        table: dict | None = data
        for section in sections:
            table = table.get(section) if isinstance(table, dict) else None
        if not isinstance(table, dict):
            continue
        value = table.get(name)
        if isinstance(value, str) and value.startswith(("./", "../")):
            table[name] = str((path.parent / value).resolve())
    return data


def saved_config(run_dir: Path, note_renamed: bool = True) -> TrainConfig:
    """The validated config a run directory recorded (``config.toml``, or a copied checkpoint's
    ``run_config.toml``); ``ConfigError`` when there is none."""
    path = run_dir / "config.toml"
    if not path.is_file() and (run_dir / RUN_CONFIG).is_file():
        path = run_dir / RUN_CONFIG
    if not path.is_file():
        raise ConfigError(f"{run_dir} is not a scirl train run directory (no config.toml)")
    return validate(read_toml(path, note_renamed), origin=str(path))


# where a run is this time, not what it computes (a moved run resumes where it is; each resume gets new servers):
# never reported as changed
WHERE_NOT_WHAT = ("output_dir", "inference.urls", "deployment.nccl_port", "deployment.nccl_address")


def changed_settings(before: TrainConfig, after: TrainConfig) -> dict[str, list]:
    """Dotted name -> [before, after] (None: not set) of the settings that differ, ``WHERE_NOT_WHAT`` aside."""

    def flat(table: dict, prefix: str = "") -> dict:
        out = {}
        for key, value in table.items():
            if isinstance(value, dict):
                out.update(flat(value, f"{prefix}{key}."))
            else:
                out[prefix + key] = value
        return out

    old, new = flat(to_toml_dict(before)), flat(to_toml_dict(after))
    return {
        key: [old.get(key), new.get(key)]
        for key in sorted(old.keys() | new.keys())
        if old.get(key) != new.get(key) and key not in WHERE_NOT_WHAT
    }


def load_config(argv: list[str], base: dict | None = None) -> TrainConfig:
    """``["@", "configs/demo.toml", "--max-steps", "3"]`` -> a validated TrainConfig; ``base`` (a resumed run's
    saved config) sits below the files and flags."""
    files, overrides = parse_overrides(argv)
    data: dict = dict(base or {})
    for path in files:
        data = deep_merge(data, anchor_to_file(read_toml(path), path))
    data = deep_merge(data, overrides)
    origin = "config" if not files else "config from " + ", ".join(str(p) for p in files) + " and flags"
    return validate(data, origin)


def to_toml_dict(cfg: TrainConfig) -> dict:
    """TOML cannot hold None: drop those keys (their defaults are None, so reading back is exact)."""

    def strip(value):
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if v is not None}
        if isinstance(value, tuple):
            return list(value)
        return value

    return strip(cfg.model_dump(mode="json"))


def write_config(cfg: TrainConfig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".toml.tmp")
    tmp.write_text(tomli_w.dumps(to_toml_dict(cfg)), encoding="utf-8")
    tmp.replace(path)
    return path
