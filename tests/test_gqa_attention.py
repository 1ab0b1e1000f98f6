"""The trainer's CPU attention (grouped K/V heads left to torch's kernel) equals transformers' SDPA path."""

import torch

from scirl.cpu.attention import GQA_SDPA_ATTENTION, use_gqa_attention


def test_gqa_attention_gives_transformers_logits_and_gradients(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # the case it is for
    input_ids = torch.randint(10, 500, (3, 12), generator=torch.Generator().manual_seed(0))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 8:] = 0  # right padding
    attention_mask[2, :5] = 0  # left padding

    def logits_and_grads():
        model.zero_grad()
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        (logits * attention_mask[..., None]).square().sum().backward()
        return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}

    reference_logits, reference_grads = logits_and_grads()
    with use_gqa_attention(model):
        assert model.config._attn_implementation == GQA_SDPA_ATTENTION
        logits, grads = logits_and_grads()
    assert model.config._attn_implementation == "sdpa"  # restored: checkpoints and the sampler see transformers' own
    real = attention_mask.bool()
    torch.testing.assert_close(logits[real], reference_logits[real], atol=1e-5, rtol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, reference_grads[name], atol=1e-5, rtol=1e-4)
