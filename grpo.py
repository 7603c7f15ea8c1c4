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

import math
import time
from dataclasses import dataclass
from typing import Literal

import torch

import common


@dataclass
class Args:
    # models and data
    model: str = "models/sft"
    """policy to start from (hub id or path); also the frozen reference π_ref"""
    reward_model: str | None = None
    """score completions with this sequence-classification model instead of checking answers"""
    dataset: str = "arithmetic"
    """`arithmetic` (built-in), `openai/gsm8k`, another hub id, or a local .jsonl/.json/.parquet prompt file"""
    dataset_config: str | None = None
    """the hub dataset's configuration name, if it has several"""
    max_prompt_length: int = 512
    """prompts are left-truncated to this many tokens"""
    output_dir: str = "models/grpo"
    """where the trained policy and tokenizer are saved"""
    trust_remote_code: bool = False
    """allow model repositories to run their own code"""
    # sampling: G completions per prompt at temperature T
    prompts_per_step: int | None = None
    """prompts sampled per round and process (each prompt's whole group stays in its process) (default: by run, see the table above)"""
    group_size: int = 8
    """G: completions sampled per prompt"""
    temperature: float | None = None
    """sampling temperature (log-probs are computed at the same temperature) (default: by run, see the table above)"""
    max_new_tokens: int | None = None
    """completion length limit (default: by run, see the table above)"""
    static_cache: bool = False
    """sample with a static (preallocated) KV cache; on CUDA transformers then compiles the decoding step: faster after a slow first call, the same distribution"""
    # the objective: clipped ratio ρ, KL to π_ref, advantages Â
    clip_eps: float = 0.2
    """ε: the ratio ρ is clipped to [1−ε, 1+ε_h]"""
    clip_eps_high: float | None = None
    """ε_h, DAPO's clip-higher (e.g. 0.28): a larger upper clip lets unlikely tokens gain probability (None: ε)"""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """token: ρ per token (GRPO); sequence: GSPO's length-normalised sequence ratio for every token of a completion"""
    beta: float = 0.04
    """β: weight of the k3 KL penalty to the reference (0 skips the reference model)"""
    loss_type: Literal["grpo", "dapo", "dr_grpo"] = "grpo"
    """grpo: mean of per-sequence token means; dapo: mean over all tokens; dr_grpo: sum / (B · max_new_tokens)"""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """divide advantages by the reward std of each group (DeepSeekMath), of the whole batch, or not at all (Dr. GRPO)"""
    mask_truncated_completions: bool = False
    """completions cut at --max-new-tokens without an EOS contribute no loss (DAPO's overlong filtering)"""
    dynamic_sampling: bool = False
    """drop groups whose rewards are all equal and sample more prompts until the step has --prompts-per-step groups (DAPO)"""
    max_sampling_rounds: int = 4
    """with --dynamic-sampling: rounds of sampling at most per step; short of groups then, the step trains on those it has"""
    format_reward: float = 0.0
    """bonus for a completion that ends with EOS and contains a number (rule-based rewards only)"""
    # optimisation
    steps: int | None = None
    """optimisation rounds; each samples prompts_per_step × group_size completions (default: by run, see the table above)"""
    num_iterations: int = 1
    """μ: optimiser steps on each generated batch (1: old log-probs are the current ones, detached)"""
    grad_accum_steps: int | None = None
    """micro-batches per optimiser step: the round's prompts_per_step × group_size sequences go through forward and backward in this many parts, gradients summed (less memory) (default: by run, see the table above)"""
    lr: float | None = None
    """learning rate (AdamW) (default: by run, see the table above)"""
    warmup_steps: int | None = None
    """linear warm-up steps (default: by run, see the table above)"""
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
    """names of the modules that get adapters (all-linear: every linear layer of the decoder, not the LM head)"""
    merge_lora: bool = False
    """with --lora-r: save merged full weights W + (α/r)·B·A in output_dir (the adapter in output_dir/adapter) instead of the adapter alone"""
    # run: precision, processes, logging, checkpoints
    seed: int = 1
    """seed for torch, python and numpy"""
    bf16: bool = torch.cuda.is_available()
    """bf16 autocast with fp32 master weights, the reference held in bf16 (default: on with CUDA; on the CPU it emulates the GPU's numerics, slowly)"""
    fsdp: bool = False
    """under torchrun: shard parameters, gradients and optimiser state with FSDP2 instead of replicating (DDP)"""
    gradient_checkpointing: bool = False
    """recompute activations during the backward pass: much less memory for long sequences, one more forward pass of compute"""
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
    """continue from this checkpoint directory, or `latest` (the newest in output_dir; none yet: start afresh)"""
    skip_nonfinite: bool = False
    """skip optimiser steps whose loss or gradient norm is NaN/inf (counted) instead of stopping"""


# The flags left at None above take a default that depends on the run: the built-in task's tuned value, or, with
# any other dataset or model, one fit for a pretrained model (TRL's recommended value where TRL has one). A flag
# given on the command line always wins; --help lists both sets; the run prints which it used.
DEFAULTS = {  # flag: (built-in task, pretrained model)
    "steps": (60, 300),
    "prompts_per_step": (64, 8),
    "temperature": (0.7, 1.0),
    "max_new_tokens": (8, 256),
    "grad_accum_steps": (2, 8),
    "lr": (2e-4, 1e-6),
    "warmup_steps": (10, 0),
}


# ---------------------------------------------------------------- the math
def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log π(y_t | ·) of the given tokens at sampling temperature T: logits [B,T,V], tokens [B,T] → [B,T].

    Equals (logits / T).log_softmax(-1).gather(-1, tokens) but computed as gather − logsumexp in fp32 (T
    divides the fp32 logits, as sampling does, not bf16 ones), a few rows at a time, so the full [B,T,V]
    fp32 log-softmax is never materialised."""
    rows = max(1, 2**26 // max(1, logits.shape[1] * logits.shape[2]))
    out = []
    for lg, tk in zip(logits.split(rows), tokens.split(rows)):
        lg = lg.float() / temperature
        out.append(lg.gather(-1, tk.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(lg, dim=-1))
    return torch.cat(out)


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
def forward_logps(model, input_ids, attention_mask, completion_ids, temperature: float, entropy: bool = False):
    """log π(y_t) of each completion token [B,T] at the sampling temperature; the hidden state at t predicts t+1.
    entropy=True: (log π(y_t), the entropy of π(·|x, y_<t)), the latter a metric without gradient."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # left padding must not shift positions
    T = completion_ids.shape[1]
    # the body's last hidden states (logits for one position only), then the LM head a chunk at a time
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        logits_to_keep=1,
        output_hidden_states=True,
    )
    return lm_head_logprobs(model, out.hidden_states[-1][:, -T - 1 : -1], completion_ids, temperature, entropy)


def completion_mask(completion_ids: torch.Tensor, eos_ids: torch.Tensor) -> torch.Tensor:
    """1 up to and including the first EOS (any of eos_ids), 0 after: built from positions, so pad == EOS is harmless."""
    is_eos = torch.isin(completion_ids, torch.as_tensor(eos_ids, device=completion_ids.device)).long()
    return ((is_eos.cumsum(1) - is_eos) == 0).long()


@torch.no_grad()
def generate(model, prompt_ids, prompt_mask, tokenizer, eos_ids: torch.Tensor, args: Args, greedy: bool = False):
    """Completions [B,T] from π_θ/T exactly (KV cache, left-padded prompts), their mask, and whether each
    ended with an EOS (any of eos_ids) rather than at the length limit."""
    temperature = 0.0 if greedy else args.temperature
    out = generate_exactly(
        model, prompt_ids, prompt_mask, tokenizer, eos_ids, args.max_new_tokens, temperature, args.static_cache
    )
    completion_ids = out[:, prompt_ids.shape[1] :]
    mask = completion_mask(completion_ids, eos_ids)
    ended = torch.isin(completion_ids, eos_ids).any(1)  # a row cut by the limit has no padding: pad == EOS is harmless
    return completion_ids * mask + tokenizer.pad_token_id * (1 - mask), mask, ended


@torch.no_grad()
def score(rows, texts, input_ids, attention_mask, ended, reward_model, rm_tokenizer, args: Args) -> torch.Tensor:
    """r_i [B]: answer correctness (+ a format bonus for a number before EOS), or the reward model's score."""
    if reward_model is not None:
        return reward_model_scores(reward_model, rm_tokenizer, input_ids, attention_mask, rows, texts, ended, args)
    rewards = []
    for row, text, done in zip(rows, texts, ended.tolist()):
        try:
            bonus = args.format_reward * float(done and common.last_number(text) is not None)
            rewards.append(float(common.is_correct(text, row["answer"])) + bonus)
        except Exception as e:
            fail(f"the reward function failed on completion {text!r} (prompt {row['prompt']!r}): {e!r}")
    return torch.tensor(rewards, device=input_ids.device)


@torch.no_grad()
def sample_groups(policy, tokenizer, eos_ids, rows, reward_model, rm_tokenizer, args: Args, device, autocast) -> dict:
    """One round of steps 1–2: a completion of each row from π_θold (rows i*G … i*G+G-1: one prompt's group) and
    its reward r_i, as per-sequence lists: prompt ids, completion ids (to the first EOS), ended (with an
    EOS, not cut by the length limit), rewards."""
    prompts = common.tokenize_prompts(tokenizer, rows, args.max_prompt_length)
    prompt_ids, prompt_mask = (t.to(device) for t in common.pad(prompts, tokenizer.pad_token_id, "left"))
    policy.eval()
    with autocast:
        completion_ids, mask, ended = generate(policy, prompt_ids, prompt_mask, tokenizer, eos_ids, args)
        texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        input_ids, attention_mask = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, mask], 1)
        rewards = score(rows, texts, input_ids, attention_mask, ended, reward_model, rm_tokenizer, args)
    policy.train()
    completions = [ids[:n] for ids, n in zip(completion_ids.tolist(), mask.sum(1).tolist())]
    return {
        "prompts": prompts,
        "completions": completions,
        "ended": ended.tolist(),
        "rewards": rewards.tolist(),
    }


def sample_step(policy, tokenizer, eos_ids, train_rows, batches, reward_model, rm_tokenizer, args: Args, run, autocast):
    """Steps 1–2 of an optimiser step: sample_groups on this process's next N = --prompts-per-step prompts. With
    --dynamic-sampling, groups whose rewards all tie (Â = 0) are dropped and another round sampled, until every
    process has N groups or --max-sampling-rounds is reached; each process then keeps as many as the fewest found
    (the same batch shape everywhere). Returns (every sequence sampled, the kept ones, the rounds sampled)."""
    N, G = args.prompts_per_step, args.group_size
    sampled, kept, rounds = {}, {}, 0
    while True:
        rows = [train_rows[i] for i in process_share(next(batches), run, N) for _ in range(G)]
        new = sample_groups(policy, tokenizer, eos_ids, rows, reward_model, rm_tokenizer, args, run.device, autocast)
        rounds += 1
        keep = informative_groups(torch.tensor(new["rewards"]), G).tolist() if args.dynamic_sampling else [True] * N
        for key, values in new.items():
            sampled[key] = sampled.get(key, []) + values
            kept[key] = kept.get(key, []) + [v for i, v in enumerate(values) if keep[i // G]]
        n_groups = min(N, min_over_processes(len(kept["rewards"]) // G, run.device))
        if not args.dynamic_sampling or n_groups == N or rounds == args.max_sampling_rounds:
            return sampled, {key: values[: n_groups * G] for key, values in kept.items()}, rounds


@torch.no_grad()
def evaluate(
    policy, tokenizer, eos_ids, rows, reward_model, rm_tokenizer, args: Args, device, autocast
) -> tuple[dict, list]:
    """Greedy completions on held-out prompts: accuracy when answers exist, and the mean reward; every sample."""
    policy.eval()
    rewards, texts = [], []
    for i in range(0, len(rows), 128):
        batch_rows = rows[i : i + 128]
        prompts = common.tokenize_prompts(tokenizer, batch_rows, args.max_prompt_length)
        ids, mask = (t.to(device) for t in common.pad(prompts, tokenizer.pad_token_id, "left"))
        with autocast:
            completion_ids, cmask, ended = generate(policy, ids, mask, tokenizer, eos_ids, args, greedy=True)
            batch_texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
            input_ids, attention_mask = torch.cat([ids, completion_ids], 1), torch.cat([mask, cmask], 1)
            r = score(batch_rows, batch_texts, input_ids, attention_mask, ended, reward_model, rm_tokenizer, args)
        rewards, texts = rewards + r.tolist(), texts + batch_texts
    policy.train()
    metrics = {"eval/reward": sum(rewards) / len(rewards)}
    if all(x["answer"] is not None for x in rows):
        metrics["eval/accuracy"] = sum(common.is_correct(t, x["answer"]) for t, x in zip(texts, rows)) / len(rows)
    return metrics, [
        {"prompt": x["prompt"], "completion": t, "answer": x["answer"], "reward": v}
        for x, t, v in zip(rows, texts, rewards)
    ]


def main(args: Args):
    run = start_run(args, "grpo")  # flags checked, --resume found, seeds set, torchrun's processes joined
    autocast = torch.autocast(run.device.type, dtype=torch.bfloat16, enabled=args.bf16)
    tokenizer, policy, ref, reward_model, rm_tokenizer = load_models(args, run)
    trained = wrap(policy, args, run.device)  # the training forward goes through the DDP/FSDP2 wrapper
    # every id that ends a completion (chat models: several)
    eos_ids = torch.tensor(common.eos_token_ids(tokenizer, policy.generation_config), device=run.device)
    if run.world > 1:  # every process samples its own completions
        torch.manual_seed(args.seed + run.rank)

    train_rows = common.load_rows(args.dataset, "train", "prompt", tokenizer, args.dataset_config)
    eval_rows = common.load_rows(args.dataset, "test", "prompt", tokenizer, args.dataset_config)[: args.eval_size]
    if reward_model is None and any(r["answer"] is None for r in train_rows + eval_rows):
        fail(f"dataset '{args.dataset}' has rows without an answer column; pass --reward-model to score completions")
    common.check_prompt_lengths(tokenizer, eval_rows, args.max_prompt_length)
    print(f"{len(train_rows)} train / {len(eval_rows)} held-out prompts from {args.dataset}")

    # fused AdamW: the whole update in one kernel, without foreach's parameter-sized temporaries
    trainable = [p for p in policy.parameters() if p.requires_grad]  # LoRA: the adapters
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0, fused=True)
    schedule = lr_schedule(optimizer, args.warmup_steps, args.steps, decay=False)
    step_rows = args.prompts_per_step * run.world
    batches, progress = begin_training(args, run, policy, optimizer, schedule, len(train_rows), step_rows)
    # --dynamic-sampling's extra rounds draw more batches: on resume, the data position is one a step plus these
    run.extra_batches = run.state.get("extra_batches", 0) if run.state else 0
    for _ in range(run.extra_batches):
        next(batches)

    def run_eval(step: int) -> dict:
        metrics, samples = evaluate(
            policy, tokenizer, eos_ids, eval_rows, reward_model, rm_tokenizer, args, run.device, autocast
        )
        return log_eval(run, step, metrics, samples)

    start = end = run.state["start"] if run.state else run_eval(0)
    G = args.group_size
    objective = dict(
        clip_eps=args.clip_eps,
        clip_eps_high=args.clip_eps_high,
        importance_sampling_level=args.importance_sampling_level,
        beta=args.beta,
        loss_type=args.loss_type,
        max_completion_length=args.max_new_tokens,
    )
    for step in progress:
        # 1. sample G completions for each of this process's N prompts from π_θold (the current policy) and
        # 2. score them (r_i); --dynamic-sampling: groups whose rewards all tie are dropped and more prompts sampled
        t0 = time.time()
        sampled, kept, rounds = sample_step(
            policy, tokenizer, eos_ids, train_rows, batches, reward_model, rm_tokenizer, args, run, autocast
        )
        gen_time, n_groups = time.time() - t0, len(kept["rewards"]) // G
        run.extra_batches += rounds - 1
        totals, grad_norm = {"loss": 0.0, "kl": 0.0, "clip_fraction": 0.0, "entropy": 0.0}, 0.0
        if n_groups == 0:
            common.warn_once(
                f"every group's rewards tied in {rounds} rounds of sampling: such a step trains on nothing"
            )
        else:
            batch = common.collate(kept["prompts"], kept["completions"], tokenizer.pad_token_id)
            names = ("input_ids", "attention_mask", "completion_ids", "completion_mask")
            input_ids, attention_mask, completion_ids, mask = (batch[k].to(run.device) for k in names)
            ended = torch.tensor(kept["ended"], device=run.device)
            # group-relative advantages Â_i (over every process's groups: --scale-rewards batch takes the whole batch's std)
            rewards = gather_over_processes(torch.tensor(kept["rewards"], device=run.device))
            advantages = group_advantages(rewards, G, scale=args.scale_rewards).view(run.world, -1)[run.rank]
            loss_mask = overlong_filter(mask, ended) if args.mask_truncated_completions else mask

            # 3. reference (and, for μ > 1, old) log-probs: once per batch, without gradients
            size = math.ceil(len(input_ids) / args.grad_accum_steps)  # sequences per forward/backward pass
            micro = [slice(i, i + size) for i in range(0, len(input_ids), size)]
            rollout = [(input_ids[s], attention_mask[s], completion_ids[s]) for s in micro]
            ref_logps = old_logps = None
            with torch.no_grad(), autocast:
                if args.beta != 0:
                    with reference_policy(policy, ref) as pi_ref:
                        ref_logps = [forward_logps(pi_ref, *r, args.temperature) for r in rollout]
                if args.num_iterations > 1:
                    old_logps = [forward_logps(policy, *r, args.temperature) for r in rollout]

            # 4. μ optimiser steps on the clipped objective, gradients accumulated over micro-batches
            # dapo averages over every token of the step, in all processes (DDP averages the processes' gradients)
            batch_tokens = mean_over_processes({"tokens": loss_mask.sum().item()}, run.device)["tokens"]
            for _ in range(args.num_iterations):
                totals = {"loss": 0.0, "kl": 0.0, "clip_fraction": 0.0, "entropy": 0.0}
                for k, s in enumerate(micro):
                    with gradient_sync(trained, last=k == len(micro) - 1):
                        with autocast:
                            logps, entropy = forward_logps(trained, *rollout[k], args.temperature, entropy=True)
                        old = old_logps[k] if old_logps else logps.detach()  # μ = 1: ρ = 1, no extra forward pass
                        ref_k = ref_logps[k] if ref_logps else None
                        loss, stats = grpo_loss(logps, old, ref_k, advantages[s], loss_mask[s], **objective)
                        # each micro-batch's share of the batch loss: its tokens (dapo) or its sequences (grpo, dr_grpo)
                        if args.loss_type == "dapo":
                            weight = loss_mask[s].sum() / max(batch_tokens, 1)
                        else:
                            weight = len(logps) / len(input_ids)
                        (loss * weight).backward()
                    totals["loss"] += loss.item() * float(weight)
                    stats["entropy"] = (entropy * mask[s]).sum() / mask[s].sum()
                    for key in stats:
                        totals[key] += stats[key].item() * len(logps) / len(input_ids)
                totals = mean_over_processes(totals, run.device)
                grad_norm = optimizer_step(args, run, step, [policy], optimizer, totals["loss"])
        schedule.step()

        # 5. log, evaluate, checkpoint (the sampling metrics count every group sampled, kept or not)
        rewards, groups = torch.tensor(sampled["rewards"]), torch.tensor(sampled["rewards"]).view(-1, G)
        totals |= {  # TRL's names
            "grad_norm": grad_norm,
            "lr": schedule.get_last_lr()[0],
            "reward": rewards.mean().item(),
            "reward_std": rewards.std().item(),
            "frac_reward_zero_std": (groups.max(1).values == groups.min(1).values).float().mean().item(),
            "completions/mean_length": sum(map(len, sampled["completions"])) / len(rewards),
            "completions/clipped_ratio": 1 - sum(sampled["ended"]) / len(rewards),  # cut by the length limit, no EOS
            "sampling_rounds": rounds,
            "groups_trained": n_groups,
            "skipped_steps": run.skipped,
            "generation_s": gen_time,
        }
        metrics = mean_over_processes({f"train/{k}": v for k, v in totals.items()}, run.device)
        log(run, metrics, step)
        if metrics["train/completions/clipped_ratio"] > 0.5:
            common.warn_once(
                f"most completions hit the {args.max_new_tokens}-token limit without an EOS: raise --max-new-tokens"
            )
        progress.set_postfix(reward=f"{metrics['train/reward']:.3f}", kl=f"{metrics['train/kl']:.4f}")
        if step % args.eval_every == 0 or step == args.steps:
            end = run_eval(step)
        maybe_checkpoint(
            args, run, step, policy, tokenizer, optimizer, schedule, start, lambda: {"extra_batches": run.extra_batches}
        )

    finish_run(args, run, policy, tokenizer, start, end)


# ======================================================================================================
# Infrastructure: loading models and LoRA adapters, the LM head a chunk at a time, torchrun, checkpoints and
# resume, logging, signals, user errors. Not part of the method: the helpers below that do the same thing in
# several scripts are textually the same in each (tests/test_copies.py checks it).
# ======================================================================================================
# the infrastructure's own imports: here, beside it, so that the top of the file shows what the method needs
import contextlib
import copy
import json
import os
import random
import re
import shutil
import signal
import sys
import warnings
from dataclasses import asdict
from types import SimpleNamespace

import numpy as np
import torch.distributed as dist
import tyro
from safetensors import safe_open
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, GenerationConfig


# -------------------------------------------------- models: loading, LoRA adapters, sampling settings
def load_model(
    path: str, trust_remote_code: bool, cls=AutoModelForCausalLM, output_loading_info: bool = False, **kwargs
):
    """A model in fp32 (master weights) with every dropout probability in its config at 0. A LoRA adapter
    directory loads as its base model with the adapter merged in."""
    if os.path.isfile(os.path.join(path, "adapter_config.json")):
        from peft import PeftConfig, PeftModel  # imported only when LoRA is used: it adds seconds to every start

        adapter = PeftConfig.from_pretrained(path)
        base = load_model(adapter.base_model_name_or_path, trust_remote_code, cls, **kwargs)
        model = PeftModel.from_pretrained(base, path).merge_and_unload()
        trained_head = "score" in (adapter.modules_to_save or [])  # a reward model's adapter carries its head
        return (model, {"missing_keys": [] if trained_head else ["score.weight"]}) if output_loading_info else model
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, **kwargs)
    for key, value in config.to_dict().items():
        if isinstance(value, float) and ("dropout" in key or "pdrop" in key):
            setattr(config, key, 0.0)  # dropout off in every model: log-probs must be deterministic
    return cls.from_pretrained(
        path,
        config=config,
        dtype=torch.float32,
        trust_remote_code=trust_remote_code,
        use_safetensors=True,
        output_loading_info=output_loading_info,
    )


def add_lora(model, args: Args, task_type: str = "CAUSAL_LM", checkpoint: str | None = None):
    """--lora-r > 0: the model's weights W freeze and low-rank adapters train beside them, W + (α/r)·B·A on
    --lora-target-modules (B = 0 at first: the model starts unchanged); a reward model or critic (SEQ_CLS)
    also trains its score head in full. On resume the adapter comes from `checkpoint`. With --bf16 the frozen
    weights are held in bf16, the trainable ones in fp32. --lora-r 0: the model as it is (full fine-tuning)."""
    if not args.lora_r:
        return model
    from peft import LoraConfig, PeftModel, get_peft_model

    if os.path.isdir(model.name_or_path):  # the adapter names its base model: an absolute path loads from anywhere
        model.name_or_path = os.path.abspath(model.name_or_path)
    if checkpoint:
        model = PeftModel.from_pretrained(model, checkpoint, is_trainable=True)
    else:
        targets = args.lora_target_modules
        config = LoraConfig(
            task_type=task_type,
            r=args.lora_r,
            lora_alpha=args.lora_alpha,
            lora_dropout=args.lora_dropout,
            target_modules="all-linear" if targets == ("all-linear",) else list(targets),
        )
        model = get_peft_model(model, config)
    for p in model.parameters():
        if not p.requires_grad:
            p.data = p.data.to(torch.bfloat16 if args.bf16 else torch.float32)
    return model


def unwrap(model):
    """The transformers model inside a LoRA wrapper (its layers carry the adapter), or the model itself."""
    return model.get_base_model() if is_lora(model) else model


def is_lora(model) -> bool:
    """Whether the model carries LoRA adapters (a peft PeftModel: none can exist before peft is imported)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


@contextlib.contextmanager
def reference_policy(policy, ref):
    """π_ref for a block of code: the frozen reference model, or with LoRA (ref None) the policy's own frozen
    base weights, its adapter switched off: one model in memory instead of two."""
    if ref is not None:
        yield ref
    else:
        with policy.disable_adapter():
            yield policy


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
    except (OSError, ValueError):
        print(f"note: {path} has no tokenizer of its own; it reads the policy's token ids")
        return model, None
    if common.same_tokenizer(tokenizer, own):
        return model, None
    print(f"note: the reward model {path} has its own tokenizer: completions are decoded and re-tokenized for it")
    return model, own


@torch.no_grad()
def reward_model_scores(reward_model, rm_tokenizer, input_ids, attention_mask, rows, texts, ended, args: Args):
    """r_ϕ(x, y) [B]: the score head at each row's last real token, minus reward_model.py's centring offset; of
    the policy's ids, or with rm_tokenizer (another vocabulary), of the decoded texts re-tokenized its way."""
    if rm_tokenizer is not None:
        input_ids, attention_mask = (
            t.to(input_ids.device)
            for t in common.retokenize(rm_tokenizer, rows, texts, ended.tolist(), args.max_prompt_length)
        )
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    hidden = getattr(reward_model, reward_model.base_model_prefix)(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
    ).last_hidden_state
    last = attention_mask.shape[1] - 1 - attention_mask.flip(1).argmax(1)  # each row's last real token
    scores = reward_model.score(hidden[torch.arange(len(last)), last]).squeeze(-1).float()
    return scores - getattr(reward_model.config, "reward_offset", 0.0)


def load_models(args: Args, run: SimpleNamespace):
    """The tokenizer, π_θ (from the checkpoint on resume), π_ref (the starting policy, frozen; none when β = 0
    or with LoRA) and r_ϕ with its tokenizer (None: rule-based rewards). Frozen models are held in bf16 with --bf16."""
    check_stage_input(args.model, "models/sft", "sft.py", "--model")
    frozen_dtype = torch.bfloat16 if args.bf16 else torch.float32
    ref, reward_model, rm_tokenizer = None, None, None
    try:
        path = args.model
        tokenizer = common.load_tokenizer(path, trust_remote_code=args.trust_remote_code)
        path = args.model if args.lora_r else run.checkpoint or args.model  # LoRA: the base, then its adapter
        policy = load_model(path, args.trust_remote_code)
        path = run.checkpoint or path
        policy = add_lora(policy, args, checkpoint=run.checkpoint).to(run.device)
        if args.gradient_checkpointing:
            enable_checkpointing(policy)
        if args.beta != 0 and not args.lora_r:  # LoRA: π_ref is the policy with its adapter switched off
            path = args.model
            ref = load_model(path, args.trust_remote_code) if run.checkpoint else copy.deepcopy(policy)
            ref.to(run.device, frozen_dtype).requires_grad_(False).eval()
        if args.reward_model:
            path = args.reward_model
            reward_model, rm_tokenizer = load_reward_model(path, tokenizer, args.trust_remote_code)
            reward_model.to(run.device, frozen_dtype).requires_grad_(False).eval()
    except Exception as e:
        fail(load_failure(path, e))
    return tokenizer, policy, ref, reward_model, rm_tokenizer


def enable_checkpointing(model):
    """--gradient-checkpointing: activations recomputed in the backward pass. Newer transformers call it
    activation_checkpointing_enable (the old name warns that it goes in v6); older ones only have the old name."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


LOGITS_CHUNK = 2**25  # logits (positions × vocabulary) that lm_head_logprobs holds at once: 128 MiB in fp32


def lm_head_logprobs(model, hidden: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, entropy=False):
    """log softmax(W·h_t / T)[y_t]: hidden states h [B,T,H] through the LM head W, tokens y [B,T] → [B,T].

    The same numbers as token_logprobs(model's logits, y, T), but a few positions at a time (LOGITS_CHUNK
    logits), each chunk recomputed in backward (checkpoint): the [B,T,V] logits are never all in memory, nor
    kept for backward (with a 150k vocabulary they dwarf the model's own activations). entropy=True: also the
    entropy H_t = −Σ_v π(v) log π(v) of each position's distribution at T, a metric (no gradient): (logps, H)."""
    head = (model.module if isinstance(model, DDP) else model).get_output_embeddings()
    positions = max(1, LOGITS_CHUNK // head.weight.shape[0])

    def chunk(h, y):
        logits = head(h)[None]
        if not entropy:
            return token_logprobs(logits, y[None], temperature)[0]
        with torch.no_grad():
            logp = (logits.float() / temperature).log_softmax(-1)  # one chunk of positions at a time
            H = -(logp.exp() * logp).sum(-1)[0]
        return token_logprobs(logits, y[None], temperature)[0], H

    out = [
        checkpoint(chunk, h, y, use_reentrant=False)
        for h, y in zip(hidden.flatten(0, 1).split(positions), tokens.flatten().split(positions))
    ]
    if not entropy:
        return torch.cat(out).view_as(tokens)
    return tuple(torch.cat(part).view_as(tokens) for part in zip(*out))


@torch.no_grad()
def generate_exactly(
    model, prompt_ids, prompt_mask, tokenizer, eos_ids, max_new_tokens: int, temperature=0.0, static_cache=False, n=1
) -> torch.Tensor:
    """[prompt | completion] ids: n completions of each left-padded prompt, sampled from exactly softmax(logits / T),
    the π_θ of every log-prob here (greedy at T = 0), each ending at its first EOS (any of eos_ids). The model's
    own generation_config (hub chat models ship top_k, top_p, min_p, repetition_penalty, …) is set aside for the
    call, as generate() merges it into any request; top_k=0 turns off transformers' default of 50. static_cache:
    a preallocated KV cache (on CUDA transformers then compiles the decoding step)."""
    sharded = isinstance(model, FSDPModule)  # FSDP2: every process must run each decoding step (synced_gpus)
    model = unwrap(model)  # LoRA: generate() reads the inner model's generation_config
    own = model.generation_config
    model.generation_config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=[int(i) for i in eos_ids],
        num_return_sequences=n,
        **(dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature else dict(do_sample=False)),
        **(dict(cache_implementation="static") if static_cache else {}),
    )
    try:
        return model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, synced_gpus=sharded)
    finally:
        model.generation_config = own


def start_run(args: Args, script: str) -> SimpleNamespace:
    """What every run does before the method: a signal now exits at once (nothing to save yet), --resume finds
    its checkpoint, the flags left at None take their DEFAULTS, bad flags stop the run with one line, the seeds
    are set and torchrun's processes join.
    Returns `run`: rank, world, device, checkpoint and its state (None on a fresh run), the run's name, and
    what the loop keeps (skipped steps, the last checkpoint, stop signals, the metrics file and wandb)."""
    t_start = time.time()  # every metrics row carries the wall time since here
    on_stop_signal(None)
    # peft reads transformers' deprecated is_gradient_checkpointing at every LoRA model: peft's warning, not the user's
    warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
    checkpoint, state = load_checkpoint(args)  # on resume, the flags not given are the run's own
    resolve_defaults(args)
    check_args(args)
    probe_writable(args.output_dir)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    rank, world, device = init_distributed()
    if rank:  # only the first process prints, logs and saves
        sys.stdout = open(os.devnull, "w")
    name = state["run_name"] if state else args.run_name or f"{script}__{args.seed}__{int(time.time())}"
    return SimpleNamespace(
        script=script,
        rank=rank,
        world=world,
        device=device,
        checkpoint=checkpoint,
        state=state,
        name=name,
        t_start=t_start,
        skipped=state["skipped"] if state else 0,
        shown=state.get("shown") if state else None,  # the held-out samples printed at each evaluation
        last_checkpoint=checkpoint,
        stop=[],
        metrics_file=None,
        wandb=None,
    )


def begin_training(args: Args, run: SimpleNamespace, model, optimizer, schedule, n_rows: int, step_rows: int):
    """Checks that the training rows fill a step, opens the metrics file (and wandb with --track), and on
    --resume puts back the optimiser, the schedule, the data position (the batches already drawn) and each
    process's RNG. From here on a signal finishes the step, saves a checkpoint and exits 0. Prints (and logs
    at step 0) the trainable parameter count. Returns the batches (endless: `step_rows` row indices a step, a
    new shuffle each epoch, the same in every process) and the steps left to run, as a progress bar."""
    if n_rows < step_rows:
        fail(f"{n_rows} training rows are fewer than one step takes ({step_rows}, over all processes)")
    batches = common.shuffled_batches(n_rows, step_rows, args.seed)
    if run.state:
        if len(run.state["rng"]) != run.world:
            fail(f"{run.checkpoint} was written by {len(run.state['rng'])} processes; resume it with as many")
        set_optimizer_state_dict(
            model, optimizer, run.state["optimizer"], options=StateDictOptions(full_state_dict=True)
        )
        schedule.load_state_dict(run.state["schedule"])
        for _ in range(run.state["step"]):
            next(batches)
        restore_rng(run.state["rng"][run.rank])
        print(f"resuming from {run.checkpoint} (step {run.state['step']})")
    if run.rank == 0:
        run.metrics_file = open_metrics(run.name, run.state["step"] if run.state else None)
        with open(f"runs/{run.name}/args.json", "w") as f:  # the flags as resolved: what this run really used
            json.dump(asdict(args), f, indent=1)
    if args.track and run.rank == 0:
        import wandb

        run.wandb = wandb.init(
            project=args.wandb_project,
            entity=args.wandb_entity,
            name=run.name,
            config=asdict(args),
            id=run.state.get("wandb_id") if run.state else None,
            resume="allow",
        )
    on_stop_signal(run.stop)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    precision = "bf16 autocast" if args.bf16 else "fp32"
    print(
        f"model: {total / 1e6:.2f}M parameters ({100 * trainable / total:.2f}% trained) on {run.device} × {run.world}, {precision}"
    )
    if not run.state:
        log(run, {"train/trainable_parameters": trainable, "train/parameters": total}, 0)
    first_step = run.state["step"] + 1 if run.state else 1
    progress = tqdm(
        range(first_step, args.steps + 1), desc=run.script, dynamic_ncols=True, disable=run.rank > 0 or None
    )
    return batches, progress


def process_share(step_batch: list, run: SimpleNamespace, size: int, micro_batch: int = 0) -> list:
    """This process's `size` rows (or indices) of a step's batch: micro-batch k of process r is slice k·world + r."""
    return step_batch[(micro_batch * run.world + run.rank) * size :][:size]


def gradient_sync(model, last: bool):
    """DDP all-reduces gradients in every backward pass; over a step's micro-batches only the last needs it."""
    return model.no_sync() if isinstance(model, DDP) and not last else contextlib.nullcontext()


def lr_schedule(optimizer, warmup_steps: int, steps: int, decay: bool):
    """Linear warm-up over warmup_steps (0: none), then constant or (decay) linearly down to 0 at the last step."""

    def factor(s: int) -> float:
        if s < warmup_steps:
            return (s + 1) / warmup_steps
        return max(0.0, (steps - s) / max(1, steps - warmup_steps)) if decay else 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def log(run: SimpleNamespace, metrics: dict, step: int, samples: list[dict] | None = None):
    """A row of runs/<name>/metrics.jsonl (first process only) and, with --track, of wandb (samples: a table)."""
    if run.rank:
        return
    run.metrics_file.write(
        json.dumps({"step": step, **metrics, "time/elapsed_s": round(time.time() - run.t_start, 3)}) + "\n"
    )
    run.metrics_file.flush()
    if run.wandb:
        import wandb

        table = (
            {"samples": wandb.Table(columns=list(samples[0]), data=[list(s.values()) for s in samples])}
            if samples
            else {}
        )
        run.wandb.log({**metrics, **table}, step=step)


def log_eval(run: SimpleNamespace, step: int, metrics: dict, samples: list[dict]) -> dict:
    """Held-out metrics and a few of the held-out samples, the same prompts at every evaluation (picked at the
    first: see common.shown_samples): logged, and printed above the progress bar."""
    if run.shown is None:
        run.shown = common.shown_samples(samples)
    samples = [{**samples[i], "verdict": common.describe(samples[i])} for i in run.shown]
    log(run, metrics, step, samples)
    for sample in samples:
        tqdm.write(f"  {sample['prompt']!r} → {sample['completion']!r} ({sample['verdict']})")
    tqdm.write(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    return metrics


def optimizer_step(args: Args, run: SimpleNamespace, step: int, models: list, optimizer, loss: float) -> float:
    """Clips each model's gradient norm to --max-grad-norm and steps, unless the loss (the same in every
    process) or the norm is NaN/inf: then the step is skipped (--skip-nonfinite, counted) or the run stops,
    naming the last good checkpoint. Returns the gradient norm (summed over `models`)."""
    norms = [torch.nn.utils.clip_grad_norm_(m.parameters(), args.max_grad_norm) for m in models]
    grad_norm = sum(n.full_tensor() if hasattr(n, "full_tensor") else n for n in norms)  # FSDP2: DTensors
    if math.isfinite(loss) and torch.isfinite(grad_norm):
        optimizer.step()
    elif args.skip_nonfinite:
        run.skipped += 1
    else:
        sys.exit(
            f"error: non-finite loss ({loss}) or gradient norm ({grad_norm.item()}) at step {step}; "
            f"last good checkpoint: {run.last_checkpoint or 'none'}. Lower --lr, or pass --skip-nonfinite"
        )
    optimizer.zero_grad(set_to_none=True)
    return grad_norm.item()


def maybe_checkpoint(
    args: Args, run: SimpleNamespace, step: int, model, tokenizer, optimizer, schedule, start: dict, extra_state=dict
):
    """A checkpoint every --save-every steps, and when any process got a stop signal: then the run exits 0.
    `extra_state()`: what else this script's checkpoints hold (called in every process, only when saving)."""
    stopping = mean_over_processes({"stop": float(bool(run.stop))}, run.device)["stop"] > 0  # a signal to one stops all
    if (args.save_every and step % args.save_every == 0) or stopping:
        run.last_checkpoint = save_checkpoint(
            args,
            step,
            model,
            tokenizer,
            optimizer,
            {
                "schedule": schedule.state_dict(),
                "run_name": run.name,
                "start": start,
                "skipped": run.skipped,
                "shown": run.shown,
                "wandb_id": run.wandb.id if run.wandb else None,
                **extra_state(),
            },
        )
    if stopping:
        print(
            f"stopped by {(run.stop or ['a signal to another process'])[0]} after step {step}; saved {run.last_checkpoint}; "
            "continue with --resume latest"
        )
        sys.exit(0)


def finish_run(args: Args, run: SimpleNamespace, model, tokenizer, start: dict, end: dict):
    """Saves the trained model in output_dir, prints the held-out metrics before → after, closes the logs.
    (torchrun's process group is destroyed after main() returns: see the end of the script.)"""
    save_final_model(model, tokenizer, args)
    print("held-out " + ", ".join(f"{k} {start[k]:.4f} → {end[k]:.4f}" for k in end) + f"; saved to {args.output_dir}")
    if run.metrics_file:
        run.metrics_file.close()
    if run.wandb:
        run.wandb.finish()


def init_distributed() -> tuple[int, int, torch.device]:
    """(rank, world size, device). Under torchrun: one process per device, NCCL on CUDA, gloo on the CPU."""
    cuda = torch.cuda.is_available()
    if "RANK" not in os.environ:
        return 0, 1, torch.device("cuda" if cuda else "cpu")
    device = torch.device(f"cuda:{os.environ['LOCAL_RANK']}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    return dist.get_rank(), dist.get_world_size(), device


def wrap(model, args: Args, device):
    """DDP (every process holds the model; gradients are averaged), or with --fsdp FSDP2 (each decoder
    layer's parameters, gradients and optimiser state sharded across processes). One process: as is."""
    if not dist.is_initialized():
        return model
    if args.fsdp:
        for module in model.modules():
            if type(module).__name__ in (model._no_split_modules or []):
                fully_shard(module)
        return fully_shard(model)
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)


def mean_over_processes(values: dict, device) -> dict:
    """Each metric averaged over all processes (a no-op for one)."""
    if not dist.is_initialized():
        return values
    t = torch.tensor(list(values.values()), dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return dict(zip(values, (t / dist.get_world_size()).tolist()))


def min_over_processes(value: int, device) -> int:
    """The smallest of the processes' values (the value itself for one process)."""
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def gather_over_processes(x: torch.Tensor) -> torch.Tensor:
    """Every process's x (the same shape in each), concatenated in rank order (x itself for one process)."""
    if not dist.is_initialized():
        return x
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts)


FULL_STATE = StateDictOptions(full_state_dict=True, cpu_offload=True)  # whole tensors, on the CPU, for rank 0 to write


def save_model(model, tokenizer, path: str, args: Args):
    """A normal transformers directory, written by rank 0 (under FSDP2 every process helps gather the weights)."""
    weights = None
    if args.fsdp and dist.is_initialized():
        weights = get_model_state_dict(model, options=FULL_STATE)
        # a tied parameter (embeddings = LM head) is saved once, under its first name, as transformers does
        tied = {n for n, _ in model.named_parameters(remove_duplicate=False)} - {n for n, _ in model.named_parameters()}
        weights = {k: v for k, v in weights.items() if k not in tied}
    if not dist.is_initialized() or dist.get_rank() == 0:
        model.save_pretrained(path, state_dict=weights)
        tokenizer.save_pretrained(path)


def save_final_model(model, tokenizer, args: Args):
    """The trained model in output_dir, written like a checkpoint: to output_dir/final.tmp, then moved over
    the previous model's files, so a failed write (disk full) leaves the previous model whole. With LoRA: the
    adapter (PeftModel.from_pretrained loads it onto its base), or with --merge-lora the merged full weights
    and the adapter in output_dir/adapter."""
    tmp = os.path.join(args.output_dir, "final.tmp")
    main_process = not dist.is_initialized() or dist.get_rank() == 0
    try:
        if main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        if args.merge_lora and is_lora(model):
            save_model(model, tokenizer, os.path.join(tmp, "adapter"), args)
            # W ← W + (α/r)·B·A in every adapted layer, in fp32 (the frozen W is held in bf16 under --bf16, and a bf16
            # sum would round small updates away): a plain transformers model, saved in fp32 like a full fine-tune
            model = model.float().merge_and_unload()
        save_model(model, tokenizer, tmp, args)
        if main_process:
            new = os.listdir(tmp)
            for name in set(os.listdir(args.output_dir)) - set(new):  # what the previous model had, the new lacks
                path = os.path.join(args.output_dir, name)
                if os.path.isfile(path):
                    os.remove(path)
                elif name == "adapter":  # a merged LoRA model's
                    shutil.rmtree(path)
            for name in new:
                if os.path.isdir(os.path.join(args.output_dir, name)):
                    shutil.rmtree(os.path.join(args.output_dir, name))
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
    """output_dir/checkpoint-<step>/: model + tokenizer (loadable as they are) and trainer_state.pt
    (optimiser, scheduler, each process's RNG states, step (= the data position: one batch per step),
    args). Written to a temporary directory and renamed into place, so a kill at any moment leaves
    the previous checkpoint whole."""
    path = os.path.join(args.output_dir, f"checkpoint-{step}")
    main_process = not dist.is_initialized() or dist.get_rank() == 0
    try:
        if main_process:
            shutil.rmtree(path + ".tmp", ignore_errors=True)
        save_model(model, tokenizer, path + ".tmp", args)
    except Exception as e:  # disk full, permissions: one line, the previous checkpoint stays whole
        write_failed(path + ".tmp", e, args.output_dir)
    optimizer_state = get_optimizer_state_dict(model, optimizer, options=FULL_STATE)  # by parameter name, unsharded
    np_rng = np.random.get_state()
    rng = {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": random.getstate(),
        "numpy": (np_rng[0], torch.from_numpy(np_rng[1].astype(np.int64)), *np_rng[2:]),
    }
    rngs = [rng]
    if dist.is_initialized():
        rngs = [None] * dist.get_world_size()
        dist.all_gather_object(rngs, rng)
    if main_process:
        try:
            torch.save(
                {
                    **state,
                    "optimizer": optimizer_state,
                    "step": step,
                    "args": asdict(args),
                    "rng": rngs,
                    "script": os.path.basename(__file__),
                },
                os.path.join(path + ".tmp", "trainer_state.pt"),
            )
            shutil.rmtree(path, ignore_errors=True)
            os.replace(path + ".tmp", path)
        except Exception as e:
            write_failed(path + ".tmp", e, args.output_dir)
        for old in checkpoints(args.output_dir)[: -args.keep_checkpoints]:
            shutil.rmtree(old)
    if dist.is_initialized():
        dist.barrier()
    return path


# flags that only steer a run: they may change when it is resumed; every other flag defines the run
CAN_CHANGE_ON_RESUME = {
    "steps",
    "resume",
    "output_dir",
    "save_every",
    "keep_checkpoints",
    "eval_every",
    "track",
    "wandb_project",
    "wandb_entity",
    "run_name",
    "skip_nonfinite",
    "gradient_checkpointing",
    "static_cache",
    "fsdp",
    "trust_remote_code",
    "merge_lora",
}


def load_checkpoint(args: Args) -> tuple[str | None, dict | None]:
    """--resume: the given checkpoint directory, or `latest` in output_dir (none yet: start afresh). The flags
    that define the run are taken from the checkpoint (a different value given on the command line stops
    the run); a run that already reached --steps stops here, changing nothing."""
    path = args.resume
    if path == "latest":
        path = (checkpoints(args.output_dir) or [None])[-1]
        if path is None:
            print(f"note: no checkpoint in {args.output_dir} yet; starting from scratch")
    if path is None:
        return None, None
    if not os.path.isfile(os.path.join(path, "trainer_state.pt")):
        fail(f"--resume {path}: not a checkpoint directory (no trainer_state.pt)")
    try:
        state = torch.load(os.path.join(path, "trainer_state.pt"), weights_only=True)
    except Exception as e:
        fail(
            f"--resume {path}: {os.path.join(path, 'trainer_state.pt')} is corrupt or cut short ({common.error_reason(e)})"
        )
    script = os.path.basename(__file__)
    written_by = state.get("script") or (script if set(state["args"]) == set(asdict(args)) else "another script")
    if written_by != script:
        fail(f"--resume {path}: that checkpoint was written by {written_by}, not {script}")
    defaults, typed = Args(), {a.split("=")[0] for a in sys.argv[1:]}
    for name, saved in state["args"].items():
        value, flag = getattr(args, name, saved), "--" + name.replace("_", "-")
        if value == saved:
            continue
        if (
            value == getattr(defaults, name) and not {flag, flag.replace("--", "--no-")} & typed
        ):  # not given: the run's own value
            setattr(args, name, saved)
        elif name not in CAN_CHANGE_ON_RESUME:
            fail(
                f"{flag} {value} differs from the {saved} that {path} was run with; resume with the same value, or start a new run"
            )
    if args.steps != state["args"]["steps"]:
        print(
            f"note: --steps {args.steps}: the run (begun with --steps {state['args']['steps']}) goes on to step {args.steps}"
        )
    if state["step"] >= args.steps:
        print(
            f"{path} is at step {state['step']}: the run already reached --steps {args.steps}; nothing to do (its model is in {path})"
        )
        sys.exit(0)
    return path, state


def restore_rng(rng: dict):
    torch.set_rng_state(rng["torch"])
    if rng["cuda"]:
        torch.cuda.set_rng_state_all(rng["cuda"])
    random.setstate(rng["python"])
    name, keys, *rest = rng["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))


def open_metrics(run_name: str, resumed_step: int | None):
    """runs/<run_name>/metrics.jsonl for appending; on resume, rows logged after the checkpoint are dropped."""
    path = f"runs/{run_name}/metrics.jsonl"
    probe_writable(os.path.dirname(path))
    if resumed_step is not None and os.path.exists(path):
        rows = [line for line in open(path).read().splitlines() if line.endswith("}")]  # not a row cut short
        with open(path, "w") as f:
            f.writelines(line + "\n" for line in rows if json.loads(line)["step"] <= resumed_step)
    return open(path, "a")


def on_stop_signal(stop: list | None):
    """SIGINT/SIGTERM. During set-up (`stop` None): exit 0 at once, there is nothing to save yet. During
    training: the signal's name goes into `stop`, the step finishes, a checkpoint is saved and the run exits 0;
    a second signal stops at once."""

    def handler(signum, frame):
        name = signal.Signals(signum).name
        if stop is None:
            print(f"stopped by {name} during set-up; nothing to save")
            sys.exit(0)
        stop.append(name)
        signal.signal(signum, signal.SIG_DFL)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)


def check_stage_input(path: str, default: str, script: str, flag: str):
    """A stage's default input (models/sft, models/reward) exists only once the stage before has run (a model,
    or a LoRA adapter); an interrupted run leaves it empty."""
    if path == default and not any(
        os.path.isfile(os.path.join(path, f)) for f in ("config.json", "adapter_config.json")
    ):
        fail(f"{path} not found: run `python {script}` first (or pass {flag})")


def check_lora(args: Args):
    """LoRA's flags: rank ≥ 0, α > 0, dropout in [0, 1); not with --fsdp; never saved over the model it adapts."""
    check_ranges(args, ["lora_alpha"], ["lora_r"])
    if not 0 <= args.lora_dropout < 1:
        fail(f"--lora-dropout must be in [0, 1) (got {args.lora_dropout})")
    if not args.lora_r:
        return
    if args.fsdp:
        fail("--lora-r with --fsdp is not supported: under torchrun, LoRA trains with DDP (drop --fsdp)")
    if not args.model:
        fail(
            "--lora-r trains adapters on a pretrained model: pass --model (the tiny from-scratch model trains in full)"
        )
    if os.path.abspath(args.output_dir) == os.path.abspath(args.model):
        fail(
            f"--output-dir {args.output_dir} is the model being adapted, which its adapter needs; pass another --output-dir"
        )


def check_args(args: Args):
    """Invalid flag values stop the run at once, before any model is loaded."""
    check_ranges(
        args,
        [
            "steps",
            "prompts_per_step",
            "num_iterations",
            "grad_accum_steps",
            "lr",
            "max_grad_norm",
            "clip_eps",
            "max_sampling_rounds",
            "temperature",
            "max_new_tokens",
            "max_prompt_length",
            "eval_every",
            "eval_size",
            "keep_checkpoints",
        ],
        ["beta", "format_reward", "warmup_steps", "seed", "save_every"],
    )
    check_lora(args)
    if args.clip_eps_high is not None and not args.clip_eps_high >= 0:
        fail(f"--clip-eps-high must be 0 or positive (got {args.clip_eps_high})")
    if args.group_size < 2:
        fail(f"--group-size must be at least 2: a group of one has no baseline (got {args.group_size})")
    if args.grad_accum_steps > args.prompts_per_step * args.group_size:
        fail(f"--grad-accum-steps ({args.grad_accum_steps}) must be at most --prompts-per-step × --group-size")
    if args.format_reward and args.reward_model:
        fail("--format-reward adds to the rule-based reward only: drop it or --reward-model")


def resolve_defaults(args: Args):
    """The flags left at None take their DEFAULTS value: the built-in task's when the run is the built-in task
    (its dataset and tiny model), else the pretrained set's. Prints which set the run uses."""
    builtin = args.dataset == "arithmetic" and common.is_builtin_model(args.model)
    taken = []
    for name, values in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, values[0] if builtin else values[1])
            taken.append(f"--{name.replace('_', '-')} {getattr(args, name)}")
    which = "the built-in task's defaults" if builtin else "defaults for a pretrained model"
    print(f"{which}: {', '.join(taken) or 'none (every such flag was given)'}")


def defaults_help() -> str:
    """The two sets of DEFAULTS as a table, for --help."""
    lines = [f"  {'--' + name.replace('_', '-'):<22} {a!s:<14} {b}" for name, (a, b) in DEFAULTS.items()]
    header = f"  {'flag':<22} {'built-in task':<14} pretrained model (any other dataset or model)"
    return "\n\nDefaults that depend on the run (a flag given always wins):\n" + "\n".join([header, *lines])


def check_ranges(args: Args, positive: list[str], non_negative: list[str]):
    """Each named flag must be a finite number > 0 (positive) or ≥ 0 (non_negative); else one error line."""
    for names, bound in ((positive, "positive"), (non_negative, "0 or positive")):
        for name in names:
            value = getattr(args, name)
            if not math.isfinite(value) or value < 0 or (value == 0 and bound == "positive"):
                fail(f"--{name.replace('_', '-')} must be {bound} (got {value})")


def fail(message: str):
    """A user error: one line on stderr, exit code 2, no traceback."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def probe_writable(directory: str):
    """Creates `directory` and writes and removes a small file in it, so that an unwritable --output-dir
    stops the run before any work instead of at the first save."""
    if os.path.isfile(directory):
        fail(f"cannot write to {directory}: it is a file, not a directory")
    try:
        os.makedirs(directory, exist_ok=True)
        probe = os.path.join(directory, f".write-test-{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        fail(f"cannot write to {directory}: {e.strerror or e}")


def load_failure(path: str, e: Exception) -> str:
    """One sentence on why a model, tokenizer or checkpoint at `path` cannot be loaded, naming the file at fault."""
    if not os.path.exists(path):
        if path.startswith((".", "/", "~")) or path.count("/") != 1:  # a hub id is `owner/name`
            return f"cannot load model {path!r}: no such file or directory"
        return f"cannot load model {path!r} from the hub: {common.error_reason(e)}"
    if os.path.isdir(path) and not any(
        os.path.isfile(os.path.join(path, f)) for f in ("config.json", "adapter_config.json")
    ):
        return f"cannot load model {path!r}: it is not a model directory (no config.json)"
    for name in sorted(os.listdir(path)) if os.path.isdir(path) else []:
        file = os.path.join(path, name)
        try:  # which file is cut short or corrupt?
            if name.endswith(".safetensors"):
                with safe_open(file, "pt"):
                    pass
            elif name.endswith(".json"):
                with open(file) as f:
                    json.load(f)
        except Exception as bad:
            return f"cannot load model {path!r}: {file} is corrupt or cut short ({common.error_reason(bad)})"
    return f"cannot load model {path!r}: {common.error_reason(e)}"


def write_failed(path: str, e: Exception, output_dir: str):
    """A write that failed (disk full, permissions): its partial directory is removed and the run stops with
    one line naming the last complete checkpoint; files written before are untouched."""
    shutil.rmtree(path, ignore_errors=True)
    last = (checkpoints(output_dir) or ["none"])[-1]
    sys.exit(
        f"error: could not write {path} ({common.error_reason(e)}); the files already in {output_dir} are untouched; "
        f"last complete checkpoint: {last}"
    )


if __name__ == "__main__":
    args = tyro.cli(Args, description=__doc__ + defaults_help())
    try:
        main(args)
    except common.DataError as e:
        fail(str(e))
    # Only now, with main()'s DDP wrapper freed: had its reducer dropped the last reference to the process
    # group, the group's threads would be joined while holding the GIL they may need (a hang at exit).
    if dist.is_initialized():
        dist.destroy_process_group()
