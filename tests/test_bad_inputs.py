"""Hostile input, as a user would give it: every bad flag, path, file, row and checkpoint stops the run
before any training with ONE `error:` line (no traceback), and leaves what existed before byte-identical;
failed writes (disk full) name the last complete checkpoint and keep the previous files whole."""

import hashlib
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import tyro
from conftest import ROOT, run_script

import common

QUICK = "--eval-size 8 --eval-every 1000".split()


def digest(path: Path) -> dict:
    """Every file under `path` with the hash of its bytes."""
    return {
        str(p.relative_to(path)): hashlib.sha1(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A tiny SFT model with checkpoints at steps 2 and 4, a GRPO checkpoint, and broken copies of each."""
    d = tmp_path_factory.mktemp("made")
    run_script(*"sft.py --steps 4 --batch-size 8 --save-every 2 --output-dir sft".split(), *QUICK, cwd=d)
    run_script(
        *"grpo.py --model sft --steps 1 --prompts-per-step 2 --group-size 2 --save-every 1 --output-dir grpo".split(),
        *QUICK,
        cwd=d,
    )
    shutil.copytree(d / "sft", d / "truncated", ignore=shutil.ignore_patterns("checkpoint-*"))
    weights = d / "truncated" / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    shutil.copytree(d / "sft" / "checkpoint-2", d / "bad_state")
    (d / "bad_state" / "trainer_state.pt").write_bytes(b"not a checkpoint")
    shutil.copytree(d / "sft" / "checkpoint-2", d / "bad_weights")
    (d / "bad_weights" / "model.safetensors").write_bytes(b"garbage" * 10)
    (d / "not_a_model").mkdir()
    (d / "not_a_model" / "notes.txt").write_text("hello")
    (d / "a_file").write_text("I am a file")
    (d / "null_sft.jsonl").write_text('{"prompt": "1+1=", "completion": "2"}\n{"prompt": "1+2=", "completion": null}\n')
    (d / "null_dpo.jsonl").write_text(
        '{"prompt": "1+1=", "chosen": "2", "rejected": "3"}\n' * 20
        + '{"prompt": "1+1=", "chosen": "2", "rejected": null}\n'
    )
    (d / "empty.jsonl").write_text("")
    (d / "garbage.jsonl").write_text("this is not json {\n")
    (d / "sft_rows.jsonl").write_text(json.dumps({"prompt": "1+1=", "completion": "2"}) + "\n")
    (d / "long.jsonl").write_text(
        "".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(100, 120))
    )
    shutil.copytree(d / "sft", d / "bad_tokenizer", ignore=shutil.ignore_patterns("checkpoint-*"))
    (d / "bad_tokenizer" / "tokenizer.json").write_text("{ cut short")
    (d / "null_gsm8k.jsonl").write_text(
        '{"question": "How many?", "answer": "#### 4"}\n{"question": "And now?", "answer": null}\n'
    )
    return d


FLAG_CASES = [  # script, flags, what the one line says: checked before anything is loaded, so tested in-process
    ("sft.py", ["--grad-accum-steps", "-1"], "--grad-accum-steps must be positive"),  # used to hang
    ("sft.py", ["--grad-accum-steps", "0"], "--grad-accum-steps must be positive"),
    ("dpo.py", ["--grad-accum-steps", "0"], "--grad-accum-steps must be positive"),
    ("reward_model.py", ["--grad-accum-steps", "0"], "--grad-accum-steps must be positive"),
    ("ppo.py", ["--grad-accum-steps", "0"], "--grad-accum-steps must be positive"),
    ("sft.py", ["--max-grad-norm", "-1"], "--max-grad-norm must be positive"),  # used to ascend the gradient
    ("grpo.py", ["--max-grad-norm", "0"], "--max-grad-norm must be positive"),
    ("sft.py", ["--weight-decay", "-1"], "--weight-decay must be 0 or positive"),
    ("ppo.py", ["--kl-coef", "-1"], "--kl-coef must be 0 or positive"),
    ("dpo.py", ["--rpo-alpha", "-1"], "--rpo-alpha must be 0 or positive"),
    ("grpo.py", ["--lr", "nan"], "--lr must be positive"),
    ("sft.py", ["--seed", "-1"], "--seed must be 0 or positive"),
    ("sft.py", "--hidden-size 100 --num-heads 8".split(), "must be divisible by --num-heads"),
    ("sft.py", ["--steps", "0"], "--steps must be positive"),
    ("grpo.py", ["--group-size", "1"], "--group-size must be at least 2"),
    ("grpo.py", "--prompts-per-step 2 --grad-accum-steps 17".split(), "--grad-accum-steps (17) must be at most"),
    ("grpo.py", "--reward-funcs accuracy format --reward-weights 1".split(), "--reward-weights has 1 values for 2"),
    (
        "ppo.py",
        "--reward-funcs accuracy --reward-model rm --reward-weights 1".split(),
        "--reward-weights has 1 values for 2",
    ),
    ("grpo.py", "--reward-funcs --reward-weights".split(), "nothing to reward: pass --reward-funcs, --reward-model"),
    ("ppo.py", ["--num-mini-batches", "3"], "must be divisible by --num-mini-batches"),
    ("ppo.py", ["--samples-per-prompt", "0"], "--samples-per-prompt must be at least 1"),
    ("ppo.py", ["--critic-lr", "0"], "--critic-lr must be positive"),
    ("dpo.py", ["--label-smoothing", "0.7"], "--label-smoothing must be in [0, 0.5)"),
    ("dpo.py", "--loss-type ipo --label-smoothing 0.1".split(), "--label-smoothing applies to --loss-type sigmoid"),
    ("reward_model.py", ["--save-every", "-1"], "--save-every must be 0 or positive"),
    ("reward_model.py", ["--sample-pairs", "1"], "--sample-pairs must be 0 (the fixed pairs) or at least 2"),
    ("reward_model.py", ["--lora-r", "-1"], "--lora-r must be 0 or positive"),
    ("ppo.py", ["--lora-dropout", "1"], "--lora-dropout must be in [0, 1)"),
    ("grpo.py", "--model m --lora-r 8 --fsdp".split(), "--lora-r with --fsdp is not supported"),
    ("sft.py", ["--lora-r", "8"], "--lora-r trains adapters on a pretrained model: pass --model"),
    ("dpo.py", "--model m --lora-r 8 --output-dir ./m".split(), "is the model being adapted"),
]


@pytest.mark.parametrize("script,flags,message", FLAG_CASES, ids=[f"{s}:{' '.join(f)}" for s, f, _ in FLAG_CASES])
def test_bad_flag_values_stop_with_one_error_line(script, flags, message, capsys):
    module = importlib.import_module(script.removesuffix(".py"))
    args = tyro.cli(module.Args, args=flags)
    module.resolve_defaults(args)
    with pytest.raises(SystemExit) as stopped:
        module.check_args(args)
    errors = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code == 2 and len(errors) == 1 and errors[0].startswith("error: ") and message in errors[0], (
        errors
    )


CASES = [  # script, flags ({d}: the fixture's directory), what the one line says
    (
        "sft.py",
        ["--grad-accum-steps", "-1"],
        "--grad-accum-steps must be positive",
    ),  # as a user runs it: it used to hang
    ("sft.py", ["--output-dir", "{d}/a_file"], "cannot write to"),  # used to exit 0 having saved nothing
    (
        "sft.py",
        ["--output-dir", "{d}/a_file/model"],
        "cannot write to",
    ),  # used to fail at the first save, after training
    (
        "dpo.py",
        ["--model", "{d}/sft", "--output-dir", "/proc/no-such-dir/out"],
        "cannot write to /proc/no-such-dir/out",
    ),
    ("sft.py", ["--model", "{d}/truncated"], "truncated/model.safetensors is corrupt or cut short"),
    ("grpo.py", ["--model", "{d}/truncated"], "truncated/model.safetensors is corrupt or cut short"),
    ("grpo.py", ["--model", "{d}/no_such_model"], "no such file or directory"),
    ("dpo.py", ["--model", "./no_such_model"], "no such file or directory"),
    ("sft.py", ["--model", "{d}/not_a_model"], "not a model directory (no config.json)"),
    ("grpo.py", ["--model", "{d}/sft", "--resume", "{d}/sft/checkpoint-4"], "written by sft.py, not grpo.py"),
    ("sft.py", ["--resume", "{d}/grpo/checkpoint-1"], "written by grpo.py, not sft.py"),
    ("dpo.py", ["--model", "{d}/sft", "--resume", "{d}/sft/checkpoint-4"], "written by sft.py, not dpo.py"),
    (
        "reward_model.py",
        ["--model", "{d}/sft", "--resume", "{d}/sft/checkpoint-4"],
        "written by sft.py, not reward_model.py",
    ),
    ("sft.py", ["--resume", "{d}/bad_state"], "bad_state/trainer_state.pt is corrupt or cut short"),
    (
        "sft.py",
        ["--resume", "{d}/bad_weights", "--steps", "6"],
        "bad_weights/model.safetensors is corrupt or cut short",
    ),
    ("sft.py", ["--model", "{d}/bad_tokenizer"], "bad_tokenizer/tokenizer.json is corrupt or cut short"),
    ("sft.py", ["--model", "no-such-org/no-such-model"], "cannot load model 'no-such-org/no-such-model' from the hub"),
    ("grpo.py", [], "models/sft not found: run `python sft.py` first"),
    ("ppo.py", ["--model", "{d}/sft"], "models/reward not found: run `python reward_model.py` first"),
    ("ppo.py", ["--model", "{d}/sft", "--reward-model", "{d}/missing_rm"], "cannot load model"),
    ("sft.py", ["--dataset", "{d}/missing.jsonl"], "dataset file not found"),
    ("reward_model.py", ["--model", "{d}/sft", "--dataset", "{d}/empty.jsonl"], "is empty"),
    ("sft.py", ["--dataset", "{d}/garbage.jsonl"], "cannot read dataset file"),
    ("dpo.py", ["--model", "{d}/sft", "--dataset", "{d}/sft_rows.jsonl"], "has no column 'chosen'"),
    (
        "grpo.py",
        ["--model", "{d}/sft", "--dataset", "{d}/long.jsonl", "--max-prompt-length", "4"],
        "every prompt is longer than the limit of 4",
    ),
    ("sft.py", ["--resume", "{d}/not_a_model"], "not a checkpoint directory"),
    ("sft.py", ["--dataset", "{d}/null_sft.jsonl"], "row 2 (train split): column 'completion' is empty (null)"),
    (
        "dpo.py",
        ["--model", "{d}/sft", "--dataset", "{d}/null_dpo.jsonl"],
        "row 21 (test split): column 'rejected' is empty (null)",
    ),
    ("grpo.py", ["--model", "{d}/sft", "--dataset", "{d}/null_gsm8k.jsonl"], "column 'answer' is empty (null)"),
]


# one case of each kind also runs as a user runs it: a subprocess, exit code 2, no traceback
AS_A_USER = {
    ("sft.py", "--grad-accum-steps -1"),  # a flag
    ("sft.py", "--model {d}/truncated"),  # a model
    ("dpo.py", "--model {d}/sft --resume {d}/sft/checkpoint-4"),  # a checkpoint
    ("grpo.py", ""),  # the stage before not run yet
    ("sft.py", "--dataset {d}/missing.jsonl"),  # a dataset (common.DataError)
}
USER_CASES = [case for case in CASES if (case[0], " ".join(case[1])) in AS_A_USER]


def run_in_process(script: str, flags: list[str], cwd: Path, monkeypatch) -> int:
    """main() as the script's command line runs it, in this process: no interpreter start-up and imports per
    case. Returns the exit code."""
    module = importlib.import_module(script.removesuffix(".py"))
    monkeypatch.chdir(cwd)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}  # start_run sets its own
    try:
        with pytest.raises(SystemExit) as stopped:
            try:
                module.main(tyro.cli(module.Args, args=flags))
            except common.DataError as e:  # what the script's `if __name__ == "__main__":` block does
                module.fail(str(e))
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return stopped.value.code


@pytest.mark.slow
@pytest.mark.parametrize("script,flags,message", CASES, ids=[f"{s}:{' '.join(f)[:40]}" for s, f, _ in CASES])
def test_bad_input_one_error_line_and_nothing_changed(script, flags, message, made, tmp_path, monkeypatch, capsys):
    before = digest(made)
    code = run_in_process(script, [f.format(d=made) for f in flags], tmp_path, monkeypatch)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and message in errors[0], err[-2000:]
    assert digest(made) == before  # every model and checkpoint that existed is byte-identical
    assert not (tmp_path / "runs").exists()  # nothing was started


@pytest.mark.slow
@pytest.mark.parametrize("script,flags,message", USER_CASES, ids=[f"{s}:{' '.join(f)[:40]}" for s, f, _ in USER_CASES])
def test_bad_input_as_a_user_runs_it(script, flags, message, made, tmp_path):
    before = digest(made)
    proc = run_script(script, *[f.format(d=made) for f in flags], cwd=tmp_path, check=False, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert len(errors) == 1 and message in errors[0], proc.stderr[-2000:]
    assert digest(made) == before
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_an_unknown_choice_is_refused_by_tyro(tmp_path):
    proc = run_script(*"dpo.py --loss-type bogus".split(), cwd=tmp_path, check=False)
    assert (
        proc.returncode == 2 and "Traceback" not in proc.stderr and "invalid choice 'bogus'" in proc.stderr
    )  # tyro's framed message
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_a_finished_run_resumed_again_says_so_and_changes_nothing(made, tmp_path):
    before = digest(made)
    proc = run_script("sft.py", "--resume", str(made / "sft" / "checkpoint-4"), cwd=tmp_path)
    assert "already reached --steps 4; nothing to do" in proc.stdout
    assert digest(made) == before


@pytest.mark.slow
def test_resume_takes_the_run_flags_from_the_checkpoint_and_extends_steps(made, tmp_path):
    """--resume: the run's own batch size, lr, ... (a --lr given is set aside); --steps may grow."""
    shutil.copytree(made / "sft", tmp_path / "sft")
    proc = run_script(*"sft.py --resume sft/checkpoint-4 --steps 6 --lr 5e-4".split(), cwd=tmp_path)
    assert "but --steps 6" in proc.stdout and "saved to sft" in proc.stdout
    (run,) = (tmp_path / "runs").iterdir()
    used = json.loads((run / "args.json").read_text())
    assert used["lr"] == 1e-3 and used["batch_size"] == 8 and used["steps"] == 6  # the run's own, but --steps
    assert (
        sorted(p.name for p in (tmp_path / "sft").glob("checkpoint-*"))
        == "checkpoint-2 checkpoint-4 checkpoint-6".split()[-2:]
    )


@pytest.mark.slow
def test_a_signal_during_set_up_stops_at_once_with_nothing_saved(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "sft.py"), "--eval-size", "500"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout.readline().startswith("the built-in task's defaults:")  # set-up is under way
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGTERM, err[-2000:]  # before training, a signal's default: stop at once
    assert not (tmp_path / "models" / "sft" / "model.safetensors").exists()


FAIL_WRITES = """
import errno, sys
sys.argv = [{script!r}, *{flags!r}]
sys.path.insert(0, {root!r})
import tyro
import sft
real = sft.save_model
def failing(model, tokenizer, path, args):  # the disk fills up once the files are half written
    real(model, tokenizer, path, args)
    if {which!r} in path:
        raise OSError(errno.ENOSPC, "No space left on device")
sft.save_model = failing
sft.main(tyro.cli(sft.Args))
"""


@pytest.mark.slow
@pytest.mark.parametrize("which", ["final.tmp", "checkpoint-4"])
def test_a_failed_write_keeps_the_previous_files_and_names_the_last_checkpoint(which, made, tmp_path):
    """Disk full while writing the final model, or a checkpoint: exit 1, one line naming the path and the last
    complete checkpoint; the previous model and checkpoint are byte-identical; no temporary directory is left."""
    shutil.copytree(made / "sft", tmp_path / "out")
    shutil.rmtree(tmp_path / "out" / "checkpoint-4")
    before = digest(tmp_path / "out")
    flags = [*"--steps 4 --batch-size 8 --save-every 4 --output-dir out".split(), *QUICK]
    code = FAIL_WRITES.format(script="sft.py", flags=flags, root=str(ROOT), which=which)
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert len(errors) == 1 and "No space left on device" in errors[0], proc.stderr[-2000:]
    assert (
        f"last complete checkpoint: {os.path.join('out', 'checkpoint-4' if which == 'final.tmp' else 'checkpoint-2')}"
        in errors[0]
    )
    after = digest(tmp_path / "out")
    assert {
        k: v for k, v in after.items() if not k.startswith("checkpoint-4/")
    } == before  # the previous files, untouched
    assert not list((tmp_path / "out").glob("*.tmp"))
