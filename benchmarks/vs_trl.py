"""This project's DPO, reward model and GRPO next to TRL's trainers: agreement and speed.

Agreement (`--part agreement`): the same weights (a random policy and a slightly perturbed copy as the reference; a random
reward model), the same character tokenizer and the same preference pairs of the built-in task go through
dpo.py's and reward_model.py's functions and through TRL's DPOTrainer and RewardTrainer (their own
tokenisation, collation and compute_loss). The first-step losses must agree to 1e-4 relative.

Tokenisation: TRL tokenizes prompt + completion in one call and appends EOS to the completions itself;
we tokenize them apart and append EOS too. With the character tokenizer (no merges across the boundary,
no BOS) both give the same ids; TRL pads whole sequences on the right, we left-pad prompts and pass
position ids, which gives the same positions.

    pip install -r benchmarks/requirements.txt
Speed (`--part speed`): the same saved model, the same rows of the built-in task and the same
hyperparameters through dpo.py, reward_model.py and grpo.py (each a subprocess, as a user runs it) and
through TRL's DPOTrainer, RewardTrainer and GRPOTrainer (each a subprocess of this file, `--worker`),
alternating ours/TRL, `--repeats` times. Throughput counts only training steps after `--skip` warm-up
steps (ours: the wall time in metrics.jsonl's step rows; TRL: a callback at each step's end), so imports,
TRL's tokenisation of the dataset and our held-out evaluations are outside it (ours tokenizes each batch
when it is drawn, inside the step). Peak memory is each process's peak RSS.

    pip install -r benchmarks/requirements.txt
    python benchmarks/vs_trl.py --size tiny
    python benchmarks/vs_trl.py --size 25m
    python benchmarks/vs_trl.py --part speed --size tiny
    python benchmarks/vs_trl.py --part speed --size 25m
"""

import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Literal

import torch
import transformers
import tyro
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, Qwen2Config

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import common  # noqa: E402
import dpo  # noqa: E402
import grpo  # noqa: E402
import reward_model  # noqa: E402
from benchmarks.results import run, write_section  # noqa: E402

SIZES = {  # the tiny built-in model, and a ~25M-parameter one
    "tiny": dict(
        hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8
    ),
    "25m": dict(
        hidden_size=512, intermediate_size=2048, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=8
    ),
}


@dataclass
class Args:
    part: Literal["agreement", "speed"] = "agreement"
    """agreement: first-step losses on identical inputs; speed: throughput and peak memory, ours / TRL"""
    size: Literal["tiny", "25m"] = "tiny"
    """model size (both are Qwen2-architecture, from a config, with the character tokenizer)"""
    pairs: int = 16
    """agreement: preference pairs in the batch"""
    beta: float = 0.1
    """DPO β"""
    methods: list[str] = field(default_factory=lambda: "dpo reward grpo".split())
    """speed: the methods to time"""
    repeats: int = 3
    """speed: runs of each implementation (alternating), for min/median/max"""
    steps: int = 30
    """speed: optimiser steps per run"""
    skip: int = 5
    """speed: first steps left out of the timing (allocator and autograd warm-up)"""
    batch_size: int = 32
    """speed: preference pairs per DPO / reward-model step"""
    prompts_per_step: int = 16
    """speed: GRPO prompts per step (× group_size completions)"""
    group_size: int = 8
    """speed: GRPO completions per prompt"""
    gradient_checkpointing: bool = True
    """speed: recompute activations in the backward pass, in both (TRL's default; ours is off by default)"""
    write: bool = True
    """write the result into benchmarks/RESULTS.md"""
    worker: Literal["dpo", "reward", "grpo"] | None = None
    """internal: run TRL's trainer for this method in this process (model in --model-dir, times to --out)"""
    model_dir: str = ""
    """internal: the worker's model"""
    out: str = ""
    """internal: where the worker writes its step times"""


def models(size: str, tokenizer):
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        num_labels=1,
        **SIZES[size],
    )
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_config(config).eval()
    ref = AutoModelForCausalLM.from_config(config).eval()
    ref.load_state_dict(
        {k: v + 0.02 * torch.randn_like(v) for k, v in policy.state_dict().items()}
    )  # near the policy, not equal
    rm = AutoModelForSequenceClassification.from_config(config).eval()
    return policy, ref, rm


@torch.no_grad()
def ours(policy, ref, rm, tokenizer, rows, beta) -> dict:
    batch = dpo.pair_batch(tokenizer, rows, 1024, "cpu")
    chosen, rejected = dpo.sequence_logps(policy, batch).chunk(2)
    ref_chosen, ref_rejected = dpo.sequence_logps(ref, batch).chunk(2)
    dpo_value = dpo.dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta)[0].mean().item()
    batch = reward_model.pair_batch(tokenizer, rows, 1024, "cpu")
    chosen, rejected = reward_model.score_at_last_token(rm, batch["input_ids"], batch["attention_mask"]).chunk(2)
    return {"dpo": dpo_value, "reward": reward_model.bradley_terry_loss(chosen, rejected).mean().item()}


@torch.no_grad()
def trl_losses(policy, ref, rm, tokenizer, rows, beta) -> dict:
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer, RewardConfig, RewardTrainer

    common_config = dict(
        per_device_train_batch_size=len(rows),
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        report_to=[],
        max_length=None,
        dataloader_num_workers=0,
    )
    data = Dataset.from_list(rows)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        trainer = DPOTrainer(
            model=policy,
            ref_model=ref,
            args=DPOConfig(output_dir=tmp, beta=beta, **common_config),
            train_dataset=data,
            processing_class=tokenizer,
        )
        batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(rows))])  # in order, unshuffled
        out["dpo"] = trainer.compute_loss(trainer.model, batch).item()
        trainer = RewardTrainer(
            model=rm, args=RewardConfig(output_dir=tmp, **common_config), train_dataset=data, processing_class=tokenizer
        )
        batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(rows))])
        out["reward"] = trainer.compute_loss(trainer.model, batch).item()
    return out


# GRPO's loss variants on identical tensors: (name, grpo_loss keywords, TRL trainer attributes), β 0.04 unless set
GRPO_VARIANTS = [
    ("GRPO (the lecture's)", {}, {}),
    ("clip-higher ε_h 0.28", {"clip_eps_high": 0.28}, {"epsilon_high": 0.28}),
    (
        "sequence-level ratio (GSPO)",
        {"importance_sampling_level": "sequence"},
        {"importance_sampling_level": "sequence"},
    ),
    ("truncated completions masked", {"truncated": True}, {"truncated": True}),
    ("dapo, TRL's defaults (β 0, ε_h = ε)", {"loss_type": "dapo", "beta": 0.0}, {"loss_type": "dapo", "beta": 0.0}),
    ("dr_grpo", {"loss_type": "dr_grpo"}, {"loss_type": "dr_grpo"}),
]


def grpo_agreement(policy, tokenizer) -> list[tuple[str, float, float, float]]:
    """For each variant: (name, our loss, TRL's loss, max |our gradient − TRL's| w.r.t. the log-probs). The same
    per-token log-probs (a random perturbation of the old ones, so that ratios leave the clip range), old and
    reference log-probs, advantages and masks go through grpo.grpo_loss and through TRL's
    GRPOTrainer._compute_loss, whose model forward is replaced by those log-probs."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    g = torch.Generator().manual_seed(0)
    B, T, L = 8, 6, 8
    mask = (torch.arange(T)[None] < torch.tensor([6, 3, 1, 5, 6, 2, 4, 6])[:, None]).long()
    old = -torch.rand(B, T, generator=g) * 3
    logps0, ref = old + torch.randn(B, T, generator=g) * 0.3, old + torch.randn(B, T, generator=g) * 0.3
    advantages, ended = torch.randn(B, generator=g), torch.tensor([True, False, True, True, False, True, True, True])
    with tempfile.TemporaryDirectory() as tmp:
        config = GRPOConfig(
            output_dir=tmp, use_cpu=True, bf16=False, report_to=[], per_device_train_batch_size=B, num_generations=2,
            max_completion_length=L, gradient_checkpointing=False, beta=0.0, loss_type="grpo", use_bias_correction_kl=False,  # β set below: no ref model; KL as DeepSeekMath
        )  # fmt: skip
        trainer = GRPOTrainer(
            model=policy,
            reward_funcs=[lambda completions, **_: [0.0] * len(completions)],
            args=config,
            train_dataset=Dataset.from_list([{"prompt": "1+1="}] * B),
            processing_class=tokenizer,
        )
        rows = []
        for name, ours_kw, trl_kw in GRPO_VARIANTS:
            ours_kw, trl_kw = dict(ours_kw), dict(trl_kw)
            loss_mask = grpo.overlong_filter(mask, ended) if ours_kw.pop("truncated", False) else mask
            trl_kw.pop("truncated", None)  # TRL masks them when it builds the batch (mask_truncated_completions)
            kw = {"beta": 0.04, "loss_type": "grpo", **ours_kw}
            logps = logps0.clone().requires_grad_(True)
            ours_loss, _ = grpo.grpo_loss(logps, old, ref, advantages, loss_mask, 0.2, max_completion_length=L, **kw)
            (ours_grad,) = torch.autograd.grad(ours_loss, logps)
            settings = {"beta": 0.04, "loss_type": "grpo", "epsilon_high": 0.2, "importance_sampling_level": "token"}
            for key, value in (settings | trl_kw).items():
                setattr(trainer, key, value)
            logps = logps0.clone().requires_grad_(True)
            trainer._get_per_token_logps_and_entropies = lambda *_, **__: (logps, torch.zeros_like(logps), None)
            inputs = {
                "prompt_ids": torch.ones(B, 1, dtype=torch.long),
                "prompt_mask": torch.ones(B, 1, dtype=torch.long),
                "completion_ids": torch.ones(B, T, dtype=torch.long),
                "completion_mask": loss_mask,
                "advantages": advantages,
                "old_per_token_logps": old,
                "ref_per_token_logps": ref,
                "num_items_in_batch": loss_mask.sum(),
            }
            trl_loss = trainer._compute_loss(trainer.model, inputs)
            (trl_grad,) = torch.autograd.grad(trl_loss, logps)
            rows.append((name, ours_loss.item(), trl_loss.item(), (ours_grad - trl_grad).abs().max().item()))
    return rows


def reward_agreement(policy, tokenizer) -> tuple[float, float]:
    """grpo.compute_rewards's summed rewards next to TRL's: GRPOTrainer._calculate_rewards, then its weighted nansum, for the
    same rows (one without an answer, an extra column), completions, reward functions (a built-in, one reading
    the extra column, one that returns None) and weights. Returns (max |ours − TRL's| summed, per function)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    def shaped(completions, bonus, **_):
        return [b * len(c) for c, b in zip(completions, bonus)]

    def only_short(completions, **_):
        return [1.0 if len(c) < 3 else None for c in completions]

    funcs, weights = [grpo.accuracy, shaped, only_short], [1.0, 0.5, -2.0]
    rows = [{"prompt": f"{a}+{a}=", "answer": str(2 * a) if a % 3 else None, "bonus": a / 4} for a in range(6)]
    completions = ["2", "#### 2", "xyz", "6", "the answer is 8", "10"]
    completion_ids = [common.tokenize(tokenizer, [c], add_eos=True)[0] for c in completions]
    ended = torch.tensor([True] * len(rows))
    sources = SimpleNamespace(funcs=[(f.__name__, f) for f in funcs], model=None, tokenizer=None)
    args = grpo.Args(reward_weights=tuple(weights), max_new_tokens=8, steps=1)
    ours, values = grpo.compute_rewards(
        sources, rows, completions, completion_ids, ended, torch.zeros(6, 1), None, args, 1
    )
    with tempfile.TemporaryDirectory() as tmp:
        config = GRPOConfig(
            output_dir=tmp, use_cpu=True, bf16=False, report_to=[], per_device_train_batch_size=6, num_generations=2,
            gradient_checkpointing=False, reward_weights=weights,
        )  # fmt: skip
        trainer = GRPOTrainer(
            model=policy,
            reward_funcs=funcs,
            args=config,
            train_dataset=Dataset.from_list(rows),
            processing_class=tokenizer,
        )
        per_func = trainer._calculate_rewards(rows, [r["prompt"] for r in rows], completions, completion_ids)
        theirs = (per_func * trainer.reward_weights.unsqueeze(0)).nansum(dim=1)
    ours_table = torch.tensor([[math.nan if v is None else v for v in vs] for vs in values.values()]).T
    per_func_diff = (ours_table.nan_to_num(-99) - per_func.nan_to_num(-99)).abs().max().item()
    return (ours - theirs).abs().max().item(), per_func_diff


# ---------------------------------------------------------------- speed
LR = {"dpo": 1e-4, "reward": 1e-4, "grpo": 2e-4}
OUR_SCRIPT = {"dpo": "dpo.py", "reward": "reward_model.py", "grpo": "grpo.py"}


def write_data(args: Args, workdir: Path) -> dict[str, Path]:
    """One local file per kind with enough rows for every step; ours and TRL both train on its first 90%
    (common.load_raw holds the last 10% out, ours evaluates on it)."""
    need = args.steps * max(args.batch_size, args.prompts_per_step)
    files = {}
    for kind in ["preference", "prompt"]:
        rows = common.arithmetic_rows("train", kind)[: need * 10 // 9 + 10]
        files[kind] = workdir / f"{kind}.jsonl"
        files[kind].write_text("".join(json.dumps(r) + "\n" for r in rows))
    return files


def ours_flags(method: str, args: Args, model: Path, data: dict, out: Path) -> list[str]:
    flags = [
        "--model",
        str(model),
        "--steps",
        str(args.steps),
        "--lr",
        str(LR[method]),
        *"--warmup-steps 1 --eval-every".split(),
        str(10**6),
        *"--eval-size 16 --output-dir".split(),
        str(out / "model"),
        "--run-name",
        "run",
    ]
    flags += ["--gradient-checkpointing"] if args.gradient_checkpointing else []
    if method == "grpo":
        return flags + [
            "--dataset",
            str(data["prompt"]),
            "--prompts-per-step",
            str(args.prompts_per_step),
            "--group-size",
            str(args.group_size),
            *"--grad-accum-steps 1 --beta 0.04 --loss-type grpo --temperature 0.7 --max-new-tokens 8".split(),
        ]
    flags += ["--beta", str(args.beta)] if method == "dpo" else ["--no-lr-decay"]  # TRL's runs: constant learning rate
    return flags + ["--dataset", str(data["preference"]), "--batch-size", str(args.batch_size)]


# TRL's trainers set as ours run on the CPU: fp32, a constant learning rate, no warm-up, no saving or reporting
TRL_CPU = dict(
    lr_scheduler_type="constant",
    warmup_steps=0,
    max_grad_norm=1.0,
    use_cpu=True,
    bf16=False,
    report_to=[],
    logging_steps=1,
    save_strategy="no",
    dataloader_num_workers=0,
)


def step_end_times(times: list):
    """A TRL callback appending the wall time at the end of each optimiser step to `times`."""
    from transformers import TrainerCallback

    class StepTimes(TrainerCallback):
        def on_step_end(self, *_, **__):
            times.append(time.time())

    return StepTimes()


def trl_worker(args: Args):
    """One TRL training run with the hyperparameters of ours_flags; writes its step-end times and logs."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, RewardConfig, RewardTrainer

    transformers.utils.logging.set_verbosity_error()
    tokenizer = common.load_tokenizer(args.model_dir)
    kind = "prompt" if args.worker == "grpo" else "preference"
    data = Dataset.from_list(common.load_raw(str(Path(args.out).parent.parent / f"{kind}.jsonl"), "train")[0])
    times = []
    with tempfile.TemporaryDirectory() as tmp:
        config = dict(
            output_dir=tmp,
            max_steps=args.steps,
            learning_rate=LR[args.worker],
            seed=1,
            gradient_checkpointing=args.gradient_checkpointing,
            **TRL_CPU,
        )
        if args.worker == "grpo":

            def correct(completions, answer, **_):
                return [float(common.is_correct(c, a)) for c, a in zip(completions, answer)]

            config = GRPOConfig(
                per_device_train_batch_size=args.prompts_per_step * args.group_size,
                num_generations=args.group_size,
                steps_per_generation=1,
                max_completion_length=8,
                temperature=0.7,
                top_p=1.0,
                top_k=0,
                beta=0.04,
                epsilon=0.2,
                loss_type="grpo",
                scale_rewards="group",
                **config,
            )
            trainer = GRPOTrainer(
                model=AutoModelForCausalLM.from_pretrained(args.model_dir),
                reward_funcs=[correct],
                args=config,
                train_dataset=data,
                processing_class=tokenizer,
                callbacks=[step_end_times(times)],
            )
        elif args.worker == "dpo":
            config = DPOConfig(per_device_train_batch_size=args.batch_size, beta=args.beta, max_length=None, **config)
            trainer = DPOTrainer(
                model=AutoModelForCausalLM.from_pretrained(args.model_dir),
                args=config,
                train_dataset=data,
                processing_class=tokenizer,
                callbacks=[step_end_times(times)],
            )
        else:
            config = RewardConfig(per_device_train_batch_size=args.batch_size, max_length=None, **config)
            model = AutoModelForSequenceClassification.from_pretrained(args.model_dir, num_labels=1)
            trainer = RewardTrainer(
                model=model,
                args=config,
                train_dataset=data,
                processing_class=tokenizer,
                callbacks=[step_end_times(times)],
            )
        trainer.train()
        trainer.save_model(tmp)  # ours saves its model too
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    Path(args.out).write_text(json.dumps({"times": times, "completion_lengths": lengths}))


def measure(method: str, impl: str, args: Args, workdir: Path, model: Path, data: dict) -> dict:
    """samples/s and tokens/s over steps skip+1..steps, and peak RSS, of one run of `impl` (ours | trl)."""
    out = workdir / f"{method}-{impl}"
    shutil.rmtree(out, ignore_errors=True)  # a fresh run each time (metrics.jsonl would be appended to)
    out.mkdir()
    if impl == "ours":
        proc = run(OUR_SCRIPT[method], ours_flags(method, args, model, data, out), cwd=out)
        rows = [json.loads(line) for line in (out / "runs" / "run" / "metrics.jsonl").read_text().splitlines()]
        rows = [r for r in rows if "train/loss" in r]
        times = [r["time/elapsed_s"] for r in rows]
        lengths = [r.get("train/completions/mean_length", 0.0) for r in rows]
    else:
        result = out / "trl.json"
        proc = run(
            "benchmarks/vs_trl.py",
            [
                "--worker",
                method,
                "--model-dir",
                str(model),
                "--out",
                str(result),
                "--steps",
                str(args.steps),
                "--batch-size",
                str(args.batch_size),
                "--beta",
                str(args.beta),
                "--prompts-per-step",
                str(args.prompts_per_step),
                "--group-size",
                str(args.group_size),
                "--gradient-checkpointing" if args.gradient_checkpointing else "--no-gradient-checkpointing",
            ],
            cwd=out,
        )
        result = json.loads(result.read_text())
        times, lengths = result["times"], result["completion_lengths"]
    assert len(times) == args.steps, (impl, method, len(times))
    seconds = times[-1] - times[args.skip - 1]
    steps = args.steps - args.skip
    if method == "grpo":
        samples = args.prompts_per_step * args.group_size
        prompt_tokens = statistics.mean(
            len(json.loads(line)["prompt"]) for line in data["prompt"].read_text().splitlines()
        )
        tokens = samples * (prompt_tokens + statistics.mean(lengths[args.skip :]))
    else:  # a pair is two sequences: prompt + chosen + EOS and prompt + rejected + EOS (one character is one token)
        samples = args.batch_size
        rows = [json.loads(line) for line in data["preference"].read_text().splitlines()]
        tokens = samples * statistics.mean(
            2 * len(r["prompt"]) + len(r["chosen"]) + len(r["rejected"]) + 2 for r in rows
        )
    return {"samples_s": samples * steps / seconds, "tokens_s": tokens * steps / seconds, "rss_gb": proc["peak_rss_gb"]}


def speed(args: Args):
    import trl

    tokenizer = common.build_char_tokenizer()
    policy, _, _ = models(args.size, tokenizer)
    n_params = sum(p.numel() for p in policy.parameters())
    results = {m: {"ours": [], "trl": []} for m in args.methods}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        policy.save_pretrained(workdir / "model")
        tokenizer.save_pretrained(workdir / "model")
        data = write_data(args, workdir)
        for repeat in range(args.repeats):
            for method in args.methods:
                for impl in ["ours", "trl"]:
                    results[method][impl].append(measure(method, impl, args, workdir, workdir / "model", data))
                    print(method, impl, repeat, results[method][impl][-1], flush=True)
    names = {
        "dpo": f"DPO ({args.batch_size} pairs/step)",
        "reward": f"reward model ({args.batch_size} pairs/step)",
        "grpo": f"GRPO ({args.prompts_per_step}×{args.group_size} completions/step, 8 new tokens)",
    }
    lines = [
        "| method | ours samples/s | TRL samples/s | throughput ours/TRL min / median / max | ours tokens/s | TRL tokens/s "
        "| peak RSS ours / TRL (GB) | peak memory ours/TRL min / median / max |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def spread(values):
        return f"{min(values):.2f} / {statistics.median(values):.2f} / {max(values):.2f}"

    for method in args.methods:
        ours, theirs = results[method]["ours"], results[method]["trl"]
        med = {
            impl: {k: statistics.median(r[k] for r in results[method][impl]) for k in ours[0]}
            for impl in ["ours", "trl"]
        }
        lines.append(
            f"| {names[method]} | {med['ours']['samples_s']:.0f} | {med['trl']['samples_s']:.0f} "
            f"| {spread([a['samples_s'] / b['samples_s'] for a, b in zip(ours, theirs)])} "
            f"| {med['ours']['tokens_s']:.0f} | {med['trl']['tokens_s']:.0f} "
            f"| {med['ours']['rss_gb']:.2f} / {med['trl']['rss_gb']:.2f} "
            f"| {spread([a['rss_gb'] / b['rss_gb'] for a, b in zip(ours, theirs)])} |"
        )
    command = "python benchmarks/vs_trl.py " + " ".join(sys.argv[1:])
    recompute = "with" if args.gradient_checkpointing else "without"
    text = (
        f"### {args.size} model ({n_params / 1e6:.2f}M parameters), {recompute} gradient checkpointing: throughput and peak memory, "
        f"ours / TRL {trl.__version__}\n\n"
        + "\n".join(lines)
        + f"\n\n{args.repeats} runs of each, alternating ours/TRL, {args.steps} steps each, timed over the last "
        f"{args.steps - args.skip} (ratios pair run i of ours with run i of TRL). Command: `{command}`; "
        f"{time.strftime('%Y-%m-%d')}, CPU fp32, torch {torch.__version__}, {torch.get_num_threads()} threads."
    )
    print(text)
    if args.write:
        write_section(f"vs_trl_speed_{args.size}_{'recompute' if args.gradient_checkpointing else 'stored'}", text)


def main(args: Args):
    import datasets
    import trl

    transformers.utils.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    tokenizer = common.build_char_tokenizer()
    rows = common.arithmetic_rows("train", "preference")[: args.pairs]
    policy, ref, rm = models(args.size, tokenizer)
    n_params = sum(p.numel() for p in policy.parameters())
    a = ours(policy, ref, rm, tokenizer, rows, args.beta)
    b = trl_losses(policy, ref, rm, tokenizer, rows, args.beta)
    lines = [
        "| loss (first step, same inputs) | ours | TRL " + trl.__version__ + " | relative difference | within 1e-4 |",
        "|---|---|---|---|---|",
    ]
    for name, label in [("dpo", f"DPO (sigmoid, β = {args.beta})"), ("reward", "reward model (Bradley–Terry)")]:
        rel = abs(a[name] - b[name]) / abs(b[name])
        lines.append(f"| {label} | {a[name]:.8f} | {b[name]:.8f} | {rel:.1e} | {'yes' if rel <= 1e-4 else 'NO'} |")
    variants = grpo_agreement(policy, tokenizer)
    lines += [
        "",
        "| GRPO loss on identical tensors | ours | TRL "
        + trl.__version__
        + " | relative difference | max gradient difference | within 1e-4 |",
    ]
    lines += ["|---|---|---|---|---|---|"]
    for name, x, y, grad in variants:
        rel = abs(x - y) / abs(y)
        lines.append(
            f"| {name} | {x:.8f} | {y:.8f} | {rel:.1e} | {grad:.1e} | {'yes' if rel <= 1e-4 and grad <= 1e-6 else 'NO'} |"
        )
    summed, per_func = reward_agreement(policy, tokenizer)
    rewards_agree = summed <= 1e-6 and per_func <= 1e-6
    lines += [
        "",
        "| GRPO rewards on identical completions (3 functions, weights 1, 0.5, −2, None in some rows) | max difference, summed | max difference, per function | equal |",
        "|---|---|---|---|",
        f"| `grpo.compute_rewards` vs TRL's `_calculate_rewards` + weighted nansum | {summed:.1e} | {per_func:.1e} | {'yes' if rewards_agree else 'NO'} |",
    ]
    text = (
        f"### {args.size} model ({n_params / 1e6:.2f}M parameters), {args.pairs} pairs of the built-in task, CPU fp32\n\n"
        + "\n".join(lines)
        + "\n\nGRPO: TRL's `_compute_loss` with its model forward replaced by the same log-probs; TRL 1.16 multiplies "
        "the KL term by ρ by default (`use_bias_correction_kl`, DeepSeek-V3.2), turned off here: ours is DeepSeekMath's k3. "
        "TRL masks truncated completions when it builds the batch, so that row gives both the masked batch. "
        f"Command: `python benchmarks/vs_trl.py --size {args.size}`."
    )
    print(text)
    if args.write:
        write_section(f"vs_trl_agreement_{args.size}", text)
    if (
        any(abs(a[k] - b[k]) / abs(b[k]) > 1e-4 for k in a)
        or any(abs(x - y) / abs(y) > 1e-4 or g > 1e-6 for _, x, y, g in variants)
        or not rewards_agree
    ):
        sys.exit("the losses disagree beyond 1e-4 relative")


if __name__ == "__main__":
    cli = tyro.cli(Args)
    if cli.worker:
        trl_worker(cli)
    elif cli.part == "speed":
        speed(cli)
    else:
        main(cli)
