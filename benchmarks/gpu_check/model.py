"""The ``model`` stage: a random-init model with a Qwen3 release's shapes, and questions of the mission's lengths.

No model hub: transformers' ``Qwen3Config`` + ``AutoModelForCausalLM.from_config``, with the shipped demo model's
tokenizer, whose 1,024 tokens fit in any of these vocabularies (ids beyond it decode to nothing, as Qwen3's own
padded ids do).

**The mission's step** (SciKnowEval's MCQ questions, the run guide's settings): 8 questions x 16 completions, each
question's prompt 100-350 tokens, completions of mixed lengths up to 256 tokens. Two things make a random model's
step look like that:

- *Prompts*: the synthetic SciKnowEval-schema questions (``scirl.synth.questions``) chat-template to 84-103 tokens
  with the demo tokenizer; each is given a target length drawn uniformly from ``PROMPT_TOKENS`` (100-350, the range
  of SciKnowEval's MCQ prompts under Qwen's tokenizer; their exact distribution is not in this repository) and its
  question text is prefixed with fact sentences about other made-up entities (a context passage, as many
  SciKnowEval questions carry) until the templated prompt reaches it, to within a word (a token above it on average).
- *Completions*: a random-init model almost never samples EOS (1 in ~150,000 at Qwen3's vocabulary), so every
  completion would run to the limit. ``build_model`` gives EOS's logit a bias instead (``bias_eos``): coordinate 0
  of every token's embedding is set to ``EOS_CARRIER`` (8), so the residual stream carries a constant component
  there and the final norm's output at coordinate 0 is about the same positive number at every position (3.67 +-
  0.03 at 0.6B with the norm's weight at 1); every output row holds the carrier at coordinate 0 too (a shift the
  same for all tokens, which the softmax ignores) and EOS's holds twice it, so EOS's logit is raised by the carrier
  times that number; the final norm's weight at coordinate 0 scales it, and is bisected until EOS is sampled with
  probability ``eos_rate(limit)`` per token, measured on the built model in its own dtype (in bfloat16 that weight
  is stored to 2^-8 of itself: the rate lands within ~6% of the target; at 0.6B, built on a CPU in bfloat16: 1.02%
  on the sequences it was bisected on, 0.95% +- 0.06% over the completion positions of others, 0.80-1.16% at
  the extremes). At the 256-token limit that is 1/100: a completion's length is geometric, truncated at 256 tokens:
  mean 92 tokens, median 69, 7.6% at the limit (``length_distribution``). At another limit the rate keeps that
  shape: 1 - 0.99^(256/limit), so a CPU's 32-token limit also ends 7.6% of its completions at the limit.

The sweep (``sweep.py``) draws its fixed batch from the same two distributions.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import time
from functools import partial
from pathlib import Path

from .common import REPO, say

QWEN3_VOCAB = 151_936

# (hidden, layers, heads, kv heads, head_dim, intermediate, vocab, tied embeddings): the releases' config.json values
SHAPES = {
    "tiny": (128, 3, 4, 4, 32, 512, 4096, True),  # the shipped demo model's, vocab beyond its tokenizer
    "0.6b": (1024, 28, 16, 8, 128, 3072, QWEN3_VOCAB, True),
    "1.7b": (2048, 28, 16, 8, 128, 6144, QWEN3_VOCAB, True),
    "4b": (2560, 36, 32, 8, 128, 9728, QWEN3_VOCAB, True),
    "8b": (4096, 36, 32, 8, 128, 12288, QWEN3_VOCAB, False),
}

PROMPT_TOKENS = (100, 350)  # a templated prompt's length, drawn uniformly
MISSION_LIMIT, MISSION_EOS_RATE = 256, 0.01  # the completion limit and EOS's chance per token there
EOS_CARRIER = 8.0  # coordinate 0 of every token's embedding (see the module's docstring)
EOS_FILE = "eos_rate.json"  # beside the model: what the bias was calibrated to and what it measured
EVAL_PER_DOMAIN = {"cuda": 50, "cpu": 10}  # b_eval: 4 domains x 50 = 200 held-out questions (a CPU: 40)


def parameter_count(shape: str) -> int:
    hidden, layers, heads, kv_heads, head_dim, inter, vocab, tied = SHAPES[shape]
    attention = hidden * head_dim * (heads + 2 * kv_heads) + heads * head_dim * hidden + 2 * head_dim
    per_layer = attention + 3 * hidden * inter + 2 * hidden
    return layers * per_layer + vocab * hidden * (1 if tied else 2) + hidden


def model_parameters(shape: str) -> dict[str, int]:
    """All parameters, the decoder's (every token's matmuls: N less the embedding and an untied head) and the LM
    head's (the loss tokens' only), as ``figures.py`` counts FLOPs."""
    hidden, *_, vocab, tied = SHAPES[shape]
    n, head = parameter_count(shape), vocab * hidden
    return {"parameters": n, "dense_parameters": n - head * (1 if tied else 2), "head_parameters": head}


def eos_rate(limit: int) -> float:
    """EOS's chance per token at a completion limit: the mission's 1/100 at 256 tokens, and at another limit the
    rate that ends the same share of completions before it."""
    return 1 - (1 - MISSION_EOS_RATE) ** (MISSION_LIMIT / limit)


def length_distribution(limit: int) -> dict:
    """A completion's length when each token is EOS with ``eos_rate(limit)``: geometric, cut at ``limit``."""
    p = eos_rate(limit)
    return {
        "eos_rate": p,
        "mean": (1 - (1 - p) ** limit) / p,
        "median": min(limit, math.ceil(math.log(0.5) / math.log(1 - p))),
        "at_limit": (1 - p) ** limit,
    }  # no EOS in ``limit`` tokens: the run's truncated/fraction


def prompt_lengths(n: int, seed: int) -> list[int]:
    low, high = PROMPT_TOKENS
    rng = random.Random(f"prompt-lengths-{seed}")
    return [rng.randint(low, high) for _ in range(n)]


def completion_lengths(n: int, limit: int, seed: int) -> list[int]:
    """``n`` lengths from ``length_distribution(limit)`` (the last token the EOS, or the limit)."""
    p, rng = eos_rate(limit), random.Random(f"completion-lengths-{seed}")
    lengths = []
    for _ in range(n):
        length = 1
        while length < limit and rng.random() >= p:
            length += 1
        lengths.append(length)
    return lengths


def model_stage(ctx: dict) -> dict:
    from scirl.trainer.batching import DEFAULT_MICRO_BATCH_TOKENS

    out = Path(ctx["out"])
    started = time.perf_counter()
    model_dir = build_model(
        ctx["shape"], out / f"model-{ctx['shape']}", ctx["device"], ctx["dtype"], eos_rate=eos_rate(ctx["max_tokens"])
    )
    per_domain = max(10, -(-ctx["steps"] * ctx["questions"] // 4)) + 5  # every step new questions, plus 5 held out
    data = write_questions(out / "questions.jsonl", per_domain, model_dir, seed=0)
    # b_eval's held-out 4 x 50 (the split holds out at most half of a domain's rows)
    eval_data = write_questions(out / "eval_questions.jsonl", 2 * EVAL_PER_DOMAIN[ctx["device"]] + 5, model_dir, seed=1)
    return {
        "model_dir": str(model_dir),
        "data": str(data),
        "eval_data": str(eval_data),
        **model_parameters(ctx["shape"]),
        "default_micro_batch_tokens": DEFAULT_MICRO_BATCH_TOKENS,
        "eos": json.loads((model_dir / EOS_FILE).read_text()),
        "expected_lengths": length_distribution(ctx["max_tokens"]),
        "build_s": round(time.perf_counter() - started, 1),
    }


def build_model(shape: str, out: Path, device: str, dtype: str, eos_rate: float | None = None) -> Path:
    """A random-init Qwen3 with ``shape``'s sizes and the demo model's tokenizer, as an HF directory; with
    ``eos_rate``, EOS sampled with that chance per token (``bias_eos``; the module's docstring says how)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, Qwen3Config

    transformers.utils.logging.disable_progress_bar()  # a bar per shard written, in a log
    if (out / "config.json").is_file():
        say(f"  model: reusing {out}")
        return out
    hidden, layers, heads, kv_heads, head_dim, inter, vocab, tied = SHAPES[shape]
    tokenizer = AutoTokenizer.from_pretrained(REPO / "scirl" / "assets" / "demo-base")
    assert len(tokenizer) <= vocab, "the tokenizer must fit in the model's vocabulary"
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=inter,
        tie_word_embeddings=tied,
        max_position_embeddings=40960,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        bos_token_id=tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    started = time.perf_counter()
    torch.manual_seed(0)
    # initialised where it will run and in the dtype it is saved in: an 8B float32 init on the host takes minutes
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    eos = bias_eos(model, config.eos_token_id, eos_rate, len(tokenizer)) if eos_rate else {"rate": None}
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / EOS_FILE).write_text(json.dumps(eos) + "\n")
    tmp.rename(out)
    n = sum(p.numel() for p in model.parameters())
    rate = f", EOS {100 * eos['measured']:.2f}% a token" if eos_rate else ""
    say(
        f"  model: {shape} shapes, {n / 1e9:.3f}B parameters, random init, {dtype}{rate}, written to {out} "
        f"({time.perf_counter() - started:.0f}s)"
    )
    return out


def bias_eos(model, eos_id: int, rate: float, prompt_vocab: int) -> dict:
    """Coordinate 0 of every token's embedding and output row set to ``EOS_CARRIER``, EOS's output row to twice it (both
    powers of two: stored exactly in any dtype), and the final norm's weight at coordinate 0 (its scale, stored to
    2^-8 of itself in bfloat16) bisected until EOS's mean probability at completion positions is ``rate``. Measured in
    the model's own dtype on 4 sequences of 192 prompt-vocabulary ids and 64 ids drawn over the whole vocabulary
    (what a random model samples). Returns what was asked and what was measured."""
    import torch

    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    scale = model.model.norm.weight  # the final norm's: what coordinate 0 of every output row is multiplied by
    generator = torch.Generator().manual_seed(0)
    ids = torch.cat(
        [
            torch.randint(0, prompt_vocab, (4, 192), generator=generator),
            torch.randint(0, head.shape[0], (4, 64), generator=generator),
        ],
        dim=1,
    ).to(head.device)
    with torch.no_grad():
        embedding[:, 0] = EOS_CARRIER
        head[:, 0] = EOS_CARRIER  # the same shift for every token (already so when tied), which the softmax ignores
        head[eos_id, 0] = 2 * EOS_CARRIER  # EOS's: CARRIER x scale x (the constant component) more

        def measured(weight: float) -> float:
            scale[0] = weight
            logits = model(input_ids=ids, logits_to_keep=64, use_cache=False).logits.float()
            return float(logits.softmax(-1)[..., eos_id].mean())

        low, high = 0.0, 8.0
        for _ in range(24):  # to 5e-7: finer than the stored weight
            middle = (low + high) / 2
            low, high = (middle, high) if measured(middle) < rate else (low, middle)
        # the two ends may round to neighbouring stored values: the one whose rate is nearer
        found = measured(min((low, high), key=lambda w: abs(measured(w) - rate)))  # and the weight left at it
        stored = float(scale[0])
    return {"rate": rate, "measured": found, "norm_scale": stored, "carrier": EOS_CARRIER}


def write_questions(path: Path, per_domain: int, model_dir: Path, seed: int) -> Path:
    """``per_domain`` synthetic MCQ rows a domain, each question prefixed with a context passage of fact sentences
    until its templated prompt reaches a length from ``prompt_lengths`` (the module's docstring)."""
    from transformers import AutoTokenizer

    from scirl.inference.base import encode_messages
    from scirl.synth.questions import generate_rows, make_world, write_jsonl
    from scirl.task.data import question_from_row
    from scirl.task.prompt import build_messages

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = generate_rows(n_per_domain=per_domain, seed=0, non_mcq=False)
    facts = [
        relation.statement.format(entity=entity, value=value)
        for relation, entity, value in make_world(entities_per_relation=40, seed=1)
    ]
    rng = random.Random(f"context-{seed}")

    def prompt_tokens(row: dict, question: str, words: list[str], *, source: str) -> int:
        """The templated prompt's tokens with ``words`` before the question (``row`` left holding that text)."""
        row["question"] = " ".join(words) + "\n\n" + question if words else question
        return len(encode_messages(tokenizer, build_messages(question_from_row(row, source=source))))

    for i, (row, target) in enumerate(zip(rows, prompt_lengths(len(rows), seed))):
        length = partial(prompt_tokens, row, row["question"], source=f"gpu-check:{i}")
        words: list[str] = []
        while length(words) < target:  # whole sentences until the target is reached
            words += rng.choice(facts).split()
        while words and length(words[:-1]) >= target:  # then the last sentence's words past it taken back
            words.pop()
        length(words)
    return write_jsonl(rows, path)
