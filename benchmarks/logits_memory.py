"""Peak memory of one DPO step with a large vocabulary: the [B,T,V] logits kept for backward (the scripts
before lm_head_logprobs) vs the LM head over chunks of positions recomputed in backward (dpo.sequence_logps);
then the chunked step with LoRA (dpo.add_lora, rank 16 on every linear layer): one model, π_ref its adapter
switched off, the frozen base in fp32 or, as with the scripts' --bf16, in bf16 under bf16 autocast.

A 25M-parameter Qwen2-architecture model with Qwen2.5's 151,936-token vocabulary (random weights, no
download); pairs × 2 sequences of prompt + completion tokens; reference log-probs (no gradients), policy
forward + backward, optimiser step. Each variant runs in a fresh process and reports its peak resident
memory (ru_maxrss) and how much the step added to what the model and optimiser already held.

    python benchmarks/logits_memory.py                # CPU
    python benchmarks/logits_memory.py --device cuda  # peak CUDA memory instead
"""

import datetime
import json
import math
import os
import resource
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import transformers
import tyro
from transformers import AutoModelForCausalLM, Qwen2Config

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import dpo  # noqa: E402
from benchmarks.results import write_section  # noqa: E402


@dataclass
class Args:
    device: str = "cpu"
    """cpu or cuda"""
    pairs: int = 8
    """preference pairs in the step (2 × pairs sequences)"""
    prompt_tokens: int = 128
    """prompt length"""
    completion_tokens: int = 128
    """completion length"""
    vocab_size: int = 151936
    """vocabulary (Qwen2.5's by default)"""
    hidden_size: int = 160
    """hidden size (160 with 4 layers and this vocabulary: ~25M parameters)"""
    variant: Literal["all", "full-logits", "chunked", "lora", "lora-bf16"] = "all"
    """all: each variant in its own process, side by side; or run one variant in this process"""
    lora_r: int = 16
    """rank of the LoRA variants' adapters"""
    write: bool = True
    """write the table into benchmarks/RESULTS.md"""


def full_logits_sequence_logps(model, batch: dict) -> torch.Tensor:
    """The previous dpo.sequence_logps: the last T + 1 positions' logits [B,T+1,V], kept for backward."""
    position_ids = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    T = batch["completion_ids"].shape[1]
    logits = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=position_ids,
        logits_to_keep=T + 1,
    ).logits
    return (dpo.token_logprobs(logits[:, :-1], batch["completion_ids"]) * batch["completion_mask"]).sum(1)


def peak_bytes(device: str) -> int:
    if device == "cuda":
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def random_pairs(vocab_size: int, pairs: int, prompt_tokens: int, completion_tokens: int, device) -> dict:
    """A DPO batch of random token ids, as dpo.pair_batch lays it out: the chosen rows, then the rejected ones."""
    prompt = torch.randint(2, vocab_size, (pairs, prompt_tokens))
    completions = torch.randint(2, vocab_size, (2 * pairs, completion_tokens))
    batch = {
        "input_ids": torch.cat([prompt.repeat(2, 1), completions], 1),
        "completion_ids": completions,
        "completion_mask": torch.ones_like(completions),
    }
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    return {k: v.to(device) for k, v in batch.items()}


def one_variant(args: Args) -> dict:
    config = Qwen2Config(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=4 * args.hidden_size,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(args.device)
    lora = args.variant.startswith("lora")
    if lora:  # π_ref: the policy with its adapter off, no second model
        policy, ref = dpo.add_lora(policy, dpo.Args(lora_r=args.lora_r, bf16=args.variant == "lora-bf16")), None
    else:
        ref = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(args.device)
        ref.requires_grad_(False).eval()
    trainable = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-6)
    autocast = torch.autocast(args.device, dtype=torch.bfloat16, enabled=args.variant == "lora-bf16")
    batch = random_pairs(config.vocab_size, args.pairs, args.prompt_tokens, args.completion_tokens, args.device)
    sequence_logps = full_logits_sequence_logps if args.variant == "full-logits" else dpo.sequence_logps
    for p in trainable:  # the optimiser's state exists before the measured step, as in training
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    before = peak_bytes(args.device)
    with torch.no_grad(), autocast, dpo.reference_policy(policy, ref) as pi_ref:
        ref_chosen, ref_rejected = sequence_logps(pi_ref, batch).chunk(2)
    with autocast:
        chosen, rejected = sequence_logps(policy, batch).chunk(2)
    losses, _, _ = dpo.dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta=0.1)
    losses.mean().backward()
    optimizer.step()
    peak = peak_bytes(args.device)
    return {
        "parameters": sum(p.numel() for p in policy.parameters()),
        "trainable": sum(p.numel() for p in trainable),
        "peak": peak,
        "step": peak - before,
        "loss": losses.mean().item(),
    }


def main(args: Args):
    if args.variant != "all":
        print(json.dumps(one_variant(args)))
        return
    results = {}
    for variant in ("full-logits", "chunked", "lora", "lora-bf16"):
        flags = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("variant", "write")]
        out = subprocess.run(
            [sys.executable, __file__, *flags, "--variant", variant, "--no-write"],
            capture_output=True,
            text=True,
            check=True,
        )
        results[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    full, chunked, lora, lora_bf16 = (results[v] for v in ("full-logits", "chunked", "lora", "lora-bf16"))
    assert abs(full["loss"] - chunked["loss"]) < 1e-4, (full["loss"], chunked["loss"])  # the same step
    # LoRA: π_ref is the policy with its adapter off (B = 0 at the start), so the loss is log 2
    assert all(abs(r["loss"] - math.log(2)) < 1e-3 for r in (lora, lora_bf16)), results
    kind = "peak CUDA memory" if args.device == "cuda" else "peak resident memory (ru_maxrss)"
    gib = 2**30
    text = "\n".join(
        [
            "### Logits memory: a DPO step with a 151,936-token vocabulary (`benchmarks/logits_memory.py`)",
            "",
            f"{full['parameters'] / 1e6:.1f}M-parameter Qwen2-architecture model, vocabulary {args.vocab_size:,}, {args.pairs} pairs × 2 × "
            f"({args.prompt_tokens} + {args.completion_tokens}) tokens, fp32 on {args.device} unless said; reference log-probs, policy forward + backward, "
            f"AdamW step. {kind}, each variant in a fresh process, measured side by side in one run. LoRA: rank {args.lora_r} "
            f"on every linear layer of the decoder ({lora['trainable'] / 1e6:.2f}M trainable; the tied embedding / LM head stays frozen), "
            "π_ref the policy with its adapter off.",
            "",
            "| variant | models held | peak | added by the step | ratio to full logits (peak) |",
            "|---|---|---|---|---|",
            f"| full logits kept for backward (before) | policy + reference | {full['peak'] / gib:.2f} GiB | {full['step'] / gib:.2f} GiB | 1.00 |",
            f"| LM head over chunks, recomputed in backward (`lm_head_logprobs`) | policy + reference | {chunked['peak'] / gib:.2f} GiB "
            f"| {chunked['step'] / gib:.2f} GiB | {chunked['peak'] / full['peak']:.2f} |",
            f"| chunked + LoRA, frozen base fp32 | one, adapter off for π_ref | {lora['peak'] / gib:.2f} GiB | {lora['step'] / gib:.2f} GiB "
            f"| {lora['peak'] / full['peak']:.2f} |",
            f"| chunked + LoRA, frozen base bf16, bf16 autocast (`--bf16`) | one, adapter off for π_ref | {lora_bf16['peak'] / gib:.2f} GiB "
            f"| {lora_bf16['step'] / gib:.2f} GiB | {lora_bf16['peak'] / full['peak']:.2f} |",
            "",
            f"Command: `python benchmarks/logits_memory.py{' --device cuda' if args.device == 'cuda' else ''}`; run {datetime.date.today()} on "
            f"{torch.cuda.get_device_name() if args.device == 'cuda' else f'{os.cpu_count()} CPU cores'}, torch {torch.__version__}, "
            f"transformers {transformers.__version__}.",
        ]
    )
    print(text)
    if args.write:
        write_section("logits_memory", text)


if __name__ == "__main__":
    main(tyro.cli(Args))
