"""Stage B, vLLM (a GPU machine with ``.[gpu]``; where vLLM does not import, each stage says so and is skipped).

- ``b_colocated``: ``scirl train --inference.backend vllm`` in one process, the engine asleep during each train step
  and given the new weights in place after it; then a fresh engine with the run's settings takes the run's prompts
  and seeds through scirl's adapter and through the raw ``vllm.LLM.generate``, alternating. Shapes too big to
  train on one GPU: generation alone (``generation_only``);
- ``b_disaggregated``: a vLLM server generates and ``scirl train --inference.urls`` trains, async by one step;
  weights go over NCCL only when the server and the trainer have GPUs of their own, else (one GPU, shared; or a
  CPU) through the filesystem: NCCL refuses two ranks of one communicator on one device;
- ``b_eval`` (in b_disaggregated's process, recorded as a stage of its own): the server loads the run's last
  checkpoint and ``scirl eval`` sends it 200 held-out questions, sampled at temperature 1 (greedy replies of the
  EOS-biased model would end at their first token).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

from .common import REPO, StageError, error_text, read_jsonl, say, stage_result, write_json_atomic
from .figures import step_work
from .launch import launch, scirl_command, train_flags
from .model import EVAL_PER_DOMAIN


def import_vllm_or_skip() -> dict | None:
    try:
        import vllm  # noqa: F401
    except Exception as e:  # a broken install raises more than ImportError
        return {"skipped": f"vLLM does not import: {error_text(e)}"}
    return None


def b_colocated_stage(ctx: dict) -> dict:
    skipped = import_vllm_or_skip()
    if skipped:
        return skipped
    out, settings = Path(ctx["out"]), ctx["settings"]
    if not ctx["trains"]:
        return {"generation": generation_only(ctx, out, settings)}
    run_dir = out / "b-run"
    shutil.rmtree(run_dir, ignore_errors=True)
    engine = [
        "--inference.backend",
        "vllm",
        "--inference.gpu-memory-utilization",
        str(settings["gpu_memory_utilization"]),
        "--inference.kv-cache-gib",
        str(ctx["kv_cache_gib"]),
    ] + (["--inference.enforce-eager"] if ctx["eager"] else [])
    flags = train_flags(
        ctx, run_dir, activation_checkpointing=settings["activation_checkpointing"], ckpt_interval=100000, engine=engine
    )
    run = launch(ctx, scirl_command(["train", *flags], deterministic=False), out / "b-run.log")
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    tokens: dict[int, int] = defaultdict(int)
    for path in run_dir.glob("rollouts/step_*.jsonl"):
        for row in read_jsonl(path):
            tokens[row["step"]] += row["num_tokens"]
    say("  generation comparison: a fresh engine with the run's settings, the run's prompts and seeds")
    result = {
        "summary": summarize(metrics, tokens, ctx),
        "train_wall_s": run["wall_s"],
        "device_peak_mb": run["device_peak_mb"],
        "generation": compare_generation(
            run_dir, Path(ctx["model_dir"]), ctx["device"], [m["step"] for m in metrics], step_prompts(run_dir)
        ),
    }
    if not ctx["keep_weights"]:
        shutil.rmtree(run_dir / "weights", ignore_errors=True)
    return result


def step_prompts(run_dir: Path) -> dict[int, list[str]]:
    """Each step's prompts, in the order it asked for them (one per group)."""
    prompts: dict[int, dict[int, str]] = defaultdict(dict)
    for path in run_dir.glob("rollouts/step_*.jsonl"):
        for row in read_jsonl(path):
            prompts[row["step"]].setdefault(row["group"], row["prompt"])
    return {step: [groups[g] for g in sorted(groups)] for step, groups in sorted(prompts.items())}


def compare_generation(
    run_dir: Path, model_dir: Path, device: str, steps: list[int], prompts: dict[int, list[str]]
) -> dict:
    """A fresh engine with the run's own settings (scirl.run.backends builds it from the run's config.toml);
    each step's prompts and sampling request (its seed included) through the adapter and through the
    raw ``LLM.generate``, alternating; the first call warms the new shapes up and is not timed."""
    import torch
    from transformers import AutoTokenizer

    from scirl.inference.base import SamplingParams
    from scirl.rollouts.generate import generation_seed
    from scirl.run.backends import make_vllm_generator
    from scirl.run.config_io import load_config
    from scirl.trainer.model import compute_dtype

    cfg = load_config(["@", str(run_dir / "config.toml")])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    dev = torch.device(device)
    generator = make_vllm_generator(
        cfg,
        str(model_dir),
        tokenizer,
        device=dev,
        dist=SimpleNamespace(world_size=1),
        dtype=compute_dtype(cfg.dtype, dev),
    )
    try:
        from vllm.inputs import TokensPrompt

        def request(step):
            ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in prompts[step]]
            params = SamplingParams(
                n=cfg.group_size,
                temperature=cfg.temperature,
                top_p=cfg.top_p,
                max_tokens=cfg.max_completion_tokens,
                seed=generation_seed(cfg.seed, step, 0),
            )
            return ids, params

        def raw(ids, params):
            outputs = generator.llm.generate(
                [TokensPrompt(prompt_token_ids=p) for p in ids],
                [generator.sampling_params(params, i) for i in range(len(ids))],
                use_tqdm=False,
            )
            return sum(len(c.token_ids) for o in outputs for c in o.outputs)

        def adapter(ids, params):
            return sum(len(c.token_ids) for group in generator.generate(ids, params) for c in group)

        def timed(fn, ids, params):
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            tokens = fn(ids, params)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            return tokens, time.perf_counter() - t

        raw(*request(steps[0]))  # warm-up: new batch shapes
        sides = {"adapter": [0, 0.0], "raw": [0, 0.0]}
        for k, step in enumerate(steps):
            order = (("raw", raw), ("adapter", adapter)) if k % 2 == 0 else (("adapter", adapter), ("raw", raw))
            for name, fn in order:
                tokens, seconds = timed(fn, *request(step))
                sides[name][0] += tokens
                sides[name][1] += seconds
        return {
            name: {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}
            for name, (tokens, seconds) in sides.items()
        }
    finally:
        generator.close()


def summarize(metrics: list[dict], rollouts_tokens: dict[int, int], ctx: dict) -> dict:
    later = metrics[1:] or metrics

    def mean(key, rows=later):
        return statistics.fmean(m[key] for m in rows)

    gen_tokens = sum(rollouts_tokens[m["step"]] for m in later)
    return {
        "steps": [
            {
                "step": m["step"],
                "generate_s": m["time/generate"],
                "train_s": m["time/train"],
                "weight_sync_s": m["time/weight_sync"],
                "weight_check_s": m.get("time/weight_check"),
                "step_s": m["time/step"] - m.get("time/checkpoint", 0.0),
                "completion_tokens": rollouts_tokens[m["step"]],
                "mismatch_kl": m["mismatch_kl"],
                **step_work(m, ctx, m["time/train"]),
                "peak_mb": m["memory/peak_mb"],
            }
            for m in metrics
        ],
        "mean_after_first": {
            "generate_s": mean("time/generate"),
            "train_s": mean("time/train"),
            "weight_sync_s": mean("time/weight_sync"),
            "step_s": statistics.fmean(m["time/step"] - m.get("time/checkpoint", 0.0) for m in later),
        },
        "training_generation_tokens_per_s": gen_tokens / sum(m["time/generate"] for m in later),
        "mismatch_kl_max": max(m["mismatch_kl"] for m in metrics),
        "memory_peak_mb": max(m["memory/peak_mb"] for m in metrics),
    }


def b_disaggregated_stage(ctx: dict) -> dict:
    """The same steps with a vLLM server generating and the trainer in its own process, generation of
    step n+1 overlapping training of step n (``max_async_level`` 1). Two or more GPUs: the server on the
    first, the trainer on the second, weights over NCCL. One GPU: both share it (the server takes its
    ``gpu_memory_utilization`` share) and weights go through the filesystem, as on a CPU: NCCL refuses
    two ranks of one communicator on one device ("Duplicate GPU detected")."""
    skipped = import_vllm_or_skip()
    if skipped:
        return skipped
    from scirl.inference.client import ServerClient
    from scirl.inference.vllm_command import server_command
    from scirl.net import pick

    out, settings = Path(ctx["out"]), ctx["settings"]
    split = ctx["device"] == "cuda" and ctx["gpu_count"] > 1
    weight_sync = "nccl" if split else "filesystem"
    port = pick("127.0.0.1", 0, "a server port", "")
    argv, server_env = server_command(
        ctx["model_dir"],
        port=port,
        served_model_name="policy",
        dtype=ctx["dtype"],
        max_model_len=ctx["seq_len"],
        device=ctx["device"],
        weight_sync=weight_sync,
        gpu_memory_utilization=settings["gpu_memory_utilization"],
        enforce_eager=ctx["eager"],
        kv_cache_gib=ctx["kv_cache_gib"],
    )
    env = {**os.environ, **server_env}
    trainer_env = {}
    if split:
        env["CUDA_VISIBLE_DEVICES"], trainer_env["CUDA_VISIBLE_DEVICES"] = "0", "1"
    elif ctx["device"] == "cpu":
        env["OMP_NUM_THREADS"] = "1"
    log_path = out / "b-server.log"
    say(
        f"  a vLLM server on port {port} ({'its own GPU' if split else 'shared with the trainer'}), weights through "
        f"{weight_sync}; log {log_path}"
    )
    started = time.perf_counter()
    with open(log_path, "w") as log:
        # its own session: vLLM's engine processes go with it when the group is ended
        server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    pgid_file = out / "stages" / "b_disaggregated-server.pgid"
    pgid_file.write_text(str(server.pid))  # the orchestrator ends it should this process be killed
    url = f"http://127.0.0.1:{port}"
    run_dir = out / "b-servers"
    try:
        client = ServerClient(url, timeout_s=60)
        try:
            say("  waiting for the server to answer /health (model load, engine start)")
            client.wait_ready(600, alive=lambda: server.poll() is None)
        finally:
            client.close()
        server_start_s = time.perf_counter() - started
        shutil.rmtree(run_dir, ignore_errors=True)
        flags = train_flags(
            ctx,
            run_dir,
            activation_checkpointing=settings["activation_checkpointing"],
            ckpt_interval=100000,
            engine=["--inference.urls", url, "--max-async-level", "1", "--deployment.weight-sync", weight_sync],
        )
        run = launch(ctx, scirl_command(["train", *flags], deterministic=False), out / "b-servers.log", trainer_env)
        figures = disaggregated_figures(read_jsonl(run_dir / "metrics.jsonl"), run, server_start_s, split, weight_sync)
        # kept now: should the eval below run out of time, the training figures stand
        write_json_atomic(stage_result(ctx, "b_disaggregated"), figures)
        try:
            figures["eval"] = eval_through_server(ctx, url, run_dir)
        except StageError as e:
            figures["eval"] = {"error": str(e), "log_tail": e.log_tail}
    except BaseException as e:
        tail = log_path.read_text(errors="replace").splitlines()[-20:]
        say("  the end of the server's log:\n    " + "\n    ".join(tail))
        if isinstance(e, StageError):
            e.log_tail = (e.log_tail or []) + ["--- the server's log:"] + tail
        raise
    finally:
        try:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        except ProcessLookupError:
            pass
        pgid_file.unlink(missing_ok=True)
    if not ctx["keep_weights"]:
        shutil.rmtree(run_dir / "weights", ignore_errors=True)
    return figures


def disaggregated_figures(metrics: list[dict], run: dict, server_start_s: float, split: bool, weight_sync: str) -> dict:
    later = metrics[1:] or metrics
    generate = statistics.fmean(m["time/generate"] for m in later)
    waited = statistics.fmean(m["time/wait_for_batch"] for m in later)
    return {
        "server_start_s": server_start_s,
        "train_wall_s": run["wall_s"],
        "device_peak_mb": run["device_peak_mb"],
        "split_gpus": split,
        "weight_sync": weight_sync,
        "steps": [
            {
                "step": m["step"],
                "generate_s": m["time/generate"],
                "wait_for_batch_s": m["time/wait_for_batch"],
                "train_s": m["time/train"],
                "weight_sync_s": m["time/weight_sync"],
                "step_s": m["time/step"],
                "weight_check_s": m.get("time/weight_check"),
                "lag_max": m.get("async/lag_max", 0),
                "mismatch_kl": m.get("mismatch_kl"),
            }
            for m in metrics
        ],
        "mean_after_first": {
            "step_s": statistics.fmean(m["time/step"] for m in later),
            "generate_s": generate,
            "wait_for_batch_s": waited,
            "train_s": statistics.fmean(m["time/train"] for m in later),
            "weight_sync_s": statistics.fmean(m["time/weight_sync"] for m in later),
        },
        # the share of generation hidden behind training: 1 when the trainer never waits for its batch
        "overlap": max(0.0, 1 - waited / generate) if generate > 0 else 0.0,
    }


def eval_through_server(ctx: dict, url: str, run_dir: Path) -> dict:
    """``scirl eval`` of the run's last checkpoint through the run's own server: the server loads the checkpoint
    as a filesystem push would (``reload_weights`` from its directory), then 200 held-out questions go through
    it as a user's eval would send them (the run's completion limit; sampled at temperature 1 with a seed rather
    than greedy, see below). Requests/s and generated tokens/s (the server's own counter)."""
    from scirl.inference.client import ServerClient

    out = Path(ctx["out"])
    checkpoints = sorted((run_dir / "weights").glob("step_*"), key=lambda p: int(p.name.removeprefix("step_")))
    if not checkpoints:
        raise StageError(f"the run left no checkpoint in {run_dir / 'weights'}")
    last = checkpoints[-1]
    client = ServerClient(url, timeout_s=300)
    try:
        client.reload_weights(last)
        client.reset_prefix_cache()
    finally:
        client.close()
    results = out / "b-eval.json"
    for stale in (results, out / "b-eval.records.jsonl"):
        stale.unlink(missing_ok=True)
    generated_before = generated_tokens(url)
    per_domain = EVAL_PER_DOMAIN[ctx["device"]]
    say(f"  b_eval: scirl eval of {last.name} through the server, {4 * per_domain} questions")
    cmd = [
        sys.executable,
        "-m",
        "scirl",
        "eval",
        "--base-url",
        f"{url}/v1",
        "--model",
        "policy",
        "--data",
        ctx["eval_data"],
        "--eval-per-domain",
        str(per_domain),
        "--max-tokens",
        str(ctx["max_tokens"]),
        "--concurrency",
        "64",
        "--out",
        str(results),
        "--no-progress",
        # sampled as in training, not greedy: the model's EOS bias (model.py) makes EOS its likeliest token, so
        # greedy replies would end at once; sampled, they have the run's lengths
        "--temperature",
        "1.0",
        "--seed",
        "0",
    ]
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise StageError(f"scirl eval exited {done.returncode}", (done.stdout + done.stderr).splitlines()[-20:])
    summary = json.loads(results.read_text())
    replies = [reply for record in read_jsonl(out / "b-eval.records.jsonl")[1:] for reply in record["replies"]]
    # the server's own count: a random model's ids past the tokenizer decode to no text, so the replies undercount
    tokens = generated_tokens(url) - generated_before
    return {
        "checkpoint": last.name,
        "questions": len(replies),
        "wall_s": seconds,
        "requests_per_s": len(replies) / seconds,
        "reply_tokens": tokens,
        "reply_tokens_per_s": tokens / seconds,
        "accuracy": summary.get("overall_accuracy"),
        "counts": summary.get("counts"),
    }


def generated_tokens(url: str) -> int:
    """The tokens a vLLM server has generated since it started: its Prometheus counter (``GET /metrics``,
    ``vllm:generation_tokens_total``, summed over its label sets)."""
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=30).text
    samples = [line.rsplit(" ", 1)[-1] for line in text.splitlines() if line.startswith("vllm:generation_tokens_total")]
    if not samples:
        raise StageError(f"{url}/metrics has no vllm:generation_tokens_total")
    return int(sum(float(value) for value in samples))


def generation_only(ctx: dict, out: Path, settings: dict) -> dict:
    """For shapes too big to train on one GPU: the engine's generation speed on the same kind of request."""
    from transformers import AutoTokenizer

    from scirl.run.config_io import load_config, write_config
    from scirl.task.data import load_splits
    from scirl.task.prompt import build_messages

    tokenizer = AutoTokenizer.from_pretrained(ctx["model_dir"])
    questions = load_splits(ctx["data"], eval_per_domain=5).train
    steps, per_step = ctx["steps"], ctx["questions"]
    prompts = {
        step: [
            tokenizer.apply_chat_template(build_messages(q), tokenize=False, add_generation_prompt=True)
            for q in questions[(step - 1) * per_step : step * per_step]
        ]
        for step in range(1, steps + 1)
    }
    run_dir = out / f"gen-{ctx['shape']}"
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = load_config(
        [
            "--model",
            ctx["model_dir"],
            "--group-size",
            str(ctx["group_size"]),
            "--max-completion-tokens",
            str(ctx["max_tokens"]),
            "--seq-len",
            str(ctx["seq_len"]),
            "--temperature",
            "1.0",
            "--seed",
            "0",
            "--dtype",
            ctx["dtype"],
            "--device",
            ctx["device"],
            "--inference.gpu-memory-utilization",
            str(settings["gpu_memory_utilization"]),
            "--inference.kv-cache-gib",
            str(ctx["kv_cache_gib"]),
            *(["--inference.enforce-eager"] if ctx["eager"] else []),
        ]
    )
    write_config(cfg, run_dir / "config.toml")
    return compare_generation(run_dir, Path(ctx["model_dir"]), ctx["device"], list(range(1, steps + 1)), prompts)
