"""Tiny Qwen3-architecture models built locally: an offline BPE tokenizer and a random-init model.

No hub is needed: the tokenizer is trained on text we generate, the model is
built from a config. The result is a normal HF model directory (config,
safetensors, tokenizer, generation config) that ``from_pretrained`` and
``vllm serve`` load like any Qwen3 checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from scirl.synth.questions import generate_rows, make_world
from scirl.task.data import question_from_row
from scirl.task.prompt import build_messages

# A Qwen-style chat template: the same control tokens and layout as Qwen3's.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]


def build_tokenizer(texts: Iterable[str], vocab_size: int = 1024):
    """Train a byte-level BPE tokenizer on ``texts`` and wrap it as a transformers fast tokenizer."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        model_max_length=4096,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def default_corpus(seed: int = 0) -> list[str]:
    """Text for the tokenizer: the synthetic questions, their statements, the prompt and answer formats."""
    texts = []
    for i, row in enumerate(generate_rows(n_per_domain=80, seed=seed, non_mcq=False)):
        q = question_from_row(row, source=f"corpus:{i}")
        texts += [m["content"] for m in build_messages(q)]
    texts += [r.statement.format(entity=e, value=v) for r, e, v in make_world(20, seed=seed)]
    texts += ["Answer: A", "Answer: B", "Answer: C", "Answer: D", "The answer is C.", "<think>", "</think>"]
    return texts


def build_tiny_model(
    out_dir: str | Path,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    vocab_size: int = 1024,
    tokenizer=None,
    seed: int = 0,
    tie_word_embeddings: bool = True,
) -> Path:
    """Write a randomly initialised Qwen3 model plus tokenizer to ``out_dir`` and return the path."""
    out_dir = Path(out_dir)
    tokenizer = tokenizer if tokenizer is not None else build_tokenizer(default_corpus(seed), vocab_size)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
