"""One GRPO step and one DPO step of the scripts' own code on a Qwen2.5-0.5B-shaped model, timed by phase.

The model is built from a config (random weights, no download). GRPO: 16 prompts × group 16, 128-token
prompts, 256 new tokens (random weights rarely stop early, so every completion is full length): generation,
reference log-probs (μ = 1: the old log-probs are the current ones, no pass), policy forward + backward,
optimiser. DPO: 32 pairs of 512 tokens (256 prompt + 256 completion), and 8 pairs of 4096 tokens (2048 +
2048): reference log-probs, policy forward + backward, optimiser. Reports seconds per phase, tokens/s, model FLOP utilisation (2·N FLOPs per
token forward, 6·N forward + backward, attention not counted) against the GPU's dense bf16 peak, and peak
CUDA memory. The first step of each is a warm-up and is not reported.

GRPO again with `--static-cache` (a preallocated KV cache; on CUDA transformers compiles the decoding step).
Then the same steps with LoRA (`--lora-r`, the scripts' `add_lora`): adapters on every linear layer, π_ref
the policy with its adapter off (no second model), the frozen base in bf16 on CUDA. With `--large` also at
Qwen2.5-7B shape (built in bf16 on the device, gradient checkpointing on), LoRA only: full fine-tuning with
fp32 master weights and AdamW would need ~16 bytes per parameter before activations.

    python benchmarks/gpu.py                              # CUDA, bf16 autocast, fp32 master weights
    python benchmarks/gpu.py --large                      # also the 7B-shaped LoRA rows
    python benchmarks/gpu.py --device cpu --tiny          # the same code on a tiny config (tests)
"""

import gc
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
import tyro
from transformers import AutoModelForCausalLM, Qwen2Config

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import dpo  # noqa: E402
import grpo  # noqa: E402
from benchmarks.logits_memory import random_pairs  # noqa: E402
from benchmarks.results import write_section  # noqa: E402

PEAK_BF16_TFLOPS = {"H200": 989, "H100": 989, "A100": 312, "L40S": 362, "L4": 121, "A10": 125, "4090": 165}  # dense


@dataclass
class Args:
    device: str = "cuda"
    """cuda or cpu"""
    tiny: bool = False
    """a tiny config and batch instead of Qwen2.5-0.5B (to test the script on a CPU)"""
    repeats: int = 3
    """timed steps of each method after one warm-up step; the median is reported"""
    peak_tflops: float | None = None
    """the GPU's dense bf16 peak (default: looked up from its name)"""
    write: bool = True
    """write the table into benchmarks/RESULTS.md"""
    lora_r: int = 16
    """rank of the LoRA rows' adapters (0: no LoRA rows)"""
    large: bool = False
    """LoRA rows at Qwen2.5-7B shape too (with --tiny: a 4-layer tiny config)"""


def shape_of(args: Args, large: bool = False):
    """The model config and step shapes: tiny, Qwen2.5-0.5B, or (large) Qwen2.5-7B."""
    if args.tiny:
        config = Qwen2Config(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4 if large else 2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
        )
        shape = dict(
            prompts=2,
            group=4,
            prompt_len=16,
            new_tokens=8,
            pairs=4,
            pair_prompt=16,
            pair_completion=16,
            micro=4,
            long_pairs=2,
            long_prompt=32,
            long_completion=32,
        )
    elif large:  # Qwen/Qwen2.5-7B's config.json
        config = Qwen2Config(
            vocab_size=152064,
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            max_position_embeddings=32768,
            rope_theta=1e6,
            tie_word_embeddings=False,
            rms_norm_eps=1e-6,
        )
    else:  # Qwen/Qwen2.5-0.5B's config.json
        config = Qwen2Config(
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            max_position_embeddings=32768,
            rope_theta=1e6,
            tie_word_embeddings=True,
            rms_norm_eps=1e-6,
        )
    if not args.tiny:  # the same step shapes at both sizes
        shape = dict(
            prompts=16,
            group=16,
            prompt_len=128,
            new_tokens=256,
            pairs=32,
            pair_prompt=256,
            pair_completion=256,
            micro=32,
            long_pairs=8,
            long_prompt=2048,
            long_completion=2048,
        )
    config.pad_token_id, config.eos_token_id = 0, 1
    return config, shape


def build(args: Args):
    """Full fine-tuning: the policy in fp32 (master weights) and a frozen reference (bf16 on CUDA, as in the scripts)."""
    config, shape = shape_of(args)
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(args.device)
    ref = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(args.device)
    if args.device == "cuda":
        ref.to(torch.bfloat16)
    ref.requires_grad_(False).eval()
    return policy, ref, config, shape


def build_lora(args: Args, large: bool):
    """LoRA: one model, its frozen base in bf16 on CUDA and its adapters in fp32 (grpo.add_lora); no reference
    model (None: π_ref is the policy with its adapter off). The large shape is built in bf16 on the device (no
    fp32 copy anywhere) and trains with gradient checkpointing."""
    config, shape = shape_of(args, large)
    torch.manual_seed(0)
    bf16 = args.device == "cuda"
    with torch.device(args.device):
        base = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if large and bf16 else torch.float32)
    if large:
        grpo.enable_gradient_checkpointing(base)
    policy = grpo.add_lora(base, grpo.Args(lora_r=args.lora_r, bf16=bf16))
    return policy, None, config, shape


def timer(device):
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def grpo_step(policy, ref, optimizer, config, shape, args, autocast) -> dict:
    """grpo.py's step: sample, reference log-probs, clipped loss over micro-batches, optimiser step."""
    G, N, device = shape["group"], shape["prompts"], args.device
    run_args = grpo.Args(
        max_new_tokens=shape["new_tokens"], temperature=1.0, static_cache=shape.get("static_cache", False)
    )
    tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=1)
    prompt_ids = torch.randint(2, config.vocab_size, (N, shape["prompt_len"]), device=device).repeat_interleave(G, 0)
    prompt_mask = torch.ones_like(prompt_ids)
    times = {}
    t = timer(device)
    policy.eval()
    with autocast:
        completion_ids, mask, _ = grpo.generate(
            policy, prompt_ids, prompt_mask, tokenizer, torch.tensor([1], device=device), run_args
        )
    policy.train()
    times["generation"], t = timer(device) - t, timer(device)
    input_ids, attention_mask = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, mask], 1)
    micro = [slice(i, i + shape["micro"]) for i in range(0, len(input_ids), shape["micro"])]
    with torch.no_grad(), autocast, grpo.reference_policy(policy, ref) as pi_ref:
        ref_logps = [
            grpo.forward_logps(pi_ref, input_ids[s], attention_mask[s], completion_ids.shape[1], 1.0) for s in micro
        ]
    times["reference log-probs"], t = timer(device) - t, timer(device)
    advantages = grpo.group_advantages(torch.rand(len(input_ids), device=device), G)
    for k, s in enumerate(micro):
        with autocast:
            logps = grpo.forward_logps(policy, input_ids[s], attention_mask[s], completion_ids.shape[1], 1.0)
        loss, _ = grpo.grpo_loss(logps, logps.detach(), ref_logps[k], advantages[s], mask[s])
        (loss * len(logps) / len(input_ids)).backward()
    times["policy forward + backward"], t = timer(device) - t, timer(device)
    torch.nn.utils.clip_grad_norm_([p for p in policy.parameters() if p.requires_grad], 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    times["optimiser"] = timer(device) - t
    tokens = input_ids.numel()
    return {"times": times, "generated": completion_ids.numel(), "tokens": tokens}


def dpo_step(policy, ref, optimizer, config, shape, args, autocast) -> dict:
    """dpo.py's step: chosen and rejected in one forward, reference log-probs without gradients."""
    device = args.device
    batch = random_pairs(config.vocab_size, shape["pairs"], shape["pair_prompt"], shape["pair_completion"], device)
    times = {}
    t = timer(device)
    with torch.no_grad(), autocast, dpo.reference_policy(policy, ref) as pi_ref:
        ref_chosen, ref_rejected = dpo.sequence_logps(pi_ref, batch).float().chunk(2)
    times["reference log-probs"], t = timer(device) - t, timer(device)
    with autocast:
        chosen, rejected = dpo.sequence_logps(policy, batch).chunk(2)
    losses, _, _ = dpo.dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta=0.1)
    losses.mean().backward()
    times["policy forward + backward"], t = timer(device) - t, timer(device)
    torch.nn.utils.clip_grad_norm_([p for p in policy.parameters() if p.requires_grad], 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    times["optimiser"] = timer(device) - t
    return {"times": times, "generated": 0, "tokens": batch["input_ids"].numel()}


def median(values):
    return sorted(values)[len(values) // 2]


def profile(policy, ref, config, shape, label: str, args: Args, autocast, peak, static_cache=False) -> list[str]:
    """One warm-up and `repeats` timed steps of GRPO, DPO and long-context DPO; a table per method. With
    static_cache also GRPO with --static-cache (the warm-up step takes the compilation)."""
    n_params = sum(p.numel() for p in policy.parameters())
    trainable = [p for p in policy.parameters() if p.requires_grad]
    lines = []
    long_context = dict(
        shape, pairs=shape["long_pairs"], pair_prompt=shape["long_prompt"], pair_completion=shape["long_completion"]
    )
    for method, step, step_shape in [
        ("GRPO", grpo_step, shape),
        *([("GRPO, --static-cache", grpo_step, dict(shape, static_cache=True))] if static_cache else []),
        ("DPO", dpo_step, shape),
        ("DPO, long context", dpo_step, long_context),
    ]:
        optimizer = torch.optim.AdamW(trainable, lr=1e-6)
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        runs = [step(policy, ref, optimizer, config, step_shape, args, autocast) for _ in range(args.repeats + 1)][1:]
        phases = {k: median([r["times"][k] for r in runs]) for k in runs[0]["times"]}
        total = sum(phases.values())
        # FLOPs: 2·N per token for a forward pass (generation, reference), 6·N for forward + backward (LoRA
        # too: the input gradients still go through every frozen weight; its weight gradients are tiny)
        flops = {
            "generation": 2 * n_params * runs[0]["generated"],
            "reference log-probs": 2 * n_params * runs[0]["tokens"],
            "policy forward + backward": 6 * n_params * runs[0]["tokens"],
            "optimiser": 0,
        }
        shape_text = (
            f"{step_shape['prompts']} prompts × group {step_shape['group']}, {step_shape['prompt_len']} prompt + {step_shape['new_tokens']} new tokens"
            if method.startswith("GRPO")
            else f"{step_shape['pairs']} pairs × 2 × {step_shape['pair_prompt'] + step_shape['pair_completion']} tokens"
        )
        memory = f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if args.device == "cuda" else "n/a (CPU)"
        lines += [
            f"**{method} step{label}** ({shape_text}; peak CUDA memory {memory}; {total:.2f} s per step)",
            "",
            "| phase | seconds | share | tokens/s | MFU |",
            "|---|---|---|---|---|",
        ]
        for phase, seconds in phases.items():
            tokens = runs[0]["generated"] if phase == "generation" else runs[0]["tokens"]
            rate = f"{tokens / seconds:,.0f}" if flops[phase] else "–"
            mfu = f"{flops[phase] / seconds / (peak * 1e12):.1%}" if peak and flops[phase] else "–"
            lines.append(f"| {phase} | {seconds:.3f} | {seconds / total:.0%} | {rate} | {mfu} |")
        lines.append("")
        del optimizer
    return lines


def free_memory():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main(args: Args):
    autocast = torch.autocast(args.device, dtype=torch.bfloat16, enabled=args.device == "cuda")
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    peak = args.peak_tflops or next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
    size = "tiny test config" if args.tiny else "Qwen2.5-0.5B shape"
    policy, ref, config, shape = build(args)
    n_params = sum(p.numel() for p in policy.parameters())
    lines = [
        f"Model: Qwen2-architecture, {n_params / 1e6:.1f}M parameters ({size}), random weights; device: {name}; "
        f"peak dense bf16: {peak or 'unknown'} TFLOPS; median of {args.repeats} steps after a warm-up.",
        "",
        *profile(policy, ref, config, shape, "", args, autocast, peak, static_cache=True),
    ]
    del policy, ref
    free_memory()
    for large in [False, True] if args.large else [False]:
        if not args.lora_r:
            break
        policy, ref, config, shape = build_lora(args, large)
        trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)
        total = sum(p.numel() for p in policy.parameters())
        what = ("tiny 4-layer config" if args.tiny else "Qwen2.5-7B shape") if large else size
        lines += [
            f"With LoRA r={args.lora_r} ({what}: {total / 1e6:.1f}M parameters, {trainable / 1e6:.2f}M trainable; "
            f"base {'bf16' if args.device == 'cuda' else 'fp32'}, π_ref = adapter off"
            f"{', gradient checkpointing' if large else ''}):",
            "",
            *profile(policy, ref, config, shape, f", LoRA r={args.lora_r}, {what}", args, autocast, peak),
        ]
        del policy, ref
        free_memory()
    text = "### GPU step profile (benchmarks/gpu.py)\n\n" + "\n".join(lines)
    print(text)
    if args.write:
        flags = (" --device cpu --tiny" if args.tiny else "") + (" --large" if args.large else "")
        write_section("gpu", text + f"\n\nCommand: `python benchmarks/gpu.py{flags}`.")


if __name__ == "__main__":
    main(tyro.cli(Args))
