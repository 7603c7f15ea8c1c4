"""torchrun on the CPU (gloo): every script completes with 2 processes and saves a loadable model; for sft
and dpo, 2 processes × batch b, 1 process × batch 2b and --grad-accum-steps 2 × batch b (with gradient
checkpointing) take the same steps (DDP, and FSDP2 for sft, which resumed from a checkpoint ends at the same weights)."""

import shutil
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, read_metrics, run_script, script_args, without_timings
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification


def torchrun(script: str, *args: str, cwd):
    proc = subprocess.run(
        [
            sys.executable,
            *"-m torch.distributed.run --standalone --nproc_per_node 2".split(),
            str(ROOT / script),
            *script_args(script, args),
        ],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, (
        f"{script} under torchrun exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return proc


def weights(path):
    return load_file(path / "model.safetensors")


def assert_same_weights(a, b, atol=1e-5):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=atol), (k, (a[k] - b[k]).abs().max().item())


def assert_one_metrics_file(cwd, run_name):
    assert [p.name for p in (cwd / "runs").iterdir()] == [run_name]
    rows = [(row["step"], tuple(sorted(row))) for row in read_metrics(cwd, run_name)]
    assert rows and len(rows) == len(set(rows))  # each row written once, by rank 0
    for _, keys in rows:  # one vocabulary: every script's training rows carry these under the same names
        assert "train/grad_norm" not in keys or "train/lr" in keys, keys


@pytest.fixture(scope="module")
def sft_dir(sft_run):
    return str(sft_run[1])


EQUIVALENT = {  # 6 steps of each at a learning rate that moves the weights
    "sft.py": "--steps 6 --lr 3e-3 --eval-every 1000 --eval-size 8".split(),
    # the fixed pairs: pairs sampled from π_ref depend on how the prompts are split over processes
    "dpo.py": ["--model", "{sft}", *"--steps 6 --lr 1e-3 --eval-every 1000 --eval-size 8 --sample-pairs 0".split()],
}


@pytest.mark.slow
@pytest.mark.parametrize("script", list(EQUIVALENT))
def test_two_processes_and_accumulation_equal_one_big_batch(script, sft_dir, tmp_path):
    # equal to float rounding is an fp32 property: bf16 rounds each split of the batch differently
    flags = [f.format(sft=sft_dir) for f in EQUIVALENT[script]] + ["--no-bf16"]
    for name in ("big", "acc", "ddp", "fsdp"):
        (tmp_path / name).mkdir()
    run_script(script, *flags, *"--batch-size 16 --output-dir big --run-name big".split(), cwd=tmp_path / "big")
    # accumulation, with activations recomputed in the backward pass (gradient checkpointing changes no number)
    run_script(
        script,
        *flags,
        *"--batch-size 8 --grad-accum-steps 2 --gradient-checkpointing --output-dir acc --run-name acc".split(),
        cwd=tmp_path / "acc",
    )
    torchrun(script, *flags, *"--batch-size 8 --output-dir ddp --run-name ddp".split(), cwd=tmp_path / "ddp")
    big = weights(tmp_path / "big/big")
    if script == "dpo.py":  # the steps moved the weights well beyond the tolerance below
        start = AutoModelForCausalLM.from_pretrained(sft_dir).state_dict()
        assert max((big[k] - start[k]).abs().max().item() for k in big) > 1e-3
    assert_same_weights(big, weights(tmp_path / "acc/acc"))
    assert_same_weights(big, weights(tmp_path / "ddp/ddp"))
    assert_one_metrics_file(tmp_path / "ddp", "ddp")
    if script == "sft.py":  # FSDP2 shards the same model and takes the same steps
        fsdp = "--batch-size 8 --fsdp --output-dir fsdp --run-name fsdp --save-every 3".split()
        torchrun(script, *flags, *fsdp, cwd=tmp_path / "fsdp")
        assert_same_weights(big, weights(tmp_path / "fsdp/fsdp"))
        AutoModelForCausalLM.from_pretrained(tmp_path / "fsdp/fsdp")
        # resumed from its step-3 checkpoint (sharded optimiser state, each process's RNG), in full fine-tuning,
        # it ends where the run that went through ended
        shutil.copytree(tmp_path / "fsdp/fsdp/checkpoint-3", tmp_path / "resumed/fsdp/checkpoint-3")
        proc = torchrun(script, *"--output-dir fsdp --resume latest".split(), cwd=tmp_path / "resumed")
        assert "resuming from fsdp/checkpoint-3" in proc.stdout
        assert_same_weights(weights(tmp_path / "fsdp/fsdp"), weights(tmp_path / "resumed/fsdp"))
        ends = [without_timings(read_metrics(d, "fsdp"))[-1] for d in (tmp_path / "fsdp", tmp_path / "resumed")]
        assert ends[1] == pytest.approx(ends[0], rel=1e-4)


RUNS = [  # script, flags: each completes under torchrun and saves what transformers loads
    (
        "reward_model.py",
        [
            "--model",
            "{sft}",
            "--steps",
            "3",
            "--batch-size",
            "8",
            "--eval-size",
            "32",
            "--sample-prompts",
            "128",  # only some prompts give a pair: enough prompts that one step's 16 pairs are not left to chance
            "--fsdp",
            "--save-every",
            "3",
        ],
    ),
    (
        "grpo.py",
        ["--model", "{sft}", *"--steps 3 --prompts-per-step 4 --group-size 4 --eval-size 8 --loss-type dapo".split()],
    ),
    (
        "grpo.py",
        "--model {sft} --steps 3 --prompts-per-step 4 --group-size 4 --eval-size 8 --dynamic-sampling --scale-rewards batch "
        "--clip-eps-high 0.28 --mask-truncated-completions --save-every 3".split(),
    ),
    (
        "ppo.py",
        [
            "--model",
            "{sft}",
            "--reward-model",
            "{rm}",
            *"--steps 3 --prompts-per-step 8 --eval-size 8 --fsdp --save-every 3".split(),
        ],
    ),
    # online DPO: each process samples half of every round's prompts, both train on all the round's pairs
    ("dpo.py", "--model {sft} --steps 3 --batch-size 8 --resample-every 2 --eval-size 8 --save-every 3".split()),
    # DDP: the critic's forward goes through its own wrapper; micro-batches but the last skip the all-reduce
    (
        "ppo.py",
        "--model {sft} --reward-model {rm} --steps 2 --prompts-per-step 8 --eval-size 8 --grad-accum-steps 2".split(),
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "script,flags",
    RUNS,
    ids=[
        f"{s}{' fsdp' if '--fsdp' in f else ''}{' dynamic' if '--dynamic-sampling' in f else ''}"
        f"{' online' if '--resample-every' in f else ''}"
        for s, f in RUNS
    ],
)
def test_each_script_runs_under_torchrun(script, flags, sft_dir, tmp_path):
    rm = tmp_path / "rm"
    AutoModelForSequenceClassification.from_pretrained(sft_dir, num_labels=1).save_pretrained(rm)
    proc = torchrun(
        script, *[f.format(sft=sft_dir, rm=rm) for f in flags], *"--output-dir out --run-name r".split(), cwd=tmp_path
    )
    assert "× 2" in proc.stdout  # rank 0 reports both processes; the others print nothing
    assert_one_metrics_file(tmp_path, "r")
    cls = AutoModelForSequenceClassification if script == "reward_model.py" else AutoModelForCausalLM
    cls.from_pretrained(tmp_path / "out")
    if "--save-every" in flags:
        state = torch.load(tmp_path / "out/checkpoint-3/trainer_state.pt", weights_only=True)
        assert len(state["rng"]) == 2  # each process's RNG states
    if script == "reward_model.py":  # each process sampled half the prompts; both train on all the pairs
        assert "for each of 32 prompts" in proc.stdout and "for each of 128 prompts" in proc.stdout
        assert len(state["pairs"][0]) > 8
    if "--resample-every" in flags:  # rounds at steps 1 and 3, of 2 steps × 16 pairs each
        assert proc.stdout.count("for each of 64 prompts") == 2 and len(state["pairs"][0]) == 32
