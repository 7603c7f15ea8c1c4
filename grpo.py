"""Group Relative Policy Optimization (GRPO): PPO's clipped objective without a critic.

For each prompt x, sample a group of G completions y_1…y_G from π_θold, score them (r_i), and use the
group's own statistics as the baseline (the lecture's "group-normalized reward z-score"):

    Â_i = (r_i − mean({r})) / std({r})
    ρ_t = π_θ(y_t | x, y_<t) / π_θold(y_t | x, y_<t)
    J(θ) = 𝔼[ (1/G) Σ_i (1/|y_i|) Σ_t ( min(ρ_t·Â_i, clip(ρ_t, 1−ε, 1+ε)·Â_i) − β·D_KL[π_θ ‖ π_ref] ) ]

and minimise ℒ = −J. D_KL is the per-token k3 estimator π_ref/π_θ − log(π_ref/π_θ) − 1 ≥ 0.
Shao et al. 2024, DeepSeekMath (arXiv:2402.03300); DeepSeek-R1 (arXiv:2501.12948).

    python grpo.py                                   # after `python sft.py`: the built-in addition task, CPU
    python grpo.py --model Qwen/Qwen2.5-0.5B-Instruct --dataset openai/gsm8k --group-size 16
"""

import contextlib
import copy
import importlib.util
import math
import os
import re
import sys
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Literal

import torch
from transformers import AutoModelForSequenceClassification

import common

# Flags whose default depends on the run: the built-in task's tuned value, or with any other dataset or model one
# fit for a pretrained model (TRL's where TRL has one). A flag given always wins; the run prints the set it used.
DEFAULTS = {  # flag: (built-in task, pretrained model)
    "steps": (60, 300),
    "prompts_per_step": (64, 8),
    "temperature": (0.7, 1.0),
    "max_new_tokens": (8, 256),
    "grad_accum_steps": (2, 8),
    "lr": (2e-4, 1e-6),
    "warmup_steps": (10, 0),
}


@dataclass
class Args:
    # models and data
    model: str = "models/sft"
    """policy to start from (hub id or path); also the frozen reference π_ref"""
    reward_funcs: tuple[str, ...] | None = None
    """r_i, summed: accuracy, format, think_format, overlong, file.py:fn or module.fn (default: accuracy)"""
    reward_weights: tuple[float, ...] | None = None
    """weight of each reward function, then of --reward-model (default: 1 each)"""
    reward_model: str | None = None
    """also score completions with this sequence-classification model r_ϕ (metrics: reward_model)"""
    dataset: str = "arithmetic"
    """`arithmetic` (built-in), `openai/gsm8k`, another hub id, or a local .jsonl/.json/.parquet file"""
    dataset_config: str | None = None
    """the hub dataset's configuration name, if it has several"""
    max_prompt_length: int = 512
    """prompts are left-truncated to this many tokens"""
    output_dir: str = "models/grpo"
    """where the trained policy and tokenizer are saved"""
    trust_remote_code: bool = False
    """allow model repositories to run their own code"""
    # sampling: G completions per prompt at temperature τ
    prompts_per_step: int | None = None
    """prompts sampled per round and process, each with its whole group (default: DEFAULTS)"""
    group_size: int = 8
    """G: completions sampled per prompt (TRL: num_generations)"""
    temperature: float | None = None
    """τ: sampling temperature, also of every log-prob (default: DEFAULTS)"""
    max_new_tokens: int | None = None
    """completion length limit (TRL: max_completion_length) (default: DEFAULTS)"""
    static_cache: bool = False
    """sample with a preallocated KV cache (on CUDA: compiled decoding, faster after the first call)"""
    # the objective: clipped ratio ρ, KL to π_ref, advantages Â
    clip_eps: float = 0.2
    """ε: the ratio ρ is clipped to [1−ε, 1+ε_h] (TRL: epsilon)"""
    clip_eps_high: float | None = None
    """ε_h: DAPO's clip-higher, e.g. 0.28 (None: ε) (TRL: epsilon_high)"""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """token: ρ per token (GRPO); sequence: GSPO's length-normalised sequence ratio"""
    beta: float = 0.04
    """β: weight of the k3 KL penalty to π_ref (0: no reference model; TRL's default is 0)"""
    loss_type: Literal["grpo", "dapo", "dr_grpo"] = "grpo"
    """grpo: mean of sequences' token means; dapo: mean over all tokens; dr_grpo: sum / (B·max_new_tokens)"""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """divide Â by the reward std of each group, of the whole batch, or not at all (Dr. GRPO)"""
    mask_truncated_completions: bool = False
    """completions cut at --max-new-tokens without an EOS get no loss (DAPO's overlong filtering)"""
    dynamic_sampling: bool = False
    """drop groups whose rewards all tie and sample more prompts to fill the step (DAPO)"""
    max_sampling_rounds: int = 4
    """with --dynamic-sampling: most rounds of sampling a step; then it trains on the groups it has"""
    # optimisation
    steps: int | None = None
    """optimisation rounds of prompts_per_step × group_size completions each (default: DEFAULTS)"""
    num_iterations: int = 1
    """μ: optimiser steps on each generated batch (1: old log-probs are the current ones, detached)"""
    grad_accum_steps: int | None = None
    """micro-batches a round's sequences are split into, gradients summed (default: DEFAULTS)"""
    lr: float | None = None
    """learning rate (AdamW) (default: DEFAULTS)"""
    warmup_steps: int | None = None
    """linear warm-up steps (default: DEFAULTS)"""
    max_grad_norm: float = 1.0
    """gradient clipping threshold (global L2 norm)"""
    # evaluation
    eval_every: int = 50
    """evaluate greedy completions on the held-out split every this many rounds (and at the end)"""
    eval_size: int = 500
    """held-out prompts used for evaluation"""
    # LoRA: train low-rank adapters instead of every weight (peft)
    lora_r: int = 0
    """r: rank of the adapters on --lora-target-modules (0: full fine-tuning)"""
    lora_alpha: int = 32
    """α: an adapter's update B·A is scaled by α/r"""
    lora_dropout: float = 0.0
    """dropout on the adapters' input (0, like every dropout here: log-probs must be deterministic)"""
    lora_target_modules: tuple[str, ...] = ("all-linear",)
    """modules that get adapters (all-linear: every linear layer of the decoder, not the LM head)"""
    merge_lora: bool = False
    """with --lora-r: save W + (α/r)·B·A merged in output_dir (the adapter in output_dir/adapter)"""
    # run: precision, processes, logging, checkpoints
    seed: int = 1
    """seed for torch and python"""
    bf16: bool = torch.cuda.is_available()
    """bf16 autocast, fp32 master weights, frozen models in bf16 (default: on with CUDA)"""
    fsdp: bool = False
    """under torchrun: shard parameters, gradients and optimiser state (FSDP2) instead of DDP"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass: less memory, one more forward of compute"""
    track: bool = False
    """log to Weights & Biases"""
    wandb_project: str = "align"
    """wandb project"""
    wandb_entity: str | None = None
    """wandb entity (team or user)"""
    run_name: str | None = None
    """name of the run (runs/<run_name>/metrics.jsonl); default grpo__<seed>__<time>"""
    save_every: int = 0
    """write output_dir/checkpoint-<step>/ every this many steps (0: only when stopped by a signal)"""
    keep_checkpoints: int = 2
    """newest checkpoints kept; older ones are deleted"""
    resume: str | None = None
    """continue from this checkpoint directory, or `latest` in output_dir (none yet: start afresh)"""

    def __post_init__(self):
        if self.reward_funcs is None:  # the answer check, unless a reward model scores instead
            self.reward_funcs = () if self.reward_model else ("accuracy",)


# ---------------------------------------------------------------- the math
def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group", eps: float = 1e-4) -> torch.Tensor:
    """Â_i = (r_i − mean({r})) / (std + eps) within each group of G = group_size consecutive rows.

    rewards [N·G] → [N·G]. std: the group's (scale="group", DeepSeekMath), the whole batch's ("batch": one scale
    for every prompt, so easy and hard prompts weigh alike; Hu 2025, REINFORCE++), or none ("none": Â = r − mean,
    Dr. GRPO, Liu et al. 2025); Bessel-corrected. A group with equal rewards gets Â = 0."""
    r = rewards.view(-1, group_size)
    advantages = r - r.mean(dim=1, keepdim=True)
    if scale == "group":
        advantages = advantages / (r.std(dim=1, keepdim=True) + eps)
    elif scale == "batch":
        advantages = advantages / (rewards.std() + eps)
    return advantages.flatten()


def informative_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N] True for the groups whose rewards are not all equal: the others have Â = 0 and teach nothing (DAPO's
    dynamic sampling drops them and samples more prompts; Yu et al. 2025, arXiv:2503.14476)."""
    r = rewards.view(-1, group_size)
    return r.max(1).values != r.min(1).values


def overlong_filter(mask: torch.Tensor, ended: torch.Tensor) -> torch.Tensor:
    """DAPO's overlong filtering: a completion cut at the length limit without an EOS (`ended` False) gets no loss
    tokens, so a truncated but maybe sound answer is not punished; its reward still counts in its group's Â."""
    return mask * ended.unsqueeze(1).to(mask.dtype)


def kl_k3(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Per-token D_KL[π_θ ‖ π_ref] ≈ π_ref/π_θ − log(π_ref/π_θ) − 1 (k3: unbiased, always ≥ 0)."""
    log_ratio = ref_logps - logps
    return torch.exp(log_ratio) - log_ratio - 1


def sequence_log_ratio(logps: torch.Tensor, old_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's ratio at every token of y_i (Zheng et al. 2025, arXiv:2507.18071), in its stop-gradient form:

    log s_i,t = sg[log s_i] + log π_θ(y_t) − sg[log π_θ(y_t)],   log s_i = (1/|y_i|) Σ_t (log π_θ(y_t) − log π_θold(y_t))

    Its value is the length-normalised sequence ratio s_i; its gradient is s_i·∇log π_θ(y_t) at each token (with
    Â_i the same for every token, GSPO-token is GSPO). [B,T] → [B,T]."""
    mask = mask.float()
    log_s = ((logps - old_logps) * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)
    return log_s.detach() + logps - logps.detach()


def grpo_loss(
    logps,
    old_logps,
    ref_logps,
    advantages,
    mask,
    clip_eps=0.2,
    beta=0.04,
    loss_type="grpo",
    max_completion_length=None,
    clip_eps_high=None,
    importance_sampling_level="token",
):
    """ℒ = −J: per token ℓ_t = −min(ρ_t·Â, clip(ρ_t, 1−ε, 1+ε_h)·Â) + β·D_KL,  ρ_t = exp(logp_t − old_logp_t).

    logps, old_logps, ref_logps, mask [B,T]; advantages [B]. ε_h = clip_eps_high: DAPO's clip-higher (None: ε_h = ε,
    the lecture's symmetric clip). importance_sampling_level "sequence": ρ_t is GSPO's sequence ratio s_i at every
    token of y_i (sequence_log_ratio). Reduction by `loss_type`: grpo: mean over sequences of each sequence's token
    mean (DeepSeekMath); dapo: mean over all tokens; dr_grpo: Σ ℓ·mask / (B · max_completion_length). Returns (loss, stats)."""
    mask = mask.float()
    log_ratio = (
        sequence_log_ratio(logps, old_logps, mask) if importance_sampling_level == "sequence" else logps - old_logps
    )
    ratio = torch.exp(log_ratio)
    low, high = 1 - clip_eps, 1 + (clip_eps if clip_eps_high is None else clip_eps_high)
    A = advantages.unsqueeze(1)
    per_token = -torch.min(ratio * A, ratio.clamp(low, high) * A)
    stats = {}
    tokens = mask.sum().clamp(min=1)  # every row may be masked out (overlong filtering)
    if beta != 0:
        kl = kl_k3(logps, ref_logps)
        per_token = per_token + beta * kl
        stats["kl"] = ((kl * mask).sum() / tokens).detach()
    if loss_type == "grpo":
        loss = ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()
    elif loss_type == "dapo":
        loss = (per_token * mask).sum() / tokens
    elif loss_type == "dr_grpo":
        loss = (per_token * mask).sum() / (mask.shape[0] * max_completion_length)
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}")
    clipped = ((ratio < low) & (A < 0)) | ((ratio > high) & (A > 0))
    stats["clip_fraction"] = ((clipped.float() * mask).sum() / tokens).detach()
    return loss, stats


# ---------------------------------------------------------------- the method's helpers
def completion_mask(completion_ids: torch.Tensor, eos_ids: torch.Tensor) -> torch.Tensor:
    """1 up to and including the first EOS (any of eos_ids), 0 after: built from positions, so pad == EOS is harmless."""
    is_eos = torch.isin(completion_ids, torch.as_tensor(eos_ids, device=completion_ids.device)).long()
    return ((is_eos.cumsum(1) - is_eos) == 0).long()


@torch.no_grad()
def generate(model, prompt_ids, prompt_mask, tokenizer, eos_ids: torch.Tensor, args: Args, greedy: bool = False):
    """Completions [B,T] from π_θ at temperature τ exactly (KV cache, left-padded prompts), their mask, and
    whether each ended with an EOS (any of eos_ids) rather than at the length limit."""
    temperature = 0.0 if greedy else args.temperature
    out = generate_exactly(
        model, prompt_ids, prompt_mask, tokenizer, eos_ids, args.max_new_tokens, temperature, args.static_cache
    )
    completion_ids = out[:, prompt_ids.shape[1] :]
    mask = completion_mask(completion_ids, eos_ids)
    ended = torch.isin(completion_ids, eos_ids).any(1)  # a row cut by the limit has no padding: pad == EOS is harmless
    return completion_ids * mask + tokenizer.pad_token_id * (1 - mask), mask, ended


@torch.no_grad()
def sample(policy, tokenizer, eos_ids, rows, reward_sources, args: Args, device, autocast, step: int, greedy=False):
    """Sample and score: a completion y of each row's prompt x from π_θ (greedy: its most likely tokens) and its
    reward r (compute_rewards). Returns prompts and completions as id lists (to the first EOS), and as tensors
    input_ids, attention_mask (prompt | completion), mask (completion tokens), ended; texts, rewards, by_source."""
    prompts = common.tokenize_prompts(tokenizer, rows, args.max_prompt_length)
    prompt_ids, prompt_mask = (t.to(device) for t in common.pad(prompts, tokenizer.pad_token_id, "left"))
    policy.eval()
    with autocast:
        completion_ids, mask, ended = generate(policy, prompt_ids, prompt_mask, tokenizer, eos_ids, args, greedy)
        texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        input_ids, attention_mask = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, mask], 1)
        completions = [ids[:n] for ids, n in zip(completion_ids.tolist(), mask.sum(1).tolist())]
        rewards, by_source = compute_rewards(
            reward_sources, rows, texts, completions, ended, input_ids, attention_mask, args, step
        )
    policy.train()
    out = dict(prompts=prompts, completions=completions, input_ids=input_ids, attention_mask=attention_mask)
    return SimpleNamespace(**out, mask=mask, ended=ended, texts=texts, rewards=rewards, by_source=by_source)


@contextlib.contextmanager
def reference_policy(policy, ref):
    """π_ref for a block of code: the frozen reference model, or with LoRA (ref None) the policy's own frozen
    base weights, its adapter switched off: one model in memory instead of two."""
    if ref is not None:
        yield ref
    else:
        with policy.disable_adapter():
            yield policy


# ---------------------------------------------------------------- rewards r_i: functions with TRL's signature
def completion_text(completion) -> str:
    """A completion as reward functions receive it: a string, or [{"role": "assistant", "content": …}] in a chat."""
    return completion if isinstance(completion, str) else completion[-1]["content"]


def accuracy(completions, answer, **_) -> list[float | None]:
    """1 when the completion's final answer is the row's, as numbers (common.final_answer: after '####', else in
    the last \\boxed{}, else after 'answer is', else the last number), else 0; None where the row has no answer."""
    return [None if a is None else float(common.is_correct(completion_text(c), a)) for c, a in zip(completions, answer)]


def format_reward(completions, ended, **_) -> list[float]:
    """1 when the completion ended with an EOS and marks its answer ('#### N', \\boxed{N}, 'the answer is N', or
    nothing but the number: common.marked_answer), else 0: a number anywhere in the text earns nothing."""
    return [float(done and common.marked_answer(completion_text(c)) is not None) for c, done in zip(completions, ended)]


def think_format(completions, **_) -> list[float]:
    """1 when the completion is one closed <think>…</think> block, first, then a non-empty answer (DeepSeek-R1)."""
    texts = [completion_text(c) for c in completions]
    pattern = re.compile(r"\s*<think>.*</think>\s*\S.*", re.S)
    return [float(t.count("<think>") == t.count("</think>") == 1 and bool(pattern.fullmatch(t))) for t in texts]


def overlong(completion_ids, max_completion_length, **_) -> list[float]:
    """DAPO's soft overlong punishment (arXiv:2503.14476), L = |y|, L_max = max_completion_length, L_cache = L_max/5:
    0 while L ≤ L_max − L_cache, then (L_max − L_cache − L) / L_cache, down to −1 at L = L_max."""
    L_max = max_completion_length
    L_cache = max(1, L_max // 5)
    return [max(-1.0, min(0.0, (L_max - L_cache - len(ids)) / L_cache)) for ids in completion_ids]


def sample_step(policy, tokenizer, eos_ids, train_rows, batches, reward_sources, args: Args, run, autocast, step):
    """Steps 1–2 of an optimiser step: sample() G completions of each of this process's next N = --prompts-per-step
    prompts (rows i*G … i*G+G-1: one prompt's group). With --dynamic-sampling, groups whose rewards all tie (Â = 0)
    are dropped and another round sampled, until every process has N groups or --max-sampling-rounds is reached;
    each process then keeps as many as the fewest found (the same batch shape everywhere). Returns (every sequence
    sampled, the kept ones, rounds), as per-sequence lists: prompts, completions, ended, rewards, rewards/<source>."""
    N, G = args.prompts_per_step, args.group_size
    sampled, kept, rounds = {}, {}, 0
    while True:
        rows = [train_rows[i] for i in process_share(next(batches), run, N) for _ in range(G)]
        s = sample(policy, tokenizer, eos_ids, rows, reward_sources, args, run.device, autocast, step)
        new = dict(prompts=s.prompts, completions=s.completions, ended=s.ended.tolist(), rewards=s.rewards.tolist())
        new |= {f"rewards/{name}": r for name, r in s.by_source.items()}
        rounds += 1
        keep = informative_groups(s.rewards, G).tolist() if args.dynamic_sampling else [True] * N
        for key, values in new.items():
            sampled[key] = sampled.get(key, []) + values
            kept[key] = kept.get(key, []) + [v for i, v in enumerate(values) if keep[i // G]]
        n_groups = min(N, int(over_processes({"n": len(kept["rewards"]) // G}, run.device, "min")["n"]))
        if not args.dynamic_sampling or n_groups == N or rounds == args.max_sampling_rounds:
            return sampled, {key: values[: n_groups * G] for key, values in kept.items()}, rounds


def clipped_update(dist_policy, batch: dict, advantages, loss_mask, old_logps, ref_logps, micro, args: Args, autocast):
    """One optimiser step's gradients of ℒ = −J (grpo_loss) over the batch, a micro-batch (slice) at a time, each
    weighted by its share of the batch's loss: its tokens (dapo, over every process) or its sequences. old_logps,
    ref_logps: a tensor per micro-batch, or None (μ = 1: π_θold = π_θ, detached; β = 0). Returns the stats."""
    input_ids, attention_mask, mask = batch["input_ids"], batch["attention_mask"], batch["completion_mask"]
    T, n = mask.shape[1], len(input_ids)
    batch_tokens = over_processes({"tokens": loss_mask.sum().item()}, input_ids.device)["tokens"]
    objective = dict(clip_eps=args.clip_eps, clip_eps_high=args.clip_eps_high, beta=args.beta, loss_type=args.loss_type)
    objective |= dict(
        importance_sampling_level=args.importance_sampling_level, max_completion_length=args.max_new_tokens
    )
    totals = {"loss": 0.0, "clip_fraction": 0.0, "entropy": 0.0}  # + kl when β > 0
    for k, s in enumerate(micro):
        with gradient_sync(dist_policy, last=k == len(micro) - 1):
            with autocast:
                logps, entropy = forward_logps(
                    dist_policy, input_ids[s], attention_mask[s], T, args.temperature, entropy=True
                )
            old = old_logps[k] if old_logps else logps.detach()  # μ = 1: ρ = 1, no extra forward pass
            loss, stats = grpo_loss(
                logps, old, ref_logps[k] if ref_logps else None, advantages[s], loss_mask[s], **objective
            )
            weight = loss_mask[s].sum() / max(batch_tokens, 1) if args.loss_type == "dapo" else len(logps) / n
            (loss * weight).backward()
        totals["loss"] += loss.item() * float(weight)
        stats["entropy"] = (entropy * mask[s]).sum() / mask[s].sum()
        for key in stats:
            totals[key] = totals.get(key, 0.0) + stats[key].item() * len(logps) / n
    return totals


@torch.no_grad()
def evaluate(policy, tokenizer, eos_ids, rows, reward_sources, args: Args, device, autocast, step: int):
    """Greedy completions of held-out prompts (sample(), 128 at a time): the mean reward, each source's, and
    accuracy when answers exist; and every sample."""
    rewards, texts, by_source = [], [], {}
    for i in range(0, len(rows), 128):
        s = sample(policy, tokenizer, eos_ids, rows[i : i + 128], reward_sources, args, device, autocast, step, True)
        rewards, texts = rewards + s.rewards.tolist(), texts + s.texts
        by_source = {name: by_source.get(name, []) + r for name, r in s.by_source.items()}
    metrics = {"eval/reward": sum(rewards) / len(rewards)} | {
        f"eval/{k}": v for k, v in reward_stats(by_source).items()
    }
    if all(x["answer"] is not None for x in rows):
        metrics["eval/accuracy"] = sum(common.is_correct(t, x["answer"]) for t, x in zip(texts, rows)) / len(rows)
    return metrics, [
        {"prompt": common.readable_prompt(x), "completion": t, "answer": x["answer"], "reward": r}
        for x, t, r in zip(rows, texts, rewards)
    ]


def main(args: Args):
    run = start_run(args, "grpo")  # flags checked, --resume found, seeds set, torchrun's processes joined
    autocast = torch.autocast(run.device.type, dtype=torch.bfloat16, enabled=args.bf16)
    tokenizer, policy, ref, reward_sources = load_models(args, run)
    dist_policy = wrap(policy, args, run.device)  # the policy's training forward, through DDP/FSDP2 under torchrun
    # every id that ends a completion (chat models: several)
    eos_ids = torch.tensor(common.eos_token_ids(tokenizer, policy.generation_config), device=run.device)
    if run.world > 1:  # every process samples its own completions
        torch.manual_seed(args.seed + run.rank)
    train_rows, eval_rows = load_prompts(args, tokenizer)

    # fused AdamW: the whole update in one kernel, without foreach's parameter-sized temporaries
    trainable = [p for p in policy.parameters() if p.requires_grad]  # LoRA: the adapters
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0, fused=True)
    schedule = lr_schedule(optimizer, args.warmup_steps, args.steps, decay=False)
    step_rows = args.prompts_per_step * run.world
    batches, progress = begin_training(args, run, policy, optimizer, schedule, len(train_rows), step_rows)

    def run_eval(step: int) -> dict:
        metrics, samples = evaluate(
            policy, tokenizer, eos_ids, eval_rows, reward_sources, args, run.device, autocast, step
        )
        return log_eval(run, step, metrics, samples)

    last_eval = run.first_eval or run_eval(0)
    G = args.group_size
    for step in progress:
        # 1. sample G completions of each of this process's N prompts from π_θold (the current policy), and
        # 2. score them: r_i (--dynamic-sampling: groups whose rewards all tie are dropped, more prompts sampled)
        t0 = time.time()
        sampled, kept, rounds = sample_step(
            policy, tokenizer, eos_ids, train_rows, batches, reward_sources, args, run, autocast, step
        )
        generation_s, n_groups = time.time() - t0, len(kept["rewards"]) // G

        # 3. group-relative advantages Â_i (of every process's groups: --scale-rewards batch divides by their std)
        rewards = torch.tensor(gather_lists(kept["rewards"]), device=run.device)
        advantages = group_advantages(rewards, G, scale=args.scale_rewards).view(run.world, -1)[run.rank]

        stats, grad_norm = {"loss": 0.0, "clip_fraction": 0.0, "entropy": 0.0}, 0.0
        if n_groups == 0:  # every group's rewards tied: Â = 0, nothing to learn from
            common.warn_once(
                f"every group's rewards tied in {rounds} rounds of sampling: such a step trains on nothing"
            )
        else:
            # 4. log-probs of π_ref (β > 0) and of π_θold (μ > 1): once per batch, without gradients
            batch = common.collate(kept["prompts"], kept["completions"], tokenizer.pad_token_id)
            batch = {k: v.to(run.device) for k, v in batch.items()}
            ended = torch.tensor(kept["ended"], device=run.device)
            mask = batch["completion_mask"]
            loss_mask = overlong_filter(mask, ended) if args.mask_truncated_completions else mask
            size = math.ceil(len(mask) / args.grad_accum_steps)  # sequences a forward/backward pass
            micro = [slice(i, i + size) for i in range(0, len(mask), size)]
            ref_logps = old_logps = None
            with torch.no_grad(), autocast:
                T, ids, attn = mask.shape[1], batch["input_ids"], batch["attention_mask"]
                if args.beta != 0:
                    with reference_policy(policy, ref) as pi_ref:
                        ref_logps = [forward_logps(pi_ref, ids[s], attn[s], T, args.temperature) for s in micro]
                if args.num_iterations > 1:
                    old_logps = [forward_logps(policy, ids[s], attn[s], T, args.temperature) for s in micro]

            # 5. μ optimiser steps on the clipped objective (grpo_loss), gradients accumulated over micro-batches
            for _ in range(args.num_iterations):
                stats = clipped_update(
                    dist_policy, batch, advantages, loss_mask, old_logps, ref_logps, micro, args, autocast
                )
                grad_norm = optimizer_step(args, run, step, [policy], optimizer)
        schedule.step()

        # 6. log, evaluate, checkpoint (the sampling metrics count every group sampled, kept or not)
        rewards = torch.tensor(sampled["rewards"])
        by_source = {k.removeprefix("rewards/"): v for k, v in sampled.items() if k.startswith("rewards/")}
        stats |= {  # TRL's names
            "grad_norm": grad_norm,
            "lr": schedule.get_last_lr()[0],
            "reward": rewards.mean().item(),
            "reward_std": rewards.std().item(),
            **reward_stats(by_source),
            "frac_reward_zero_std": (~informative_groups(rewards, G)).float().mean().item(),
            "completions/mean_length": sum(map(len, sampled["completions"])) / len(rewards),
            "completions/clipped_ratio": 1 - sum(sampled["ended"]) / len(rewards),  # cut by the length limit, no EOS
            "sampling_rounds": rounds,
            "groups_trained": n_groups,
            "generation_s": generation_s,
        }
        metrics = over_processes({f"train/{k}": v for k, v in stats.items()}, run.device)
        log(run, metrics, step)
        if metrics["train/completions/clipped_ratio"] > 0.5:
            common.warn_once(
                f"most completions hit the {args.max_new_tokens}-token limit without an EOS: raise --max-new-tokens"
            )
        progress.set_postfix(reward=f"{metrics['train/reward']:.3f}", kl=f"{metrics.get('train/kl', 0):.4f}")
        if step % args.eval_every == 0 or step == args.steps:
            last_eval = run_eval(step)
        maybe_checkpoint(args, run, step, policy, tokenizer, optimizer, schedule)

    finish_run(args, run, policy, tokenizer, last_eval)


# ======================================== plumbing: models, data, flag checks (main() reads fine without it)
def load_models(args: Args, run):
    """The tokenizer, π_θ (from the checkpoint on resume), π_ref (the starting policy, frozen; none when β = 0
    or with LoRA) and the reward sources: the reward functions, r_ϕ and its tokenizer (None: no reward model, or
    it reads the policy's tokens). Frozen models are held in bf16 with --bf16."""
    frozen_dtype = torch.bfloat16 if args.bf16 else torch.float32
    reward_sources = SimpleNamespace(funcs=load_reward_funcs(args.reward_funcs), model=None, tokenizer=None)
    ref = None
    path = args.model if args.lora_r else run.checkpoint or args.model  # LoRA: the base model, then its adapter
    tokenizer = common.load_tokenizer(args.model, trust_remote_code=args.trust_remote_code)
    policy = load_model(path, args.trust_remote_code)
    policy = add_lora(policy, args, adapter=run.checkpoint).to(run.device)
    if args.gradient_checkpointing:
        enable_gradient_checkpointing(policy)
    if args.beta != 0 and not args.lora_r:  # LoRA: π_ref is the policy with its adapter switched off
        ref = load_model(args.model, args.trust_remote_code) if run.checkpoint else copy.deepcopy(policy)
        ref.to(run.device, frozen_dtype).requires_grad_(False).eval()
    if args.reward_model:
        reward_model, rm_tokenizer = load_reward_model(args.reward_model, tokenizer, args.trust_remote_code)
        reward_sources.model, reward_sources.tokenizer = reward_model, rm_tokenizer
        reward_model.to(run.device, frozen_dtype).requires_grad_(False).eval()
    return tokenizer, policy, ref, reward_sources


def load_prompts(args: Args, tokenizer) -> tuple[list[dict], list[dict]]:
    """The training prompts and the first --eval-size held-out ones; a dataset without answers needs a reward."""
    train_rows = common.load_rows(args.dataset, "train", "prompt", tokenizer, args.dataset_config)
    eval_rows = common.load_rows(args.dataset, "test", "prompt", tokenizer, args.dataset_config)[: args.eval_size]
    if (
        list(args.reward_funcs) == ["accuracy"]
        and not args.reward_model
        and any(r["answer"] is None for r in eval_rows)
    ):
        fail(
            f"dataset '{args.dataset}' has rows without an answer, which accuracy needs: pass --reward-model or --reward-funcs"
        )
    common.check_prompt_lengths(tokenizer, eval_rows, args.max_prompt_length)
    print(f"{len(train_rows)} train / {len(eval_rows)} held-out prompts from {args.dataset}")
    return train_rows, eval_rows


# the flags checked below the banner (check_args), besides those every script has
METHOD_POSITIVE = "prompts_per_step num_iterations clip_eps max_sampling_rounds temperature max_prompt_length".split()
METHOD_NON_NEGATIVE = ["beta"]


def method_rules(args: Args) -> list[tuple[bool, str]]:
    """(broken, message): flag combinations that cannot work."""
    N, G, accum, high = args.prompts_per_step, args.group_size, args.grad_accum_steps, args.clip_eps_high
    return [
        (high is not None and not high >= 0, f"--clip-eps-high must be 0 or positive (got {high})"),
        (G < 2, f"--group-size must be at least 2: a group of one has no baseline (got {G})"),
        (accum > N * G, f"--grad-accum-steps ({accum}) must be at most --prompts-per-step × --group-size ({N * G})"),
        *reward_rules(args),
    ]


# ---------------------------------------- reward sources: loading and calling them (the same text in grpo.py and ppo.py)
REWARD_FUNCS = {"accuracy": accuracy, "format": format_reward, "think_format": think_format, "overlong": overlong}


def load_reward_funcs(names) -> list[tuple]:
    """(name, function) for each --reward-funcs entry: a built-in (REWARD_FUNCS), `path/to/file.py:function`, or
    `package.module.function` importable from the working directory (TRL's CLI convention)."""
    funcs = []
    for name in names:
        try:
            if name in REWARD_FUNCS:
                funcs.append((name, REWARD_FUNCS[name]))
                continue
            if ":" in name:
                path, attr = name.rsplit(":", 1)
                spec = importlib.util.spec_from_file_location(os.path.basename(path).removesuffix(".py"), path)
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
            elif "." in name:
                if os.getcwd() not in sys.path:  # `module.function` from the working directory
                    sys.path.insert(0, os.getcwd())
                module_name, attr = name.rsplit(".", 1)
                module = importlib.import_module(module_name)
            else:
                raise ValueError("no such built-in")
            funcs.append((attr, getattr(module, attr)))
        except Exception as e:
            fail(
                f"--reward-funcs {name}: {common.error_reason(e)} (give a built-in: {', '.join(REWARD_FUNCS)}; or "
                "path/to/file.py:function or module.function)"
            )
    return funcs


def call_reward_func(name: str, fn, kwargs: dict, n: int) -> list[float | None]:
    """fn(**kwargs): one reward or None per completion; a function that raises or returns another number of them
    stops the run with one line naming it and the first completion it fails on."""
    try:
        out = [None if r is None else float(r) for r in fn(**kwargs)]
    except Exception as e:
        for i in range(n):  # which completion does it fail on?
            try:
                fn(**{k: v[i : i + 1] if isinstance(v, list) else v for k, v in kwargs.items()})
            except Exception as e_i:
                fail(
                    f"reward function {name} failed on completion {kwargs['completions'][i]!r:.200} of prompt "
                    f"{kwargs['prompts'][i]!r:.200}: {common.error_reason(e_i)}"
                )
        fail(f"reward function {name} failed on a batch of {n} completions: {common.error_reason(e)}")
    if len(out) != n:
        fail(
            f"reward function {name} returned {len(out)} rewards for {n} completions: it must return one per completion"
        )
    return out


@torch.no_grad()
def compute_rewards(
    reward_sources, rows, texts, completion_ids, ended, input_ids, attention_mask, args: Args, step: int
):
    """r_i [B] = Σ_k w_k·r_k,i over the reward functions, then r_ϕ (a None skips its term: TRL's nansum), and each
    source's rewards by name. Functions get TRL's keywords: prompts, completions (message lists for chat
    prompts), completion_ids (to the first EOS), every other dataset column, trainer_state; and ended (stopped at
    an EOS) and max_completion_length, for the built-ins."""
    chat = [r.get("messages") is not None for r in rows]
    kwargs = {k: [r.get(k) for r in rows] for k in rows[0] if k not in ("prompt", "messages")}
    kwargs |= dict(
        prompts=[r["messages"] if c else r["prompt"] for r, c in zip(rows, chat)],
        completions=[[{"role": "assistant", "content": t}] if c else t for t, c in zip(texts, chat)],
        completion_ids=completion_ids,
        trainer_state=SimpleNamespace(global_step=step, max_steps=args.steps),
        ended=ended.tolist(),
        max_completion_length=args.max_new_tokens,
    )
    by_source = {name: call_reward_func(name, fn, kwargs, len(rows)) for name, fn in reward_sources.funcs}
    if reward_sources.model is not None:
        by_source["reward_model"] = reward_model_scores(
            reward_sources.model, reward_sources.tokenizer, input_ids, attention_mask, rows, texts, ended, args
        ).tolist()
    table = torch.tensor([[math.nan if r is None else r for r in rs] for rs in by_source.values()])  # [sources, B]
    if table.isnan().all(0).any():
        common.warn_once("every reward source returned None for some completions: their reward is 0")
    weights = torch.tensor(args.reward_weights or [1.0] * len(by_source)).unsqueeze(1)
    return (weights * table).nansum(0).to(input_ids.device), by_source


def reward_stats(by_source: dict) -> dict:
    """rewards/<name>/mean and /std of each source over the completions it scored (None left out; TRL's names)."""
    stats = {}
    for name, rewards in by_source.items():
        r = torch.tensor([x for x in rewards if x is not None] or [math.nan], dtype=torch.float64)
        stats |= {f"rewards/{name}/mean": r.mean().item(), f"rewards/{name}/std": r.std().item() if len(r) > 1 else 0.0}
    return stats


def reward_rules(args: Args) -> list[tuple[bool, str]]:
    """(broken, message) for the reward flags: something to reward, and one weight per source."""
    n, w = len(args.reward_funcs) + bool(args.reward_model), args.reward_weights
    return [
        (n == 0, "nothing to reward: pass --reward-funcs, --reward-model or both"),
        (
            w is not None and len(w) != n,
            f"--reward-weights has {len(w or ())} values for {n} reward sources (each of --reward-funcs, then --reward-model)",
        ),
    ]


def load_reward_model(path: str, tokenizer, trust_remote_code: bool):
    """r_ϕ and the tokenizer it reads: None when it is the policy's (the policy's token ids go in as they
    are), else its own (completions are then decoded and re-tokenized). A model whose checkpoint has no
    score head (e.g. a causal LM) would score with a random one: refused."""
    model, info = load_model(
        path, trust_remote_code, AutoModelForSequenceClassification, output_loading_info=True, num_labels=1
    )
    if "score.weight" in info["missing_keys"]:
        fail(
            f"{path} is not a reward model: its checkpoint has no score head (score.weight), so it would score with random "
            "weights; pass a sequence-classification model, e.g. one trained by reward_model.py"
        )
    try:
        own = common.load_tokenizer(path, trust_remote_code=trust_remote_code)
    except common.DataError:
        print(f"note: {path} has no tokenizer of its own; it reads the policy's token ids")
        return model, None
    if common.same_tokenizer(tokenizer, own):
        return model, None
    print(f"note: the reward model {path} has its own tokenizer: completions are decoded and re-tokenized for it")
    return model, own


@torch.no_grad()
def reward_model_scores(reward_model, rm_tokenizer, input_ids, attention_mask, rows, texts, ended, args: Args):
    """r_ϕ(x, y) [B] (score_at_last_token, below), minus reward_model.py's centring offset; of the policy's ids, or with
    rm_tokenizer (another vocabulary), of the decoded texts re-tokenized its way."""
    if rm_tokenizer is not None:
        input_ids, attention_mask = (
            t.to(input_ids.device)
            for t in common.retokenize(rm_tokenizer, rows, texts, ended.tolist(), args.max_prompt_length)
        )
    offset = getattr(reward_model.config, "reward_offset", 0.0)  # reward_model.py's centring
    return score_at_last_token(reward_model, input_ids, attention_mask) - offset


# ======================================================================================================
# Infrastructure: loading models, LoRA, the LM head a chunk at a time, sampling, torchrun, checkpoints and
# resume, logging, signals, user errors. Not part of the method, and the same text in all five scripts
# (tests/test_copies.py checks it), so that a fix in one is a fix in all.
# ======================================================================================================
import contextlib
import json
import math
import os
import random
import re
import shutil
import signal
import sys
import time
import warnings
from dataclasses import asdict
from types import SimpleNamespace

import torch.distributed as dist
import tyro
from torch.distributed.checkpoint import state_dict as dcp
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint as recompute
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, GenerationConfig

LOGITS_CHUNK = 2**25  # logits (positions × vocabulary) that lm_head_logprobs holds at once: 128 MiB in fp32
FULL_STATE = dcp.StateDictOptions(full_state_dict=True, cpu_offload=True)  # whole tensors, on the CPU, for rank 0
STAGES = {"models/sft": "sft.py", "models/reward": "reward_model.py"}  # default inputs, made by the stage before
# flags a resumed run may change; every other flag is the checkpoint's own
RESUME_FLAGS = "resume output_dir steps save_every keep_checkpoints eval_every track wandb_project wandb_entity".split()
POSITIVE = "steps grad_accum_steps lr max_grad_norm eval_every eval_size max_new_tokens keep_checkpoints".split()
NON_NEGATIVE = "warmup_steps seed save_every lora_r lora_alpha".split()


# -------------------------------------------------- models: loading, LoRA, the LM head, sampling
def load_model(path: str, trust_remote_code: bool, cls=AutoModelForCausalLM, output_loading_info=False, **kwargs):
    """A model in fp32 (master weights), dropout off; a LoRA adapter directory: its base with the adapter merged.
    A failure raises common.DataError, one line on why (the user error __main__ reports)."""
    try:
        if os.path.isfile(os.path.join(path, "adapter_config.json")):
            from peft import PeftConfig, PeftModel  # imported only when LoRA is used: it adds seconds to every start

            adapter = PeftConfig.from_pretrained(path)
            base = load_model(adapter.base_model_name_or_path, trust_remote_code, cls, **kwargs)
            model = PeftModel.from_pretrained(base, path).merge_and_unload()
            missing = [] if "score" in (adapter.modules_to_save or []) else ["score.weight"]  # a reward model's has it
            return (model, {"missing_keys": missing}) if output_loading_info else model
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, **kwargs)
        for key, value in config.to_dict().items():
            if isinstance(value, float) and ("dropout" in key or "pdrop" in key):
                setattr(config, key, 0.0)  # log-probs must be deterministic
        if cls is AutoModelForSequenceClassification and config.pad_token_id is None:
            config.pad_token_id = 0  # its forward refuses batches without one; position_scores reads every position
        kwargs = dict(config=config, dtype=torch.float32, trust_remote_code=trust_remote_code, use_safetensors=True)
        return cls.from_pretrained(path, output_loading_info=output_loading_info, **kwargs)
    except common.DataError:
        raise  # the base model's, said already
    except Exception as e:
        raise common.load_error(path, e) from None


def add_lora(model, args: Args, task_type: str = "CAUSAL_LM", adapter: str | None = None):
    """--lora-r > 0: W freezes and W + (α/r)·B·A trains on --lora-target-modules (B = 0: the model starts
    unchanged), with a SEQ_CLS model's score head; `adapter`: the one resumed. --bf16: the frozen W in bf16."""
    if not args.lora_r:
        return model
    from peft import LoraConfig, PeftModel, get_peft_model

    if os.path.isdir(model.name_or_path):  # the adapter names its base model: an absolute path loads from anywhere
        model.name_or_path = os.path.abspath(model.name_or_path)
    if adapter:
        try:
            model = PeftModel.from_pretrained(model, adapter, is_trainable=True)
        except Exception as e:
            raise common.load_error(adapter, e) from None
    else:
        targets = "all-linear" if args.lora_target_modules == ("all-linear",) else list(args.lora_target_modules)
        lora = dict(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout, target_modules=targets)
        try:
            model = get_peft_model(model, LoraConfig(task_type=task_type, **lora))
        except ValueError as e:  # e.g. no module of that name
            raise common.DataError(f"--lora-target-modules: {common.error_reason(e)}") from None
    for p in model.parameters():
        if not p.requires_grad:
            p.data = p.data.to(torch.bfloat16 if args.bf16 else torch.float32)
    return model


def unwrap(model):
    """The transformers model inside the DDP and LoRA (peft) wrappers (its layers carry the adapter)."""
    model = model.module if isinstance(model, DDP) else model
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def enable_gradient_checkpointing(model):
    """Activations recomputed in the backward pass (transformers ≥ 5.x names it activation checkpointing)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)  # left padding must not shift positions


def forward_logps(model, input_ids, attention_mask, T: int, temperature: float = 1.0, entropy: bool = False):
    """log π(y_t) [B,T] of the last T tokens at temperature τ (the hidden state at t predicts token t+1);
    entropy=True: also the entropy of each π(·|x, y_<t), without gradient."""
    positions = position_ids(attention_mask)  # logits for one position only: the LM head runs a chunk at a time
    out = model(
        input_ids, attention_mask=attention_mask, position_ids=positions, logits_to_keep=1, output_hidden_states=True
    )
    return lm_head_logprobs(model, out.hidden_states[-1][:, -T - 1 : -1], input_ids[:, -T:], temperature, entropy)


def position_scores(model, input_ids, attention_mask) -> torch.Tensor:
    """A sequence-classification model's scalar head at every position [B, L] (a reward model, a critic), the
    forward through the DDP/FSDP2 wrapper, so that its gradients are synced as the policy's are."""
    out = model(
        input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask), output_hidden_states=True
    )
    return unwrap(model).score(out.hidden_states[-1]).squeeze(-1).float()


def score_at_last_token(model, input_ids, attention_mask) -> torch.Tensor:
    """r_ϕ(x, y) [B]: a reward model's scalar head at each row's last real token (any padding)."""
    last = attention_mask.shape[1] - 1 - attention_mask.flip(1).argmax(1)
    return position_scores(model, input_ids, attention_mask)[torch.arange(len(last)), last]


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log π(y_t | ·) = log softmax(logits / τ)[y_t]: logits [B,T,V], tokens [B,T] → [B,T]; as gather − logsumexp
    in fp32 (τ divides fp32 logits, as sampling does), so no [B,T,V] log-softmax is materialised."""
    logits = logits.float() / temperature
    return logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def lm_head_logprobs(model, hidden: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, entropy=False):
    """token_logprobs(W·h, y, T) for hidden states h [B,T,H] through the LM head W, a chunk of positions at a
    time, recomputed in backward: the [B,T,V] logits are never all in memory. entropy: also H_t (no gradient)."""
    head = unwrap(model).get_output_embeddings()

    def chunk(h, y):
        logits = head(h)
        if not entropy:
            return token_logprobs(logits, y, temperature)
        with torch.no_grad():
            logp = (logits.float() / temperature).log_softmax(-1)
        return token_logprobs(logits, y, temperature), -(logp.exp() * logp).sum(-1)

    n = max(1, LOGITS_CHUNK // head.weight.shape[0])  # positions a chunk
    out = [
        recompute(chunk, h, y, use_reentrant=False)
        for h, y in zip(hidden.flatten(0, 1).split(n), tokens.flatten().split(n))
    ]
    if not entropy:
        return torch.cat(out).view_as(tokens)
    return tuple(torch.cat(part).view_as(tokens) for part in zip(*out))


@torch.no_grad()
def generate_exactly(
    model, prompt_ids, prompt_mask, tokenizer, eos_ids, max_new_tokens, temperature=0.0, static_cache=False, n=1
) -> torch.Tensor:
    """[prompt | completion] ids: n completions of each left-padded prompt from exactly softmax(logits / τ), the
    π_θ of every log-prob here (greedy at τ = 0), each ending at its first EOS. The model's generation_config
    (top_k, top_p, … on hub chat models) is set aside for the call. static_cache: a preallocated KV cache."""
    sharded = isinstance(model, FSDPModule)  # FSDP2: every process must run each decoding step (synced_gpus)
    model = unwrap(model)  # LoRA: generate() reads the inner model's generation_config
    config = GenerationConfig(do_sample=temperature > 0, max_new_tokens=max_new_tokens, num_return_sequences=n)
    if temperature:  # exactly softmax(logits / τ): top_k 0 and top_p 1 turn generate()'s top-50 default off
        config.update(temperature=temperature, top_k=0, top_p=1.0)
    config.update(pad_token_id=tokenizer.pad_token_id, eos_token_id=[int(i) for i in eos_ids])
    config.cache_implementation = "static" if static_cache else None
    own, model.generation_config = model.generation_config, config
    try:
        return model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, synced_gpus=sharded)
    finally:
        model.generation_config = own


# -------------------------------------------------- the run: start, steps, checkpoints, the end
def start_run(args: Args, script: str) -> SimpleNamespace:
    """--resume's checkpoint and flags found, DEFAULTS filled in, flags checked, seeds set, torchrun's processes
    joined. Returns `run`: rank, world, device, the checkpoint and its state (None: a fresh run), the logs."""
    run = SimpleNamespace(script=script, t_start=time.time(), stop=[], metrics_file=None, wandb=None, rank=0, world=1)
    # peft reads transformers' deprecated is_gradient_checkpointing at every LoRA model: peft's warning, not the user's
    warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
    run.checkpoint, run.state = load_checkpoint(args)
    run.last_checkpoint = run.checkpoint
    resolve_defaults(args)
    check_args(args)
    for path in {args.model, getattr(args, "reward_model", None)} & set(STAGES):  # the stage before not run yet?
        if not any(os.path.isfile(os.path.join(path, name)) for name in ("config.json", "adapter_config.json")):
            fail(f"{path} not found: run `python {STAGES[path]}` first (or pass another model)")
    try:
        os.makedirs(args.output_dir, exist_ok=True)
    except OSError as e:
        fail(f"cannot write to {args.output_dir}: {e.strerror or e}")
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    run.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if "RANK" in os.environ:  # torchrun: one process per device, NCCL on CUDA, gloo on the CPU
        run.device = torch.device(f"cuda:{os.environ['LOCAL_RANK']}" if run.device.type == "cuda" else "cpu")
        if run.device.type == "cuda":
            torch.cuda.set_device(run.device)
        dist.init_process_group("nccl" if run.device.type == "cuda" else "gloo")
        run.rank, run.world = dist.get_rank(), dist.get_world_size()
    if run.rank:  # only the first process prints, logs and saves
        sys.stdout = open(os.devnull, "w")
    saved = run.state or dict(run_name=args.run_name or f"{script}__{args.seed}__{int(time.time())}", wandb_id=None)
    run.name, run.wandb_id = saved["run_name"], saved["wandb_id"]
    run.first_eval, run.shown = saved.get("first_eval"), saved.get("shown")  # shown: the samples each eval prints
    return run


def begin_training(args: Args, run: SimpleNamespace, model, optimizer, schedule, n_rows: int, step_rows: int):
    """The logs open, --resume puts back the optimiser, schedule, data position and RNG, signals now stop the run
    at the step's end. Returns the endless batches of `step_rows` row indices, and the steps left as a progress bar."""
    if n_rows < step_rows:
        fail(f"{n_rows} training rows are fewer than one step takes ({step_rows}, over all processes)")

    def counted(batches):  # a resumed run skips as many as were drawn (GRPO's --dynamic-sampling draws extra)
        for batch in batches:
            run.batches_drawn += 1
            yield batch

    run.batches_drawn, batches = 0, counted(common.shuffled_batches(n_rows, step_rows, args.seed))
    step = run.state["step"] if run.state else 0
    if run.state:
        if len(run.state["rng"]) != run.world:
            fail(f"{run.checkpoint} was written by {len(run.state['rng'])} processes; resume it with as many")
        dcp.set_optimizer_state_dict(model, optimizer, run.state["optimizer"], options=FULL_STATE)
        schedule.load_state_dict(run.state["schedule"])
        for _ in range(run.state.get("batches_drawn", step)):  # before 2026-12-07: one a step
            next(batches)
        rng = run.state["rng"][run.rank]
        torch.set_rng_state(rng["torch"])
        torch.cuda.set_rng_state_all(rng["cuda"])  # [] on the CPU
        random.setstate(rng["python"])
        print(f"resuming from {run.checkpoint} (step {step})")
    if run.rank == 0:  # runs/<name>/: the flags as resolved, and metrics.jsonl without the rows after the checkpoint
        os.makedirs(f"runs/{run.name}", exist_ok=True)
        with open(f"runs/{run.name}/args.json", "w") as f:
            json.dump(asdict(args), f, indent=1)
        path = f"runs/{run.name}/metrics.jsonl"
        rows = open(path).read().splitlines() if run.state and os.path.exists(path) else []
        run.metrics_file = open(path, "w")
        run.metrics_file.writelines(r + "\n" for r in rows if r.endswith("}") and json.loads(r)["step"] <= step)
    if args.track and run.rank == 0:
        import wandb

        where = dict(project=args.wandb_project, entity=args.wandb_entity, id=run.wandb_id, resume="allow")
        run.wandb = wandb.init(name=run.name, config=asdict(args), **where)

    def on_signal(signum, frame):  # finish the step, checkpoint, exit 0; a second signal stops at once
        run.stop.append(signal.Signals(signum).name)
        signal.signal(signum, signal.SIG_DFL)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    total = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    where = f"on {run.device} × {run.world}, {'bf16 autocast' if args.bf16 else 'fp32'}"
    print(f"model: {total / 1e6:.2f}M parameters ({100 * trained / total:.2f}% trained) {where}")
    if not run.state:
        log(run, {"train/trainable_parameters": trained, "train/parameters": total}, 0)
    bar = tqdm(range(step + 1, args.steps + 1), desc=run.script, dynamic_ncols=True, disable=run.rank > 0 or None)
    return batches, bar


def process_share(step_batch: list, run: SimpleNamespace, size: int, micro_batch: int = 0) -> list:
    """This process's `size` rows (or indices) of a step's batch: micro-batch k of process r is slice k·world + r."""
    return step_batch[(micro_batch * run.world + run.rank) * size :][:size]


def gradient_sync(*models, last: bool):
    """DDP all-reduces gradients in every backward pass; over a step's micro-batches only the last needs it."""
    stack = contextlib.ExitStack()
    for model in models:
        if isinstance(model, DDP) and not last:
            stack.enter_context(model.no_sync())
    return stack


def lr_schedule(optimizer, warmup_steps: int, steps: int, decay: bool):
    """Linear warm-up over warmup_steps (0: none), then constant, or with decay linearly down to 0 at the end."""

    def factor(s: int) -> float:
        if s < warmup_steps:
            return (s + 1) / warmup_steps
        if not decay:
            return 1.0
        return max(0.0, (steps - s) / max(1, steps - warmup_steps))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def log(run: SimpleNamespace, metrics: dict, step: int, samples: list[dict] | None = None):
    """A row of runs/<name>/metrics.jsonl (first process only) and, with --track, of wandb (samples: a table)."""
    if run.rank:
        return
    row = {"step": step, **metrics, "time/elapsed_s": round(time.time() - run.t_start, 3)}
    run.metrics_file.write(json.dumps(row) + "\n")
    run.metrics_file.flush()
    if run.wandb:
        import wandb

        if samples:
            metrics = {**metrics, "samples": wandb.Table(columns=[*samples[0]], data=[[*s.values()] for s in samples])}
        run.wandb.log(metrics, step=step)


def log_eval(run: SimpleNamespace, step: int, metrics: dict, samples: list[dict]) -> dict:
    """Held-out metrics and a few samples (the same prompts each time: common.shown_samples), logged and printed."""
    run.shown = run.shown or common.shown_samples(samples)
    run.first_eval = run.first_eval or metrics
    samples = [{**samples[i], "verdict": common.describe(samples[i])} for i in run.shown]
    log(run, metrics, step, samples)
    for sample in samples:
        tqdm.write(f"  {common.sample_line(sample)}")
    tqdm.write(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    return metrics


def optimizer_step(args: Args, run: SimpleNamespace, step: int, models: list, optimizer) -> float:
    """Clips each model's gradient norm to --max-grad-norm and steps; a NaN/inf norm (synced: the same in every
    process) stops the run, naming the last good checkpoint. Returns the norm (summed)."""
    norms = [torch.nn.utils.clip_grad_norm_(m.parameters(), args.max_grad_norm) for m in models]
    grad_norm = sum(n.full_tensor() if hasattr(n, "full_tensor") else n for n in norms).item()  # FSDP2: DTensors
    if not math.isfinite(grad_norm):
        last = run.last_checkpoint or "none"
        sys.exit(
            f"error: non-finite gradient norm ({grad_norm}) at step {step}; last good checkpoint: {last}. Lower --lr"
        )
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def maybe_checkpoint(args: Args, run, step: int, model, tokenizer, optimizer, schedule, extra=dict):
    """A checkpoint every --save-every steps and on a stop signal to any process (then exit 0), holding `extra()`."""
    stopping = over_processes({"stop": float(bool(run.stop))}, run.device, "max")["stop"]  # one signalled: all stop
    if (args.save_every and step % args.save_every == 0) or stopping:
        wandb_id = run.wandb.id if run.wandb else None
        state = dict(run_name=run.name, wandb_id=wandb_id, first_eval=run.first_eval, shown=run.shown, **extra())
        state["batches_drawn"] = run.batches_drawn
        state["schedule"] = schedule.state_dict()
        run.last_checkpoint = save_checkpoint(args, step, model, tokenizer, optimizer, state)
    if stopping:
        signal_name = run.stop[0] if run.stop else "a signal to another process"
        print(f"stopped by {signal_name} after step {step}; saved {run.last_checkpoint}; continue with --resume latest")
        sys.exit(0)


def finish_run(args: Args, run: SimpleNamespace, model, tokenizer, last_eval: dict):
    """Saves the trained model in output_dir, prints the held-out metrics before → after, closes the logs."""
    save_final_model(model, tokenizer, args)
    changes = ", ".join(f"{k} {run.first_eval[k]:.4f} → {last_eval[k]:.4f}" for k in last_eval)
    print(f"held-out {changes}; saved to {args.output_dir}")
    if run.metrics_file:
        run.metrics_file.close()
    if run.wandb:
        run.wandb.finish()


# -------------------------------------------------- torchrun: DDP or FSDP2, values over processes
def wrap(model, args: Args, device):
    """Under torchrun DDP (gradients averaged), or with --fsdp FSDP2 (each decoder layer sharded); else as it is."""
    if not dist.is_initialized():
        return model
    if args.fsdp:
        for module in model.modules():
            if type(module).__name__ in (model._no_split_modules or []):
                fully_shard(module)
        return fully_shard(model)
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)


def over_processes(values: dict, device, op: str = "mean") -> dict:
    """Each value's mean (or min, max) over all processes (one process: the values)."""
    if not dist.is_initialized():
        return values
    t = torch.tensor(list(values.values()), dtype=torch.float64, device=device)
    dist.all_reduce(t, op={"mean": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[op])
    return dict(zip(values, (t / dist.get_world_size() if op == "mean" else t).tolist()))


def gather_lists(items: list) -> list:
    """Every process's `items`, concatenated in rank order: the same list in every process (one: `items`)."""
    if not dist.is_initialized():
        return items
    shares = [None] * dist.get_world_size()
    dist.all_gather_object(shares, items)
    return [item for share in shares for item in share]


# -------------------------------------------------- saving: checkpoints, resume, the final model
def save_model(model, tokenizer, path: str, args: Args):
    """A plain transformers directory, written by rank 0 (under FSDP2 every process helps gather the weights)."""
    weights = None
    if args.fsdp and dist.is_initialized():
        weights = dcp.get_model_state_dict(model, options=FULL_STATE)
        # a tied parameter (embeddings = LM head) is saved once, under its first name, as transformers does
        tied = {n for n, _ in model.named_parameters(remove_duplicate=False)} - {n for n, _ in model.named_parameters()}
        weights = {k: v for k, v in weights.items() if k not in tied}
    if not dist.is_initialized() or dist.get_rank() == 0:
        model.save_pretrained(path, state_dict=weights)
        tokenizer.save_pretrained(path)


def save_final_model(model, tokenizer, args: Args):
    """The model (LoRA: the adapter; --merge-lora: merged, the adapter in adapter/) written to output_dir/final.tmp,
    then moved over the previous model's files: a failed write (disk full) leaves the previous model whole."""
    tmp, main_process = os.path.join(args.output_dir, "final.tmp"), not dist.is_initialized() or dist.get_rank() == 0
    try:
        if main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        if args.merge_lora and hasattr(model, "merge_and_unload"):  # a LoRA (peft) model
            save_model(model, tokenizer, os.path.join(tmp, "adapter"), args)
            # W ← W + (α/r)·B·A in fp32 (the frozen W is bf16 under --bf16, whose sum would round small updates away)
            model = model.float().merge_and_unload()
        save_model(model, tokenizer, tmp, args)
        if main_process:
            new = os.listdir(tmp)
            for name in os.listdir(args.output_dir):  # the previous model's files (not its checkpoints)
                path = os.path.join(args.output_dir, name)
                if name in new or name == "adapter" or os.path.isfile(path):
                    shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
            for name in new:
                os.replace(os.path.join(tmp, name), os.path.join(args.output_dir, name))
            os.rmdir(tmp)
    except Exception as e:
        write_failed(tmp, e, args.output_dir)


def checkpoints(output_dir: str) -> list[str]:
    """Complete checkpoints in output_dir, oldest first (`checkpoint-N.tmp` is a write that was cut short)."""
    names = os.listdir(output_dir) if os.path.isdir(output_dir) else []
    steps = sorted(int(n.split("-")[1]) for n in names if re.fullmatch(r"checkpoint-\d+", n))
    return [os.path.join(output_dir, f"checkpoint-{s}") for s in steps]


def save_checkpoint(args: Args, step: int, model, tokenizer, optimizer, state: dict) -> str:
    """output_dir/checkpoint-<step>/: the models, loadable (a ModuleDict's others in subdirectories), and
    trainer_state.pt; written to a .tmp directory and renamed, so a kill at any moment leaves the previous whole."""
    path = os.path.join(args.output_dir, f"checkpoint-{step}")
    main_process = not dist.is_initialized() or dist.get_rank() == 0
    models = list(model.items()) if isinstance(model, torch.nn.ModuleDict) else [("", model)]
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    rngs = gather_lists([{"torch": torch.get_rng_state(), "python": random.getstate(), "cuda": cuda}])
    try:
        if main_process:
            shutil.rmtree(path + ".tmp", ignore_errors=True)
        for i, (name, m) in enumerate(models):
            save_model(m, tokenizer, os.path.join(path + ".tmp", name if i else ""), args)
        optimizer_state = dcp.get_optimizer_state_dict(model, optimizer, options=FULL_STATE)  # by name, unsharded
        if main_process:
            state |= dict(
                optimizer=optimizer_state, step=step, args=asdict(args), rng=rngs, script=os.path.basename(__file__)
            )
            torch.save(state, os.path.join(path + ".tmp", "trainer_state.pt"))
            shutil.rmtree(path, ignore_errors=True)
            os.replace(path + ".tmp", path)
            for old in checkpoints(args.output_dir)[: -args.keep_checkpoints]:
                shutil.rmtree(old)
    except Exception as e:  # disk full, permissions: one line, the previous checkpoint stays whole
        write_failed(path + ".tmp", e, args.output_dir)
    if dist.is_initialized():
        dist.barrier()
    return path


def load_checkpoint(args: Args) -> tuple[str | None, dict | None]:
    """--resume: the given checkpoint directory, or `latest` in output_dir (none yet: start afresh). The run's
    flags come from the checkpoint, except RESUME_FLAGS; a run that already reached --steps stops here."""
    path = args.resume
    if path == "latest":
        path = checkpoints(args.output_dir)[-1] if checkpoints(args.output_dir) else None
        if path is None:
            print(f"note: no checkpoint in {args.output_dir} yet; starting from scratch")
    if path is None:
        return None, None
    file = os.path.join(path, "trainer_state.pt")
    if not os.path.isfile(file):
        fail(f"--resume {path}: not a checkpoint directory (no trainer_state.pt)")
    try:
        state = torch.load(file, weights_only=True)
    except Exception as e:
        fail(f"--resume {path}: {file} is corrupt or cut short ({common.error_reason(e)})")
    if state["script"] != os.path.basename(__file__):
        fail(f"--resume {path}: that checkpoint was written by {state['script']}, not {os.path.basename(__file__)}")
    defaults = Args()  # a RESUME_FLAGS flag left at its default is the run's own too
    for name, saved in state["args"].items():
        if name not in RESUME_FLAGS or getattr(args, name) in (None, getattr(defaults, name)):
            setattr(args, name, saved)
    changed = [n for n in RESUME_FLAGS[1:] if getattr(args, n) != state["args"][n]]
    flags = ", ".join(f"--{n.replace('_', '-')} {getattr(args, n)}" for n in changed)
    print(f"resuming with the flags {path} was run with" + (f", but {flags}" if flags else ""))
    if state["step"] >= args.steps:
        print(f"{path} is at step {state['step']}: the run already reached --steps {args.steps}; nothing to do")
        sys.exit(0)
    return path, state


# -------------------------------------------------- flags and user errors
def check_args(args: Args):
    """Flag values that would go silently wrong (every script's, then the method's) stop the run with one line."""
    for name in POSITIVE + NON_NEGATIVE + METHOD_POSITIVE + METHOD_NON_NEGATIVE:
        value, positive = getattr(args, name), name in POSITIVE + METHOD_POSITIVE
        if not math.isfinite(value) or value < 0 or (value == 0 and positive):
            fail(f"--{name.replace('_', '-')} must be {'positive' if positive else '0 or positive'} (got {value})")
    lora = args.lora_r > 0
    for broken, message in [
        (not 0 <= args.lora_dropout < 1, f"--lora-dropout must be in [0, 1) (got {args.lora_dropout})"),
        (lora and args.fsdp, "--lora-r with --fsdp is not supported: under torchrun, LoRA trains with DDP"),
        (lora and not args.model, "--lora-r trains adapters on a pretrained model: pass --model"),
        (
            lora and args.model and os.path.abspath(args.output_dir) == os.path.abspath(args.model),
            f"--output-dir {args.output_dir} is the model being adapted, which its adapter needs; pass another",
        ),
        *method_rules(args),
    ]:
        if broken:
            fail(message)


def resolve_defaults(args: Args):
    """Flags left at None take DEFAULTS' value for the built-in task (its data and tiny model) or a pretrained model."""
    builtin = args.dataset == "arithmetic" and common.is_builtin_model(args.model)
    taken = []
    for name, values in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, values[0] if builtin else values[1])
            taken.append(f"--{name.replace('_', '-')} {getattr(args, name)}")
    which = "the built-in task's defaults" if builtin else "defaults for a pretrained model"
    print(f"{which}: {', '.join(taken) or 'none (every such flag was given)'}")


def fail(message: str):
    """A user error: one line on stderr, exit code 2, no traceback."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def write_failed(path: str, e: Exception, output_dir: str):
    """A failed write (disk full): its partial directory goes, and one line names the last complete checkpoint."""
    shutil.rmtree(path, ignore_errors=True)
    last = (checkpoints(output_dir) or ["none"])[-1]
    sys.exit(
        f"error: could not write {path} ({common.error_reason(e)}); the files already in {output_dir} are "
        f"untouched; last complete checkpoint: {last}"
    )


if __name__ == "__main__":
    table = "\n".join(f"  --{n.replace('_', '-'):<22} {a!s:<14} {b}" for n, (a, b) in DEFAULTS.items())
    header = "\n\nDefaults that depend on the run (a flag given always wins; where TRL 1.16's differ, docs/running.md says why):"
    header += f"\n  {'flag':<22} {'built-in task':<14} pretrained model"
    args = tyro.cli(Args, description=__doc__ + header + "\n" + table)
    try:
        main(args)
    except common.DataError as e:
        fail(str(e))
    # Only now, with main()'s DDP wrapper freed: had its reducer dropped the last reference to the process
    # group, the group's threads would be joined while holding the GIL they may need (a hang at exit).
    if dist.is_initialized():
        dist.destroy_process_group()
