"""LoRA (--lora-r): the disabled adapter is π_ref exactly, frozen weights in bf16 and adapters in fp32, the
trainable count, save → reload (adapter and merged) with the same outputs; end to end, LoRA SFT, DPO and GRPO
improve the tiny model, a LoRA run resumes exactly under torchrun, and every script trains adapters on the
hub-like chat model."""

import copy
import json
import math
import os
import re

import pytest
import torch
from conftest import SCRIPTS, moved, read_metrics, run_script
from peft import PeftModel
from safetensors.torch import load_file
from test_distributed import torchrun
from test_hub_models import TINY_PPO
from test_logprobs import batch_with_every_eos
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

import common
import grpo
import reward_model
import sft


def logps(model, batch):
    return grpo.forward_logps(model, batch["input_ids"], batch["attention_mask"], batch["completion_ids"].shape[1], 1.0)


def lora_policy(chat_model, **flags):
    """The chat model with rank-4 adapters whose B is random (as after training), so adapter on ≠ off."""
    args = grpo.Args(model=str(chat_model), lora_r=4, **flags)
    policy = grpo.add_lora(grpo.load_model(str(chat_model), False), args)
    torch.manual_seed(0)
    for name, p in policy.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.05)
    return policy.eval(), args


def test_disabled_adapter_is_the_starting_model_exactly(chat_model):
    tok = common.load_tokenizer(chat_model)
    batch = batch_with_every_eos(tok)
    start = logps(grpo.load_model(str(chat_model), False).eval(), batch)
    policy, _ = lora_policy(chat_model)
    with torch.no_grad():
        with grpo.reference_policy(policy, None) as ref:
            assert torch.equal(logps(ref, batch), start)
        assert (logps(policy, batch) - start).abs().max() > 1e-3  # the adapter is back on after the block
        fresh = grpo.add_lora(grpo.load_model(str(chat_model), False), grpo.Args(lora_r=4)).eval()
        assert torch.equal(logps(fresh, batch), start)  # B = 0: LoRA starts at the starting model


def lora_layers(model) -> list[torch.nn.Linear]:
    """The linear layers "all-linear" adapts: every nn.Linear of the decoder, not the output layer."""
    out = model.get_output_embeddings()
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not out]


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_trainable_parameters_are_the_adapters_in_fp32(chat_model, bf16):
    base = grpo.load_model(str(chat_model), False)
    expected = sum(4 * (m.in_features + m.out_features) for m in lora_layers(base))  # A: r×in, B: out×r
    policy, _ = lora_policy(chat_model, bf16=bf16)
    trainable = {n: p for n, p in policy.named_parameters() if p.requires_grad}
    assert sum(p.numel() for p in trainable.values()) == expected
    assert all("lora_" in n and p.dtype == torch.float32 for n, p in trainable.items())
    frozen = {p.dtype for p in policy.parameters() if not p.requires_grad}
    assert frozen == {torch.bfloat16 if bf16 else torch.float32}
    # a reward model (or PPO's critic) trains its score head in full beside the adapters
    rm = AutoModelForSequenceClassification.from_pretrained(chat_model, num_labels=1)
    layers = [m for m in rm.modules() if isinstance(m, torch.nn.Linear) and m is not rm.score]
    rm = reward_model.add_lora(rm, reward_model.Args(lora_r=4), "SEQ_CLS")
    head = rm.config.hidden_size
    assert sum(p.numel() for p in rm.parameters() if p.requires_grad) == head + sum(
        4 * (m.in_features + m.out_features) for m in layers
    )


def test_saved_adapter_and_merged_model_reload_with_the_same_outputs(chat_model, tmp_path):
    tok = common.load_tokenizer(chat_model)
    batch = batch_with_every_eos(tok)
    policy, args = lora_policy(chat_model)
    with torch.no_grad():
        trained = logps(policy, batch)
    (tmp_path / "a").mkdir()
    grpo.save_final_model(policy, tok, grpo.Args(output_dir=str(tmp_path / "a"), lora_r=4))
    assert (tmp_path / "a/adapter_config.json").exists() and not (tmp_path / "a/model.safetensors").exists()
    with torch.no_grad():  # the adapter onto its base, and the scripts' loader (which merges it)
        peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(chat_model), tmp_path / "a")
        torch.testing.assert_close(logps(peft_model.eval(), batch), trained, atol=1e-6, rtol=0)
        torch.testing.assert_close(
            logps(grpo.load_model(str(tmp_path / "a"), False), batch), trained, atol=1e-5, rtol=0
        )
    # --merge-lora over the adapter's directory: full weights that plain transformers loads, the adapter beside
    grpo.save_final_model(policy, tok, grpo.Args(output_dir=str(tmp_path / "a"), lora_r=4, merge_lora=True))
    assert not (tmp_path / "a/adapter_config.json").exists()  # else the directory would load as an adapter
    assert (tmp_path / "a/adapter/adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "a").eval()
    assert not any("lora" in k for k in load_file(tmp_path / "a/model.safetensors"))
    with torch.no_grad():
        torch.testing.assert_close(logps(merged, batch), trained, atol=1e-5, rtol=0)


def test_merge_is_in_fp32_when_the_frozen_base_is_held_in_bf16(chat_model, tmp_path):
    """--bf16 holds the frozen weights W in bf16; --merge-lora still sums W + (α/r)·B·A in fp32 and saves fp32, so
    the merged model computes what was trained (a sum in bf16 would round small updates away)."""
    tok = common.load_tokenizer(chat_model)
    batch = batch_with_every_eos(tok)
    policy, _ = lora_policy(chat_model, bf16=True)
    with torch.no_grad():  # the trained function: W as held (bf16 values), adapters in fp32
        trained = logps(copy.deepcopy(policy).float(), batch)
    grpo.save_final_model(policy, tok, grpo.Args(output_dir=str(tmp_path), lora_r=4, merge_lora=True, bf16=True))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert {p.dtype for p in merged.parameters()} == {torch.float32}
    with torch.no_grad():
        torch.testing.assert_close(logps(merged, batch), trained, atol=1e-5, rtol=0)


def test_reward_model_adapter_carries_its_score_head(chat_model, tmp_path):
    tok = common.load_tokenizer(chat_model)
    rm = reward_model.load_model(str(chat_model), False, AutoModelForSequenceClassification, num_labels=1)
    rm = reward_model.add_lora(rm, reward_model.Args(lora_r=4), "SEQ_CLS")
    torch.manual_seed(0)
    for p in rm.parameters():
        if p.requires_grad:
            p.data.normal_(0, 0.05)  # adapters and head, as after training
    ids = torch.tensor(common.tokenize(tok, ["What is 1+2? 3"]))
    with torch.no_grad():
        scores = rm.eval()(input_ids=ids).logits
    for merge in (False, True):  # the adapter (with its head), then merged full weights (reward_model's default)
        out = tmp_path / str(merge)
        out.mkdir()
        reward_model.save_final_model(rm, tok, reward_model.Args(output_dir=str(out), lora_r=4, merge_lora=merge))
        assert (out / "adapter_config.json").exists() != merge
        loaded, info = reward_model.load_model(
            str(out), False, AutoModelForSequenceClassification, output_loading_info=True, num_labels=1
        )
        assert not info["missing_keys"]  # the trained head came back, not a fresh random one
        with torch.no_grad():
            torch.testing.assert_close(loaded.eval()(input_ids=ids).logits, scores, atol=1e-5, rtol=0)


# ---------------------------------------------------------------- end to end (subprocesses)
def first_eval_and_last(cwd, run_name, key):
    evals = [m[key] for m in read_metrics(cwd, run_name) if key in m]
    return evals[0], evals[-1]


def assert_counts_logged(cwd, run_name, stdout):
    assert re.search(r"model: [\d.]+M parameters \([\d.]+% trained\)", stdout)
    row = read_metrics(cwd, run_name)[0]
    assert row["step"] == 0 and 0 < row["train/trainable_parameters"] < row["train/parameters"]


@pytest.mark.slow
def test_lora_sft_trains_adapters_on_a_pretrained_model_and_merges(tmp_path):
    """sft.py trains the tiny model from scratch in full; with --model, LoRA adapters on it learn the task."""
    torch.manual_seed(0)
    tok = common.build_char_tokenizer()
    sft.tiny_model(tok, sft.Args()).save_pretrained(tmp_path / "base")  # random weights: everything to learn
    tok.save_pretrained(tmp_path / "base")
    flags = "--model base --lora-r 16 --lr 3e-3 --steps 150 --eval-every 150".split()
    out = run_script("sft.py", *flags, *"--merge-lora --run-name s".split(), cwd=tmp_path).stdout
    start, end = first_eval_and_last(tmp_path, "s", "eval/loss")
    assert end < 0.85 * start, (start, end)
    assert_counts_logged(tmp_path, "s", out)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "models/sft")  # plain transformers, full weights
    assert (tmp_path / "models/sft/adapter/adapter_config.json").exists()
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    if os.environ.get("TEST_SCRIPTS_BF16"):  # `pytest --bf16`: the run held the frozen weights (not buffers) in bf16
        for p in base.parameters():
            p.data = p.data.to(torch.bfloat16).float()
    with torch.no_grad():
        ids = torch.tensor(common.tokenize(tok, ["12+34="]))
        peft_model = PeftModel.from_pretrained(base, tmp_path / "models/sft/adapter")
        torch.testing.assert_close(merged(ids).logits, peft_model(ids).logits, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_lora_dpo_starts_at_log_2_and_raises_accuracy(sft_run, tmp_path):
    """π_ref is the policy with its adapter off: the first loss is log 2 exactly, in fp32 and in bf16."""
    _, model_dir, _ = sft_run
    flags = ["--model", str(model_dir), *"--lora-r 8 --lr 1e-4 --steps 30 --eval-every 30".split()]
    out = run_script("dpo.py", *flags, "--run-name", "d", cwd=tmp_path).stdout
    train = [m for m in read_metrics(tmp_path, "d") if "train/loss" in m]
    assert train[0]["train/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert train[0]["train/rewards/margins"] == 0
    start, end = first_eval_and_last(tmp_path, "d", "eval/accuracy")
    assert end >= start + 0.1, (start, end)
    assert_counts_logged(tmp_path, "d", out)
    adapter = json.loads((tmp_path / "models/dpo/adapter_config.json").read_text())
    assert adapter["r"] == 8 and os.path.samefile(adapter["base_model_name_or_path"], model_dir)


@pytest.mark.slow
def test_lora_grpo_raises_accuracy(sft_run, tmp_path):
    _, model_dir, _ = sft_run
    flags = ["--model", str(model_dir), *"--lora-r 8 --lr 1e-3 --steps 10 --eval-every 10".split()]
    run_script("grpo.py", *flags, "--run-name", "g", cwd=tmp_path)
    start, end = first_eval_and_last(tmp_path, "g", "eval/accuracy")
    assert end >= start + 0.1, (start, end)


@pytest.mark.slow
def test_lora_resumes_exactly_under_torchrun(sft_run, tmp_path):
    """Two processes (DDP): 4 steps in one go == steps 3–4 resumed from the step-2 checkpoint (adapter +
    optimiser state), metrics and adapter weights."""
    _, model_dir, _ = sft_run
    flags = [
        *("--model", str(model_dir), *"--lora-r 8 --lr 1e-3 --steps 4 --save-every 2".split()),
        *("--prompts-per-step", "4", "--group-size", "4", "--eval-every", "1000", "--eval-size", "8"),
    ]

    def train_rows():  # on resume the run appends to its own metrics file, from the checkpoint's step on
        rows = read_metrics(tmp_path, "r")
        return [
            {k: v for k, v in m.items() if not k.endswith("_s")} for m in rows if m["step"] > 2 and "train/loss" in m
        ]

    torchrun("grpo.py", *flags, *"--output-dir whole --run-name r".split(), cwd=tmp_path)
    whole_rows = train_rows()
    (tmp_path / "cut").mkdir()
    os.rename(tmp_path / "whole/checkpoint-2", tmp_path / "cut/checkpoint-2")
    proc = torchrun("grpo.py", *flags, *"--output-dir cut --resume latest".split(), cwd=tmp_path)
    assert "resuming from cut/checkpoint-2" in proc.stdout
    cut_rows = train_rows()
    assert [m.keys() for m in cut_rows] == [m.keys() for m in whole_rows] and len(cut_rows) == 2
    assert all(a == pytest.approx(b, rel=1e-4, abs=1e-6) for a, b in zip(cut_rows, whole_rows)), (cut_rows, whole_rows)
    whole, cut = (load_file(tmp_path / f"{n}/adapter_model.safetensors") for n in ("whole", "cut"))
    assert whole.keys() == cut.keys() and all(torch.allclose(whole[k], cut[k], atol=1e-6) for k in whole)


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_trains_adapters_on_the_hub_like_model(script, chat_model, char_reward_model, tmp_path):
    from test_hub_models import gsm8k_file, preference_file

    data = {
        "sft.py": gsm8k_file,
        "grpo.py": gsm8k_file,
        "ppo.py": gsm8k_file,
        "dpo.py": preference_file,
        "reward_model.py": preference_file,
    }[script](tmp_path / "data.jsonl")
    flags = ["--model", str(chat_model), "--dataset", data, *"--lora-r 16 --steps 2 --eval-every 2".split()]
    flags += {
        "sft.py": ["--batch-size", "8"],
        "dpo.py": ["--batch-size", "8"],
        "reward_model.py": ["--batch-size", "8"],
        "grpo.py": "--prompts-per-step 4 --group-size 4 --max-new-tokens 6 --eval-size 8".split(),
        "ppo.py": ["--reward-model", str(char_reward_model), *TINY_PPO[2:], "--save-every", "2"],
    }[script]
    proc = run_script(script, *flags, *"--output-dir out --run-name r".split(), cwd=tmp_path)
    assert_counts_logged(tmp_path, "r", proc.stdout)
    assert "FutureWarning" not in proc.stderr, proc.stderr[-2000:]  # e.g. peft on transformers' renamed API
    if script == "reward_model.py":  # merged by default: config.reward_offset lives in the full model's config
        rm = AutoModelForSequenceClassification.from_pretrained(tmp_path / "out")
        assert rm.config.num_labels == 1 and hasattr(rm.config, "reward_offset")
        assert (tmp_path / "out/adapter/adapter_config.json").exists()
    else:
        PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(chat_model), tmp_path / "out")
    adapter = tmp_path / ("out/adapter" if script == "reward_model.py" else "out")
    lora_B = [k for k in moved(None, adapter, "adapter_model.safetensors") if "lora_B" in k]
    # B starts at 0; GRPO's rule rewards all tie on this untrained model: zero advantages, no update
    assert bool(lora_B) == (script != "grpo.py")
    if script == "ppo.py":  # the critic: a second adapter, with its value head, on its own copy of the base
        critic = json.loads((tmp_path / "out/checkpoint-2/critic/adapter_config.json").read_text())
        assert critic["task_type"] == "SEQ_CLS" and "score" in critic["modules_to_save"]
