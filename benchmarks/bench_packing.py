"""Micro-batches by tokens: length-sorted padded rows against packed rows, measured.

One step's sequences (prompt + completion) under a completion-length distribution, cut into micro-batches
four ways, each a forward + backward of the trainer's computation (the model to its final hidden states,
the block-wise head's logprobs at the completion tokens, a loss over them) on a random Qwen3:

- ``fixed``: micro_batch_size rows in the order they were sampled, right-padded (scirl before micro-batches
  were sorted);
- ``sorted``: micro_batch_size rows sorted by length, right-padded (scirl's default);
- ``tokens``: sorted, as many rows as keep rows x longest within ``--tokens`` (``micro_batch_tokens``);
- ``packed``: sequences laid end to end in rows of at most ``--tokens``, each with its own positions from 0
  and no attention across them (transformers' packed-sequence mask: position ids that restart, no attention
  mask), no padding at all but the last row's;
- ``flex``: the same packed rows through torch's ``flex_attention`` (transformers' ``flex_attention``
  implementation: a block mask of the sequences' causal blocks, so the blocks between sequences are skipped).
  Timed only on CUDA: torch's CPU flex attention has no backward (``NotImplementedError``, torch 2.13), so on
  a CPU it runs the forward alone (compiled by inductor: a C++ compiler is needed), to check its logprobs.

Printed per distribution: the tokens each way computes (padding included) against the real tokens, the
attention score elements (SDPA computes every one of a row's L x L, masked or not, unless a varlen or
block-sparse kernel skips them), the seconds of a step, and the largest difference of the packed logprobs
from the sorted ones (the same computation: they must agree to round-off).

    python benchmarks/bench_packing.py [--sequences 128] [--limit 256] [--tokens 4096] [--repeats 3] [--device cpu]
                                      [--dtype float32]

On a CPU SDPA has no kernel that skips masked blocks: a packed row pays attention over its whole length,
which padding-free sorted rows do not. On a GPU the same holds for SDPA's math and memory-efficient kernels;
flex attention's block mask skips them (the ``flex`` row), as flash attention's variable-length path would
(the flash-attn package, not in torch).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scirl.trainer.head import Head, hidden_states_out  # noqa: E402

DISTRIBUTIONS = {
    # completions that all run to the limit (a random model; a long-thinking policy early on)
    "at the limit": lambda rng, limit: limit,
    # an MCQ policy: half answer in a few dozen tokens, half reason at length, some cut at the limit
    "bimodal": lambda rng, limit: (rng.randint(8, limit // 6) if rng.random() < 0.5
                                   else min(limit, rng.randint(limit // 2, int(1.2 * limit)))),
    "uniform": lambda rng, limit: rng.randint(1, limit),
}


def sequences(distribution: str, n: int, limit: int, group: int, seed: int = 0) -> list[tuple[int, int]]:
    """(prompt length, completion length) per sequence; a group's completions share a prompt length."""
    rng = random.Random(seed)
    out = []
    for g in range(n // group):
        prompt = rng.randint(80, 160)
        out += [(prompt, DISTRIBUTIONS[distribution](rng, limit)) for _ in range(group)]
    return out


def padded_batches(lengths: list[tuple[int, int]], rows: list[list[int]]) -> list[dict]:
    """Right-padded micro-batches of the given sequence indices."""
    batches = []
    for idx in rows:
        width = max(sum(lengths[i]) for i in idx)
        mask = torch.zeros(len(idx), width, dtype=torch.long)
        loss = torch.zeros(len(idx), width, dtype=torch.bool)
        for r, i in enumerate(idx):
            p, c = lengths[i]
            mask[r, : p + c] = 1
            loss[r, p : p + c] = True
        batches.append({"index": idx, "attention_mask": mask, "loss_mask": loss, "position_ids": None})
    return batches


def packed_batches(lengths: list[tuple[int, int]], order: list[int], tokens: int) -> list[dict]:
    """Rows of sequences end to end, at most ``tokens`` each (a longer sequence alone); one row per micro-batch."""
    rows, current, used = [], [], 0
    for i in order:
        n = sum(lengths[i])
        if current and used + n > tokens:
            rows.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        rows.append(current)
    batches = []
    for idx in rows:
        width = sum(sum(lengths[i]) for i in idx)
        positions = torch.cat([torch.arange(sum(lengths[i])) for i in idx])[None]
        loss = torch.zeros(1, width, dtype=torch.bool)
        start = 0
        for i in idx:
            p, c = lengths[i]
            loss[0, start + p : start + p + c] = True
            start += p + c
        batches.append({"index": idx, "attention_mask": None, "loss_mask": loss, "position_ids": positions})
    return batches


def layouts(lengths, micro_batch_size: int, tokens: int) -> dict[str, list[dict]]:
    n = len(lengths)
    by_length = sorted(range(n), key=lambda i: sum(lengths[i]))
    chunks, current = [], []
    for i in by_length:  # ascending: a new sequence is its chunk's longest
        if current and (len(current) + 1) * sum(lengths[i]) > tokens:
            chunks.append(current)
            current = []
        current.append(i)
    chunks.append(current)
    packed = packed_batches(lengths, by_length, tokens)
    return {  # sorted first: the others are compared with it
        "sorted": padded_batches(lengths, [by_length[s : s + micro_batch_size] for s in range(0, n, micro_batch_size)]),
        "fixed": padded_batches(lengths, [list(range(s, min(s + micro_batch_size, n))) for s in range(0, n, micro_batch_size)]),
        "tokens": padded_batches(lengths, chunks),
        "packed": packed,
        "flex": packed,  # the same rows, through flex attention
    }


def ids_of(batch: dict, token_ids: list[list[int]]) -> torch.Tensor:
    if batch["position_ids"] is not None:
        return torch.tensor([[t for i in batch["index"] for t in token_ids[i]]])
    ids = torch.zeros(batch["attention_mask"].shape, dtype=torch.long)
    for r, i in enumerate(batch["index"]):
        ids[r, : len(token_ids[i])] = torch.tensor(token_ids[i])
    return ids


def step(model, head: Head, batches: list[dict], token_ids, completions: list[int],
         backward: bool = True) -> dict[int, torch.Tensor]:
    """Forward + backward of every micro-batch (or the forward alone); the logprobs of each sequence's completion tokens."""
    out = {}
    for b in batches:
        ids = ids_of(b, token_ids).to(b["loss_mask"].device)
        with hidden_states_out(model) as seen, torch.set_grad_enabled(backward):
            hidden = model(input_ids=ids, attention_mask=b["attention_mask"], position_ids=b["position_ids"],
                           use_cache=False).logits
        mask = b["loss_mask"][:, 1:]  # position t predicts token t + 1
        logprobs, _ = head.token_logprobs(hidden[:, :-1], seen["weight"], ids[:, 1:], mask)
        if backward:
            (-logprobs.sum()).backward()
        # row by row, left to right: each sequence's completion tokens, in the order of b["index"]
        flat, start = logprobs.detach()[mask], 0
        for i in b["index"]:
            out[i] = flat[start : start + completions[i]]
            start += completions[i]
    return out


def attention_elements(batches: list[dict], lengths: list[tuple[int, int]], skips_between: bool) -> int:
    """Score elements a kernel computes: every row's L x L, or (``skips_between``: a block-sparse kernel on
    packed rows) each sequence's own L x L only."""
    if skips_between:
        return sum(sum(lengths[i]) ** 2 for b in batches for i in b["index"])
    return sum(b["loss_mask"].shape[0] * b["loss_mask"].shape[1] ** 2 for b in batches)


def flex_available(device: torch.device) -> bool:
    """flex_attention trains only where it has a backward: CUDA (torch's CPU path refuses backward)."""
    return device.type == "cuda"


@contextmanager
def attention(model, implementation: str):
    """The model's attention implementation switched for the duration (transformers reads it each forward)."""
    before = model.config._attn_implementation
    model.set_attn_implementation(implementation)
    try:
        yield
    finally:
        model.set_attn_implementation(before)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--limit", type=int, default=256, help="completion token limit")
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per micro-batch (tokens and packed layouts)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=4096,
                        help="small by default: the head runs on loss tokens only, the same in every layout")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="the model's dtype (bfloat16: a GPU's training dtype; the head's softmax stays float32)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    config = Qwen3Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                         num_key_value_heads=max(1, args.hidden // 128), head_dim=64, tie_word_embeddings=True,
                         max_position_embeddings=8192)
    config._attn_implementation = "sdpa"
    dtype = getattr(torch, args.dtype)
    model = Qwen3ForCausalLM(config).to(device=device, dtype=dtype).train()
    head = Head()
    print(f"bench_packing: Qwen3 hidden {args.hidden}, {args.layers} layers, vocabulary {args.vocab}, {device}, {args.dtype}; "
          f"{args.sequences} sequences (groups of {args.group_size}), completions <= {args.limit}; micro-batches of "
          f"{args.micro_batch_size} rows (fixed, sorted) or {args.tokens} tokens (tokens, packed)")
    print(f"{'distribution':>13} {'layout':>7} {'mbs':>4} {'computed':>9} {'/ real':>7} {'attention':>10} {'s/step':>8} "
          f"{'vs sorted':>9}")
    for name in DISTRIBUTIONS:
        lengths = sequences(name, args.sequences, args.limit, args.group_size)
        rng = random.Random(1)
        token_ids = [[rng.randrange(args.vocab) for _ in range(p + c)] for p, c in lengths]
        completions = [c for _, c in lengths]
        real = sum(p + c for p, c in lengths)
        results = {}
        for layout, batches in layouts(lengths, args.micro_batch_size, args.tokens).items():
            batches = [{k: (v.to(device) if torch.is_tensor(v) else v) for k, v in b.items()} for b in batches]
            computed = sum(b["loss_mask"].numel() for b in batches)
            scores = attention_elements(batches, lengths, skips_between=layout == "flex")
            row = f"{name:>13} {layout:>7} {len(batches):>4} {computed:>9} {computed / real:>7.2f} {scores / 1e6:>9.1f}M"
            if layout == "flex" and not flex_available(device):
                with attention(model, "flex_attention"):  # the forward alone: checks the layout's logprobs
                    results[layout] = (None, step(model, head, batches, token_ids, completions, backward=False))
                print(f"{row} {'n/a':>8} {'n/a':>9}  (flex attention has no backward on {device.type}: forward only)")
                continue
            with attention(model, "flex_attention" if layout == "flex" else "sdpa"):
                step(model, head, batches, token_ids, completions)  # warm-up (flex: its compilation)
                model.zero_grad(set_to_none=True)
                times = []
                for _ in range(args.repeats):
                    started = time.perf_counter()
                    logprobs = step(model, head, batches, token_ids, completions)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    times.append(time.perf_counter() - started)
                    model.zero_grad(set_to_none=True)
            results[layout] = (statistics.median(times), logprobs)
            print(f"{row} {results[layout][0]:>8.3f} {results['sorted'][0] / results[layout][0]:>9.2f}")
        for layout in ("packed", "flex"):
            if layout in results:
                diff = max(float((results[layout][1][i] - results["sorted"][1][i]).abs().max()) for i in range(len(lengths)))
                print(f"{name:>13} {layout} vs sorted logprobs: max |difference| {diff:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
