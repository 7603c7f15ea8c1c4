"""Direct Preference Optimization (DPO): the KL-constrained RLHF objective solved in closed form.

The optimal policy of max 𝔼[r] − β·D_KL[π ‖ π_ref] satisfies r(x, y) = β·log(π(y|x) / π_ref(y|x)) + β·log Z(x).
In Bradley–Terry Z(x) cancels: the policy learns from preference pairs y_w ≻ y_l directly, with no reward model and
no sampling while training (Rafailov et al. 2023); on the built-in task, or prompts with answers (GSM8K's format),
the pairs are π_ref's own right and wrong samples, drawn once before training (`--sample-pairs 0`: fixed pairs):

    h = log π_θ(y_w|x)/π_ref(y_w|x) − log π_θ(y_l|x)/π_ref(y_l|x)
    ℒ_DPO(θ) = −𝔼[ log σ(β·h) ]         (label smoothing ls: −(1−ls)·log σ(βh) − ls·log σ(−βh))
    ℒ_IPO(θ) = 𝔼[ (h − 1/(2β))² ]       (Azar et al. 2023)
    + α·𝔼[ −log π_θ(y_w|x) / |y_w| ]     (--rpo-alpha: RPO, Pang et al. 2024: keeps log π(y_w) from falling)

    python dpo.py                                    # after `python sft.py`: the built-in task, CPU
    python dpo.py --model Qwen/Qwen2.5-0.5B-Instruct --dataset trl-lib/ultrafeedback_binarized
"""

import contextlib
import copy
import random
import time
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from tqdm import tqdm

import common

# Flags whose default depends on the run: the built-in task's tuned value, or with any other dataset or model one
# fit for a pretrained model (TRL's where TRL has one). A flag given always wins; the run prints the set it used.
DEFAULTS = {  # flag: (built-in task, pretrained model)
    "steps": (300, 300),
    "beta": (3.0, 0.1),
    "lr": (1e-5, 5e-7),
    "warmup_steps": (20, 0),
    "batch_size": (64, 8),
    "max_new_tokens": (8, 256),
}


@dataclass
class Args:
    # models and data
    model: str = "models/sft"
    """policy to start from (hub id or path)"""
    ref_model: str | None = None
    """reference π_ref (hub id or path); default: a frozen copy of the starting policy"""
    dataset: str = "arithmetic"
    """`arithmetic`, a hub id, or a .jsonl/.json/.parquet file of pairs, or of prompts with answers"""
    dataset_config: str | None = None
    """the hub dataset's configuration name, if it has several"""
    max_length: int = 1024
    """prompt and completions are each truncated to this many tokens (prompts from the left)"""
    output_dir: str = "models/dpo"
    """where the trained policy and tokenizer are saved"""
    trust_remote_code: bool = False
    """allow model repositories to run their own code"""
    # the objective: β, loss variants
    beta: float | None = None
    """β: strength of the implicit KL constraint (larger stays closer to π_ref) (default: DEFAULTS)"""
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid"
    """sigmoid: the DPO loss; ipo: the squared IPO loss"""
    label_smoothing: float = 0.0
    """ls: assumed probability that a preference label is flipped (conservative DPO; sigmoid only)"""
    rpo_alpha: float = 0.0
    """α: weight of the chosen completions' per-token NLL in the loss (RPO: keeps log π(y_w) up)"""
    # pairs sampled from π_ref (rows with answers: the built-in task, GSM8K-format prompts)
    sample_pairs: int = 4
    """rows with answers: pair right and wrong samples of π_ref, this many a prompt (0: the fixed pairs)"""
    sample_temperature: float = 0.7
    """temperature of those samples"""
    resample_every: int = 0
    """K: pairs sampled afresh from the current policy π_θ every K steps (online DPO; 0: once, from π_ref)"""
    # optimisation
    steps: int | None = None
    """optimiser steps (default: DEFAULTS)"""
    batch_size: int | None = None
    """pairs per micro-batch and process (a step: × grad_accum_steps × processes) (default: DEFAULTS)"""
    grad_accum_steps: int = 1
    """micro-batches whose gradients are summed before each optimiser step"""
    lr: float | None = None
    """learning rate (AdamW) (default: DEFAULTS)"""
    warmup_steps: int | None = None
    """linear warm-up steps (default: DEFAULTS)"""
    max_grad_norm: float = 1.0
    """gradient clipping threshold (global L2 norm)"""
    # evaluation
    eval_every: int = 50
    """evaluate on the held-out split every this many steps (and at the end)"""
    eval_size: int = 500
    """held-out pairs (and prompts) used for evaluation"""
    max_new_tokens: int | None = None
    """generation length when measuring held-out accuracy (default: DEFAULTS)"""
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
    """bf16 autocast, fp32 master weights, the reference in bf16 (default: on with CUDA)"""
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
    """name of the run (runs/<run_name>/metrics.jsonl); default dpo__<seed>__<time>"""
    save_every: int = 0
    """write output_dir/checkpoint-<step>/ every this many steps (0: only when stopped by a signal)"""
    keep_checkpoints: int = 2
    """newest checkpoints kept; older ones are deleted"""
    resume: str | None = None
    """continue from this checkpoint directory, or `latest` in output_dir (none yet: start afresh)"""


# ---------------------------------------------------------------- the math
def dpo_loss(
    policy_chosen_logps,
    policy_rejected_logps,
    ref_chosen_logps,
    ref_rejected_logps,
    beta,
    loss_type="sigmoid",
    label_smoothing=0.0,
):
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


# ---------------------------------------------------------------- the method's helpers
def sequence_logps(model, batch: dict) -> torch.Tensor:
    """Σ_t log π(y_t | x, y_<t) over completion tokens [B] (forward_logps, below: the LM head a chunk at a time)."""
    T = batch["completion_ids"].shape[1]
    return (forward_logps(model, batch["input_ids"], batch["attention_mask"], T) * batch["completion_mask"]).sum(1)


def pair_batch(tokenizer, rows: list[dict], max_length: int, device, eos_ids: list[int] | None = None) -> dict:
    """Chosen (first B rows) then rejected (last B rows), each after its prompt and ending with EOS: one batch."""
    completions = [r["chosen"] for r in rows] + [r["rejected"] for r in rows]
    return common.completion_batch(tokenizer, rows * 2, completions, max_length, eos_ids, device)


@torch.no_grad()
def sample_pairs(model, tokenizer, rows: list[dict], args: Args, run, autocast) -> list[dict]:
    """Pairs from the model's own samples, labelled by the answer key: --sample-pairs completions of each prompt
    at --sample-temperature; a prompt with a correct and a wrong one gives {prompt, chosen: the first correct,
    rejected: a wrong one at random}. (The DPO paper builds its controlled-experiment pairs the same way:
    samples of π_SFT, scored by a judge.) Each process samples a share of the rows; all get every pair."""
    k, n, pairs, t0 = args.sample_pairs, 8 * args.batch_size, [], time.time()
    eos_ids = common.eos_token_ids(tokenizer, model.generation_config)
    mine = rows[run.rank * len(rows) // run.world : (run.rank + 1) * len(rows) // run.world]
    for i in tqdm(range(0, len(mine), n), desc="sampling pairs", disable=run.rank > 0 or None, leave=False):
        batch_rows = mine[i : i + n]
        prompts = common.tokenize_prompts(tokenizer, batch_rows, args.max_length)
        ids, mask = (t.to(run.device) for t in common.pad(prompts, tokenizer.pad_token_id, "left"))
        with autocast:
            out = generate_exactly(
                model, ids, mask, tokenizer, eos_ids, args.max_new_tokens, args.sample_temperature, n=k
            )
        texts = tokenizer.batch_decode(out[:, ids.shape[1] :], skip_special_tokens=True)
        for j, row in enumerate(batch_rows):
            right = [t for t in texts[j * k : (j + 1) * k] if common.is_correct(t, row["answer"])]
            wrong = [t for t in texts[j * k : (j + 1) * k] if not common.is_correct(t, row["answer"])]
            if right and wrong:
                pairs.append({"prompt": row["prompt"], "chosen": right[0], "rejected": random.choice(wrong)})
    pairs = gather_lists(pairs)
    print(
        f"sampled {k} completions at T={args.sample_temperature} for each of {len(rows)} prompts: {len(pairs)} "
        f"had a right and a wrong one → a pair ({time.time() - t0:.0f} s)"
    )
    return pairs


def sample_round(model, tokenizer, prompts: list[dict], r: int, args: Args, run, autocast, step_rows: int):
    """Round r of online DPO (Guo et al. 2024, arXiv:2402.04792; iterative DPO, Xiong et al. 2024): sample_pairs
    from `model` on the round's 2·K·step_rows prompts (the next ones, wrapping around), as many as DPO sampled once
    for the whole run, divided by rounds; then cycled or cut to K·step_rows pairs, so that the round's K steps draw
    each about once. Returns them and how many different pairs the samples gave."""
    n, K, training = 2 * args.resample_every * step_rows, args.resample_every, model.training
    model.eval()  # generate() keeps its KV cache off for a training model with gradient checkpointing
    pairs = sample_pairs(model, tokenizer, [prompts[(r * n + i) % len(prompts)] for i in range(n)], args, run, autocast)
    model.train(training)
    return [pairs[i % len(pairs)] for i in range(K * step_rows)] if pairs else [], len(pairs)


@torch.no_grad()
def reference_logps(policy, ref, batch: dict, autocast) -> tuple[torch.Tensor, torch.Tensor]:
    """log π_ref(y_w | x) and log π_ref(y_l | x) [B] of a pair_batch's pairs (fp32): computed for each batch, as
    TRL does by default, rather than cached (less state: a resumed run needs none)."""
    with autocast, reference_policy(policy, ref) as pi_ref:
        return sequence_logps(pi_ref, batch).float().chunk(2)


@torch.no_grad()
def greedy_completions(model, prompt_ids, prompt_mask, tokenizer, eos_ids: list[int], args: Args) -> list[str]:
    """The greedy completions of left-padded prompts, as text: what held-out accuracy is measured on."""
    out = generate_exactly(model, prompt_ids, prompt_mask, tokenizer, eos_ids, args.max_new_tokens)
    return tokenizer.batch_decode(out[:, prompt_ids.shape[1] :], skip_special_tokens=True)


@contextlib.contextmanager
def reference_policy(policy, ref):
    """π_ref for a block of code: the frozen reference model, or with LoRA (ref None) the policy's own frozen
    base weights, its adapter switched off: one model in memory instead of two."""
    if ref is not None:
        yield ref
    else:
        with policy.disable_adapter():
            yield policy


@torch.no_grad()
def evaluate(policy, tokenizer, eos_ids, pairs, ref_logps, prompts, args: Args, device, autocast):
    """Held-out preference accuracy of the implicit reward on `pairs` (ref_logps: π_ref's, a (w, l) pair for each
    batch of --batch-size pairs), greedy completions of `prompts` and their accuracy when they have answers;
    every sample."""
    policy.eval()
    wins, texts, n = [], [], args.batch_size  # never more memory than a training batch
    for i, (ref_w, ref_l) in zip(range(0, len(pairs), n), ref_logps):
        batch = pair_batch(tokenizer, pairs[i : i + n], args.max_length, device, eos_ids)
        with autocast:
            logp_w, logp_l = sequence_logps(policy, batch).float().chunk(2)
        wins += ((logp_w - ref_w) > (logp_l - ref_l)).tolist()
    for i in range(0, len(prompts), n):
        ids = common.tokenize_prompts(tokenizer, prompts[i : i + n], args.max_length)
        ids, mask = (t.to(device) for t in common.pad(ids, tokenizer.pad_token_id, "left"))
        with autocast:
            texts += greedy_completions(policy, ids, mask, tokenizer, eos_ids, args)
    policy.train()
    metrics = {"eval/rewards/accuracies": sum(wins) / len(wins)}
    if all(r.get("answer") is not None for r in prompts):
        metrics["eval/accuracy"] = sum(common.is_correct(t, r["answer"]) for t, r in zip(texts, prompts)) / len(prompts)
    return metrics, [
        {"prompt": common.readable_prompt(r), "completion": t, "answer": r.get("answer")}
        for r, t in zip(prompts, texts)
    ]


def main(args: Args):
    run = start_run(args, "dpo")  # flags checked, --resume found, seeds set, torchrun's processes joined
    autocast = torch.autocast(run.device.type, dtype=torch.bfloat16, enabled=args.bf16)
    tokenizer, policy, ref = load_models(args, run)
    dist_policy = wrap(policy, args, run.device)  # the training forward, through DDP/FSDP2 under torchrun
    eos_ids = common.eos_token_ids(tokenizer, policy.generation_config)  # completions end at the first of any

    # 1. preference pairs (x, y_w, y_l): the dataset's, or, with answers, π_ref's own right and wrong samples
    step_rows = args.batch_size * args.grad_accum_steps * run.world
    train_rows, eval_rows, eval_prompts, pool, t_sample = load_pairs(
        args, run, tokenizer, policy, ref, autocast, step_rows
    )

    # fused AdamW: the whole update in one kernel, without foreach's parameter-sized temporaries
    trainable = [p for p in policy.parameters() if p.requires_grad]  # LoRA: the adapters
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0, fused=True)
    schedule = lr_schedule(optimizer, args.warmup_steps, args.steps, decay=False)
    batches, progress = begin_training(args, run, policy, optimizer, schedule, len(train_rows), step_rows)

    # π_ref's log-probs of the held-out pairs, once: each evaluation compares π_θ's with them
    held_out = [eval_rows[i : i + args.batch_size] for i in range(0, len(eval_rows), args.batch_size)]
    eval_ref = [
        reference_logps(policy, ref, pair_batch(tokenizer, rows, args.max_length, run.device, eos_ids), autocast)
        for rows in held_out
    ]

    def run_eval(step: int) -> dict:
        metrics, samples = evaluate(
            policy, tokenizer, eos_ids, eval_rows, eval_ref, eval_prompts, args, run.device, autocast
        )
        return log_eval(run, step, metrics, samples)

    def extra_state() -> dict:  # sampled pairs are saved with the checkpoint: a resumed run trains on the same
        return {"pairs": [train_rows, eval_rows]} if pool else {}

    if t_sample:
        log(run, {"train/generation_s": round(t_sample, 3)}, 0)
    last_eval = run.first_eval or run_eval(0)
    K = args.resample_every
    for step in progress:
        totals = {"loss": 0.0}
        if K and step > 1 and (step - 1) % K == 0:  # 1b. online DPO: the next round's pairs, sampled from π_θ itself
            t0 = time.time()
            train_rows, n = sample_round(policy, tokenizer, pool, (step - 1) // K, args, run, autocast, step_rows)
            totals |= {"pairs": n, "generation_s": time.time() - t0}

        # 2. the DPO loss on a batch of pairs, gradients summed over micro-batches and processes
        idx = next(batches)
        for k in range(args.grad_accum_steps):
            rows = [train_rows[i] for i in process_share(idx, run, args.batch_size, micro_batch=k)]
            batch = pair_batch(tokenizer, rows, args.max_length, run.device, eos_ids)
            ref_w, ref_l = reference_logps(policy, ref, batch, autocast)  # log π_ref(y_w | x), log π_ref(y_l | x)
            with gradient_sync(dist_policy, last=k == args.grad_accum_steps - 1):
                with autocast:  # log π_θ(y_w | x) and log π_θ(y_l | x): chosen and rejected in one forward pass
                    logp_w, logp_l = sequence_logps(dist_policy, batch).chunk(2)
                losses, chosen_rewards, rejected_rewards = dpo_loss(
                    logp_w, logp_l, ref_w, ref_l, args.beta, args.loss_type, args.label_smoothing
                )
                if args.rpo_alpha:  # RPO: + α · (−log π_θ(y_w) / |y_w|), so the chosen answer's likelihood is kept up
                    losses = losses - args.rpo_alpha * logp_w / batch["completion_mask"][: len(rows)].sum(1)
                # the step's mean over all its pairs; DDP averages over processes, hence × world
                loss = losses.sum() / (len(idx) / run.world)
                loss.backward()
            totals["loss"] += loss.item()
            for key, value in {
                "rewards/chosen": chosen_rewards.mean(),
                "rewards/rejected": rejected_rewards.mean(),
                "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
                "logps/chosen": logp_w.mean(),
                "logps/rejected": logp_l.mean(),
            }.items():
                totals[key] = totals.get(key, 0.0) + value.item() / args.grad_accum_steps
        totals = over_processes(totals, run.device)
        grad_norm = optimizer_step(args, run, step, [policy], optimizer)
        schedule.step()

        # 3. log, evaluate, checkpoint
        progress.set_postfix(loss=f"{totals['loss']:.4f}")
        totals["rewards/margins"] = totals["rewards/chosen"] - totals["rewards/rejected"]
        totals.update(grad_norm=grad_norm, lr=schedule.get_last_lr()[0])
        log(run, {f"train/{k}": v for k, v in totals.items()}, step)
        if step % args.eval_every == 0 or step == args.steps:
            last_eval = run_eval(step)
        maybe_checkpoint(args, run, step, policy, tokenizer, optimizer, schedule, extra_state)

    finish_run(args, run, policy, tokenizer, last_eval)


# ======================================== plumbing: models, data, flag checks (main() reads fine without it)
def load_pairs(args: Args, run, tokenizer, policy, ref, autocast, step_rows: int):
    """Preference pairs (x, y_w, y_l) to train on and held out: the dataset's, or for rows with answers
    (--sample-pairs) π_ref's own right and wrong samples; on resume, the very pairs the run started with.
    With --resample-every K, π_ref's pairs are the first round's (K steps' worth, sample_round).
    Returns them, the held-out prompts to answer greedily (all, when they have answers: accuracy; else the few each
    evaluation prints), the prompts the pairs are sampled from (None: the dataset's pairs; each checkpoint keeps
    sampled ones) and the seconds sampling took."""
    kind = "preference"
    if args.sample_pairs and common.prompts_with_answers(args.dataset, args.dataset_config):
        kind = "prompt"
    train_rows = common.load_rows(args.dataset, "train", kind, tokenizer, args.dataset_config)
    eval_rows = common.load_rows(args.dataset, "test", kind, tokenizer, args.dataset_config)[: args.eval_size]
    common.check_prompt_lengths(tokenizer, eval_rows, args.max_length)
    eval_prompts = eval_rows if all(r.get("answer") is not None for r in eval_rows) else eval_rows[:4]
    pool, t_sample = None, 0.0
    if run.state and "pairs" in run.state:  # resumed: the very pairs the run had
        pool, (train_rows, eval_rows) = train_rows, run.state["pairs"]
    elif args.sample_pairs and all(r.get("answer") is not None for r in train_rows[:1000]):
        # On-policy pairs: the fixed pairs' slips are answers π_ref itself rarely gives, so pushing them down
        # barely moves its greedy answers; its own right and wrong samples do. Prompts for twice the pairs
        # the run draws: only those with a right and a wrong sample give one. A prompt dataset's held-out
        # pairs are π_ref's samples too (first, so they do not depend on --steps).
        pool, t0 = train_rows, time.time()
        with reference_policy(policy, ref) as pi_ref:
            if kind == "prompt":
                eval_rows = sample_pairs(pi_ref, tokenizer, eval_rows, args, run, autocast)
            if args.resample_every:
                train_rows, _ = sample_round(pi_ref, tokenizer, pool, 0, args, run, autocast, step_rows)
            else:
                train_rows = sample_pairs(pi_ref, tokenizer, pool[: 2 * args.steps * step_rows], args, run, autocast)
        t_sample = time.time() - t0
    if args.resample_every and not pool:
        fail("--resample-every samples pairs by their answers: it needs rows with answers and --sample-pairs 2 or more")
    if kind == "prompt" and not (pool and eval_rows and train_rows):
        fail(
            f"dataset '{args.dataset}' has no preference pairs, and π_ref's samples gave none to train and evaluate on "
            "(only prompts it sometimes gets right and sometimes wrong give one: raise --sample-pairs or --eval-size)"
        )
    print(f"{len(train_rows)} train / {len(eval_rows)} held-out pairs from {args.dataset}")
    return train_rows, eval_rows, eval_prompts, pool, t_sample


def load_models(args: Args, run):
    """The tokenizer, π_θ (from the checkpoint on resume) and π_ref: the starting policy (also on resume) or
    --ref-model, frozen, in eval mode, never with gradients; held in bf16 with --bf16. With LoRA and no
    --ref-model, ref is None: π_ref is the policy with its adapter switched off (reference_policy)."""
    path = args.model if args.lora_r else run.checkpoint or args.model  # LoRA: the base model, then its adapter
    tokenizer = common.load_tokenizer(args.model, trust_remote_code=args.trust_remote_code)
    policy = load_model(path, args.trust_remote_code)
    policy = add_lora(policy, args, adapter=run.checkpoint).to(run.device).train()
    if args.gradient_checkpointing:
        enable_gradient_checkpointing(policy)
    ref = None
    if args.ref_model or not args.lora_r:
        ref = (
            load_model(args.ref_model or args.model, args.trust_remote_code)
            if args.ref_model or run.checkpoint
            else copy.deepcopy(policy)
        )
        ref.to(run.device, torch.bfloat16 if args.bf16 else torch.float32).requires_grad_(False).eval()
    return tokenizer, policy, ref


# the flags checked below the banner (check_args), besides those every script has
METHOD_POSITIVE = "batch_size beta sample_temperature max_length".split()
METHOD_NON_NEGATIVE = "rpo_alpha resample_every".split()


def method_rules(args: Args) -> list[tuple[bool, str]]:
    """(broken, message): flag combinations that cannot work."""
    smoothing, loss, k = args.label_smoothing, args.loss_type, args.sample_pairs
    return [
        (not 0 <= smoothing < 0.5, f"--label-smoothing must be in [0, 0.5) (got {smoothing})"),
        (smoothing and loss != "sigmoid", f"--label-smoothing applies to --loss-type sigmoid only, not {loss}"),
        (k == 1 or k < 0, f"--sample-pairs must be 0 (the fixed pairs) or at least 2 samples per prompt (got {k})"),
    ]


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
