"""sft.py: its math, an end-to-end run as a user would start it, reloading, wandb, and any-model SFT."""

import json
import subprocess
import sys
import warnings

import pytest
import torch
from conftest import ROOT, moved, read_metrics, run_script
from transformers import AutoModelForCausalLM, AutoTokenizer

import common
import sft


def test_token_logprobs_matches_log_softmax_gather():
    """The one copy below the banner (tests/test_copies.py keeps the five scripts' identical)."""
    torch.manual_seed(0)
    logits, tokens = torch.randn(3, 5, 11) * 4, torch.randint(0, 11, (3, 5))
    naive = logits.log_softmax(-1).gather(-1, tokens[..., None]).squeeze(-1)
    assert torch.allclose(sft.token_logprobs(logits, tokens), naive, atol=1e-6)
    # bf16 logits are promoted to fp32 before the log-softmax
    out = sft.token_logprobs(logits.bfloat16(), tokens)
    assert out.dtype == torch.float32
    assert torch.allclose(
        out, logits.bfloat16().float().log_softmax(-1).gather(-1, tokens[..., None]).squeeze(-1), atol=1e-5
    )


def test_sft_loss_is_the_token_mean_over_completion_tokens():
    logps = torch.tensor([[-1.0, -2.0, -9.0], [-3.0, -9.0, -9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert sft.sft_loss(logps, mask).item() == (1 + 2 + 3) / 3


def test_left_padding_does_not_change_logprobs():
    """Position ids come from the attention mask, so a padded row scores its completion as unpadded."""
    tok = common.build_char_tokenizer()
    torch.manual_seed(0)
    model = sft.tiny_model(tok, sft.Args()).eval()
    prompts, completions = common.tokenize(tok, ["1+2=", "123+456="]), common.tokenize(tok, ["3", "579"], add_eos=True)
    batched = sft.completion_logps(model, common.collate(prompts, completions, tok.pad_token_id))
    alone = sft.completion_logps(model, common.collate(prompts[:1], completions[:1], tok.pad_token_id))
    assert torch.allclose(batched[0, :2], alone[0], atol=1e-5)


def test_gradient_checkpointing_is_switched_on_without_a_deprecation_warning():
    """--gradient-checkpointing reaches every decoder layer (directly and through a LoRA wrapper), and calls
    the name this transformers version has rather than its deprecated alias."""
    tok = common.build_char_tokenizer()
    model = sft.tiny_model(tok, sft.Args())
    lora = sft.add_lora(sft.tiny_model(tok, sft.Args()), sft.Args(model="m", lora_r=4))
    for m in (model, lora):
        assert not any(getattr(layer, "gradient_checkpointing", False) for layer in m.modules())
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            sft.enable_gradient_checkpointing(m)
        layers = [layer for layer in m.modules() if type(layer).__name__ == "Qwen2DecoderLayer"]
        assert layers and all(layer.gradient_checkpointing for layer in layers)

    class OlderTransformersModel:  # before the rename: only gradient_checkpointing_enable
        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
            self.kwargs = gradient_checkpointing_kwargs

    older = OlderTransformersModel()
    sft.enable_gradient_checkpointing(older)
    assert older.kwargs == {"use_reentrant": False}


@pytest.mark.slow
def test_help_documents_every_flag():
    out = subprocess.run(
        [sys.executable, str(ROOT / "sft.py"), "--help"], capture_output=True, text=True, check=True
    ).stdout
    for name in sft.Args.__dataclass_fields__:
        flag = "--" + name.replace("_", "-")
        assert flag in out, flag
    assert "optimiser steps" in out  # field docstrings become the help text


def teachers_level() -> float:
    """Held-out greedy accuracy of a model that imitates the built-in task's teacher: right wherever the
    teacher is right more often than not, i.e. on the prompts with no carry into the hundreds."""
    pairs = common.arithmetic_pairs("test")
    return sum(not common.carries_into_hundreds(a, b) for a, b in pairs) / len(pairs)


@pytest.mark.slow
def test_sft_end_to_end_learns_the_teacher_and_saves(sft_run):
    _, model_dir, metrics = sft_run
    evals = [m for m in metrics if "eval/accuracy" in m]
    assert evals[0]["step"] == 0 and evals[-1]["step"] > 0
    before, after = evals[0]["eval/accuracy"], evals[-1]["eval/accuracy"]
    assert before < 0.02 and abs(after - teachers_level()) < 0.06, (before, after, teachers_level())
    assert evals[-1]["eval/loss"] < evals[0]["eval/loss"] / 2
    assert any("train/loss" in m for m in metrics)
    assert (model_dir / "model.safetensors").exists() and not list(model_dir.glob("*.bin"))


@pytest.mark.slow
def test_saved_model_reloads_and_generates(sft_run):
    _, model_dir, _ = sft_run
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    ids = tok(["210+430="], return_tensors="pt")  # 12+34, little-endian
    out = model.generate(**ids, max_new_tokens=6, do_sample=False)
    text = tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert text == "6400", text  # 46: no carry, so the teacher never slips here


@pytest.mark.slow
def test_sft_in_cpu_bf16_follows_the_fp32_run(tmp_path):
    """bf16 autocast on the CPU (the GPU's numerics) takes the same path as fp32 from the same seed: every
    logged loss within a few percent, while the held-out loss falls by 40%. Where full-length runs land in each
    precision, over seeds, thread counts and processes, is benchmarks/sft_spread.py's table; `pytest --bf16`
    runs the session model's end-to-end checks in bf16 (emulated bf16 is several times slower on a CPU)."""
    flags = "--seed 2 --steps 30 --eval-every 30 --eval-size 16".split()
    out = run_script("sft.py", *flags, *"--bf16 --run-name bf16".split(), cwd=tmp_path).stdout
    assert "bf16 autocast" in out
    run_script("sft.py", *flags, *"--no-bf16 --run-name fp32 --output-dir models/fp32".split(), cwd=tmp_path)
    bf16, fp32 = (read_metrics(tmp_path, name) for name in ("bf16", "fp32"))
    losses = [(a[k], b[k]) for a, b in zip(bf16, fp32) for k in ("train/loss", "eval/loss") if k in a]
    assert len(losses) == 5 and losses[-1][1] < 0.6 * losses[0][1], losses
    assert all(abs(a - b) < 0.04 * b for a, b in losses), losses
    assert any(a != b for a, b in losses)  # bf16 did round differently


@pytest.mark.slow
def test_track_writes_an_offline_wandb_run(tmp_path):
    run_script(*"sft.py --steps 2 --eval-every 2 --eval-size 16 --track --run-name wb".split(), cwd=tmp_path)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    data = list(runs[0].glob("*.wandb"))
    assert data and data[0].stat().st_size > 0
    assert [m["step"] for m in read_metrics(tmp_path, "wb") if "eval/loss" in m] == [0, 2]


@pytest.mark.slow
def test_sft_any_model_on_a_conversational_dataset(tmp_path, sft_run):
    """--model <path> --dataset <file>: a pretrained model, chat-templated rows, no answers (loss only)."""
    _, model_dir, _ = sft_run
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% if m['role'] == 'user' %}={% endif %}{% endfor %}"
    tok.save_pretrained(tmp_path / "chat_model")
    AutoModelForCausalLM.from_pretrained(model_dir).save_pretrained(tmp_path / "chat_model")
    rows = [
        {"messages": [{"role": "user", "content": f"{a}*2"}, {"role": "assistant", "content": str(2 * a)}]}
        for a in range(200)
    ]
    (tmp_path / "double.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_script(
        "sft.py",
        "--model",
        str(tmp_path / "chat_model"),
        "--dataset",
        str(tmp_path / "double.jsonl"),
        *"--steps 60 --batch-size 32 --lr 1e-3 --warmup-steps 5 --eval-every 60".split(),
        *"--output-dir out --run-name chat".split(),
        cwd=tmp_path,
    )
    losses = [m["eval/loss"] for m in read_metrics(tmp_path, "chat") if "eval/loss" in m]
    assert not any("eval/accuracy" in m for m in read_metrics(tmp_path, "chat"))
    assert losses[-1] < losses[0] * 0.7, losses
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "out") is not None


@pytest.mark.slow
def test_sft_on_plain_text_rows(tmp_path, sft_run):
    """The `text` format (no prompt): every token of the text is a completion token."""
    _, model_dir, _ = sft_run
    (tmp_path / "t.jsonl").write_text("".join(json.dumps({"text": f"{a}+{a}={2 * a}"}) + "\n" for a in range(50)))
    run_script(
        "sft.py",
        "--model",
        str(model_dir),
        "--dataset",
        str(tmp_path / "t.jsonl"),
        *"--steps 2 --batch-size 8 --eval-every 2 --output-dir out --run-name txt".split(),
        cwd=tmp_path,
    )
    (start, end) = [m["eval/loss"] for m in read_metrics(tmp_path, "txt") if "eval/loss" in m]
    assert end < start and moved(model_dir, tmp_path / "out")  # the texts' tokens were trained on
