"""Log-probs from hidden states: the LM head over chunks of positions, each chunk recomputed in backward,
gives the same values and gradients as the full [B,T,V] logits (sft, dpo, grpo, ppo)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

import common
import dpo
import grpo
import ppo
import sft


def batch_with_every_eos(tok):
    """Left-padded prompts and right-padded completions ending in <|im_end|>, in <|endoftext|>, or not at all."""
    im_end, endoftext = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    prompts = common.tokenize(tok, ["Add 1 and 2.", "What is 123+456? Think.", "Tom"])
    words = common.tokenize(tok, ["The sum is 3.", "579", "has 7 apples and more"])
    completions = [words[0] + [im_end], words[1] + [endoftext], words[2]]
    return common.collate(prompts, completions, tok.pad_token_id)


def full_logits_logps(model, batch, temperature):
    """The reference: every position's logits, then log_softmax(logits / T) at the completion tokens."""
    position_ids = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    logits = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=position_ids
    ).logits
    T = batch["completion_ids"].shape[1]
    return (
        (logits[:, -T - 1 : -1].float() / temperature)
        .log_softmax(-1)
        .gather(-1, batch["completion_ids"][..., None])[..., 0]
    )


def chunked_logps(script, model, batch, temperature):
    ids, mask, completion_ids = batch["input_ids"], batch["attention_mask"], batch["completion_ids"]
    if script is sft:
        return sft.completion_logps(model, batch)
    return script.forward_logps(model, ids, mask, completion_ids.shape[1], temperature)


@pytest.mark.parametrize("script", [sft, dpo, grpo, ppo], ids=lambda m: m.__name__)
def test_chunked_lm_head_equals_full_logits_values_and_gradients(script, chat_model, monkeypatch):
    monkeypatch.setattr(script, "LOGITS_CHUNK", 5)  # many chunks, cutting across rows
    tok = common.load_tokenizer(chat_model)
    model = AutoModelForCausalLM.from_pretrained(chat_model)
    batch = batch_with_every_eos(tok)
    mask = batch["completion_mask"].float()
    temperature = 1.0 if script in (sft, dpo) else 0.7

    reference = full_logits_logps(model, batch, temperature)
    if script is dpo:  # per-sequence sums over completion tokens
        reference, chunked = (reference * mask).sum(1), dpo.sequence_logps(model, batch)
    else:
        reference, chunked = reference * mask, chunked_logps(script, model, batch, temperature) * mask
    assert torch.allclose(chunked, reference, atol=1e-5)

    grads = []
    for logps in (reference, chunked):
        model.zero_grad()
        (logps.sum() * 0.1).backward(retain_graph=True)
        grads.append([p.grad.clone() for p in model.parameters()])
    assert max((a - b).abs().max().item() for a, b in zip(*grads)) < 1e-5
    assert sum(g.abs().sum() for g in grads[1]) > 0  # the gradient reaches the weights, LM head included
