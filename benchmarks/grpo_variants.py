"""GRPO as the lecture writes it vs the DAPO-style combination researchers switch on first, on the built-in task.

One SFT model (`sft.py --seed <sft-seed>`), then for each seed `grpo.py` with its defaults and with
`--dynamic-sampling --clip-eps-high 0.28 --mask-truncated-completions --loss-type dapo`, each a subprocess as a
user runs it, for --steps steps: held-out accuracy before → after, wall time, and the completions sampled per
step (dynamic sampling samples more prompts while groups tie), mean ± std over seeds, into RESULTS.md.

    python benchmarks/grpo_variants.py --seeds 1 2 3
"""

import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import tyro

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.results import mean_std, run, write_section  # noqa: E402

VARIANTS = {
    "GRPO (defaults: the lecture's objective)": [],
    "DAPO-style: dynamic sampling, ε_h 0.28, overlong filtering, token-mean loss": [
        *("--dynamic-sampling", "--clip-eps-high", "0.28", "--mask-truncated-completions", "--loss-type", "dapo")
    ],
}


@dataclass
class Args:
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    """GRPO seeds"""
    sft_seed: int = 1
    """seed of the one SFT model every run starts from"""
    steps: int = 100
    """GRPO steps per run"""
    workdir: str = "runs/grpo_variants"
    """where the models and metrics are written"""
    write: bool = True
    """write the section in RESULTS.md"""


def main(args: Args):
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    run("sft.py", ["--seed", str(args.sft_seed), "--run-name", "sft"], cwd=work)
    lines = [
        "| GRPO variant | held-out accuracy before → after | wall time (s) | completions sampled / step | groups trained / step |",
        "|---|---|---|---|---|",
    ]
    for name, flags in VARIANTS.items():
        results = []
        for seed in args.seeds:
            run_name = f"{'dapo' if flags else 'grpo'}-{seed}"
            proc = run(
                "grpo.py",
                [
                    *flags,
                    "--seed",
                    str(seed),
                    "--steps",
                    str(args.steps),
                    "--run-name",
                    run_name,
                    "--output-dir",
                    f"models/{run_name}",
                ],
                cwd=work,
            )
            rows = [json.loads(line) for line in (work / "runs" / run_name / "metrics.jsonl").read_text().splitlines()]
            evals = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
            train = [r for r in rows if "train/loss" in r]
            used = json.loads((work / "runs" / run_name / "args.json").read_text())  # the flags as resolved
            sampled = (
                statistics.mean(r["train/sampling_rounds"] for r in train)
                * used["prompts_per_step"]
                * used["group_size"]
            )
            trained = statistics.mean(r["train/groups_trained"] for r in train)
            results.append((evals[0], evals[-1], proc["wall_s"], sampled, trained))
        before, after, wall, sampled, trained = zip(*results)
        lines.append(
            f"| {name} | {mean_std(before, '.3f')} → {mean_std(after, '.3f')} | {mean_std(wall, '.0f')} "
            f"| {mean_std(sampled, '.0f')} | {mean_std(trained, '.1f')} |"
        )
    text = (
        f"### GRPO variants on the built-in task (`benchmarks/grpo_variants.py`, {args.steps} steps, seeds {args.seeds}, one SFT model of seed {args.sft_seed})\n\n"
        + "\n".join(lines)
        + f"\n\nCommand: `python benchmarks/grpo_variants.py {' '.join(sys.argv[1:])}`; {time.strftime('%Y-%m-%d')}, CPU fp32, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads. Wall time is the whole run (evaluations every 50 "
        "steps included)."
    )
    print(text)
    if args.write:
        write_section("grpo_variants", text)


if __name__ == "__main__":
    main(tyro.cli(Args))
