"""Direct Preference Optimization (DPO): the KL-constrained RLHF objective solved in closed form.

The optimal policy of max 𝔼[r] − β·D_KL[π ‖ π_ref] satisfies r(x, y) = β·log(π(y|x) / π_ref(y|x)) + β·log Z(x).
Substituting this implicit reward into Bradley–Terry, Z(x) cancels and the policy is trained directly on
preference pairs (y_w ≻ y_l), with no reward model and no sampling:

    h = log π_θ(y_w|x)/π_ref(y_w|x) − log π_θ(y_l|x)/π_ref(y_l|x)
    ℒ_DPO(θ) = −𝔼[ log σ(β·h) ]                   (sigmoid; label smoothing ls: −(1−ls)·log σ(βh) − ls·log σ(−βh))
    ℒ_IPO(θ) = 𝔼[ (h − 1/(2β))² ]                  (Azar et al. 2023)

Rafailov et al. 2023 (arXiv:2305.18290).

    python dpo.py                                    # after `python sft.py`: the built-in task, CPU
    python dpo.py --model Qwen/Qwen2.5-0.5B-Instruct --dataset trl-lib/ultrafeedback_binarized --lr 5e-7 --batch-size 32
"""

import copy
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
import tyro
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import common


@dataclass
class Args:
    model: str = "models/sft"
    """policy to start from (hub id or path)"""
    ref_model: str | None = None
    """reference π_ref (hub id or path); default: a frozen copy of the starting policy"""
    dataset: str = "arithmetic"
    """`arithmetic` (built-in preferences), a hub id, or a local preference .jsonl/.json/.parquet file"""
    dataset_config: str | None = None
    """the hub dataset's configuration name, if it has several"""
    output_dir: str = "models/dpo"
    """where the trained policy and tokenizer are saved"""
    steps: int = 300
    """optimiser steps"""
    batch_size: int = 64
    """preference pairs per step"""
    lr: float = 3e-5
    """learning rate (AdamW); use ~5e-7 to 5e-6 for pretrained models"""
    warmup_steps: int = 20
    """linear warm-up steps"""
    max_grad_norm: float = 1.0
    """gradient clipping threshold (global L2 norm)"""
    beta: float = 1.0
    """β: strength of the implicit KL constraint (larger stays closer to π_ref; 0.1 is usual for chat models)"""
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid"
    """sigmoid: the DPO loss; ipo: the squared IPO loss"""
    label_smoothing: float = 0.0
    """ls: assumed probability that a preference label is flipped (conservative DPO; sigmoid only)"""
    max_length: int = 1024
    """prompt and completions are each truncated to this many tokens (prompts from the left)"""
    eval_every: int = 50
    """evaluate on the held-out split every this many steps (and at the end)"""
    eval_size: int = 500
    """held-out pairs (and prompts) used for evaluation"""
    max_new_tokens: int = 8
    """generation length when measuring held-out accuracy"""
    seed: int = 1
    """seed for torch, python and numpy"""
    bf16: bool = True
    """bf16 autocast with fp32 master weights on CUDA; the reference in bf16 (the CPU runs fp32)"""
    trust_remote_code: bool = False
    """allow model repositories to run their own code"""
    track: bool = False
    """log to Weights & Biases"""
    wandb_project: str = "align"
    """wandb project"""
    wandb_entity: str | None = None
    """wandb entity (team or user)"""
    run_name: str | None = None
    """name of the run (runs/<run_name>/metrics.jsonl); default dpo__<seed>__<time>"""


# ---------------------------------------------------------------- math
def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log π(y_t | ·) of the given tokens: logits [B,T,V], tokens [B,T] → [B,T].

    Equals logits.log_softmax(-1).gather(-1, tokens) but computed as gather − logsumexp in fp32, a few
    rows at a time, so the full [B,T,V] fp32 log-softmax is never materialised."""
    rows = max(1, 2**26 // max(1, logits.shape[1] * logits.shape[2]))
    out = []
    for lg, tk in zip(logits.split(rows), tokens.split(rows)):
        lg = lg.float()
        out.append(lg.gather(-1, tk.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(lg, dim=-1))
    return torch.cat(out)


def dpo_loss(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, beta, loss_type="sigmoid", label_smoothing=0.0):
    """Per-pair DPO/IPO loss from summed sequence log-probs [B].

    h = (log π_θ(y_w) − log π_ref(y_w)) − (log π_θ(y_l) − log π_ref(y_l));
    sigmoid: −(1−ls)·log σ(βh) − ls·log σ(−βh);  ipo: (h − 1/(2β))².
    Returns (losses [B], chosen_rewards [B], rejected_rewards [B]); the implicit rewards β·log(π_θ/π_ref)
    are detached."""
    chosen_logratio = policy_chosen_logps - ref_chosen_logps
    rejected_logratio = policy_rejected_logps - ref_rejected_logps
    h = chosen_logratio - rejected_logratio
    if loss_type == "sigmoid":
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    elif loss_type == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}")
    return losses, beta * chosen_logratio.detach(), beta * rejected_logratio.detach()


# ---------------------------------------------------------------- helpers
def load_model(path: str, trust_remote_code: bool):
    """A causal LM in fp32 (master weights) with every dropout probability in its config at 0."""
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    for key, value in config.to_dict().items():
        if isinstance(value, float) and ("dropout" in key or "pdrop" in key):
            setattr(config, key, 0.0)  # engineering detail 1: no dropout in any model
    return AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32, trust_remote_code=trust_remote_code, use_safetensors=True)


def sequence_logps(model, batch: dict) -> torch.Tensor:
    """Σ_t log π(y_t | x, y_<t) over completion tokens [B]; logits at position t predict token t+1."""
    position_ids = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)  # left padding must not shift positions
    T = batch["completion_ids"].shape[1]
    # only the last T + 1 positions' logits are computed: the prompt's own predictions are never needed
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=position_ids, logits_to_keep=T + 1).logits
    return (token_logprobs(logits[:, :-1], batch["completion_ids"]) * batch["completion_mask"]).sum(1)


def pair_batch(rows, tokenizer, max_length: int, device) -> dict:
    """Chosen (first B rows) then rejected (last B rows), each ending with EOS: one concatenated forward."""
    prompts = common.tokenize(tokenizer, [r["prompt"] for r in rows], max_length=max_length, left_truncate=True)
    completions = common.tokenize(tokenizer, [r["chosen"] for r in rows] + [r["rejected"] for r in rows], add_eos=True, max_length=max_length)
    return {k: v.to(device) for k, v in common.collate(prompts * 2, completions, tokenizer.pad_token_id).items()}


def main(args: Args):
    run_name = args.run_name or f"dpo__{args.seed}__{int(time.time())}"
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16 and device.type == "cuda")

    if args.model == "models/sft" and not os.path.isdir(args.model):
        sys.exit("error: models/sft not found: run `python sft.py` first (or pass --model)")
    tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    if tokenizer.pad_token is None:  # masks come from lengths, so padding with EOS is safe
        tokenizer.pad_token = tokenizer.eos_token
        print(f"note: the tokenizer has no pad token; padding with EOS ({tokenizer.eos_token!r})")
    policy = load_model(args.model, args.trust_remote_code).to(device).train()
    # π_ref: frozen, eval mode, never with gradients; bf16 on CUDA
    ref = load_model(args.ref_model, args.trust_remote_code) if args.ref_model else copy.deepcopy(policy)
    ref.to(device).requires_grad_(False).eval()
    if device.type == "cuda" and args.bf16:
        ref.to(torch.bfloat16)

    train_rows = common.load_rows(args.dataset, "train", "preference", tokenizer, args.dataset_config)
    eval_rows = common.load_rows(args.dataset, "test", "preference", tokenizer, args.dataset_config)[: args.eval_size]
    has_answers = all(r.get("answer") is not None for r in eval_rows)
    print(f"policy {args.model} on {device}; {len(train_rows)} train / {len(eval_rows)} held-out pairs from {args.dataset}")

    @torch.no_grad()
    def ref_logps(rows) -> torch.Tensor:
        with autocast:
            return sequence_logps(ref, pair_batch(rows, tokenizer, args.max_length, device)).float()

    # Reference log-probs: computed once per pair, the first time it is drawn, then reused every epoch.
    ref_cache = torch.full((len(train_rows), 2), float("nan"), device=device)
    eval_ref = torch.cat([ref_logps(eval_rows[i : i + 128]).view(2, -1).T for i in range(0, len(eval_rows), 128)])

    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / args.warmup_steps))
    os.makedirs(f"runs/{run_name}", exist_ok=True)
    metrics_file = open(f"runs/{run_name}/metrics.jsonl", "a")
    if args.track:
        import wandb

        wandb.init(project=args.wandb_project, entity=args.wandb_entity, name=run_name, config=asdict(args))

    def log(metrics: dict, step: int, samples=None):
        metrics_file.write(json.dumps({"step": step, **metrics}) + "\n")
        metrics_file.flush()
        if args.track:
            table = {"samples": wandb.Table(columns=["prompt", "completion", "answer"], data=samples)} if samples else {}
            wandb.log({**metrics, **table}, step=step)

    @torch.no_grad()
    def evaluate(step: int) -> dict:
        """Held-out preference accuracy of the implicit reward, and greedy accuracy when answers exist."""
        policy.eval()
        wins, correct, samples = [], [], []
        for i in range(0, len(eval_rows), 128):
            rows = eval_rows[i : i + 128]
            batch = pair_batch(rows, tokenizer, args.max_length, device)
            with autocast:
                chosen, rejected = sequence_logps(policy, batch).float().chunk(2)
            wins += ((chosen - eval_ref[i : i + 128, 0]) > (rejected - eval_ref[i : i + 128, 1])).tolist()
            if has_answers:
                P, B = batch["prompt_ids"].shape[1], len(rows)
                with autocast:
                    out = policy.generate(
                        input_ids=batch["prompt_ids"][:B], attention_mask=batch["prompt_mask"][:B], max_new_tokens=args.max_new_tokens,
                        do_sample=False, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                    )
                texts = tokenizer.batch_decode(out[:, P:], skip_special_tokens=True)
                correct += [common.is_correct(t, r["answer"]) for t, r in zip(texts, rows)]
                samples += [[r["prompt"], t, r["answer"]] for r, t in zip(rows, texts)][: max(0, 5 - len(samples))]
        policy.train()
        metrics = {"eval/rewards/accuracies": float(np.mean(wins))}
        if has_answers:
            metrics["eval/accuracy"] = float(np.mean(correct))
        log(metrics, step, samples)
        return metrics

    start = evaluate(0)
    print("step 0: " + ", ".join(f"{k} {v:.4f}" for k, v in start.items()))
    batches = common.shuffled_batches(len(train_rows), args.batch_size, args.seed)
    progress = tqdm(range(1, args.steps + 1), desc="dpo", dynamic_ncols=True)
    for step in progress:
        idx = next(batches)
        rows = [train_rows[i] for i in idx]
        missing = [i for i in idx if ref_cache[i, 0].isnan()]
        if missing:
            ref_cache[missing] = ref_logps([train_rows[i] for i in missing]).view(2, -1).T
        batch = pair_batch(rows, tokenizer, args.max_length, device)
        with autocast:  # chosen and rejected in one concatenated forward pass
            policy_chosen, policy_rejected = sequence_logps(policy, batch).chunk(2)
        losses, chosen_rewards, rejected_rewards = dpo_loss(
            policy_chosen, policy_rejected, ref_cache[idx, 0], ref_cache[idx, 1], args.beta, args.loss_type, args.label_smoothing
        )
        loss = losses.mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
        optimizer.step()
        schedule.step()
        progress.set_postfix(loss=f"{loss.item():.4f}")
        log({
            "train/loss": loss.item(), "train/grad_norm": grad_norm.item(),
            "rewards/chosen": chosen_rewards.mean().item(), "rewards/rejected": rejected_rewards.mean().item(),
            "rewards/margins": (chosen_rewards - rejected_rewards).mean().item(),
            "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean().item(),
            "logps/chosen": policy_chosen.mean().item(), "logps/rejected": policy_rejected.mean().item(),
        }, step)
        if step % args.eval_every == 0 or step == args.steps:
            end = evaluate(step)
            tqdm.write(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in end.items()))

    policy.save_pretrained(args.output_dir)
    tokenizer.save_pretrained(args.output_dir)
    metrics_file.close()
    print("held-out " + ", ".join(f"{k} {start[k]:.4f} → {end[k]:.4f}" for k in end) + f"; saved to {args.output_dir}")
    if args.track:
        wandb.finish()


if __name__ == "__main__":
    args = tyro.cli(Args)
    try:
        main(args)
    except common.DataError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
