"""GRPO with vLLM colocated on one GPU: where a step's time goes, and what the adapter costs.

Offline (no model hub): builds a random-init model with a Qwen3 release's shapes (transformers'
``Qwen3Config`` + ``AutoModelForCausalLM.from_config``; the tokenizer is the shipped demo model's,
whose 1,024 tokens fit in any of these vocabularies: ids beyond it decode to nothing, as Qwen3's
own padded ids do), writes synthetic SciKnowEval-schema questions (``scirl.synthetic``), and runs
``scirl train --inference.backend vllm``: one process, the vLLM engine asleep (level 2) during each
train step and given the new weights in place after it.

A random model earns no reward, so every group has zero advantage and its tokens look like
gibberish: the three rollout filters are set to monitor only, so every completion is still
trained on (the loss is then the KL term's, and forward + backward run in full). Completions
run until EOS or the token limit, and a random model rarely says EOS: nearly full length.

Prints, per step and as the mean of the steps after the first (the first pays for new shapes):

- step time split: ``time/generate``, ``time/train``, ``time/weight_sync`` (sleep + push of the new
  weights + wake), from the run's ``metrics.jsonl``;
- generation tokens/s, three ways on the same prompts and sampling requests (same seeds): inside
  training (completion tokens / ``time/generate``), a fresh engine with the run's own settings
  through scirl's adapter (``VLLMGenerator.generate``), and through the raw ``vllm.LLM.generate``
  it wraps; the ratio adapter / raw is the adapter's overhead, training / raw adds sleep/wake and
  reloaded weights;
- mismatch KL (sampler vs trainer logprobs, per step and the largest);
- peak memory: ``memory/peak_mb`` (torch's allocator in the training process: the trainer, and the
  engine where it allocates through torch) and, on a GPU, the device's peak as ``nvidia-smi`` saw it
  (the whole process, engine pools included), sampled every 0.5 s.

Also writes everything to ``OUT/gpu_check.json``, the run to ``OUT/run-<shape>``, its log to
``OUT/run-<shape>.log``.

GPU (default when CUDA is there): ``--shape 0.6b``, 5 steps of 8 questions x 16 completions
(128) x up to 256 tokens, bfloat16, CUDA graphs on. On one H200 about 5-6 minutes in all (estimated
 from the parts, not yet measured on a GPU):
the model build and save ~30 s, ``scirl train``'s start + vLLM's engine start (compile + graph
capture) ~2 min, 5 steps of a few seconds each, the final checkpoint ~20 s, then the comparison
engine's start ~1.5 min and its timed calls ~30 s. Other shapes: ``1.7b``, ``4b`` (activation
checkpointing; about 2x and 4x the time); ``8b`` is measured for generation only: training it
on one GPU needs ~148 GB for float32 masters, gradients and AdamW states alone.

CPU (``--cpu``, or no CUDA): ``--shape tiny`` (the demo model's shapes: hidden 128, 3 layers,
4 heads of 32, with a 4,096-token vocabulary so ids beyond the tokenizer occur as on the GPU),
2 steps of 4 questions x 4 completions x 32 tokens, float32, eager; about a minute on 2 cores.

    bash benchmarks/gpu_check.sh [--shape 0.6b] [--steps 5] [--out DIR] [--cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
QWEN3_VOCAB = 151_936

# (hidden, layers, heads, kv heads, head_dim, intermediate, vocab, tied embeddings): the releases' config.json values
SHAPES = {
    "tiny": (128, 3, 4, 4, 32, 512, 4096, True),  # the shipped demo model's, vocab beyond its tokenizer
    "0.6b": (1024, 28, 16, 8, 128, 3072, QWEN3_VOCAB, True),
    "1.7b": (2048, 28, 16, 8, 128, 6144, QWEN3_VOCAB, True),
    "4b": (2560, 36, 32, 8, 128, 9728, QWEN3_VOCAB, True),
    "8b": (4096, 36, 32, 8, 128, 12288, QWEN3_VOCAB, False),
}
# per shape on one H200 (141 GB): the engine's share (weights + KV, awake during generation while the
# trainer keeps its ~18 bytes/parameter), completions per forward/backward, activation checkpointing
GPU_SETTINGS = {
    "0.6b": dict(gpu_memory_utilization=0.35, micro_batch_size=16, activation_checkpointing=False),
    "1.7b": dict(gpu_memory_utilization=0.3, micro_batch_size=16, activation_checkpointing=False),
    "4b": dict(gpu_memory_utilization=0.25, micro_batch_size=8, activation_checkpointing=True),
    "8b": dict(gpu_memory_utilization=0.5, micro_batch_size=8, activation_checkpointing=True),
}
TRAIN_BYTES_PER_PARAM = 4 + 4 + 8 + 2  # float32 master + gradient + AdamW's two moments + the bf16 compute copy


def say(*parts) -> None:
    print(*parts, flush=True)


def parameter_count(shape: str) -> int:
    hidden, layers, heads, kv_heads, head_dim, inter, vocab, tied = SHAPES[shape]
    attention = hidden * head_dim * (heads + 2 * kv_heads) + heads * head_dim * hidden + 2 * head_dim
    per_layer = attention + 3 * hidden * inter + 2 * hidden
    return layers * per_layer + vocab * hidden * (1 if tied else 2) + hidden


def build_model(shape: str, out: Path, device: str, dtype: str) -> Path:
    """A random-init Qwen3 with ``shape``'s sizes and the demo model's tokenizer, as an HF directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, Qwen3Config

    if (out / "config.json").is_file():
        say(f"model: reusing {out}")
        return out
    hidden, layers, heads, kv_heads, head_dim, inter, vocab, tied = SHAPES[shape]
    tokenizer = AutoTokenizer.from_pretrained(REPO / "scirl" / "assets" / "demo-base")
    assert len(tokenizer) <= vocab, "the tokenizer must fit in the model's vocabulary"
    config = Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=head_dim, intermediate_size=inter, tie_word_embeddings=tied,
        max_position_embeddings=40960, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
        bos_token_id=tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    started = time.perf_counter()
    torch.manual_seed(0)
    # initialised where it will run and in the dtype it is saved in: an 8B float32 init on the host takes minutes
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.generation_config = GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                                               pad_token_id=config.pad_token_id)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)
    n = sum(p.numel() for p in model.parameters())
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    say(f"model: {shape} shapes, {n / 1e9:.3f}B parameters, random init, {dtype}, written to {out} "
        f"({time.perf_counter() - started:.0f}s)")
    return out


def write_questions(path: Path, per_domain: int) -> Path:
    from scirl.synthetic import generate_rows, write_jsonl

    return write_jsonl(generate_rows(n_per_domain=per_domain, seed=0, non_mcq=False), path)


class DeviceMemoryPeak:
    """The GPU's used memory as nvidia-smi reports it, sampled in a thread: the whole training process,
    vLLM's own memory pools included (torch's allocator statistics miss those)."""

    def __init__(self, interval: float = 0.5):
        self.interval, self.peak_mb, self._stop = interval, None, threading.Event()
        # the device torch calls cuda:0 (nvidia-smi numbers them all; it also counts this script's own context)
        self.gpu = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0].strip()
        self._thread = threading.Thread(target=self._run, daemon=True) if shutil.which("nvidia-smi") else None

    def _run(self):
        while not self._stop.is_set():
            try:
                text = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", self.gpu],
                                      capture_output=True, text=True, timeout=10).stdout
                value = float(text.split()[0])
                self.peak_mb = value if self.peak_mb is None else max(self.peak_mb, value)
            except (subprocess.SubprocessError, ValueError, IndexError, OSError):
                pass
            self._stop.wait(self.interval)

    def __enter__(self):
        if self._thread is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=15)


def train(args, model_dir: Path, data: Path, run_dir: Path, settings: dict, urls: list[str] | None = None,
          env_extra: dict | None = None) -> tuple[float, float | None]:
    """``scirl train`` as a user runs it, with the vLLM backend in process or, given ``urls``, generating on
    those servers (async level 1); returns (wall seconds, device peak MB)."""
    engine = (["--inference.urls", ",".join(urls), "--max-async-level", "1"] if urls else
              ["--inference.backend", "vllm", "--inference.gpu-memory-utilization", str(settings["gpu_memory_utilization"]),
               "--inference.kv-cache-gib", str(args.kv_cache_gib)] + (["--inference.enforce-eager"] if args.eager else []))
    flags = [
        "--model", str(model_dir), "--output-dir", str(run_dir), "--data.source", str(data), "--data.eval-per-domain", "5",
        "--max-steps", str(args.steps), "--batch-size", str(args.questions * args.group_size),
        "--group-size", str(args.group_size), "--micro-batch-size", str(settings["micro_batch_size"]),
        "--max-completion-tokens", str(args.max_tokens), "--seq-len", str(args.seq_len), "--temperature", "1.0",
        "--device", args.device, "--dtype", args.dtype, "--seed", "0", "--ckpt.interval", "100000", *engine,
        # a random model: no reward, ids past 100k, repeats; monitor only, so every completion is trained on
        "--filters.gibberish.no-enforce", "--filters.repetition.no-enforce", "--filters.zero-advantage.no-enforce",
    ]
    if settings["activation_checkpointing"]:
        flags.append("--activation-checkpointing")
    cmd = [sys.executable, "-m", "scirl", "train", *flags]
    log_path = run_dir.with_name(run_dir.name + ".log")
    say(f"train: {' '.join(cmd[1:])}\n       (log: {log_path})")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           **(env_extra or {})}
    if args.device == "cpu":
        env["OMP_NUM_THREADS"] = str(args.threads)
    started = time.perf_counter()
    with DeviceMemoryPeak() as memory, open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
        for line in proc.stdout:
            log.write(line)
            if line.startswith(("Step ", "Training ", "Saved ")):
                say("  " + line.rstrip())
        status = proc.wait()
    if status != 0:
        tail = log_path.read_text().splitlines()[-30:]
        raise SystemExit(f"scirl train failed (exit {status}); the end of {log_path}:\n" + "\n".join(tail))
    return time.perf_counter() - started, memory.peak_mb


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def step_prompts(run_dir: Path) -> dict[int, list[str]]:
    """Each step's prompts, in the order it asked for them (one per group)."""
    prompts: dict[int, dict[int, str]] = defaultdict(dict)
    for path in run_dir.glob("rollouts/step_*.jsonl"):
        for row in read_jsonl(path):
            prompts[row["step"]].setdefault(row["group"], row["prompt"])
    return {step: [groups[g] for g in sorted(groups)] for step, groups in sorted(prompts.items())}


def compare_generation(run_dir: Path, model_dir: Path, device: str, steps: list[int], prompts: dict[int, list[str]]) -> dict:
    """A fresh engine with the run's own settings (scirl.backends builds it from the run's config.toml);
    each step's prompts and sampling request (its seed included) through the adapter and through the
    raw ``LLM.generate``, alternating; the first call warms the new shapes up and is not timed."""
    import torch
    from transformers import AutoTokenizer

    from scirl.backends import make_vllm_generator
    from scirl.config import load_config
    from scirl.inference.base import SamplingParams
    from scirl.train import generation_seed
    from scirl.trainer import compute_dtype

    cfg = load_config(["@", str(run_dir / "config.toml")])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    dev = torch.device(device)
    generator = make_vllm_generator(cfg, str(model_dir), tokenizer, device=dev, dist=SimpleNamespace(world_size=1),
                                    dtype=compute_dtype(cfg.dtype, dev))
    try:
        from vllm.inputs import TokensPrompt

        def request(step):
            ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in prompts[step]]
            params = SamplingParams(n=cfg.group_size, temperature=cfg.temperature, top_p=cfg.top_p,
                                    max_tokens=cfg.max_completion_tokens, seed=generation_seed(cfg.seed, step, 0))
            return ids, params

        def raw(ids, params):
            outputs = generator.llm.generate([TokensPrompt(prompt_token_ids=p) for p in ids],
                                             [generator.sampling_params(params, i) for i in range(len(ids))], use_tqdm=False)
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
        return {name: {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}
                for name, (tokens, seconds) in sides.items()}
    finally:
        generator.close()


def summarize(metrics: list[dict], rollouts_tokens: dict[int, int]) -> dict:
    later = metrics[1:] or metrics

    def mean(key, rows=later):
        return statistics.fmean(m[key] for m in rows)

    gen_tokens = sum(rollouts_tokens[m["step"]] for m in later)
    return {
        "steps": [{"step": m["step"], "generate_s": m["time/generate"], "train_s": m["time/train"],
                   "weight_sync_s": m["time/weight_sync"], "step_s": m["time/step"] - m.get("time/checkpoint", 0.0),
                   "completion_tokens": rollouts_tokens[m["step"]], "mismatch_kl": m["mismatch_kl"],
                   "peak_mb": m["memory/peak_mb"]} for m in metrics],
        "mean_after_first": {"generate_s": mean("time/generate"), "train_s": mean("time/train"),
                             "weight_sync_s": mean("time/weight_sync"),
                             "step_s": statistics.fmean(m["time/step"] - m.get("time/checkpoint", 0.0) for m in later)},
        "training_generation_tokens_per_s": gen_tokens / sum(m["time/generate"] for m in later),
        "mismatch_kl_max": max(m["mismatch_kl"] for m in metrics),
        "memory_peak_mb": max(m["memory/peak_mb"] for m in metrics),
    }


def print_report(result: dict) -> None:
    s = result["summary"]
    say("\n" + "=" * 78)
    say(f"gpu_check: {result['shape']} shapes ({result['parameters'] / 1e9:.3f}B), {result['device']}, {result['dtype']}, "
        f"{result['completions']} completions x <= {result['max_tokens']} tokens per step")
    say(f"{'step':>4} {'generate s':>11} {'train s':>9} {'sync s':>8} {'step s':>8} {'tokens':>7} {'gen tok/s':>10} "
        f"{'mismatch KL':>12} {'peak MB':>9}")
    for r in s["steps"]:
        say(f"{r['step']:>4} {r['generate_s']:>11.3f} {r['train_s']:>9.3f} {r['weight_sync_s']:>8.3f} {r['step_s']:>8.3f} "
            f"{r['completion_tokens']:>7} {r['completion_tokens'] / r['generate_s']:>10.0f} {r['mismatch_kl']:>12.2e} "
            f"{r['peak_mb']:>9.0f}")
    m = s["mean_after_first"]
    total = m["generate_s"] + m["train_s"] + m["weight_sync_s"]
    say(f"mean of steps 2+: step {m['step_s']:.3f}s = generate {m['generate_s']:.3f}s ({100 * m['generate_s'] / total:.0f}%)"
        f" + train {m['train_s']:.3f}s ({100 * m['train_s'] / total:.0f}%)"
        f" + weight sync {m['weight_sync_s']:.3f}s ({100 * m['weight_sync_s'] / total:.0f}%)")
    g = result.get("generation")
    if g:
        raw = g["raw"]["tokens_per_s"]
        say(f"generation tokens/s: training {s['training_generation_tokens_per_s']:.0f} | adapter {g['adapter']['tokens_per_s']:.0f}"
            f" | raw vllm.LLM.generate {raw:.0f}  (adapter/raw {g['adapter']['tokens_per_s'] / raw:.2f},"
            f" training/raw {s['training_generation_tokens_per_s'] / raw:.2f})")
    say(f"mismatch KL: max {s['mismatch_kl_max']:.2e}")
    peak = f"peak memory: {s['memory_peak_mb']:.0f} MB (torch allocator, training process)"
    if result.get("device_peak_mb") is not None:
        peak += f"; device {result['device_peak_mb']:.0f} MB (nvidia-smi)"
    say(peak)
    say(f"wall: train {result['train_wall_s']:.0f}s, total {result['wall_s']:.0f}s")


def disaggregated(args, model_dir: Path, data: Path, out: Path, settings: dict) -> dict:
    """The same steps with a vLLM server generating and the trainer in its own process, generation of
    step n+1 overlapping training of step n (``max_async_level`` 1), weights through the filesystem on
    a CPU and over NCCL on GPUs. One GPU: server and trainer share it (the server takes its
    ``gpu_memory_utilization`` share); two or more: the server on the first, the trainer on the second."""
    import torch

    from scirl.deploy.ports import pick
    from scirl.inference.vllm_server import ServerClient, server_command

    port = pick("127.0.0.1", 0, "a server port", "")
    argv, server_env = server_command(str(model_dir), port=port, served_model_name="policy", dtype=args.dtype,
                                      max_model_len=args.seq_len, device=args.device,
                                      weight_sync="nccl" if args.device == "cuda" else "filesystem",
                                      gpu_memory_utilization=settings["gpu_memory_utilization"],
                                      enforce_eager=args.eager, kv_cache_gib=args.kv_cache_gib)
    split = args.device == "cuda" and torch.cuda.device_count() > 1
    env = {**os.environ, **server_env}
    trainer_env = {}
    if split:
        env["CUDA_VISIBLE_DEVICES"], trainer_env["CUDA_VISIBLE_DEVICES"] = "0", "1"
    elif args.device == "cpu":
        env["OMP_NUM_THREADS"] = "1"
    log_path = out / f"server-{args.shape}.log"
    say(f"disaggregated: a vLLM server on port {port} ({'its own GPU' if split else 'shared with the trainer'}), "
        f"log {log_path}")
    started = time.perf_counter()
    with open(log_path, "w") as log:
        server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        client = ServerClient(url, timeout_s=60)
        try:
            client.wait_ready(600, alive=lambda: server.poll() is None)
        finally:
            client.close()
        server_start_s = time.perf_counter() - started
        run_dir = out / f"run-{args.shape}-servers"
        shutil.rmtree(run_dir, ignore_errors=True)
        wall, peak = train(args, model_dir, data, run_dir, settings, urls=[url], env_extra=trainer_env)
    except BaseException:
        say("the end of the server's log:\n" + "\n".join(log_path.read_text().splitlines()[-20:]))
        raise
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    later = metrics[1:] or metrics
    generate = statistics.fmean(m["time/generate"] for m in later)
    waited = statistics.fmean(m["time/wait_for_batch"] for m in later)
    return {"server_start_s": server_start_s, "train_wall_s": wall, "device_peak_mb": peak, "split_gpus": split,
            "steps": [{"step": m["step"], "generate_s": m["time/generate"], "wait_for_batch_s": m["time/wait_for_batch"],
                       "train_s": m["time/train"], "weight_sync_s": m["time/weight_sync"], "step_s": m["time/step"],
                       "lag_max": m.get("async/lag_max", 0), "mismatch_kl": m.get("mismatch_kl")} for m in metrics],
            "mean_after_first": {"step_s": statistics.fmean(m["time/step"] for m in later), "generate_s": generate,
                                 "wait_for_batch_s": waited, "train_s": statistics.fmean(m["time/train"] for m in later),
                                 "weight_sync_s": statistics.fmean(m["time/weight_sync"] for m in later)},
            # the share of generation hidden behind training: 1 when the trainer never waits for its batch
            "overlap": max(0.0, 1 - waited / generate) if generate > 0 else 0.0}


def print_disaggregated(d: dict) -> None:
    say(f"disaggregated ({'server and trainer on separate GPUs' if d['split_gpus'] else 'server and trainer sharing'}), "
        f"server up in {d['server_start_s']:.0f}s:")
    say(f"{'step':>4} {'generate s':>11} {'waited s':>9} {'train s':>9} {'sync s':>8} {'step s':>8} {'lag':>4}")
    for r in d["steps"]:
        say(f"{r['step']:>4} {r['generate_s']:>11.3f} {r['wait_for_batch_s']:>9.3f} {r['train_s']:>9.3f} "
            f"{r['weight_sync_s']:>8.3f} {r['step_s']:>8.3f} {r['lag_max']:>4}")
    m = d["mean_after_first"]
    say(f"disaggregated mean of steps 2+: step {m['step_s']:.3f}s = waited for batch {m['wait_for_batch_s']:.3f}s + "
        f"train {m['train_s']:.3f}s + weight sync {m['weight_sync_s']:.3f}s; generation {m['generate_s']:.3f}s, "
        f"overlap {100 * d['overlap']:.0f}%")


def generation_only(args, model_dir: Path, data: Path, out: Path, settings: dict) -> dict:
    """For shapes too big to train on one GPU: the engine's generation speed on the same kind of request."""
    from scirl.config import load_config
    from scirl.data import load_splits
    from scirl.prompt import build_messages
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    questions = load_splits(str(data), eval_per_domain=5).train
    prompts = {step: [tokenizer.apply_chat_template(build_messages(q), tokenize=False, add_generation_prompt=True)
                      for q in questions[(step - 1) * args.questions: step * args.questions]]
               for step in range(1, args.steps + 1)}
    run_dir = out / f"gen-{args.shape}"
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = load_config(["--model", str(model_dir), "--group-size", str(args.group_size), "--max-completion-tokens",
                       str(args.max_tokens), "--seq-len", str(args.seq_len), "--temperature", "1.0", "--seed", "0",
                       "--dtype", args.dtype, "--device", args.device,
                       "--inference.gpu-memory-utilization", str(settings["gpu_memory_utilization"]),
                       "--inference.kv-cache-gib", str(args.kv_cache_gib),
                       *(["--inference.enforce-eager"] if args.eager else [])])
    from scirl.config import write_config

    write_config(cfg, run_dir / "config.toml")
    return compare_generation(run_dir, model_dir, args.device, list(range(1, args.steps + 1)), prompts)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="the CPU check (default where CUDA is not available)")
    parser.add_argument("--shape", choices=sorted(SHAPES), help="model shapes (default: 0.6b on a GPU, tiny on a CPU)")
    parser.add_argument("--steps", type=int, help="GRPO steps (default: 5 on a GPU, 2 on a CPU)")
    parser.add_argument("--questions", type=int, help="questions per step (default: 8 on a GPU, 4 on a CPU)")
    parser.add_argument("--group-size", type=int, help="completions per question (default: 16 on a GPU, 4 on a CPU)")
    parser.add_argument("--max-tokens", type=int, help="completion token limit (default: 256 on a GPU, 32 on a CPU)")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--eager", action="store_true", help="vLLM without CUDA graphs / compilation (always on a CPU)")
    parser.add_argument("--kv-cache-gib", type=float, default=0.25, help="CPU only: the engine's KV cache")
    parser.add_argument("--threads", type=int, default=1, help="CPU only: torch threads")
    parser.add_argument("--out", type=Path, help="work directory (default: a fresh temporary one, kept)")
    parser.add_argument("--disaggregated", action=argparse.BooleanOptionalAction, default=None,
                        help="also run the steps with a vLLM server generating, async by one step (default: on a GPU)")
    args = parser.parse_args(argv)

    started = time.perf_counter()
    import torch

    gpu = torch.cuda.is_available() and not args.cpu
    defaults = dict(shape="0.6b", steps=5, questions=8, group_size=16, max_tokens=256) if gpu else \
        dict(shape="tiny", steps=2, questions=4, group_size=4, max_tokens=32)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.device, args.dtype = ("cuda", "bfloat16") if gpu else ("cpu", "float32")
    if not gpu:
        args.eager = True  # compiling buys a tiny model nothing on a CPU and costs a minute
        torch.set_num_threads(args.threads)  # before any engine: vLLM's CPU backend pins the count
    elif args.shape == "tiny":
        raise SystemExit("--shape tiny is the CPU check's; on a GPU take 0.6b, 1.7b, 4b or 8b")
    settings = GPU_SETTINGS.get(args.shape, dict(gpu_memory_utilization=0.5, micro_batch_size=4, activation_checkpointing=False))
    out = args.out or Path(tempfile.mkdtemp(prefix="scirl-gpu-check-"))
    out.mkdir(parents=True, exist_ok=True)
    say(f"gpu_check: {args.shape} shapes on {'the GPU' if gpu else 'the CPU'}, work directory {out}")

    params = parameter_count(args.shape)
    model_dir = build_model(args.shape, out / f"model-{args.shape}", args.device, "bfloat16" if gpu else "float32")
    per_domain = max(10, -(-args.steps * args.questions // 4)) + 5  # every step new questions, plus 5 held out
    data = write_questions(out / "questions.jsonl", per_domain)
    result = {"shape": args.shape, "parameters": params, "device": args.device, "dtype": args.dtype,
              "completions": args.questions * args.group_size, "max_tokens": args.max_tokens, "steps": args.steps}

    if gpu:
        need_gb = params * TRAIN_BYTES_PER_PARAM / 1e9
        have_gb = torch.cuda.get_device_properties(0).total_memory / 1e9
        if need_gb > 0.9 * have_gb:
            say(f"{args.shape}: training needs ~{need_gb:.0f} GB for float32 masters, gradients, AdamW and the bf16 copy "
                f"alone, this GPU has {have_gb:.0f} GB: measuring generation only")
            result["generation"] = generation_only(args, model_dir, data, out, settings)
            g = result["generation"]
            say(f"generation tokens/s: adapter {g['adapter']['tokens_per_s']:.0f} | raw vllm.LLM.generate "
                f"{g['raw']['tokens_per_s']:.0f} (adapter/raw {g['adapter']['tokens_per_s'] / g['raw']['tokens_per_s']:.2f})")
            result["wall_s"] = time.perf_counter() - started
            (out / "gpu_check.json").write_text(json.dumps(result, indent=2) + "\n")
            return result

    run_dir = out / f"run-{args.shape}"
    shutil.rmtree(run_dir, ignore_errors=True)
    result["train_wall_s"], result["device_peak_mb"] = train(args, model_dir, data, run_dir, settings)
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    tokens: dict[int, int] = defaultdict(int)
    for path in run_dir.glob("rollouts/step_*.jsonl"):
        for row in read_jsonl(path):
            tokens[row["step"]] += row["num_tokens"]
    result["summary"] = summarize(metrics, tokens)
    say("generation comparison: a fresh engine with the run's settings, the run's prompts and seeds")
    result["generation"] = compare_generation(run_dir, model_dir, args.device, [m["step"] for m in metrics],
                                              step_prompts(run_dir))
    if args.disaggregated if args.disaggregated is not None else gpu:
        result["disaggregated"] = disaggregated(args, model_dir, data, out, settings)
    result["wall_s"] = time.perf_counter() - started
    (out / "gpu_check.json").write_text(json.dumps(result, indent=2) + "\n")
    print_report(result)
    if "disaggregated" in result:
        print_disaggregated(result["disaggregated"])
    say(f"(all figures: {out / 'gpu_check.json'})")
    return result


if __name__ == "__main__":
    main()
