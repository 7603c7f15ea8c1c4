"""Stage 0: supervised fine-tuning (SFT), the starting policy π_ref of every alignment method.

Maximise the log-likelihood of the reference completion y given the prompt x, on completion tokens only:

    ℒ_SFT(θ) = −𝔼_(x,y) [ (1/|y|) Σ_t log π_θ(y_t | x, y_<t) ]

With no arguments it builds a ~0.5M-parameter Qwen2-architecture model with a character tokenizer,
teaches it 3-digit addition (the built-in `arithmetic` task) to a moderate accuracy that the alignment
stages then improve, and saves model + tokenizer to `models/sft`. With `--model` and `--dataset` it
fine-tunes any causal LM on any prompt/completion or messages dataset.

    python sft.py                                   # tiny model, built-in task, ~1 minute on a CPU
    python sft.py --model Qwen/Qwen2.5-0.5B --dataset trl-lib/Capybara --lr 2e-5 --batch-size 16
"""

import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
import tyro
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, Qwen2Config

import common


@dataclass
class Args:
    model: str | None = None
    """hub id or local path of the model to fine-tune; None builds the tiny from-scratch model"""
    dataset: str = "arithmetic"
    """`arithmetic` (built-in), a hub id, or a local .jsonl/.json/.parquet file"""
    dataset_config: str | None = None
    """the hub dataset's configuration name, if it has several"""
    output_dir: str = "models/sft"
    """where the model and tokenizer are saved"""
    steps: int = 600
    """optimiser steps (the default leaves the tiny model moderately good: ~65-70% held-out accuracy)"""
    batch_size: int = 64
    """sequences per optimiser step"""
    lr: float = 1e-3
    """peak learning rate (AdamW); use ~1e-5 to 5e-5 for pretrained models"""
    warmup_steps: int = 20
    """linear warm-up steps, then a constant learning rate"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping threshold (global L2 norm)"""
    max_length: int = 1024
    """prompt and completion are each truncated to this many tokens (prompts from the left)"""
    eval_every: int = 200
    """evaluate on the held-out split every this many steps (and at the end)"""
    eval_size: int = 500
    """held-out rows used for evaluation"""
    max_new_tokens: int = 8
    """generation length when measuring held-out accuracy"""
    hidden_size: int = 128
    """tiny model only: hidden size"""
    num_layers: int = 2
    """tiny model only: transformer layers"""
    num_heads: int = 8
    """tiny model only: attention heads"""
    seed: int = 1
    """seed for torch, python and numpy"""
    bf16: bool = True
    """bf16 autocast with fp32 master weights on CUDA (the CPU always runs fp32)"""
    trust_remote_code: bool = False
    """allow model repositories to run their own code (off: only transformers' own architectures)"""
    track: bool = False
    """log to Weights & Biases"""
    wandb_project: str = "align"
    """wandb project"""
    wandb_entity: str | None = None
    """wandb entity (team or user)"""
    run_name: str | None = None
    """name of the run (runs/<run_name>/metrics.jsonl); default sft__<seed>__<time>"""


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


def sft_loss(logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """ℒ_SFT = −Σ_t mask_t·log π_θ(y_t) / Σ_t mask_t: token-mean negative log-likelihood of completions."""
    return -(logps * mask).sum() / mask.sum()


# ---------------------------------------------------------------- helpers
def tiny_model(tokenizer, args: Args):
    """A from-scratch Qwen2-architecture model (RoPE, RMSNorm, SwiGLU, tied embeddings), dropout off."""
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        intermediate_size=4 * args.hidden_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_heads,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        attention_dropout=0.0,  # engineering detail 1: no dropout
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,  # the character tokenizer adds no BOS
    )
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def load_model(path: str, trust_remote_code: bool):
    """A pretrained causal LM in fp32 (master weights) with every dropout probability in its config at 0."""
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    for key, value in config.to_dict().items():
        if isinstance(value, float) and ("dropout" in key or "pdrop" in key):
            setattr(config, key, 0.0)  # engineering detail 1: no dropout in any model
    return AutoModelForCausalLM.from_pretrained(
        path, config=config, dtype=torch.float32, trust_remote_code=trust_remote_code, use_safetensors=True
    )


def forward_logps(model, batch: dict) -> torch.Tensor:
    """log π_θ of each completion token [B,T]; logits at position t predict token t+1."""
    position_ids = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)  # left padding must not shift positions
    T = batch["completion_ids"].shape[1]
    # only the last T + 1 positions' logits are computed: the prompt's own predictions are never needed
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=position_ids, logits_to_keep=T + 1).logits
    return token_logprobs(logits[:, :-1], batch["completion_ids"])


@torch.no_grad()
def evaluate(model, tokenizer, rows, args: Args, device, autocast) -> tuple[dict, list]:
    """Held-out loss, and greedy exact-match accuracy when the rows have answers; plus a few samples."""
    model.eval()
    prompts = common.tokenize(tokenizer, [r["prompt"] for r in rows], max_length=args.max_length, left_truncate=True)
    completions = common.tokenize(tokenizer, [r["completion"] for r in rows], add_eos=True, max_length=args.max_length)
    total_nll, total_tokens, correct, samples = 0.0, 0, 0, []
    has_answers = all(r.get("answer") is not None for r in rows)
    for i in range(0, len(rows), 64):
        batch = {k: v.to(device) for k, v in common.collate(prompts[i : i + 64], completions[i : i + 64], tokenizer.pad_token_id).items()}
        with autocast:
            logps = forward_logps(model, batch)
        total_nll -= (logps * batch["completion_mask"]).sum().item()
        total_tokens += batch["completion_mask"].sum().item()
        if has_answers:
            with autocast:
                out = model.generate(
                    input_ids=batch["prompt_ids"], attention_mask=batch["prompt_mask"], max_new_tokens=args.max_new_tokens,
                    do_sample=False, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                )
            texts = tokenizer.batch_decode(out[:, batch["prompt_ids"].shape[1] :], skip_special_tokens=True)
            for row, text in zip(rows[i : i + 64], texts):
                correct += common.is_correct(text, row["answer"])
                if len(samples) < 5:
                    samples.append([row["prompt"], text, row["answer"]])
    model.train()
    metrics = {"eval/loss": total_nll / max(total_tokens, 1)}
    if has_answers:
        metrics["eval/accuracy"] = correct / len(rows)
    return metrics, samples


def main(args: Args):
    run_name = args.run_name or f"sft__{args.seed}__{int(time.time())}"
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16 and device.type == "cuda")

    if args.model is None:
        tokenizer = common.build_char_tokenizer()
        model = tiny_model(tokenizer, args)
    else:
        tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
        model = load_model(args.model, args.trust_remote_code)
        if tokenizer.pad_token is None:  # masks come from lengths, so padding with EOS is safe
            tokenizer.pad_token = tokenizer.eos_token
            print(f"note: the tokenizer has no pad token; padding with EOS ({tokenizer.eos_token!r})")
    model.to(device).train()
    print(f"model: {args.model or 'tiny Qwen2'} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters) on {device}")

    train_rows = common.load_rows(args.dataset, "train", "sft", tokenizer, args.dataset_config)
    eval_rows = common.load_rows(args.dataset, "test", "sft", tokenizer, args.dataset_config)[: args.eval_size]
    prompts = common.tokenize(tokenizer, [r["prompt"] for r in train_rows], max_length=args.max_length, left_truncate=True)
    completions = common.tokenize(tokenizer, [r["completion"] for r in train_rows], add_eos=True, max_length=args.max_length)
    print(f"data: {len(train_rows)} train rows, {len(eval_rows)} held-out rows from {args.dataset}")

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
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

    def run_eval(step: int):
        metrics, samples = evaluate(model, tokenizer, eval_rows, args, device, autocast)
        log(metrics, step, samples)
        for prompt, text, answer in samples[:3]:
            tqdm.write(f"  {prompt!r} → {text!r} (answer {answer})")
        tqdm.write(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
        return metrics

    start = run_eval(0)
    batches = common.shuffled_batches(len(train_rows), args.batch_size, args.seed)
    progress = tqdm(range(1, args.steps + 1), desc="sft", dynamic_ncols=True)
    for step in progress:
        idx = next(batches)
        batch = {k: v.to(device) for k, v in common.collate([prompts[i] for i in idx], [completions[i] for i in idx], tokenizer.pad_token_id).items()}
        with autocast:
            logps = forward_logps(model, batch)
        loss = sft_loss(logps, batch["completion_mask"])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        schedule.step()
        progress.set_postfix(loss=f"{loss.item():.4f}")
        if step % 10 == 0:
            log({"train/loss": loss.item(), "train/grad_norm": grad_norm.item(), "train/lr": schedule.get_last_lr()[0]}, step)
        if step % args.eval_every == 0 or step == args.steps:
            end = run_eval(step)

    model.save_pretrained(args.output_dir)
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
