"""Stage 0: supervised fine-tuning (SFT), the starting policy π_ref of every alignment method.

Maximise the log-likelihood of the reference completion y given the prompt x, on completion tokens only:

    ℒ_SFT(θ) = −𝔼_(x,y) [ (1/|y|) Σ_t log π_θ(y_t | x, y_<t) ]

With no arguments it builds a ~0.5M-parameter Qwen2-architecture model with a character tokenizer,
teaches it 3-digit addition (the built-in `arithmetic` task) from a careless teacher's demonstrations,
which it learns to imitate, slips included (the alignment stages then reward the correct sum), and saves
model + tokenizer to `models/sft`. With `--model` and `--dataset` it fine-tunes any causal LM on any
prompt/completion or messages dataset.

    python sft.py                                   # tiny model, built-in task, a few minutes on a CPU
    python sft.py --model Qwen/Qwen2.5-0.5B --dataset trl-lib/Capybara         # a hub model: pretrained defaults
"""

from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

import common

# Flags whose default depends on the run: the built-in task's tuned value, or with any other dataset or model one
# fit for a pretrained model (TRL's where TRL has one). A flag given always wins; the run prints the set it used.
DEFAULTS = {  # flag: (built-in task, pretrained model)
    "lr": (1e-3, 2e-5),
    "warmup_steps": (20, 0),
    "batch_size": (64, 8),
    "max_new_tokens": (8, 256),
}


@dataclass
class Args:
    # model and data
    model: str | None = None
    """hub id or local path of the model to fine-tune; None builds the tiny from-scratch model"""
    dataset: str = "arithmetic"
    """`arithmetic` (built-in), a hub id, or a local .jsonl/.json/.parquet file"""
    dataset_config: str | None = None
    """the hub dataset's configuration name, if it has several"""
    max_length: int = 1024
    """prompt and completion are each truncated to this many tokens (prompts from the left)"""
    output_dir: str = "models/sft"
    """where the model and tokenizer are saved"""
    trust_remote_code: bool = False
    """allow model repositories to run their own code (off: only transformers' own architectures)"""
    # the tiny from-scratch model (when --model is not given)
    hidden_size: int = 128
    """tiny model only: hidden size"""
    num_layers: int = 2
    """tiny model only: transformer layers"""
    num_heads: int = 8
    """tiny model only: attention heads"""
    # optimisation
    steps: int = 1500
    """optimiser steps (the default takes the tiny model to the teacher's level on the built-in task)"""
    batch_size: int | None = None
    """sequences per micro-batch and process (a step: × grad_accum_steps × processes) (default: DEFAULTS)"""
    grad_accum_steps: int = 1
    """micro-batches whose gradients are summed before each optimiser step"""
    lr: float | None = None
    """peak learning rate (AdamW) (default: DEFAULTS)"""
    warmup_steps: int | None = None
    """linear warm-up steps (default: DEFAULTS)"""
    lr_decay: bool = True
    """after the warm-up, decay the learning rate linearly to 0 at the last step (--no-lr-decay: constant)"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping threshold (global L2 norm)"""
    # evaluation
    eval_every: int = 200
    """evaluate on the held-out split every this many steps (and at the end)"""
    eval_size: int = 500
    """held-out rows used for evaluation"""
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
    """bf16 autocast with fp32 master weights (default: on with CUDA)"""
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
    """name of the run (runs/<run_name>/metrics.jsonl); default sft__<seed>__<time>"""
    save_every: int = 0
    """write output_dir/checkpoint-<step>/ every this many steps (0: only when stopped by a signal)"""
    keep_checkpoints: int = 2
    """newest checkpoints kept; older ones are deleted"""
    resume: str | None = None
    """continue from this checkpoint directory, or `latest` in output_dir (none yet: start afresh)"""


# ---------------------------------------------------------------- the math
def sft_loss(logps: torch.Tensor, mask: torch.Tensor, num_tokens: float | None = None) -> torch.Tensor:
    """ℒ_SFT = −Σ_t mask_t·log π_θ(y_t) / Σ_t mask_t: token-mean negative log-likelihood of completions.

    When a step is split into micro-batches (or processes), pass the whole step's token count as
    `num_tokens`: the micro-batch losses then add up to the token mean of the whole step."""
    return -(logps * mask).sum() / (mask.sum() if num_tokens is None else num_tokens)


# ---------------------------------------------------------------- the method's helpers
def sft_batch(tokenizer, rows: list[dict], args: Args, eos_ids: list[int], device) -> dict:
    """The rows' prompts x and reference completions y (each ending at its first EOS), collated on `device`."""
    return common.completion_batch(tokenizer, rows, [r["completion"] for r in rows], args.max_length, eos_ids, device)


def completion_logps(model, batch: dict) -> torch.Tensor:
    """log π_θ of each completion token [B,T] (forward_logps, below: the LM head a chunk at a time)."""
    return forward_logps(model, batch["input_ids"], batch["attention_mask"], batch["completion_ids"].shape[1])


@torch.no_grad()
def greedy_completions(model, prompt_ids, prompt_mask, tokenizer, eos_ids: list[int], args: Args) -> list[str]:
    """The greedy completions of left-padded prompts, as text: what held-out accuracy is measured on."""
    out = generate_exactly(model, prompt_ids, prompt_mask, tokenizer, eos_ids, args.max_new_tokens)
    return tokenizer.batch_decode(out[:, prompt_ids.shape[1] :], skip_special_tokens=True)


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
        attention_dropout=0.0,  # dropout off: log-probs must be deterministic
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,  # the character tokenizer adds no BOS
    )
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


@torch.no_grad()
def evaluate(model, tokenizer, eos_ids: list[int], rows, args: Args, device, autocast) -> tuple[dict, list]:
    """Held-out loss (ℒ_SFT of the reference completions), and greedy exact-match accuracy when the rows have
    answers; plus every sample (without answers, the first few)."""
    model.eval()
    has_answers = all(r.get("answer") is not None for r in rows)
    total_nll, total_tokens, texts = 0.0, 0, []
    for i in range(0, len(rows), 64):
        batch = sft_batch(tokenizer, rows[i : i + 64], args, eos_ids, device)
        with autocast:
            total_nll -= (completion_logps(model, batch) * batch["completion_mask"]).sum().item()
            if has_answers or i == 0:  # without answers, only the few completions each evaluation prints
                k = None if has_answers else 4
                ids, mask = batch["prompt_ids"][:k], batch["prompt_mask"][:k]
                texts += greedy_completions(model, ids, mask, tokenizer, eos_ids, args)
        total_tokens += batch["completion_mask"].sum().item()
    model.train()
    metrics = {"eval/loss": total_nll / max(total_tokens, 1)}
    if has_answers:
        metrics["eval/accuracy"] = sum(common.is_correct(t, r["answer"]) for t, r in zip(texts, rows)) / len(rows)
    return metrics, [
        {"prompt": common.readable_prompt(r), "completion": t, "answer": r.get("answer")} for r, t in zip(rows, texts)
    ]


def main(args: Args):
    run = start_run(args, "sft")  # flags checked, --resume found, seeds set, torchrun's processes joined
    autocast = torch.autocast(run.device.type, dtype=torch.bfloat16, enabled=args.bf16)

    # 1. the model π_θ: the tiny from-scratch one, a hub/local model, or the checkpoint being resumed
    tokenizer, model = load_models(args, run)
    dist_model = wrap(model, args, run.device)  # the training forward, through DDP/FSDP2 under torchrun
    eos_ids = common.eos_token_ids(tokenizer, model.generation_config)  # completions end at the first of any

    # 2. the data: prompt x and completion y (ending in EOS) for every row, tokenized a batch at a time
    train_rows = common.load_rows(args.dataset, "train", "sft", tokenizer, args.dataset_config)
    eval_rows = common.load_rows(args.dataset, "test", "sft", tokenizer, args.dataset_config)[: args.eval_size]
    common.check_prompt_lengths(tokenizer, eval_rows, args.max_length)
    print(f"data: {len(train_rows)} train rows, {len(eval_rows)} held-out rows from {args.dataset}")

    # 3. AdamW (fused: one kernel, no parameter-sized temporaries), linear warm-up, then (--lr-decay) down to 0
    trainable = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=args.weight_decay, fused=True)
    schedule = lr_schedule(optimizer, args.warmup_steps, args.steps, decay=args.lr_decay)
    step_rows = args.batch_size * args.grad_accum_steps * run.world
    batches, progress = begin_training(args, run, model, optimizer, schedule, len(train_rows), step_rows)

    def run_eval(step: int) -> dict:
        return log_eval(run, step, *evaluate(model, tokenizer, eos_ids, eval_rows, args, run.device, autocast))

    last_eval = run.first_eval or run_eval(0)
    for step in progress:
        # 4. one step: ℒ_SFT, the token mean over all the step's completions, gradients summed over its
        # micro-batches and processes
        rows = [train_rows[i] for i in next(batches)]
        shares = [process_share(rows, run, args.batch_size, k) for k in range(args.grad_accum_steps)]
        micro_batches = [sft_batch(tokenizer, share, args, eos_ids, run.device) for share in shares]
        # this process's share of the step's completion tokens (DDP averages the processes' gradients)
        num_tokens = sum(b["completion_mask"].sum().item() for b in micro_batches)
        num_tokens = over_processes({"tokens": num_tokens}, run.device)["tokens"]
        loss = 0.0
        for k, batch in enumerate(micro_batches):
            with gradient_sync(dist_model, last=k == len(micro_batches) - 1):
                with autocast:
                    logps = completion_logps(dist_model, batch)
                micro_loss = sft_loss(logps, batch["completion_mask"], num_tokens)
                micro_loss.backward()
            loss += micro_loss.item()
        loss = over_processes({"loss": loss}, run.device)["loss"]
        grad_norm = optimizer_step(args, run, step, [model], optimizer)
        schedule.step()

        # 5. log, evaluate, checkpoint
        progress.set_postfix(loss=f"{loss:.4f}")
        if step % 10 == 0:
            metrics = dict(loss=loss, grad_norm=grad_norm, lr=schedule.get_last_lr()[0])
            log(run, {f"train/{k}": v for k, v in metrics.items()}, step)
        if step % args.eval_every == 0 or step == args.steps:
            last_eval = run_eval(step)
        maybe_checkpoint(args, run, step, model, tokenizer, optimizer, schedule)

    finish_run(args, run, model, tokenizer, last_eval)


# ======================================== plumbing: models, data, flag checks (main() reads fine without it)
def load_models(args: Args, run):
    """The tokenizer and π_θ: the tiny from-scratch model, a hub/local model (with LoRA adapters if asked), or
    the checkpoint being resumed; on run.device, in training mode."""
    if args.model is None and run.checkpoint is None:
        tokenizer = common.build_char_tokenizer()
        model = tiny_model(tokenizer, args)
    else:
        path = args.model if args.lora_r else run.checkpoint or args.model  # LoRA: the base model, then its adapter
        tokenizer = common.load_tokenizer(path, trust_remote_code=args.trust_remote_code)
        model = load_model(path, args.trust_remote_code)
        model = add_lora(model, args, adapter=run.checkpoint)
    if args.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    return tokenizer, model.to(run.device).train()


# the flags checked below the banner (check_args), besides those every script has
METHOD_POSITIVE = "batch_size max_length hidden_size num_layers num_heads".split()
METHOD_NON_NEGATIVE = "weight_decay".split()


def method_rules(args: Args) -> list[tuple[bool, str]]:
    """(broken, message): flag combinations that cannot work."""
    message = f"--hidden-size ({args.hidden_size}) must be divisible by --num-heads ({args.num_heads})"
    return [(args.hidden_size % args.num_heads != 0, message)]


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
