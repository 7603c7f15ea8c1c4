"""The lecture's closing comparison of PPO, DPO and GRPO, measured on the built-in task.

For each seed it runs the whole pipeline as a user would (each script a subprocess with its defaults):
sft, reward_model, then ppo, dpo and grpo from the same SFT model, and a control: the SFT model trained on
(with sft.py) for DPO's steps, batch and learning rate, on the same demonstrations. A method's gain over the
control is what its own signal (reward, preferences) adds to more training. It writes a markdown table (models held in memory,
trainable parameters, peak memory, wall time, share of time generating, held-out accuracy before → after,
KL to the reference at the end) into benchmarks/RESULTS.md and plots held-out accuracy against wall time
to benchmarks/compare.png.

    pip install -r benchmarks/requirements.txt
    python benchmarks/compare.py --seeds 1 2 3
    python benchmarks/compare.py --seeds 1 2 3 --bf16     # every stage in bf16 autocast (the GPU's numerics)
    python benchmarks/compare.py --seeds 1 2 3 --lora-r 8  # PPO, DPO and GRPO also with LoRA adapters, side by side
"""

import json
import os
import platform
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import transformers
import tyro
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import common  # noqa: E402
import dpo  # noqa: E402
import grpo  # noqa: E402
from benchmarks.results import RESULTS, run, write_section  # noqa: E402

METHODS = {  # what each method holds in memory while it trains (from the scripts)
    "ppo": "4: policy, reference, reward model, critic",
    "dpo": "2: policy, reference (pairs sampled from it once; its log-probs per batch)",
    "grpo": "2: policy, reference (rule-based reward)",
    "more_sft": "1: policy",
}
LABELS = {"ppo": "PPO", "dpo": "DPO", "grpo": "GRPO", "more_sft": "more SFT (control)"}
LORA = {  # with --lora-r: what each method holds as <method>_lora, and its learning rate (adapters want a larger one)
    "ppo": (
        "3: policy (π_ref: its adapter off), reward model, critic (adapter + value head on a copy of the base)",
        "2e-4",
    ),
    "dpo": ("1: policy (π_ref: its adapter off; pairs sampled from it once; its log-probs per batch)", "1e-4"),
    "grpo": ("1: policy (π_ref: its adapter off)", "1e-3"),
}
# the control: sft.py continued from models/sft with DPO's built-in-task steps, batch and learning rate
CONTROL = "--model models/sft --output-dir models/more_sft".split() + [
    x for flag in ("steps", "batch_size", "lr") for x in (f"--{flag.replace('_', '-')}", str(dpo.DEFAULTS[flag][0]))
]


@dataclass
class Args:
    seeds: list[int] = field(default_factory=lambda: [1])
    """seeds of the alignment stages; the table reports mean ± standard deviation over them"""
    sft_seed: int = 1
    """seed of the one SFT model and reward model all methods start from"""
    bf16: bool = False
    """run every stage with --bf16 (bf16 autocast, frozen models in bf16); the section and plot get a _bf16 suffix"""
    workdir: str = "runs/compare"
    """where each seed's models and runs are written"""
    results: str = str(RESULTS)
    """markdown file whose comparison section is (re)written"""
    plot: str | None = None
    """held-out accuracy against wall time (default: benchmarks/compare.png, or compare_bf16.png with --bf16)"""
    eval_every: int = 10
    """held-out evaluation interval passed to the alignment stages (points on the plot)"""
    lora_r: int = 0
    """> 0: PPO, DPO and GRPO also run with LoRA adapters of this rank (LORA's learning rates, merged on save),
    side by side with full fine-tuning in one table (section compare_lora)"""


@torch.no_grad()
def kl_to_reference(policy_dir: Path, ref_dir: Path, n: int = 500) -> float:
    """KL(π ‖ π_ref) per completion: Σ_t log π(y_t) − log π_ref(y_t) over completions sampled from π at
    temperature 1, averaged over the held-out prompts (a Monte Carlo estimate, the same for every method)."""
    tokenizer = common.load_tokenizer(policy_dir)
    policy, ref = (AutoModelForCausalLM.from_pretrained(d).eval() for d in (policy_dir, ref_dir))
    prompts = common.tokenize(tokenizer, [r["prompt"] for r in common.arithmetic_rows("test", "prompt")[:n]])
    ids, mask = common.pad(prompts, tokenizer.pad_token_id, "left")
    torch.manual_seed(0)
    out = policy.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=8,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    completion = out[:, ids.shape[1] :]
    cmask = grpo.completion_mask(completion, torch.tensor([tokenizer.eos_token_id]))
    full_mask = torch.cat([mask, cmask], 1)
    position_ids = (full_mask.cumsum(-1) - 1).clamp(min=0)
    logps = [
        grpo.token_logprobs(
            m(input_ids=out, attention_mask=full_mask, position_ids=position_ids).logits[:, ids.shape[1] - 1 : -1],
            completion,
        )
        for m in (policy, ref)
    ]
    return ((logps[0] - logps[1]) * cmask).sum(1).mean().item()


def stage(name: str, seed: int, cwd: Path, args: Args) -> dict:
    method = name.removesuffix("_lora")
    flags = [
        "--seed",
        str(seed),
        "--run-name",
        name,
        "--bf16" if args.bf16 else "--no-bf16",
    ]
    if method in METHODS:
        flags += ["--eval-every", str(args.eval_every)]
    if name == "more_sft":
        flags = CONTROL + flags
    if name.endswith("_lora"):
        flags += [
            "--lora-r",
            str(args.lora_r),
            "--lr",
            LORA[method][1],
            "--merge-lora",
            "--output-dir",
            f"models/{name}",
        ]
    print(f"seed {seed}: {name}", flush=True)
    shutil.rmtree(
        cwd / "runs" / name, ignore_errors=True
    )  # a rerun starts afresh: metrics.jsonl is appended to (for resumes)
    result = run("sft.py" if name == "more_sft" else f"{method}.py", flags, cwd)
    result["rows"] = [json.loads(line) for line in (cwd / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    return result


def pipeline(seed: int, base: dict, args: Args) -> dict:
    """PPO, DPO, GRPO and the control with this seed, from the shared SFT model and reward model in `base`."""
    cwd = Path(args.workdir).resolve() / f"seed{seed}"
    (cwd / "models").mkdir(parents=True, exist_ok=True)
    for name in ("sft", "reward"):
        link = cwd / "models" / name
        if not link.exists():
            link.symlink_to(base["dir"] / "models" / name)
    results = {"sft": base["sft"], "reward_model": base["reward_model"]}
    for name in columns(args):
        results[name] = stage(name, seed, cwd, args)
    for method in columns(args):
        r, rows = results[method], results[method]["rows"]
        evals = [row for row in rows if "eval/accuracy" in row]
        r["curve"] = [(row["time/elapsed_s"], row["eval/accuracy"]) for row in evals]
        r["before"], r["after"] = evals[0]["eval/accuracy"], evals[-1]["eval/accuracy"]
        r["generation_share"] = sum(row.get("train/generation_s", 0.0) for row in rows) / r["wall_s"]
        r["kl"] = kl_to_reference(cwd / "models" / method, cwd / "models" / "sft")
        r["trainable"] = rows[0]["train/trainable_parameters"]  # PPO: policy and critic
        del r["rows"]
    return results


def base_models(args: Args) -> dict:
    """The SFT model and the reward model every method starts from (trained once, with --sft-seed)."""
    cwd = Path(args.workdir).resolve() / "base"
    cwd.mkdir(parents=True, exist_ok=True)
    base = {
        "dir": cwd,
        "sft": stage("sft", args.sft_seed, cwd, args),
        "reward_model": stage("reward_model", args.sft_seed, cwd, args),
    }
    base["reward_model"]["accuracy"] = [row for row in base["reward_model"]["rows"] if "eval/accuracy" in row][-1][
        "eval/accuracy"
    ]
    return base


def mean_spread(values, fmt="{:.1f}", scale=1.0) -> str:
    """mean ± sample standard deviation"""
    values = np.array(values) * scale
    text = fmt.format(values.mean())
    return text + (" ± " + fmt.format(values.std(ddof=1)) if len(values) > 1 else "")


def columns(args: Args) -> list[str]:
    """The runs of each seed: every method, each followed by its LoRA run with --lora-r."""
    lora = [f"{m}_lora" for m in LORA] if args.lora_r else []
    return sorted([*METHODS, *lora], key=lambda name: list(METHODS).index(name.removesuffix("_lora")))


def label(name: str, args: Args) -> str:
    return f"{LABELS[name[:-5]]} LoRA r={args.lora_r}" if name.endswith("_lora") else LABELS[name]


def in_memory(name: str) -> str:
    return LORA[name[:-5]][0] if name.endswith("_lora") else METHODS[name]


def trained(run: dict) -> list[str]:
    """The alignment runs of one seed's results, in their order (sft and reward_model are shared)."""
    return [name for name in run if name not in ("sft", "reward_model")]


def table(runs: list[dict], args: Args) -> str:
    columns = trained(runs[0])
    lines = [
        "| | " + " | ".join(label(m, args) for m in columns) + " |",
        "|---|" + "---|" * len(columns),
        "| models in memory | " + " | ".join(in_memory(m) for m in columns) + " |",
        "| trainable parameters | " + " | ".join(f"{runs[0][m]['trainable'] / 1e6:.2f}M" for m in columns) + " |",
        "| peak memory (process RSS, GB) | "
        + " | ".join(mean_spread([r[m]["peak_rss_gb"] for r in runs], "{:.2f}") for m in columns)
        + " |",
        "| wall time (s) | "
        + " | ".join(mean_spread([r[m]["wall_s"] for r in runs], "{:.0f}") for m in columns)
        + " |",
        "| share of time generating | "
        + " | ".join(mean_spread([r[m]["generation_share"] for r in runs], "{:.0f}%", 100) for m in columns)
        + " |",
        "| held-out accuracy before → after (%) | "
        + " | ".join(
            mean_spread([r[m]["before"] for r in runs], scale=100)
            + " → "
            + mean_spread([r[m]["after"] for r in runs], scale=100)
            for m in columns
        )
        + " |",
        "| KL(π ‖ π_ref) per completion at the end (nats) | "
        + " | ".join(mean_spread([r[m]["kl"] for r in runs], "{:.3f}") for m in columns)
        + " |",
    ]
    extra = (
        f"PPO's wall time excludes training its reward model ({mean_spread([r['reward_model']['wall_s'] for r in runs], '{:.0f}')} s, "
        f"held-out pairwise accuracy {mean_spread([r['reward_model']['accuracy'] for r in runs], scale=100)}%); all start "
        f"from the same SFT model ({mean_spread([r['sft']['wall_s'] for r in runs], '{:.0f}')} s)."
    )
    return "\n".join(lines) + "\n\n" + extra


def plot(runs: list[dict], path: str, args: Args):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    colors = dict(zip(METHODS, "tab:red tab:blue tab:green tab:gray".split()))
    for method in trained(runs[0]):
        color = colors[method.removesuffix("_lora")]
        for k, r in enumerate(runs):
            t, acc = zip(*r[method]["curve"])
            ax.plot(
                t,
                np.array(acc) * 100,
                color=color,
                marker="o",
                markersize=3,
                alpha=1.0 if k == 0 else 0.35,
                linestyle="--" if method == "more_sft" else ":" if method.endswith("_lora") else "-",
                label=label(method, args) if k == 0 else None,
            )
    ax.set_xlabel(
        "wall time of the stage (s, 2 CPU cores)" if not torch.cuda.is_available() else "wall time of the stage (s)"
    )
    ax.set_ylabel("held-out greedy accuracy (%)")
    ax.set_title(
        "3-digit addition: alignment from the same SFT model" + (f" ({len(runs)} seeds)" if len(runs) > 1 else "")
    )
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(args: Args):
    transformers.utils.logging.disable_progress_bar()
    section = "compare" + ("_lora" if args.lora_r else "") + ("_bf16" if args.bf16 else "")
    plot_path = args.plot or str(ROOT / "benchmarks" / f"{section}.png")
    base = base_models(args)
    runs = [pipeline(seed, base, args) for seed in args.seeds]
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores" + (
        f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ", no GPU"
    )
    command = (
        f"python benchmarks/compare.py --seeds {' '.join(map(str, args.seeds))} --sft-seed {args.sft_seed}"
        + (" --bf16" if args.bf16 else "")
        + (f" --lora-r {args.lora_r}" if args.lora_r else "")
    )
    text = (
        f"### PPO vs DPO vs GRPO on the built-in task{', full fine-tuning vs LoRA' if args.lora_r else ''}"
        f"{', bf16 autocast' if args.bf16 else ', fp32'}\n\n"
        f"Measured {time.strftime('%Y-%m-%d')} on {machine} (torch {torch.__version__}); `{command}`: every stage with its "
        f"defaults; one SFT model and reward model (seed "
        f"{args.sft_seed}), then PPO, DPO, GRPO and the control (`sft.py {' '.join(CONTROL)}`) with seeds {', '.join(map(str, args.seeds))}; held-out evaluation every "
        f"{args.eval_every} steps. Mean ± standard deviation over seeds. Peak memory is each training process's own maximum resident set."
        + (
            f" LoRA: adapters of rank {args.lora_r} on every linear layer, learning rates "
            + ", ".join(f"{LABELS[m]} {lr}" for m, (_, lr) in LORA.items())
            + ", otherwise the defaults."
            if args.lora_r
            else ""
        )
        + "\n\n"
        + table(runs, args)
        + f"\n\n![held-out accuracy against wall time]({Path(plot_path).name})\n"
    )
    write_section(section, text, Path(args.results))
    plot(runs, plot_path, args)
    print(text)


if __name__ == "__main__":
    main(tyro.cli(Args))
