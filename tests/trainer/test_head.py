"""The block-wise LM head (``scirl/trainer/head.py``) against the full-logits computation it replaces: the
sampled tokens' logprobs, entropies, nucleus and SDPO's targets, their gradients, and a whole trainer
forward/backward with tied and untied heads; plus the peak memory of a big-vocabulary step."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import Qwen3Config, Qwen3ForCausalLM

from helpers.train_runs import fixed_samples
from scirl import algorithms
from scirl.distributed import Dist
from scirl.run.config import TrainConfig
from scirl.trainer import Trainer
from scirl.trainer import head as head_module
from scirl.trainer.head import Head, block_stats, hidden_states_out
from scirl.trainer.loss import rl_loss, token_logprobs
from scirl.trainer.packing import make_micro_batches
from scirl.trainer.targets import student_logprobs, teacher_targets

# float32 throughout: two orders of the same float32 sums (block matmuls, softmax over a row) differ by a
# few units in the last place of values of order 1-10, hence 1e-5 absolute / 1e-4 relative
TOL = dict(rtol=1e-4, atol=1e-5)


def random_head(seed, rows=(3, 7), hidden=16, vocab=97):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(*rows, hidden, generator=g)).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * 0.5).requires_grad_()
    targets = torch.randint(0, vocab, rows, generator=g)
    mask = torch.rand(rows, generator=g) > 0.3
    return h, w, targets, mask, torch.randn(rows, generator=g)


def grads(loss, *tensors):
    return torch.autograd.grad(loss, tensors)


@pytest.mark.parametrize("block", [1, 4, 1000])
@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 1.0), (1.0, 0.8), (1.3, 0.6)])
def test_logprobs_entropy_and_gradients_equal_the_full_logits_ones(temperature, top_p, block):
    h, w, targets, mask, upstream = random_head(0)
    lp, ent = Head(temperature, top_p, block).token_logprobs(h[mask], w, targets[mask])  # the loss tokens only
    want_lp, want_ent = token_logprobs(h @ w.T, targets, temperature, top_p)
    torch.testing.assert_close(lp, want_lp[mask], **TOL)
    torch.testing.assert_close(ent, want_ent[mask], **TOL)
    assert not torch.isinf(lp).any()  # the target is kept in the nucleus
    got = grads((lp * upstream[mask]).sum(), h, w)
    want = grads((want_lp * upstream * mask).sum(), h, w)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL)


def test_the_nucleus_renormalises_over_its_tokens():
    """Written out for one row: probabilities 0.5, 0.3, 0.15, 0.05; top_p 0.75 keeps the first two."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    w, h = torch.diag(probs.log()), torch.ones(1, 4)  # logits h @ w.T = log(probs)
    lp, ent = Head(1.0, 0.75, 8).token_logprobs(h, w, torch.tensor([1]))
    kept = torch.tensor([0.5, 0.3]) / 0.8
    assert lp.item() == pytest.approx(float(kept[1].log()), abs=1e-6)
    assert ent.item() == pytest.approx(float(-(kept * kept.log()).sum()), abs=1e-6)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("top_k, tail", [(5, True), (5, False), (0, True)])
def test_sdpo_targets_and_student_logprobs_equal_the_full_logits_ones(top_k, tail, fused, monkeypatch):
    """Several ids a row (the teacher's top k). ``fused``: the compiled head's handling of them, its block
    functions run eagerly here (``test_a_compiled_head_equals_the_full_logits_one`` compiles them)."""
    monkeypatch.setattr(head_module, "compiled", lambda fn: fn)
    h, w, _, _, _ = random_head(1, rows=(11,))
    teacher_h = torch.randn(11, h.shape[-1], generator=torch.Generator().manual_seed(2))
    head = Head(0.8, 0.5, 3, fused=fused)  # the nucleus plays no part in SDPO's distributions
    got = head.teacher_targets(teacher_h, w.detach(), top_k=top_k, tail=tail)
    want = teacher_targets(teacher_h @ w.detach().T, top_k=top_k, tail=tail, temperature=0.8)
    if top_k:
        assert torch.equal(got.ids, want.ids)
    torch.testing.assert_close(got.logprobs, want.logprobs, **TOL)
    student = head.student_logprobs(h, w, got, tail=tail)
    want_student = student_logprobs(h @ w.T, want, tail=tail, temperature=0.8)
    torch.testing.assert_close(student, want_student, **TOL)
    upstream = torch.randn(student.shape, generator=torch.Generator().manual_seed(3))
    for a, b in zip(grads((student * upstream).sum(), h, w), grads((want_student * upstream).sum(), h, w)):
        torch.testing.assert_close(a, b, **TOL)


def tiny_qwen3(tied: bool, vocab: int = 512) -> Qwen3ForCausalLM:
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config).float()


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_a_trainer_micro_batch_has_the_full_logits_gradients(tied, temperature, top_p):
    """The trainer's forward/backward (hidden states, then the block-wise head) against the model's own logits
    through ``token_logprobs`` and the loss: the same loss and the same gradient in every parameter (with a
    tied head, the embedding's gradient holds both uses)."""
    model = tiny_qwen3(tied)
    reference = copy.deepcopy(model)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    cfg = TrainConfig()
    trainer = Trainer(
        model,
        cfg.optim,
        algorithms.build(cfg),
        temperature=temperature,
        top_p=top_p,
        device=torch.device("cpu"),
        dist=Dist(),
        dtype=torch.float32,
        head_block_tokens=3,
    )
    samples = fixed_samples(4, seed=5)
    (mb,) = make_micro_batches(samples, max_rows=4)
    scale = float(mb.loss_tokens)
    loss, sums = trainer.forward_backward(trainer.on_device(mb), [scale])

    lp = torch.zeros(mb.loss_mask.shape)
    entropy = torch.zeros(mb.loss_mask.shape)
    for r, s in enumerate(samples):  # each sample its own sequence, through the model's own head
        logits = reference(input_ids=torch.tensor([s.prompt_ids + s.completion_ids])).logits[0]
        prompt, completion = len(s.prompt_ids), len(s.completion_ids)
        row_lp, row_entropy = token_logprobs(
            logits[prompt - 1 : prompt + completion - 1], torch.tensor(s.completion_ids), temperature, top_p
        )
        lp = lp.index_put((torch.tensor([r]), torch.arange(completion)), row_lp)
        entropy[r, :completion] = row_entropy.detach()
    mask = mb.loss_mask
    want, want_sums = rl_loss(
        lp,
        mb.inference_logprobs,
        mb.advantages,
        mask,
        mask_low=cfg.loss.mask_low,
        mask_high=cfg.loss.mask_high,
        kl_tau=cfg.loss.kl_tau,
        loss_scale=scale,
    )
    want.backward()
    assert float(loss) == pytest.approx(float(want.detach()), abs=1e-6)
    assert float(sums.masked) == float(want_sums.masked)
    assert float(sums.mismatch_kl) == pytest.approx(float(want_sums.mismatch_kl), abs=1e-5)
    assert float(sums.entropy) == pytest.approx(float(entropy[mask].sum()), rel=1e-5)
    reference_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, reference_params[name].grad, **TOL, msg=name)


def test_the_head_is_restored_after_the_forward():
    model = tiny_qwen3(True)
    ids = torch.arange(5)[None]
    with hidden_states_out(model) as seen:
        hidden = model(input_ids=ids).logits
    assert hidden.shape == (1, 5, 32) and seen["weight"] is model.lm_head.weight
    torch.testing.assert_close(model(input_ids=ids).logits, hidden @ model.lm_head.weight.T)


class VocabularyRows(TorchDispatchMode):
    """Records the most rows of any tensor over the vocabulary (last dimension ``vocab``) an op creates, in
    the forward and the backward alike."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.most = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # views (the weight transposed for a matmul, [H, V]) allocate nothing: outputs sharing an input's storage
        inputs = {
            t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
        }
        for t in tree_flatten(out)[0]:
            if (
                isinstance(t, torch.Tensor)
                and t.dim()
                and t.shape[-1] == self.vocab
                and t.untyped_storage().data_ptr() not in inputs
            ):
                self.most = max(self.most, t.numel() // self.vocab)
        return out


@pytest.mark.parametrize("block", [4, 1000])
def test_a_big_vocabulary_step_never_holds_a_tokens_by_vocabulary_tensor(block):
    """With Qwen3's 151,936-token vocabulary, no tensor of the step's forward and backward spans more than a
    block of tokens over the vocabulary, where the full-logits step's span every position of the micro-batch
    (a block larger than the micro-batch: its loss tokens, never the padding or the prompts)."""
    vocab = 151_936
    model = tiny_qwen3(True, vocab=vocab)
    cfg = TrainConfig()
    trainer = Trainer(
        model,
        cfg.optim,
        algorithms.build(cfg),
        temperature=0.7,
        top_p=0.9,
        device=torch.device("cpu"),
        dist=Dist(),
        dtype=torch.float32,
        head_block_tokens=block,
    )
    (mb,) = make_micro_batches(fixed_samples(4, seed=5), max_rows=4)
    tokens = mb.loss_tokens
    assert tokens > 2 * 4 and mb.packed.input_ids.numel() > 2 * tokens
    mb = trainer.on_device(mb)
    with VocabularyRows(vocab) as seen:
        trainer.forward_backward(mb, [float(tokens)])
    assert seen.most == min(block, tokens)


def test_a_near_certain_tokens_entropy_is_exact_to_float32():
    """The logged entropy as -sum p log p with log p taken from the shifted logits: for tokens 16-20 nats above the
    rest of logits around 30, within float32's resolution of 1 (a few 1e-7) of the float64 value; lse - sum p * logit
    subtracts two numbers near 50 and is off by ~2e-4, more than such a token's whole entropy."""
    g = torch.Generator().manual_seed(0)
    vocab, rows = 512, 64
    logits = 30 + torch.randn(rows, vocab, generator=g)
    logits[torch.arange(rows), torch.randint(0, vocab, (rows,), generator=g)] += 16 + 4 * torch.rand(rows, generator=g)
    # hidden states that are the logits themselves, through an identity head
    _, entropy = Head(1.0, 1.0, 16).token_logprobs(logits.clone(), torch.eye(vocab), logits.argmax(-1))
    exact = -(logits.double().softmax(-1) * logits.double().log_softmax(-1)).sum(-1)
    assert exact.min() < 1e-5
    torch.testing.assert_close(entropy.double(), exact, rtol=0, atol=2e-6)


def compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


@pytest.mark.slow
def test_a_compiled_head_equals_the_full_logits_one():
    """``Head(fused=True)`` (``kernels = "compile"``: each block's elementwise work compiled by inductor, the
    weight's gradient added into its accumulator by one GEMM a block) at a temperature and a nucleus: the
    full-logits logprobs, entropies and gradients, 13 loss tokens in blocks of 4, the last of one row, then 26 in
    blocks of 8, then one token. Blocks of any size share a graph: one a function, where static shapes would
    compile one per micro-batch's last block."""
    import torch._dynamo

    torch._dynamo.reset()
    before = compiled_graphs()
    for rows, block in ((13, 4), (26, 8), (1, 8)):
        h, w, targets, _, upstream = random_head(4, rows=(rows,))
        lp, ent = Head(0.7, 0.8, block, fused=True).token_logprobs(h, w, targets)
        want_lp, want_ent = token_logprobs(h @ w.T, targets, 0.7, 0.8)
        torch.testing.assert_close(lp, want_lp, **TOL)
        torch.testing.assert_close(ent, want_ent, **TOL)
        for a, b in zip(grads((lp * upstream).sum(), h, w), grads((want_lp * upstream).sum(), h, w)):
            torch.testing.assert_close(a, b, **TOL)
    assert compiled_graphs() - before == 2  # the forward's and the backward's


def test_the_compiled_heads_entropy_keeps_its_digits_near_certainty():
    """A near-certain token (a margin of 20 over 96 others) in ``block_stats``, the arithmetic the compiled head
    runs (here eagerly): its entropy, ~4e-6, and its logprob, ~-2e-7, to 1e-4 relative of float64's; ``lse - sum p
    * logit`` and ``log(1 + rest)`` in float32 lose them to round-off (~4e-6 and ~1e-7)."""
    logits = torch.full((2, 97), 20.0)
    logits[:, 0] = 40.0
    _, logprobs, entropy = block_stats(logits, torch.tensor([[0], [3]]), None, 1.0)
    p = torch.softmax(logits[0].double(), dim=-1)
    assert entropy[0].item() == pytest.approx(float(-(p * p.log()).sum()), rel=1e-4)
    assert logprobs[0, 0].item() == pytest.approx(float(p[0].log()), rel=1e-4)


def test_bf16_weight_gradients_accumulate_in_float32_without_a_vocabulary_sized_product(monkeypatch):
    """bf16 operands: on CUDA one float32-output GEMM a block (``torch.addmm(..., out_dtype=float32, out=acc)``), here
    through a stand-in that enforces its contract as torch 2.10-2.13's CUDA kernel checks it (mat1, mat2 of one
    16-bit dtype; out of out_dtype; self of out_dtype or mat1's), adding into the accumulator itself. Both ways
    give the float32 sums of the bf16 products."""
    calls = []

    def addmm(self, mat1, mat2, *, out_dtype=None, out=None, beta=1, alpha=1):
        assert out_dtype == torch.float32 and out is not None and out.dtype == out_dtype
        assert mat1.dtype == mat2.dtype and mat1.dtype in (torch.bfloat16, torch.float16)
        assert self.dtype in (out_dtype, mat1.dtype)
        calls.append(out is self)
        return out.copy_(beta * self.to(out_dtype) + alpha * (mat1.float() @ mat2.float()))

    g = torch.Generator().manual_seed(0)
    grad, hidden = (torch.randn(5, n, generator=g).bfloat16() for n in (97, 16))
    want = grad.float().T @ hidden.float()
    for fp32_output in (True, False):
        monkeypatch.setattr(head_module, "fp32_output_gemm", lambda device, fp32_output=fp32_output: fp32_output)
        monkeypatch.setattr(head_module.torch, "addmm", addmm)
        total = torch.zeros(97, 16)
        head_module.accumulate_weight_grad(total, grad[:2], hidden[:2])
        head_module.accumulate_weight_grad(total, grad[2:], hidden[2:])
        torch.testing.assert_close(total, want, rtol=1e-6, atol=1e-6)
    assert calls == [True, True]
