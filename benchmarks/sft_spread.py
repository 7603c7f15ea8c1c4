"""Where `python sft.py` lands when only the floating-point summation order changes: seeds × precision
(fp32, bf16 autocast) × CPU threads, plus torchrun with 2 processes (the same global batch of 64).

Every run is `sft.py` with its defaults and a seed, in its own process; the table gives the held-out greedy
accuracy at the end, per run, and the spread (max − min) of each row and of all runs. The level a run
should reach is the teacher's: the share of held-out prompts with no carry into the hundreds.

    python benchmarks/sft_spread.py                            # seeds 1-5, fp32 and bf16, 1 and 2 threads, torchrun × 2
    python benchmarks/sft_spread.py --seeds 1 2 --threads 2    # a smaller grid
"""

import datetime
import json
import os
import platform
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import tyro

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import common  # noqa: E402
from benchmarks.results import RESULTS, finish, start, write_section  # noqa: E402


@dataclass
class Args:
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 5])
    """seeds of sft.py"""
    threads: list[int] = field(default_factory=lambda: [1, 2])
    """CPU threads per run (OMP_NUM_THREADS); the one-thread runs go two at a time when there are 2+ cores"""
    precisions: list[str] = field(default_factory=lambda: ["fp32", "bf16"])
    """fp32 (--no-bf16) and/or bf16 (--bf16: bf16 autocast, fp32 master weights)"""
    torchrun: bool = True
    """also run each seed and precision under torchrun with 2 processes of 1 thread, batch 32 each"""
    workdir: str = "runs/sft_spread"
    """where each run's model and metrics are written"""
    results: str = str(RESULTS)
    """markdown file whose sft_spread section is (re)written"""


def command(seed: int, precision: str, processes: int, cwd: Path) -> list[str]:
    name = f"{precision}_s{seed}_p{processes}"
    flags = [
        "--seed",
        str(seed),
        "--bf16" if precision == "bf16" else "--no-bf16",
        *"--eval-every 100000 --run-name".split(),
        name,
        "--output-dir",
        f"models/{name}",
    ]
    if processes == 1:
        return [sys.executable, str(ROOT / "sft.py"), *flags]
    return [
        sys.executable,
        *"-m torch.distributed.run --nproc_per_node".split(),
        str(processes),
        str(ROOT / "sft.py"),
        *flags,
        "--batch-size",
        str(64 // processes),
    ]


def final_accuracy(cwd: Path, cmd: list[str]) -> float:
    name = cmd[cmd.index("--run-name") + 1]
    rows = [json.loads(line) for line in (cwd / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    return [r["eval/accuracy"] for r in rows if "eval/accuracy" in r][-1]


def run_all(jobs: list[tuple[str, int, list[str]]], cwd: Path, parallel: int) -> dict:
    """Runs (row, threads, command) jobs, `parallel` at a time; returns {(row, seed): accuracy}."""
    results, running, queue = {}, [], list(jobs)
    while queue or running:
        while queue and len(running) < parallel:
            row, threads, cmd = queue.pop(0)
            running.append((row, cmd, start(cmd, cwd, threads)))
        row, cmd, proc = running.pop(0)
        finish(proc)
        seed = int(cmd[cmd.index("--seed") + 1])
        results[row, seed] = final_accuracy(cwd, cmd)
        print(f"{row}, seed {seed}: {100 * results[row, seed]:.1f}%", flush=True)
    return results


def main(args: Args):
    cwd = Path(args.workdir).resolve()
    shutil.rmtree(cwd, ignore_errors=True)
    cwd.mkdir(parents=True)
    start = time.time()
    rows, results = [], {}
    for threads in args.threads:
        jobs = []
        for precision in args.precisions:
            row = f"{precision}, 1 process × {threads} thread{'s' * (threads > 1)}"
            rows.append(row)
            jobs += [(row, threads, command(seed, precision, 1, cwd)) for seed in args.seeds]
        parallel = max(1, (os.cpu_count() or 1) // threads)
        results |= run_all(jobs, cwd, parallel)
    if args.torchrun:
        jobs = []
        for precision in args.precisions:
            row = f"{precision}, torchrun 2 processes × 1 thread"
            rows.append(row)
            jobs += [(row, 1, command(seed, precision, 2, cwd)) for seed in args.seeds]
        results |= run_all(jobs, cwd, 1)

    pairs = common.arithmetic_pairs("test")
    teacher = sum(not common.carries_into_hundreds(a, b) for a, b in pairs) / len(pairs)
    values = [100 * v for v in results.values()]
    lines = [
        "| run | " + " | ".join(f"seed {s}" for s in args.seeds) + " | spread |",
        "|---|" + "---|" * (len(args.seeds) + 1),
    ]
    for row in rows:
        accs = [100 * results[row, s] for s in args.seeds]
        lines.append(f"| {row} | " + " | ".join(f"{a:.1f}" for a in accs) + f" | {max(accs) - min(accs):.1f} |")
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}"
    text = (
        "### Where `python sft.py` lands: seeds × precision × threads × processes (`benchmarks/sft_spread.py`)\n\n"
        f"Measured {datetime.date.today()} on {machine}; `python benchmarks/sft_spread.py"
        f" --seeds {' '.join(map(str, args.seeds))}`: held-out greedy accuracy (%) of `sft.py` with its defaults at the"
        f" end, {len(values)} runs, {(time.time() - start) / 60:.0f} min in all. The teacher's level (held-out prompts"
        f" without a carry into the hundreds): {100 * teacher:.1f}%.\n\n"
        + "\n".join(lines)
        + f"\n\nAll runs: {min(values):.1f}–{max(values):.1f}%, spread {max(values) - min(values):.1f} points.\n"
    )
    write_section("sft_spread", text, Path(args.results))
    print(text)


if __name__ == "__main__":
    main(tyro.cli(Args))
