"""RLHF with Proximal Policy Optimization (PPO): the InstructGPT recipe (Ouyang et al. 2022).

A learned reward model r_ϕ scores each sampled completion; a KL penalty to the reference keeps the policy near
π_ref; a critic V_ψ (initialised from the reward model) is the baseline for GAE advantages (Schulman et al. 2016,
arXiv:1506.02438) in PPO's clipped objective (Schulman et al. 2017, arXiv:1707.06347):

    r_t = −β·(log π_θold(y_t) − log π_ref(y_t))  (+ r_ϕ(x, y) at the last token)
    δ_t = r_t + γ·V_ψ(s_{t+1}) − V_ψ(s_t),   Â_t = Σ_l (γλ)^l·δ_{t+l}           (GAE)
    ρ_t = π_θ(y_t | s_t) / π_θold(y_t | s_t)
    ℒ_policy = −𝔼_t[ min(ρ_t·Â_t, clip(ρ_t, 1−ε, 1+ε)·Â_t) ]
    ℒ_value  = ½·𝔼_t[ max((V_ψ − R_t)², (clip(V_ψ, V_old − ε, V_old + ε) − R_t)²) ],  R_t = Â_t + V_old

    python ppo.py                                    # after `python sft.py` and `python reward_model.py`
    python ppo.py --model Qwen/Qwen2.5-0.5B-Instruct --reward-model <rm> --dataset trl-lib/tldr --max-new-tokens 64
    python ppo.py --reward-funcs accuracy            # a rule-based reward instead of r_ϕ (grpo.py's --reward-funcs)
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

import torch
from transformers import AutoModelForSequenceClassification

import common

# Flags whose default depends on the run: the built-in task's tuned value, or with any other dataset or model one
# fit for a pretrained model (TRL's where TRL has one). A flag given always wins; the run prints the set it used.
DEFAULTS = {  # flag: (built-in task, pretrained model)
    "steps": (60, 200),
    "prompts_per_step": (128, 16),
    "max_new_tokens": (8, 256),
    "kl_coef": (0.5, 0.05),
    "num_ppo_epochs": (2, 4),
    "lr": (2e-5, 3e-6),
    "warmup_steps": (10, 0),
}


@dataclass
class Args:
    # models and data
    model: str = "models/sft"
    """policy to start from (hub id or path); also the frozen reference π_ref"""
    reward_model: str | None = None
    """reward model r_ϕ, also where V_ψ starts (default: models/reward, unless --reward-funcs)"""
    reward_funcs: tuple[str, ...] = ()
    """reward functions added to r_ϕ (or instead): accuracy, format, think_format, overlong, file.py:fn, …"""
    reward_weights: tuple[float, ...] | None = None
    """weight of each reward function, then of the reward model (default: 1 each)"""
    dataset: str = "arithmetic"
    """`arithmetic` (built-in), a hub id, or a local prompt .jsonl/.json/.parquet file"""
    dataset_config: str | None = None
    """the hub dataset's configuration name, if it has several"""
    max_prompt_length: int = 512
    """prompts are left-truncated to this many tokens"""
    output_dir: str = "models/ppo"
    """where the trained policy and tokenizer are saved"""
    trust_remote_code: bool = False
    """allow model repositories to run their own code"""
    # sampling
    prompts_per_step: int | None = None
    """prompts per rollout (default: DEFAULTS)"""
    samples_per_prompt: int = 1
    """completions sampled of each prompt: the critic then sees several returns of one state"""
    temperature: float = 0.7
    """sampling temperature (every log-prob is computed at the same temperature)"""
    max_new_tokens: int | None = None
    """completion length limit (default: DEFAULTS)"""
    static_cache: bool = False
    """sample with a preallocated KV cache (on CUDA: compiled decoding, faster after the first call)"""
    # the objective: clipped ratio ρ, KL-penalised rewards, GAE advantages Â, value loss
    clip_eps: float = 0.2
    """ε: the ratio ρ is clipped to [1−ε, 1+ε_h]"""
    clip_eps_high: float | None = None
    """ε_h: DAPO's clip-higher, e.g. 0.28 (None: ε)"""
    clip_eps_value: float = 0.2
    """values move at most this far from V_old in the clipped value loss"""
    vf_coef: float = 0.1
    """weight of the value loss"""
    kl_coef: float | None = None
    """β: per-token KL penalty to the reference in the reward (default: DEFAULTS)"""
    gamma: float = 1.0
    """γ: discount"""
    lam: float = 0.95
    """λ: GAE trade-off between bias (0) and variance (1)"""
    missing_eos_penalty: float = 1.0
    """subtracted from the score of completions that never emit EOS (0: off)"""
    whiten_advantages: bool = True
    """Â shifted and scaled to mean 0, std 1 over the rollout's tokens"""
    zero_value_head: bool = False
    """a new value head (V_ψ not from r_ϕ) starts at zero: V_ψ = 0 everywhere, not random, at first"""
    # optimisation
    steps: int | None = None
    """rollout/update rounds (default: DEFAULTS)"""
    num_ppo_epochs: int | None = None
    """passes over each rollout (default: DEFAULTS)"""
    num_mini_batches: int = 2
    """minibatches per pass (one optimiser step each)"""
    grad_accum_steps: int = 1
    """micro-batches per minibatch: gradients are summed over them before its optimiser step (less memory)"""
    lr: float | None = None
    """learning rate of the policy (AdamW) (default: DEFAULTS)"""
    critic_lr: float | None = None
    """learning rate of the critic V_ψ (None: --lr)"""
    warmup_steps: int | None = None
    """linear warm-up rounds (default: DEFAULTS)"""
    max_grad_norm: float = 1.0
    """gradient clipping threshold (global L2 norm, policy and critic each)"""
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
    """name of the run (runs/<run_name>/metrics.jsonl); default ppo__<seed>__<time>"""
    save_every: int = 0
    """write output_dir/checkpoint-<step>/ every this many steps (0: only when stopped by a signal)"""
    keep_checkpoints: int = 2
    """newest checkpoints kept; older ones are deleted"""
    resume: str | None = None
    """continue from this checkpoint directory, or `latest` in output_dir (none yet: start afresh)"""

    def __post_init__(self):
        if self.reward_model is None and not self.reward_funcs:  # RLHF: the reward model of reward_model.py
            self.reward_model = "models/reward"


# ---------------------------------------------------------------- the math
def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum()


def kl_penalized_rewards(scores, logps, ref_logps, mask, kl_coef) -> torch.Tensor:
    """r_t = −β·(log π_θold(y_t) − log π_ref(y_t)) on real tokens, plus r_ϕ(x, y) at each row's last real token.

    scores [B]; logps, ref_logps, mask [B,T] (mask a prefix of each row) → [B,T], 0 on padding."""
    rewards = -kl_coef * (logps - ref_logps) * mask
    last = mask.sum(1).long().clamp(min=1) - 1
    rewards[torch.arange(len(scores)), last] += scores
    return rewards


def compute_gae(rewards, values, mask, gamma=1.0, lam=0.95):
    """GAE: δ_t = r_t + γ·V_{t+1} − V_t, Â_t = δ_t + γλ·Â_{t+1}; the value after a row's last real token
    is 0. Returns (advantages, returns = Â + V), both [B,T] and 0 where mask is 0."""
    mask = mask.float()
    T = rewards.shape[1]
    advantages = torch.zeros_like(rewards)
    next_value, next_advantage = torch.zeros_like(rewards[:, 0]), torch.zeros_like(rewards[:, 0])
    for t in reversed(range(T)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantages[:, t] = delta + gamma * lam * next_advantage
        # beyond the last real token nothing follows: the next state's value and advantage are 0
        next_value, next_advantage = values[:, t] * mask[:, t], advantages[:, t] * mask[:, t]
    advantages = advantages * mask
    return advantages, (advantages + values) * mask


def whiten(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(Â − mean) / std over the batch's real tokens; 0 on padding."""
    mean = masked_mean(advantages, mask)
    std = masked_mean((advantages - mean) ** 2, mask).sqrt()
    return (advantages - mean) / (std + 1e-8) * mask


def ppo_policy_loss(logps, old_logps, advantages, mask, clip_eps=0.2, clip_eps_high=None):
    """ℒ = masked mean of max(−Â·ρ, −Â·clip(ρ, 1−ε, 1+ε_h)), ρ = exp(logp − old_logp); ε_h = clip_eps_high, DAPO's
    clip-higher (None: ε). Returns (loss, stats: clip_fraction, approx_kl = ½·mean((logp − old_logp)²))."""
    mask = mask.float()
    ratio = torch.exp(logps - old_logps)
    high = 1 + (clip_eps if clip_eps_high is None else clip_eps_high)
    unclipped, clipped = -advantages * ratio, -advantages * ratio.clamp(1 - clip_eps, high)
    loss = masked_mean(torch.max(unclipped, clipped), mask)
    stats = {
        "clip_fraction": masked_mean((clipped > unclipped).float(), mask).detach(),
        "approx_kl": masked_mean(0.5 * (logps - old_logps) ** 2, mask).detach(),
    }
    return loss, stats


def ppo_value_loss(values, old_values, returns, mask, clip_eps=0.2):
    """ℒ_V = ½ · masked mean of max((V − R)², (clip(V, V_old − ε, V_old + ε) − R)²)."""
    clipped = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
    return 0.5 * masked_mean(torch.max((values - returns) ** 2, (clipped - returns) ** 2), mask.float())


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 − Var(R − V) / Var(R) over real tokens: 1 when the critic predicts the returns, ≤ 0 when it does not."""
    residual_var = masked_mean((returns - values - masked_mean(returns - values, mask)) ** 2, mask)
    returns_var = masked_mean((returns - masked_mean(returns, mask)) ** 2, mask)
    return (1 - residual_var / returns_var.clamp(min=1e-8)).item()


# ---------------------------------------------------------------- the method's helpers
def critic_values(critic, input_ids, attention_mask, T: int) -> torch.Tensor:
    """V_ψ(s_t) [B,T]: the value of the state before completion token t (read where y_t is predicted)."""
    return position_scores(critic, input_ids, attention_mask)[:, -T - 1 : -1]


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


@torch.no_grad()
def evaluate(policy, tokenizer, eos_ids, rows, reward_sources, args: Args, device, autocast, step: int):
    """Greedy completions of held-out prompts (sample(), 128 at a time): the mean score, each reward source's,
    and accuracy when answers exist; and every sample."""
    scores, texts, by_source = [], [], {}
    for i in range(0, len(rows), 128):
        s = sample(policy, tokenizer, eos_ids, rows[i : i + 128], reward_sources, args, device, autocast, step, True)
        scores, texts = scores + s.rewards.tolist(), texts + s.texts
        by_source = {name: by_source.get(name, []) + r for name, r in s.by_source.items()}
    metrics = {"eval/score": sum(scores) / len(scores)} | {f"eval/{k}": v for k, v in reward_stats(by_source).items()}
    if all(r["answer"] is not None for r in rows):
        metrics["eval/accuracy"] = sum(common.is_correct(t, r["answer"]) for t, r in zip(texts, rows)) / len(rows)
    return metrics, [
        {"prompt": common.readable_prompt(r), "completion": t, "answer": r["answer"], "score": v}
        for r, t, v in zip(rows, texts, scores)
    ]


def main(args: Args):
    run = start_run(args, "ppo")  # flags checked, --resume found, seeds set, torchrun's processes joined
    autocast = torch.autocast(run.device.type, dtype=torch.bfloat16, enabled=args.bf16)
    tokenizer, policy, critic, ref, reward_sources = load_models(args, run)
    # every id that ends a completion (chat models: several)
    eos_ids = torch.tensor(common.eos_token_ids(tokenizer, policy.generation_config), device=run.device)
    dist_policy = wrap(policy, args, run.device)  # the training forwards, through DDP/FSDP2 under torchrun
    dist_critic = wrap(critic, args, run.device)
    both = torch.nn.ModuleDict({"policy": policy, "critic": critic})  # one optimiser, one checkpoint for the two
    if run.world > 1:  # every process samples its own completions
        torch.manual_seed(args.seed + run.rank)
    train_rows, eval_rows = load_prompts(args, tokenizer)

    # fused AdamW: the whole update in one kernel, without foreach's parameter-sized temporaries; the critic in a
    # group of its own (--critic-lr). LoRA: the two adapters and the value head
    groups = [(policy, args.lr), (critic, args.critic_lr or args.lr)]
    groups = [{"params": [p for p in m.parameters() if p.requires_grad], "lr": lr} for m, lr in groups]
    optimizer = torch.optim.AdamW(groups, weight_decay=0.0, fused=True)
    schedule = lr_schedule(optimizer, args.warmup_steps, args.steps, decay=False)
    step_rows = args.prompts_per_step * run.world
    batches, progress = begin_training(args, run, both, optimizer, schedule, len(train_rows), step_rows)

    def run_eval(step: int) -> dict:
        metrics, samples = evaluate(
            policy, tokenizer, eos_ids, eval_rows, reward_sources, args, run.device, autocast, step
        )
        return log_eval(run, step, metrics, samples)

    last_eval = run.first_eval or run_eval(0)
    for step in progress:
        # 1. rollout: sample completions of each prompt from π_θold and score them (r_ϕ and/or reward functions)
        rows = [train_rows[i] for i in process_share(next(batches), run, args.prompts_per_step)]
        rows = [row for row in rows for _ in range(args.samples_per_prompt)]
        t0 = time.time()
        rollout = sample(policy, tokenizer, eos_ids, rows, reward_sources, args, run.device, autocast, step)
        generation_s = time.time() - t0
        input_ids, attention_mask, mask, ended = rollout.input_ids, rollout.attention_mask, rollout.mask, rollout.ended
        T = mask.shape[1]  # completion tokens
        scores = rollout.rewards - args.missing_eos_penalty * (~ended).float()

        # 2. log-probs of π_θold and π_ref and the values V_ψ(s_t), without gradients
        with torch.no_grad(), autocast:
            old_logps = forward_logps(policy, input_ids, attention_mask, T, args.temperature)
            with reference_policy(policy, ref) as pi_ref:
                ref_logps = forward_logps(pi_ref, input_ids, attention_mask, T, args.temperature)
            old_values = critic_values(critic, input_ids, attention_mask, T)

        # 3. per-token rewards with the KL penalty, GAE advantages Â (whitened over the batch) and returns
        rewards = kl_penalized_rewards(scores, old_logps, ref_logps, mask, args.kl_coef)
        advantages, returns = compute_gae(rewards, old_values, mask, args.gamma, args.lam)
        advantages = whiten(advantages, mask) if args.whiten_advantages else advantages

        # 4. update: num_ppo_epochs passes over num_mini_batches minibatches, one optimiser step each
        names = "policy_loss value_loss clip_fraction approx_kl value_clip_fraction entropy grad_norm".split()
        stats = dict.fromkeys(names, 0.0)
        mb_size, n_updates = len(input_ids) // args.num_mini_batches, args.num_ppo_epochs * args.num_mini_batches
        for _ in range(args.num_ppo_epochs):
            order = torch.randperm(len(input_ids), device=run.device)
            for mb in order[: mb_size * args.num_mini_batches].split(mb_size):
                micros = mb.chunk(args.grad_accum_steps)
                for k, micro in enumerate(micros):
                    share = mask[micro].sum() / mask[mb].sum()  # both losses are token means over the minibatch
                    ids, attn = input_ids[micro], attention_mask[micro]
                    with gradient_sync(dist_policy, dist_critic, last=k == len(micros) - 1):
                        with autocast:
                            logps, entropy = forward_logps(dist_policy, ids, attn, T, args.temperature, entropy=True)
                            values = critic_values(dist_critic, ids, attn, T)
                        pg_loss, pg_stats = ppo_policy_loss(
                            logps, old_logps[micro], advantages[micro], mask[micro], args.clip_eps, args.clip_eps_high
                        )
                        vf_loss = ppo_value_loss(
                            values, old_values[micro], returns[micro], mask[micro], args.clip_eps_value
                        )
                        ((pg_loss + args.vf_coef * vf_loss) * share).backward()
                    vf_clipped = ((values - old_values[micro]).abs() > args.clip_eps_value).float()
                    micro_stats = dict(policy_loss=pg_loss, value_loss=vf_loss, **pg_stats)
                    micro_stats["value_clip_fraction"] = masked_mean(vf_clipped, mask[micro])
                    micro_stats["entropy"] = masked_mean(entropy, mask[micro])
                    for key, value in micro_stats.items():  # means over the minibatches of the round
                        stats[key] += share.item() * value.item() / n_updates
                stats["grad_norm"] += optimizer_step(args, run, step, [policy, critic], optimizer) / n_updates
        schedule.step()

        # 5. log, evaluate, checkpoint
        kl = ((old_logps - ref_logps) * mask).sum(1)  # per-sequence KL estimate to the reference
        stats |= {
            "score": scores.mean().item(),
            **reward_stats(rollout.by_source),
            "kl": kl.mean().item(),
            "rlhf_reward": (scores - args.kl_coef * kl).mean().item(),
            "explained_variance": explained_variance(old_values, returns, mask),
            "completions/mean_length": mask.sum(1).float().mean().item(),  # named as in grpo.py (TRL's GRPO)
            "completions/clipped_ratio": 1 - ended.float().mean().item(),  # cut by the length limit, no EOS
            "lr": schedule.get_last_lr()[0],
            "generation_s": generation_s,
        }
        if args.samples_per_prompt > 1:  # prompts whose completions all scored alike (named as in grpo.py)
            stats["frac_reward_zero_std"] = (scores.view(-1, args.samples_per_prompt).std(1) == 0).float().mean().item()
        metrics = over_processes({f"train/{k}": v for k, v in stats.items()}, run.device)
        log(run, metrics, step)
        if metrics["train/completions/clipped_ratio"] > 0.5:
            common.warn_once(
                f"most completions hit the {args.max_new_tokens}-token limit without an EOS: raise --max-new-tokens"
            )
        progress.set_postfix(score=f"{metrics['train/score']:.3f}", kl=f"{metrics['train/kl']:.3f}")
        if step % args.eval_every == 0 or step == args.steps:
            last_eval = run_eval(step)
        maybe_checkpoint(args, run, step, both, tokenizer, optimizer, schedule)

    finish_run(args, run, policy, tokenizer, last_eval)  # the policy alone: a plain causal LM


# ======================================== plumbing: models, data, flag checks (main() reads fine without it)
def load_models(args: Args, run):
    """Four models: the policy π_θ and critic V_ψ train (from the checkpoint on resume); the reference π_ref
    (the starting policy; None with LoRA: the policy with its adapter switched off) and the reward model r_ϕ
    are frozen, held in bf16 with --bf16. Also the tokenizer and the reward sources: the reward functions, r_ϕ
    and its tokenizer (None: no reward model, or it reads the policy's tokens)."""
    frozen_dtype = torch.bfloat16 if args.bf16 else torch.float32
    reward_sources = SimpleNamespace(funcs=load_reward_funcs(args.reward_funcs), model=None, tokenizer=None)
    ref, critic_checkpoint = None, run.checkpoint and os.path.join(run.checkpoint, "critic")
    path = args.model if args.lora_r else run.checkpoint or args.model  # LoRA: the base model, then its adapter
    tokenizer = common.load_tokenizer(args.model, trust_remote_code=args.trust_remote_code)
    policy = load_model(path, args.trust_remote_code)
    policy = add_lora(policy, args, adapter=run.checkpoint).to(run.device)
    if not args.lora_r:  # LoRA: π_ref is the policy with its adapter switched off
        ref = load_model(args.model, args.trust_remote_code) if run.checkpoint else copy.deepcopy(policy)
        ref.to(run.device, frozen_dtype).requires_grad_(False).eval()
    if args.reward_model:
        reward_sources.model, reward_sources.tokenizer = load_reward_model(
            args.reward_model, tokenizer, args.trust_remote_code
        )
    if critic_checkpoint and not args.lora_r:
        critic = load_model(critic_checkpoint, args.trust_remote_code, AutoModelForSequenceClassification, num_labels=1)
    elif (
        reward_sources.model is not None and reward_sources.tokenizer is None
    ):  # V_ψ starts from r_ϕ: it knows what scores well
        critic = copy.deepcopy(reward_sources.model)
    else:  # no r_ϕ, or one that cannot read the policy's tokens: the policy's weights with a new value head
        critic = load_model(args.model, args.trust_remote_code, AutoModelForSequenceClassification, num_labels=1)
        if args.zero_value_head:
            torch.nn.init.zeros_(critic.score.weight)
        print(f"note: the critic starts from the policy with a new value head{' at 0' * args.zero_value_head}")
    critic = add_lora(critic, args, "SEQ_CLS", adapter=critic_checkpoint).to(run.device)
    if reward_sources.model is not None:
        reward_sources.model.to(run.device, frozen_dtype).requires_grad_(False).eval()
    if args.gradient_checkpointing:
        for model in (policy, critic):
            enable_gradient_checkpointing(model)
    return tokenizer, policy, critic, ref, reward_sources


def load_prompts(args: Args, tokenizer) -> tuple[list[dict], list[dict]]:
    """The training prompts and the first --eval-size held-out ones."""
    train_rows = common.load_rows(args.dataset, "train", "prompt", tokenizer, args.dataset_config)
    eval_rows = common.load_rows(args.dataset, "test", "prompt", tokenizer, args.dataset_config)[: args.eval_size]
    common.check_prompt_lengths(tokenizer, eval_rows, args.max_prompt_length)
    print(f"{len(train_rows)} train / {len(eval_rows)} held-out prompts from {args.dataset}")
    return train_rows, eval_rows


# the flags checked below the banner (check_args), besides those every script has
METHOD_POSITIVE = (
    "prompts_per_step num_ppo_epochs num_mini_batches clip_eps clip_eps_value temperature max_prompt_length".split()
)
METHOD_NON_NEGATIVE = "vf_coef kl_coef missing_eos_penalty".split()


def method_rules(args: Args) -> list[tuple[bool, str]]:
    """(broken, message): flag combinations that cannot work."""
    n, M, accum, high = args.samples_per_prompt, args.num_mini_batches, args.grad_accum_steps, args.clip_eps_high
    N, gamma, lam, critic_lr = args.prompts_per_step * max(n, 1), args.gamma, args.lam, args.critic_lr
    rollout = "--prompts-per-step × --samples-per-prompt"
    return [
        (high is not None and not high >= 0, f"--clip-eps-high must be 0 or positive (got {high})"),
        (n < 1, f"--samples-per-prompt must be at least 1 (got {n})"),
        (critic_lr is not None and not critic_lr > 0, f"--critic-lr must be positive (got {critic_lr})"),
        (N < M * accum, f"{rollout} ({N}) must be at least --num-mini-batches × --grad-accum-steps"),
        (N % M != 0, f"{rollout} ({N}) must be divisible by --num-mini-batches ({M})"),
        (not (0 <= lam <= 1 and 0 <= gamma <= 1), f"--gamma and --lam must be in [0, 1] (got {gamma}, {lam})"),
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
