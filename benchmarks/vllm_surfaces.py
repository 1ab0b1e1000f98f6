"""Read, without importing it, the parts of a vLLM release that scirl calls, and print them as JSON.

    python benchmarks/vllm_surfaces.py WHEEL_OR_DIR [WHEEL_OR_DIR ...] [--json OUT] [--table]

Each input is a vLLM wheel (``vllm-X-*.whl``, read in place with ``zipfile``) or an unpacked ``vllm``
package directory (an installed one: its ``*.dist-info`` beside it gives the name, version and torch pin).
Importing vLLM is not an option: the wheels are CUDA builds for other torch versions than the one here,
so every surface is read from source: with ``ast`` for classes, signatures, dataclass fields and route
decorators, plain text search for the rest. ``--table`` prints a markdown table, one column per
release and one row per surface, instead of the JSON. Used to write ``docs/vllm-range.md``.

The surfaces are those of ``scirl/inference/vllm.py``, ``vllm_command.py``, ``client.py``,
``scirl/weights/nccl.py`` and ``filesystem.py``: keep the lists below in step with them.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

# engine arguments scirl passes to vllm.LLM (required and optional)
ENGINE_FIELDS = (
    "model",
    "tokenizer",
    "dtype",
    "seed",
    "max_model_len",
    "gpu_memory_utilization",
    "enforce_eager",
    "logprobs_mode",
    "enable_sleep_mode",
    "kv_cache_memory_bytes",
    "enable_chunked_prefill",
    "weight_transfer_config",
)
# server flags of scirl.inference.vllm_command.server_command
SERVER_FLAGS = (
    "--model",
    "--served-model-name",
    "--dtype",
    "--max-model-len",
    "--seed",
    "--logprobs-mode",
    "--disable-uvicorn-access-log",
    "--enforce-eager",
    "--kv-cache-memory-bytes",
    "--no-enable-chunked-prefill",
    "--gpu-memory-utilization",
    "--data-parallel-size",
    "--weight-transfer-config",
)
# routes scirl.inference.client and scirl.weights call (/openapi.json is FastAPI's own)
SCIRL_ROUTES = (
    "/health",
    "/v1/models",
    "/v1/completions",
    "/collective_rpc",
    "/reset_prefix_cache",
    "/is_sleeping",
    "/server_info",
    "/get_world_size",
    "/init_weight_transfer_engine",
    "/start_weight_update",
    "/update_weights",
    "/finish_weight_update",
    "/update_weight_version",
    "/weight_info",
    "/weight_checker",
    "/shutdown_weight_transfer_engine",
)
SAMPLING_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "max_tokens",
    "min_tokens",
    "seed",
    "logprobs",
    "prompt_logprobs",
    "stop_token_ids",
)
LLM_METHODS = ("sleep", "wake_up", "collective_rpc", "reset_prefix_cache", "generate")
RELOAD_LOGGER_FILE = "vllm/model_executor/model_loader/reload/layerwise.py"
WEIGHT_TRANSFER_DIR = "vllm/distributed/weight_transfer/"


class InputError(Exception):
    """Bad input on the command line: one line on stderr, exit 2."""


class Release:
    """The files of one vLLM release, keyed ``vllm/...``, from a wheel or a package directory."""

    def __init__(self, path: Path):
        self.path = path
        if path.is_file():
            if not zipfile.is_zipfile(path):
                raise InputError(f"{path}: not a wheel (not a zip file)")
            self._zip = zipfile.ZipFile(path)
            names = self._zip.namelist()
            self.files = {n: n for n in names if n.startswith("vllm/") and n.endswith(".py")}
            meta = [n for n in names if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)]
            self.metadata = self._zip.read(meta[0]).decode() if meta else ""
        elif path.is_dir():
            self._zip = None
            package = path / "vllm" if (path / "vllm" / "__init__.py").is_file() else path
            if not (package / "__init__.py").is_file() or package.name != "vllm":
                raise InputError(f"{path}: not a vllm package directory (no vllm/__init__.py)")
            self.files = {"vllm/" + p.relative_to(package).as_posix(): p for p in package.rglob("*.py")}
            infos = sorted(package.parent.glob("vllm*.dist-info/METADATA"))
            self.metadata = infos[0].read_text() if infos else ""
        else:
            raise InputError(f"{path}: no such file or directory")
        if "vllm/__init__.py" not in self.files:
            raise InputError(f"{path}: holds no vllm package")
        self._cache: dict[str, ast.Module] = {}

    def text(self, name: str) -> str | None:
        where = self.files.get(name)
        if where is None:
            return None
        raw = self._zip.read(where) if self._zip is not None else Path(where).read_bytes()
        return raw.decode("utf-8", errors="replace")

    def tree(self, name: str) -> ast.Module | None:
        if name not in self._cache:
            text = self.text(name)
            self._cache[name] = ast.parse(text) if text is not None else None
        return self._cache[name]

    def under(self, prefix: str) -> list[str]:
        return sorted(n for n in self.files if n.startswith(prefix))


# ---- ast helpers ----


def find_class(tree: ast.Module | None, name: str) -> ast.ClassDef | None:
    if tree is None:
        return None
    return next((n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name), None)


def method(cls: ast.ClassDef | None, name: str) -> ast.FunctionDef | None:
    if cls is None:
        return None
    return next(
        (n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name), None
    )


def class_fields(cls: ast.ClassDef) -> dict[str, str]:
    """Annotated names in a class body (dataclass / msgspec fields), ClassVars left out: name -> annotation."""
    fields = {}
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            annotation = ast.unparse(node.annotation)
            if not annotation.startswith(("ClassVar", "typing.ClassVar")):
                fields[node.target.id] = annotation
    return fields


def params(fn: ast.FunctionDef | None) -> list[str] | None:
    """Parameter names, ``*args``/``**kwargs`` spelled so, ``self`` left out."""
    if fn is None:
        return None
    a = fn.args
    names = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]
    names += [f"*{a.vararg.arg}"] if a.vararg else []
    names += [f"**{a.kwarg.arg}"] if a.kwarg else []
    return [n for n in names if n != "self"]


def signature(fn: ast.FunctionDef | None) -> str | None:
    if fn is None:
        return None
    returns = f" -> {ast.unparse(fn.returns)}" if fn.returns else ""
    return f"({ast.unparse(fn.args)}){returns}"


def top_function(tree: ast.Module | None, name: str) -> ast.FunctionDef | None:
    if tree is None:
        return None
    return next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name), None)


def binds(tree: ast.Module | None, name: str) -> bool:
    """Whether a module defines or imports ``name`` at its top level (``module.name`` then works)."""
    if tree is None:
        return False
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name == name:
            return True
        if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == name for a in node.names):
            return True
    return False


# ---- the surfaces ----


def distribution(release: Release) -> dict:
    meta = Parser().parsestr(release.metadata) if release.metadata else None
    version = meta.get("Version") if meta else None
    if version is None:
        match = re.search(r"__version__\s*=\s*version\s*=\s*['\"]([^'\"]+)", release.text("vllm/_version.py") or "")
        version = match.group(1) if match else "unknown"
    torch = [
        r.split(";")[0].strip()
        for r in (meta.get_all("Requires-Dist") or [] if meta else [])
        if re.match(r"torch\s*(==|>=|<=|~=|<|>|\(|;|$)", r)
    ]
    return {"name": meta.get("Name") if meta else None, "version": version, "torch": sorted(set(torch))}


def engine_args(release: Release) -> dict:
    cls = find_class(release.tree("vllm/engine/arg_utils.py"), "EngineArgs")
    fields = class_fields(cls) if cls else {}
    return {
        "fields": {f: f in fields for f in ENGINE_FIELDS},
        "enable_chunked_prefill_type": fields.get("enable_chunked_prefill"),
        "all_fields": sorted(fields),
    }


def llm_class(release: Release) -> dict:
    cls = find_class(release.tree("vllm/entrypoints/llm.py"), "LLM")
    out = {}
    for name in LLM_METHODS:
        fn = method(cls, name)
        out[name] = None if fn is None else signature(fn)
    return out


def worker(release: Release) -> dict:
    worker_cls = find_class(release.tree("vllm/v1/worker/gpu_worker.py"), "Worker")
    reload = method(worker_cls, "reload_weights")
    reload_params = params(reload)
    runner_params = None
    if reload_params is not None and any(p.startswith("*") for p in reload_params):
        # the worker forwards *args/**kwargs to its model runner: what the runner takes is what counts
        runner = find_class(release.tree("vllm/v1/worker/gpu_model_runner.py"), "GPUModelRunner")
        runner_params = params(method(runner, "reload_weights"))
    effective = runner_params if runner_params is not None else reload_params or []
    checksums = {}
    for name in release.under("vllm/v1/worker/"):
        tree = release.tree(name)
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            if method(cls, "compute_weight_checksums") is not None:
                checksums[f"{name.removeprefix('vllm/v1/worker/')}:{cls.name}"] = True
    return {
        "reload_weights": reload_params,
        "model_runner_reload_weights": runner_params,
        "takes_weights_iterator": "weights_iterator" in effective,
        "takes_weights_path": "weights_path" in effective,
        "compute_weight_checksums": sorted(checksums),
        "reload_logger_module": RELOAD_LOGGER_FILE in release.files,
    }


def routes(release: Release) -> list[str]:
    """Every path given to a ``@<router>.get/post/put/delete/api_route("...")`` decorator or an
    ``add_api_route("...")`` call under vllm/entrypoints."""
    found = set()
    for name in release.under("vllm/entrypoints/"):
        for node in ast.walk(release.tree(name)):
            if _route_path(node):
                found.add(_route_path(node))
    return sorted(found)


def route_returns(release: Release, path: str) -> list[str]:
    """What the handler of ``path`` returns (each ``return`` expression), e.g. an empty ``Response`` or JSON."""
    for name in release.under("vllm/entrypoints/"):
        for fn in ast.walk(release.tree(name)):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
                _route_path(d) == path for d in fn.decorator_list
            ):
                return [
                    " ".join(ast.unparse(r.value).split())
                    for r in ast.walk(fn)
                    if isinstance(r, ast.Return) and r.value is not None
                ]
    return []


def _route_path(node) -> str | None:
    """The path of a route decorator or ``add_api_route`` call, else None."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args):
        return None
    first, owner = node.args[0], getattr(node.func.value, "id", "")
    if (
        node.func.attr in ("get", "post", "put", "delete", "api_route", "add_api_route")
        and isinstance(first, ast.Constant)
        and isinstance(first.value, str)
        and first.value.startswith("/")
        and (node.func.attr == "add_api_route" or "router" in owner or owner == "app")
    ):
        return first.value
    return None


def server(release: Release) -> dict:
    """Each flag: how the parser gets it (a literal ``"--flag"`` in the source, or a field of EngineArgs or of
    the frontend's argument dataclass, from which vLLM derives ``--field-name``), or None."""
    engine_cls = find_class(release.tree("vllm/engine/arg_utils.py"), "EngineArgs")
    engine = class_fields(engine_cls) if engine_cls else {}
    frontend: dict[str, str] = {}
    for name in release.under("vllm/entrypoints/"):
        for cls_name in ("FrontendArgs", "BaseFrontendArgs"):
            cls = find_class(release.tree(name), cls_name)
            if cls is not None:
                frontend.update(class_fields(cls))
    argument_files = release.under("vllm/engine/") + release.under("vllm/entrypoints/")
    literal_sources = [release.text(n) or "" for n in argument_files]
    flags = {}
    for flag in SERVER_FLAGS:
        negated = flag.startswith("--no-")
        field = flag.removeprefix("--no-" if negated else "--").replace("-", "_")
        if any(f'"{flag}"' in text or f"'{flag}'" in text for text in literal_sources):
            flags[flag] = "literal"
        elif field in engine and (not negated or "bool" in engine[field]):
            flags[flag] = "EngineArgs." + field
        elif field in frontend and (not negated or "bool" in frontend[field]):
            flags[flag] = "FrontendArgs." + field
        else:
            flags[flag] = None
    module = release.text("vllm/entrypoints/openai/api_server.py") or ""
    return {
        "flags": flags,
        "api_server_main": "__main__" in module,
        "dev_mode_env": "VLLM_SERVER_DEV_MODE" in (release.text("vllm/envs.py") or ""),
    }


def weight_transfer(release: Release) -> dict:
    """The NCCL payload dataclasses (fields include their bases'), where they are defined, and the two
    trainer-side helpers scirl calls."""
    classes = {}
    for name in release.under(WEIGHT_TRANSFER_DIR):
        tree = release.tree(name)
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, (name, node))

    def fields_of(cls_name: str, seen=()) -> list[str] | None:
        if cls_name not in classes or cls_name in seen:
            return None
        _, cls = classes[cls_name]
        inherited = []
        for base in cls.bases:
            base_name = ast.unparse(base).split(".")[-1]
            inherited += fields_of(base_name, seen + (cls_name,)) or []
        return inherited + [f for f in class_fields(cls) if f not in inherited]

    engine_tree = release.tree(WEIGHT_TRANSFER_DIR + "nccl_engine.py")
    out = {}
    for cls_name in ("NCCLWeightTransferInitInfo", "NCCLWeightTransferUpdateInfo"):
        module = classes[cls_name][0].removeprefix(WEIGHT_TRANSFER_DIR) if cls_name in classes else None
        out[cls_name] = {
            "module": module,
            "in_nccl_engine": binds(engine_tree, cls_name),
            "fields": fields_of(cls_name),
        }
    out["nccl_common.trainer_init"] = signature(
        top_function(release.tree(WEIGHT_TRANSFER_DIR + "nccl_common.py"), "trainer_init")
    )
    out["packed_tensor.packed_nccl_broadcast_producer"] = signature(
        top_function(release.tree(WEIGHT_TRANSFER_DIR + "packed_tensor.py"), "packed_nccl_broadcast_producer")
    )
    return out


def sampler(release: Release) -> dict:
    sampler_text = release.text("vllm/v1/sample/ops/topk_topp_sampler.py") or ""
    envs = release.tree("vllm/envs.py")
    default = None
    for node in ast.walk(envs) if envs else ():
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                if isinstance(key, ast.Constant) and key.value == "VLLM_USE_FLASHINFER_SAMPLER":
                    default = " ".join(ast.unparse(value).split())
    return {"reads_VLLM_USE_FLASHINFER_SAMPLER": "VLLM_USE_FLASHINFER_SAMPLER" in sampler_text, "envs_entry": default}


def requests(release: Release) -> dict:
    """SamplingParams fields, the completion request's fields scirl sends, the prompt class it imports."""
    sampling = find_class(release.tree("vllm/sampling_params.py"), "SamplingParams")
    fields = class_fields(sampling) if sampling else {}
    completion_fields: set[str] = set()
    for name in release.under("vllm/entrypoints/"):
        cls = find_class(release.tree(name), "CompletionRequest")
        if cls is not None:
            completion_fields |= set(class_fields(cls))
    inputs = release.text("vllm/inputs/__init__.py") or ""
    platform = find_class(release.tree("vllm/platforms/interface.py"), "Platform")
    return {
        "SamplingParams": {f: f in fields for f in SAMPLING_FIELDS},
        "CompletionRequest.return_token_ids": "return_token_ids" in completion_fields,
        "CompletionRequest.prompt_logprobs": "prompt_logprobs" in completion_fields,
        "inputs.TokensPrompt": "TokensPrompt" in inputs,
        "Platform.is_sleep_mode_available": method(platform, "is_sleep_mode_available") is not None,
    }


def surfaces(path: Path) -> dict:
    release = Release(path)
    all_routes = routes(release)
    return {
        "source": path.name,
        **distribution(release),
        "engine_args": engine_args(release),
        "LLM": llm_class(release),
        "worker": worker(release),
        "server": server(release),
        "routes": {
            "scirl": {r: r in all_routes for r in SCIRL_ROUTES},
            "all": all_routes,
            "/reset_prefix_cache returns": route_returns(release, "/reset_prefix_cache"),
        },
        "weight_transfer": weight_transfer(release),
        "sampler": sampler(release),
        "requests": requests(release),
    }


# ---- the table ----


def _cell(value) -> str:
    if value is True:
        return "yes"
    if value is False or value is None or value == []:
        return "**no**"
    if isinstance(value, list):
        return ", ".join(map(str, value))
    return str(value).replace("|", "\\|")


def _param_names(sig: str | None) -> str | None:
    """``(self, a: int=1, *, b=None) -> T`` -> ``(a, *, b)``: the table shows names, the JSON the full signature."""
    if sig is None:
        return None
    args = ast.parse(f"def f{sig.split(' -> ')[0]}: pass").body[0].args
    names = [a.arg for a in args.posonlyargs + args.args if a.arg != "self"]
    names += ["*"] if args.kwonlyargs and not args.vararg else []
    names += [f"*{args.vararg.arg}"] if args.vararg else []
    names += [a.arg for a in args.kwonlyargs] + ([f"**{args.kwarg.arg}"] if args.kwarg else [])
    return "(" + ", ".join(names) + ")"


def table_rows(report: dict) -> dict[str, object]:
    """One release's surfaces, flattened to row name -> value."""
    rows: dict[str, object] = {"distribution": report["name"], "torch pin": report["torch"]}
    rows.update({f"EngineArgs.{f}": v for f, v in report["engine_args"]["fields"].items()})
    rows["EngineArgs.enable_chunked_prefill type"] = report["engine_args"]["enable_chunked_prefill_type"]
    rows.update({f"LLM.{m}": _param_names(s) for m, s in report["LLM"].items()})
    w = report["worker"]
    rows["Worker.reload_weights(weights_iterator=)"] = w["takes_weights_iterator"]
    rows["Worker.reload_weights(weights_path=)"] = w["takes_weights_path"]
    rows["compute_weight_checksums (worker classes)"] = w["compute_weight_checksums"]
    rows["reload/layerwise.py (RELOAD_LOGGER)"] = w["reload_logger_module"]
    rows["python -m vllm.entrypoints.openai.api_server"] = report["server"]["api_server_main"]
    rows.update({f"flag {f}": v for f, v in report["server"]["flags"].items()})
    rows.update({f"route {r}": v for r, v in report["routes"]["scirl"].items()})
    rows["route /reset_prefix_cache returns"] = report["routes"]["/reset_prefix_cache returns"]
    for cls_name in ("NCCLWeightTransferInitInfo", "NCCLWeightTransferUpdateInfo"):
        info = report["weight_transfer"][cls_name]
        rows[f"{cls_name} fields"] = info["fields"]
        rows[f"{cls_name} in nccl_engine"] = info["in_nccl_engine"]
    rows["nccl_common.trainer_init"] = _param_names(report["weight_transfer"]["nccl_common.trainer_init"])
    rows["packed_nccl_broadcast_producer"] = _param_names(
        report["weight_transfer"]["packed_tensor.packed_nccl_broadcast_producer"]
    )
    rows["sampler reads VLLM_USE_FLASHINFER_SAMPLER"] = report["sampler"]["reads_VLLM_USE_FLASHINFER_SAMPLER"]
    rows["envs VLLM_USE_FLASHINFER_SAMPLER"] = report["sampler"]["envs_entry"]
    req = report["requests"]
    missing = [f for f, ok in req["SamplingParams"].items() if not ok]
    rows["SamplingParams fields scirl sets"] = "all" if not missing else "missing " + ", ".join(missing)
    for key in (
        "CompletionRequest.return_token_ids",
        "CompletionRequest.prompt_logprobs",
        "inputs.TokensPrompt",
        "Platform.is_sleep_mode_available",
    ):
        rows[key] = req[key]
    return rows


def markdown_table(reports: list[dict], only_differing: bool = False) -> str:
    columns = [table_rows(r) for r in reports]
    lines = ["| surface | " + " | ".join(r["version"] for r in reports) + " |", "|---|" + "---|" * len(reports)]
    for row in columns[0]:
        values = [_cell(c.get(row)) for c in columns]
        if only_differing and len(set(values)) == 1:
            continue
        lines.append(f"| {row} | " + " | ".join(values) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("inputs", nargs="+", type=Path, help="vLLM wheels or vllm package directories")
    parser.add_argument("--json", type=Path, help="also write the JSON here")
    parser.add_argument("--table", action="store_true", help="print a markdown table instead of JSON")
    parser.add_argument("--differing", action="store_true", help="with --table: only the rows that differ")
    args = parser.parse_args(argv)
    try:
        reports = [surfaces(p) for p in args.inputs]
    except (InputError, zipfile.BadZipFile, SyntaxError) as exc:
        print(f"vllm_surfaces: {exc}", file=sys.stderr)
        return 2
    text = json.dumps(reports, indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    print(markdown_table(reports, args.differing) if args.table else text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
