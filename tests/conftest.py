"""Shared test harness: run scripts as a user would (subprocess + CLI flags) and train the tiny SFT
model once per session for every end-to-end test."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TQDM_DISABLE="1", WANDB_MODE="offline")

SFT_TEST_STEPS = 600  # the session model: enough to be clearly better than chance, small enough for CI


def run_script(script: str, *args: str, cwd: Path, check: bool = True, env: dict | None = None, timeout: int = 600):
    """Runs `python <script> <args>` in `cwd` (so models/, runs/ and wandb/ land there)."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / script), *args],
        cwd=cwd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})},
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"{script} {' '.join(args)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def read_metrics(cwd: Path, run_name: str) -> list[dict]:
    return [json.loads(line) for line in (cwd / "runs" / run_name / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="session")
def sft_run(tmp_path_factory):
    """The tiny SFT model, trained once: (work dir, model dir, metrics rows)."""
    cwd = tmp_path_factory.mktemp("sft")
    run_script("sft.py", "--steps", str(SFT_TEST_STEPS), "--eval-every", "300", "--run-name", "session", cwd=cwd)
    return cwd, cwd / "models" / "sft", read_metrics(cwd, "session")


RM_TEST_ARGS = ["--steps", "900", "--eval-every", "300", "--sample-prompts", "5000"]  # ~1/10 of the defaults' pairs, 1/5 of their steps


@pytest.fixture(scope="session")
def reward_run(sft_run, tmp_path_factory):
    """A reward model trained once from the session SFT model, on pairs of its own samples (the default on
    the built-in task): (work dir, model dir, metrics rows, stdout)."""
    _, sft_dir, _ = sft_run
    cwd = tmp_path_factory.mktemp("reward")
    out = run_script("reward_model.py", "--model", str(sft_dir), *RM_TEST_ARGS, "--run-name", "session", cwd=cwd).stdout
    return cwd, cwd / "models" / "reward", read_metrics(cwd, "session"), out
