"""The transformers generation backend: shared prefill, per-row EOS, sampling logprobs, reproducibility."""

from __future__ import annotations

import pytest
import torch

from scirl.cpu.generator import CPUGenerator
from scirl.inference.base import SamplingParams
from scirl.inference.hf import HFGenerator

PROMPT_TEXTS = [
    "Which element has atomic number 6?",
    "A",
    "The boiling point of water at sea level is closest to which value? Options follow.",
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer.encode(t) for t in PROMPT_TEXTS]


@pytest.fixture(scope="module")
def generator(tiny_model_dir):
    torch.set_num_threads(2)
    return HFGenerator(tiny_model_dir)


def load_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)


@pytest.fixture(scope="module")
def many_eos(tiny_model_dir, tokenizer):
    """A generator whose generation config lists 60 EOS ids (~6% per step), so rows stop at different steps."""
    model = load_model(tiny_model_dir)
    eos = [tokenizer.eos_token_id] + list(range(100, 159))
    model.generation_config.eos_token_id = eos
    return CPUGenerator(model, tokenizer=tokenizer), set(eos)


def reference_logprobs(model, prompt, completion, temperature, top_p):
    """Teacher-forced log-probs of ``completion`` under softmax(logits / T) restricted to the top-p set."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].double()
    out = []
    for row, token in zip(logits, completion):
        logp = torch.log_softmax(row / temperature, dim=-1)
        if top_p < 1:
            # nucleus: the most likely tokens until their mass reaches top_p, renormalised
            order = torch.argsort(logp, descending=True)
            kept, mass = [], 0.0
            for i in order.tolist():
                if mass >= top_p:
                    break
                kept.append(i)
                mass += logp[i].exp().item()
            assert token in kept, "sampled a token outside the top-p set"
            logp = logp[kept] - torch.logsumexp(logp[kept], dim=0)
            out.append(logp[kept.index(token)].item())
        else:
            out.append(logp[token].item())
    return out


def test_each_row_stops_at_its_own_eos(many_eos, prompts):
    gen, eos = many_eos
    result = gen.generate(prompts, SamplingParams(n=8, temperature=1.0, max_tokens=40, seed=3))
    assert [len(group) for group in result] == [8, 8, 8]
    lengths = set()
    for group in result:
        for c in group:
            assert len(c.token_ids) == len(c.logprobs)
            # no EOS before the end: a row stops at its first EOS
            assert not eos & set(c.token_ids[:-1])
            if c.finish_reason == "stop":
                assert c.token_ids[-1] in eos  # the EOS is kept so the trainer learns to stop
            else:
                assert c.finish_reason == "length" and len(c.token_ids) == 40
            lengths.add(len(c.token_ids))
    assert len(lengths) > 3, "rows should stop at different steps"
    assert any(c.finish_reason == "stop" for g in result for c in g)


def test_logprobs_match_teacher_forced_recomputation(many_eos, prompts, tiny_model_dir):
    """Returned logprobs are the sampling distribution's, so the trainer's first importance ratio is ~1."""
    gen, _ = many_eos
    model = load_model(tiny_model_dir)
    for temperature, top_p in [(1.0, 1.0), (0.7, 0.9)]:
        result = gen.generate(prompts, SamplingParams(n=4, temperature=temperature, top_p=top_p, max_tokens=24, seed=0))
        for prompt, group in zip(prompts, result):
            for c in group:
                expected = reference_logprobs(model, prompt, c.token_ids, temperature, top_p)
                assert c.logprobs == pytest.approx(expected, abs=1e-4)


def test_greedy_logprobs_are_plain_log_softmax(generator, prompts, tiny_model_dir):
    model = load_model(tiny_model_dir)
    result = generator.generate(prompts[:1], SamplingParams(n=1, temperature=0, max_tokens=12))
    c = result[0][0]
    assert c.logprobs == pytest.approx(reference_logprobs(model, prompts[0], c.token_ids, 1.0, 1.0), abs=1e-4)


def test_group_shares_one_prefill(generator, prompts):
    calls = []

    def record(module, args, kwargs):
        calls.append(tuple(kwargs["input_ids"].shape))

    handle = generator.model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        result = generator.generate(prompts, SamplingParams(n=5, temperature=1.0, max_tokens=6, seed=0))
    finally:
        handle.remove()
    longest = max(len(p) for p in prompts)
    # one prefill for all 3 prompts, then only one new token per live row per step
    assert calls[0] == (3, longest)
    assert all(seq == 1 for _, seq in calls[1:])
    assert calls[1][0] == 15
    assert len(calls) <= 6
    assert sum(len(g) for g in result) == 15


def test_seed_makes_sampling_reproducible(generator, prompts):
    params = SamplingParams(n=4, temperature=1.0, max_tokens=16, seed=123)
    first = generator.generate(prompts, params)
    again = generator.generate(prompts, params)
    other = generator.generate(prompts, SamplingParams(n=4, temperature=1.0, max_tokens=16, seed=124))
    ids = lambda r: [[c.token_ids for c in g] for g in r]  # noqa: E731
    assert ids(first) == ids(again)
    assert [[c.logprobs for c in g] for g in first] == [[c.logprobs for c in g] for g in again]
    assert ids(first) != ids(other)
    # the completions of one group differ from each other: each row samples independently
    assert len({tuple(c.token_ids) for c in first[0]}) == 4


def test_batched_greedy_equals_one_prompt_at_a_time(tiny_model_dir, prompts):
    params = SamplingParams(n=2, temperature=0, max_tokens=20)
    batched = HFGenerator(tiny_model_dir).generate(prompts, params)
    one_row = HFGenerator(tiny_model_dir, max_batch_size=1)  # every group split into single rows
    alone = [one_row.generate([p], params)[0] for p in prompts]
    assert [[c.token_ids for c in g] for g in batched] == [[c.token_ids for c in g] for g in alone]
    for g_batched, g_alone in zip(batched, alone):
        for a, b in zip(g_batched, g_alone):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_batches_respect_the_size_bounds(tiny_model_dir, prompts):
    gen = HFGenerator(tiny_model_dir, max_batch_size=6)
    batches = gen.plan_batches(prompts, SamplingParams(n=4, max_tokens=8))
    assert all(sum(k for _, k in b) <= 6 for b in batches)
    # every prompt gets exactly n completions, in prompt order
    per_prompt = {}
    for b in batches:
        for i, k in b:
            per_prompt[i] = per_prompt.get(i, 0) + k
    assert per_prompt == {0: 4, 1: 4, 2: 4}
    result = gen.generate(prompts, SamplingParams(n=4, temperature=1.0, max_tokens=8, seed=0))
    assert [len(g) for g in result] == [4, 4, 4]


def test_length_finish_reason_and_text(generator, prompts, tokenizer):
    result = generator.generate(prompts, SamplingParams(n=2, temperature=0, max_tokens=5))
    for group in result:
        for c in group:
            assert c.finish_reason == "length"
            assert len(c.token_ids) == 5 and len(c.logprobs) == 5
            assert c.text == tokenizer.decode(c.token_ids, skip_special_tokens=True)
            assert all(lp <= 0 for lp in c.logprobs)


def test_shared_module_keeps_train_mode_and_ignores_update(tiny_model_dir, tokenizer, prompts):
    model = load_model(tiny_model_dir)
    model.train()
    gen = HFGenerator(model, tokenizer=tokenizer)
    gen.generate(prompts[:1], SamplingParams(n=2, max_tokens=3, seed=0))
    assert model.training
    before = model.lm_head.weight.clone()
    gen.update_weights([("lm_head.weight", torch.zeros_like(before))])  # no-op: the trainer owns the module
    assert torch.equal(model.lm_head.weight, before)


def test_owned_copy_loads_pushed_weights(tiny_model_dir, prompts):
    gen = HFGenerator(tiny_model_dir)
    params = SamplingParams(n=1, temperature=0, max_tokens=8)
    before = gen.generate(prompts[:1], params)[0][0]
    trained = load_model(tiny_model_dir)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    gen.update_weights(trained.named_parameters())
    after = gen.generate(prompts[:1], params)[0][0]
    assert after.token_ids != before.token_ids
    reference = HFGenerator(trained, tokenizer=gen.tokenizer).generate(prompts[:1], params)[0][0]
    assert after.token_ids == reference.token_ids
    with pytest.raises(ValueError, match="not in the model"):
        gen.update_weights([("_fsdp_wrapped.lm_head.weight", torch.zeros(1))])


def test_bad_requests_are_rejected(generator, prompts):
    with pytest.raises(ValueError, match="empty"):
        generator.generate([[]], SamplingParams())
    with pytest.raises(ValueError, match="top_p"):
        generator.generate(prompts, SamplingParams(top_p=0))
    with pytest.raises(ValueError, match="n must be"):
        generator.generate(prompts, SamplingParams(n=0))


def test_sampler_draws_from_the_given_distribution():
    from scirl.inference.hf import sample_categorical

    probs = torch.tensor([[0.5, 0.0, 0.3, 0.2], [0.0, 0.0, 0.0, 1.0]])
    rows = probs.repeat(20000, 1)
    draws = sample_categorical(rows, torch.Generator().manual_seed(0)).view(20000, 2)
    first = torch.bincount(draws[:, 0], minlength=4).float() / 20000
    assert first.tolist() == pytest.approx([0.5, 0.0, 0.3, 0.2], abs=0.015)
    assert first[1] == 0  # a zero-probability token is never drawn
    assert (draws[:, 1] == 3).all()


def test_preallocated_cache_matches_transformers_dynamic_cache(generator, prompts, monkeypatch):
    import scirl.cpu.generator as hf

    params = SamplingParams(n=3, temperature=1.0, max_tokens=16, seed=5)
    fast = CPUGenerator(generator.model, tokenizer=generator.tokenizer, shared_prefix_attention=False).generate(
        prompts, params
    )
    monkeypatch.setattr(hf, "preallocated_layer_class", lambda: None)  # fall back to DynamicCache
    plain = generator.generate(prompts, params)  # the plain loop: transformers' DynamicCache
    assert [[c.token_ids for c in g] for g in fast] == [[c.token_ids for c in g] for g in plain]
    for g_fast, g_plain in zip(fast, plain):
        for a, b in zip(g_fast, g_plain):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_min_tokens_holds_eos_back(many_eos, prompts, tiny_model_dir):
    gen, eos = many_eos
    params = SamplingParams(n=8, temperature=1.0, max_tokens=30, min_tokens=30, seed=3)
    result = gen.generate(prompts, params)
    assert all(len(c.token_ids) == 30 and c.finish_reason == "length" for g in result for c in g)
    assert not any(eos & set(c.token_ids) for g in result for c in g)
    # the logprobs are those of the distribution without EOS, renormalised
    model = load_model(tiny_model_dir)
    c, prompt = result[0][0], prompts[0]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1 : -1].double()
    logits[:, sorted(eos)] = float("-inf")
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(c.token_ids)[:, None]).squeeze(1)
    assert c.logprobs == pytest.approx(expected.tolist(), abs=1e-4)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(n=4, temperature=0, max_tokens=30),
        SamplingParams(n=5, temperature=1.0, max_tokens=30, seed=3),
    ],
)
def test_shared_prefix_attention_matches_repeated_prompt_cache(many_eos, prompts, params, monkeypatch):
    """Decoding from one prompt K/V per group gives the tokens and logprobs of n repeated copies."""
    import scirl.cpu.generator as hf

    gen, _ = many_eos
    steps = []
    original_update = hf.SharedPrefixCache.update

    def counting_update(self, key_states, value_states, layer_idx, *args, **kwargs):
        steps.append(key_states.shape[0])
        return original_update(self, key_states, value_states, layer_idx, *args, **kwargs)

    monkeypatch.setattr(hf.SharedPrefixCache, "update", counting_update)
    shared = gen.generate(prompts, params)
    assert steps  # the shared path ran
    reference = CPUGenerator(gen.model, tokenizer=gen.tokenizer, shared_prefix_attention=False).generate(
        prompts, params
    )
    if params.temperature > 0:  # sampled rows of one group stop at different steps; greedy ones do not stop here
        lengths = [len(c.token_ids) for g in shared for c in g]
        assert min(lengths) < 10 and max(lengths) == 30
    assert [[c.token_ids for c in g] for g in shared] == [[c.token_ids for c in g] for g in reference]
    assert [[c.finish_reason for c in g] for g in shared] == [[c.finish_reason for c in g] for g in reference]
    for g_shared, g_ref in zip(shared, reference):
        for a, b in zip(g_shared, g_ref):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    assert gen.model.config._attn_implementation == "sdpa"  # the model's own setting is back


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_with_lse_kernel_matches_the_plain_formula(dtype):
    """The decode attention's two parts are merged by their log-sum-exp: the CPU kernel's lse and output
    must be those of plain softmax attention, with a -inf padding bias and with strided (buffer-prefix) K/V."""
    from scirl.cpu.attention import attention_with_lse

    g = torch.Generator().manual_seed(0)
    query = torch.randn(3, 2, 5, 16, generator=g).to(dtype)
    buffer_k, buffer_v = (torch.randn(3, 2, 12, 16, generator=g).to(dtype) for _ in range(2))
    key, value = buffer_k[:, :, :7], buffer_v[:, :, :7]  # a filled prefix, as the preallocated cache exposes
    bias = torch.zeros(3, 1, 1, 7).masked_fill(
        torch.arange(7) < torch.tensor([0, 2, 4])[:, None, None, None], float("-inf")
    )
    out, lse = attention_with_lse(query, key, value, 0.25, bias)
    scores = (query.float() @ key.float().transpose(-1, -2)) * 0.25 + bias
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(lse, scores.logsumexp(-1), atol=tol, rtol=tol)
    torch.testing.assert_close(out.float(), scores.softmax(-1) @ value.float(), atol=tol, rtol=tol)
    plain_out, plain_lse = attention_with_lse(query, key, value, 0.25, bias, kernel=False)
    torch.testing.assert_close(plain_lse, lse, atol=tol, rtol=tol)
    torch.testing.assert_close(plain_out.float(), out.float(), atol=tol, rtol=tol)


def test_should_stop_cancels_generation_between_decode_steps(tiny_model_dir):
    """A caller whose reader is gone (scirl serve's disconnected client) stops the decode loop early."""
    from scirl.inference.base import GenerationCancelled, SamplingParams
    from scirl.inference.hf import HFGenerator

    gen = HFGenerator(str(tiny_model_dir), device="cpu")
    polls = []

    def should_stop():
        polls.append(1)
        return len(polls) > 3

    with pytest.raises(GenerationCancelled):
        gen.generate([[5, 6, 7]], SamplingParams(n=2, max_tokens=50, min_tokens=50, seed=0), should_stop=should_stop)
    assert len(polls) == 4  # stopped at the first poll that said so, not after 50 tokens
    params = SamplingParams(n=2, max_tokens=5, seed=0)
    assert gen.generate([[5, 6, 7]], params, should_stop=lambda: False) == gen.generate([[5, 6, 7]], params)


@pytest.mark.parametrize(
    "params",
    [SamplingParams(n=3, temperature=0, max_tokens=12), SamplingParams(n=4, temperature=1.0, max_tokens=12, seed=7)],
)
def test_cpu_decode_path_equals_the_plain_loop(many_eos, prompts, params):
    """The CPU generator (preallocated cache, shared prompt K/V) only changes speed: same tokens, same logprobs."""
    gen, _ = many_eos
    plain = HFGenerator(gen.model, tokenizer=gen.tokenizer).generate(prompts, params)
    fast = gen.generate(prompts, params)
    assert [[c.token_ids for c in g] for g in fast] == [[c.token_ids for c in g] for g in plain]
    for g_fast, g_plain in zip(fast, plain):
        for a, b in zip(g_fast, g_plain):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
