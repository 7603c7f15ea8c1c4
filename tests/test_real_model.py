"""A real pretrained chat model, SmolLM2-135M-Instruct (Llama architecture, ChatML template with a default system
prompt, `<|im_start|>` as BOS written by the template and not added by the tokenizer, `<|im_end|>` as EOS and pad):
its tokenisation against its own chat template, generation against HF generate, and every script on it for a
few steps. Beside it, the Qwen-like fixture (no BOS) and a Llama-3-like tokenizer (adds BOS, the template writes
it too): every conversational prompt must be exactly the template's ids, with one BOS or none as the template says."""

import json
import statistics

import pytest
import torch
from conftest import CHATML, moved, read_metrics, run_script, write_jsonl
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

import common
import dpo
import grpo
import ppo
import reward_model
import sft
from benchmarks.real_model import sum_questions

pytestmark = pytest.mark.real_model

QUESTIONS = [
    f"Tom has {a} apples and buys {b} more. How many apples does he have now?"
    for a, b in zip(range(3, 15), range(5, 17))
]


def gsm8k_rows():
    return [
        {"question": q, "answer": f"He has {3 + i} + {5 + i} = {8 + 2 * i}.\n#### {8 + 2 * i}"}
        for i, q in enumerate(QUESTIONS)
    ]


def chat_rows():
    """`messages` (SFT) and conversational prompt/chosen/rejected (preference) rows: a system turn on some."""
    rows = []
    for i, q in enumerate(QUESTIONS):
        system = [{"role": "system", "content": "Answer briefly."}] if i % 2 else []
        prompt = [*system, {"role": "user", "content": q}]
        right, wrong = f"{8 + 2 * i} apples.", f"{9 + 2 * i} apples."
        rows.append(
            {
                "messages": [*prompt, {"role": "assistant", "content": f"He has {right}"}],
                "prompt": prompt,
                "chosen": [{"role": "assistant", "content": right}],
                "rejected": [{"role": "assistant", "content": wrong}],
            }
        )
    return rows


def llama3_style(chat_model):
    """The Qwen-like fixture's tokenizer made Llama-3-like: it adds a BOS to every text, and its template writes one."""
    from tokenizers import processors

    tok = common.load_tokenizer(chat_model)
    tok.add_special_tokens({"bos_token": "<|begin_of_text|>"})
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", tok.bos_token_id)]
    )
    tok.chat_template = "{{ bos_token }}" + CHATML
    return tok


@pytest.fixture(params="smollm2 qwen-like llama3-like".split())
def chat_tokenizer(request, chat_model):
    if request.param == "smollm2":
        return common.load_tokenizer(request.getfixturevalue("smollm2"))
    return common.load_tokenizer(chat_model) if request.param == "qwen-like" else llama3_style(chat_model)


def template_ids(tok, messages, add_generation_prompt=False):
    return tok.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
    )


def unpadded(batch, i):
    """Row i of a collated batch: (prompt ids, completion ids) without their padding."""
    prompt = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()].tolist()
    return prompt, batch["completion_ids"][i][batch["completion_mask"][i].bool()].tolist()


def until_first_eos(ids, start, eos_ids):
    """ids cut after the first EOS at or after position `start`."""
    end = next(i for i in range(start, len(ids)) if ids[i] in eos_ids)
    return ids[: end + 1]


def test_conversational_rows_are_tokenized_exactly_as_the_chat_template(chat_tokenizer, tmp_path):
    tok, eos = chat_tokenizer, [chat_tokenizer.eos_token_id]
    rows = chat_rows()
    file = write_jsonl(tmp_path / "chat.jsonl", rows)
    implicit = write_jsonl(  # chosen/rejected as whole conversations, the prompt implicit
        tmp_path / "implicit.jsonl",
        [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in rows],
    )
    sft_rows = common.load_rows(file, "train", "sft", tok)
    batch = common.completion_batch(tok, sft_rows, [r["completion"] for r in sft_rows], 1024, eos)
    for i, row in enumerate(rows[: len(sft_rows)]):
        prompt, completion = unpadded(batch, i)
        assert prompt == template_ids(tok, row["messages"][:-1], add_generation_prompt=True)
        assert prompt + completion == until_first_eos(template_ids(tok, row["messages"]), len(prompt), eos)
    for path in (file, implicit):
        pairs = common.load_rows(path, "train", "preference", tok)
        batch = dpo.pair_batch(tok, pairs, 1024, "cpu", eos)
        for i, row in enumerate(rows[: len(pairs)]):
            for j, side in ((i, "chosen"), (i + len(pairs), "rejected")):
                prompt, completion = unpadded(batch, j)
                assert prompt == template_ids(tok, row["prompt"], add_generation_prompt=True)
                whole = template_ids(tok, row["prompt"] + row[side])
                assert prompt + completion == until_first_eos(whole, len(prompt), eos)
    gsm8k = common.load_rows(write_jsonl(tmp_path / "gsm8k.jsonl", gsm8k_rows()), "train", "prompt", tok)
    for row, prompt in zip(gsm8k, common.tokenize_prompts(tok, gsm8k, 1024)):
        assert prompt == template_ids(tok, row["messages"], add_generation_prompt=True)
    bos = [tok.bos_token_id] if tok("")["input_ids"] else []  # plain text keeps the tokenizer's own special tokens
    assert (
        common.tokenize_prompts(tok, [{"prompt": "What is 2+3?"}], 64)[0]
        == bos + tok("What is 2+3?", add_special_tokens=False)["input_ids"]
    )


def test_smollm2_prompts_start_with_the_bos_its_template_writes(smollm2, tmp_path):
    tok = common.load_tokenizer(smollm2)
    assert tok.bos_token == "<|im_start|>" and tok("hi")["input_ids"][0] != tok.bos_token_id  # added by no one else
    rows = common.load_rows(write_jsonl(tmp_path / "gsm8k.jsonl", gsm8k_rows()), "train", "prompt", tok)
    prompt = common.tokenize_prompts(tok, rows, 1024)[0]
    assert (
        tok.convert_ids_to_tokens(prompt[:3]) == "<|im_start|> system Ċ".split()
    )  # the template's default system turn


@pytest.mark.parametrize("script", [grpo, ppo])
def test_greedy_completions_equal_hf_generate_on_the_templates_ids(smollm2, script):
    tok = common.load_tokenizer(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2).eval()
    prompts = [
        template_ids(tok, [{"role": "user", "content": q}], add_generation_prompt=True)
        for q in ("What is 2+3?", QUESTIONS[0])
    ]
    eos = torch.tensor(common.eos_token_ids(tok, model.generation_config))
    ids, mask = common.pad(prompts, tok.pad_token_id, "left")  # two lengths: one prompt is left-padded
    args = script.Args(max_new_tokens=12, temperature=1.0)
    completion_ids, cmask, _ = script.generate(model, ids, mask, tok, eos, args, greedy=True)
    for prompt, row, row_mask in zip(prompts, completion_ids, cmask):
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt) :].tolist()
        end = next((i + 1 for i, t in enumerate(expected) if t in eos.tolist()), len(expected))  # its first EOS kept
        assert row[row_mask.bool()].tolist() == expected[:end]
        assert tok.decode(row[row_mask.bool()], skip_special_tokens=True).strip()  # it answers something


def test_the_cards_command_takes_the_pretrained_defaults(chat_model, tmp_path):
    """`grpo.py --model <hub chat model> --dataset <GSM8K> --group-size 16`, as the card writes it (one step)."""
    data = write_jsonl(tmp_path / "gsm8k.jsonl", gsm8k_rows())
    flags = ["--model", str(chat_model), "--dataset", data, *"--group-size 16 --steps 1 --eval-size 2".split()]
    proc = run_script("grpo.py", *flags, *"--run-name card --output-dir out".split(), cwd=tmp_path)
    used = json.loads((tmp_path / "runs" / "card" / "args.json").read_text())
    # what docs/running.md promises a pretrained model (TRL's values, but where it says why not)
    promised = dict(prompts_per_step=8, temperature=1.0, max_new_tokens=256, lr=1e-6, warmup_steps=0, beta=0.04)
    assert {name: used[name] for name in promised} == promised and used["steps"] == 1 and used["loss_type"] == "grpo"
    assert used["group_size"] == 16 and "defaults for a pretrained model" in proc.stdout
    assert [row["train/lr"] for row in read_metrics(tmp_path, "card") if "train/loss" in row] == [1e-6]  # no warm-up


def test_the_built_in_task_keeps_its_tuned_defaults(tmp_path):
    common.build_char_tokenizer().save_pretrained(tmp_path / "tiny")  # what sft.py saves beside the tiny model
    for script in (sft, reward_model, dpo, grpo, ppo):
        args = script.Args(model=None if script is sft else str(tmp_path / "tiny"))
        script.resolve_defaults(args)
        assert all(getattr(args, name) == v[0] for name, v in script.DEFAULTS.items()), script.__name__
        args = script.Args(model=None if script is sft else str(tmp_path / "tiny"), dataset="x.jsonl", lr=0.5)
        script.resolve_defaults(args)
        assert args.lr == 0.5 and all(getattr(args, n) == v[1] for n, v in script.DEFAULTS.items() if n != "lr")


# ---------------------------------------------------------------- every script on SmolLM2, a few steps
SHORT = "--eval-size 2 --eval-every 2 --max-new-tokens 8".split()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("real-data")
    return {"chat": write_jsonl(d / "chat.jsonl", chat_rows()), "gsm8k": write_jsonl(d / "gsm8k.jsonl", gsm8k_rows())}


@pytest.mark.slow
def test_sft_trains_smollm2_on_messages(smollm2, data, tmp_path):
    flags = ["--model", str(smollm2), "--dataset", data["chat"], *"--steps 2 --batch-size 2".split(), *SHORT]
    run_script("sft.py", *flags, *"--run-name r --output-dir out".split(), cwd=tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    tok = common.load_tokenizer(tmp_path / "out")
    ids = template_ids(tok, [{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False).shape[1] > len(ids)
    assert len(moved(smollm2, tmp_path / "out")) > 10
    assert json.loads((tmp_path / "runs" / "r" / "args.json").read_text())["lr"] == sft.DEFAULTS["lr"][1]


@pytest.fixture(scope="module")
def smollm2_reward(smollm2, data, tmp_path_factory):
    """A reward model trained from SmolLM2 for two steps on conversational pairs (reloaded by the test below)."""
    cwd = tmp_path_factory.mktemp("real-reward")
    flags = ["--model", str(smollm2), "--dataset", data["chat"], *"--steps 2 --batch-size 2".split(), *SHORT]
    run_script("reward_model.py", *flags, *"--run-name r --output-dir out".split(), cwd=cwd)
    return cwd / "out"


@pytest.mark.slow
def test_reward_model_trains_on_smollm2(smollm2, smollm2_reward):
    """Two steps moved the backbone it started from (and a score head was saved with it)."""
    model = AutoModelForSequenceClassification.from_pretrained(smollm2_reward)
    assert len(moved(smollm2, smollm2_reward)) > 10 and "score.weight" in dict(model.named_parameters())


@pytest.mark.slow
@pytest.mark.parametrize("script", ["dpo.py", "grpo.py"])
def test_lora_adapters_train_on_smollm2(smollm2, data, script, tmp_path):
    from peft import PeftModel

    if script == "dpo.py":
        flags = ["--dataset", data["chat"], *"--steps 2 --batch-size 2".split()]
    else:  # 4 new tokens: no answer fits, which the run says once
        flags = ["--dataset", data["gsm8k"], *"--steps 1 --prompts-per-step 2 --group-size 2".split()]
        flags += ["--grad-accum-steps", "2"]
    flags += ["--model", str(smollm2), "--lora-r", "8", *SHORT]
    proc = run_script(script, *flags, *"--max-new-tokens 4 --run-name r --output-dir out".split(), cwd=tmp_path)
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(smollm2), tmp_path / "out")
    lora_B = [k for k in moved(None, tmp_path / "out", "adapter_model.safetensors") if "lora_B" in k]
    # B starts at 0: DPO's steps trained the adapters; GRPO's rewards all tie (no answer fits), so Â = 0
    assert bool(lora_B) == (script == "dpo.py")
    if script == "grpo.py":
        assert proc.stdout.count("raise --max-new-tokens") == 1


@pytest.mark.slow
def test_ppo_trains_smollm2_against_its_reward_model(smollm2, smollm2_reward, data, tmp_path):
    flags = ["--model", str(smollm2), "--reward-model", str(smollm2_reward), "--dataset", data["gsm8k"]]
    flags += [*"--steps 1 --prompts-per-step 2 --num-mini-batches 1".split(), *SHORT]
    run_script("ppo.py", *flags, *"--run-name r --output-dir out".split(), cwd=tmp_path)
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "out").config.model_type == "llama"
    assert read_metrics(tmp_path, "r")[-1]["step"] == 1 and len(moved(smollm2, tmp_path / "out")) > 10


def test_a_reward_model_tokenizer_without_a_chat_template_is_named(chat_model, tmp_path):
    """grpo.py --reward-model <one whose tokenizer has no chat template> with a chat policy on GSM8K rows."""
    policy_tok = common.load_tokenizer(chat_model)
    rows = common.load_rows(write_jsonl(tmp_path / "gsm8k.jsonl", gsm8k_rows()), "train", "prompt", policy_tok)
    plain = common.build_char_tokenizer()  # no chat_template
    with pytest.raises(
        common.DataError, match=r"the reward model's tokenizer .* has no chat template.*reward_model.py"
    ):
        common.retokenize(plain, rows[:2], ["8", "9"], [True, True], 64)


@pytest.mark.slow
def test_dpo_on_its_own_samples_makes_smollm2_better(smollm2, tmp_path):
    """`dpo.py --dataset <prompts with answers>`: pairs of SmolLM2's own right and wrong answers (held-out ones
    too), 8 steps: the implicit reward ranks the held-out pairs and greedy accuracy on the 40 held-out questions
    rises. Margins: RESULTS.md, seeds 1-3."""
    flags = ["--model", str(smollm2), "--dataset", write_jsonl(tmp_path / "sums.jsonl", sum_questions())]
    flags += "--max-new-tokens 16 --steps 8 --batch-size 4 --lr 1e-5 --eval-every 8 --eval-size 40".split()
    run_script("dpo.py", *flags, *"--run-name r --output-dir out".split(), cwd=tmp_path)
    first, last = [m for m in read_metrics(tmp_path, "r") if "eval/accuracy" in m]
    assert last["eval/rewards/accuracies"] >= 0.8 and last["eval/accuracy"] >= first["eval/accuracy"] + 0.15, (
        first,
        last,
    )


@pytest.mark.slow
def test_grpo_with_lora_makes_smollm2_better(smollm2, tmp_path):
    """`grpo.py --lora-r 16` on the same sums: 8 steps of 4 prompts × 8 samples, rewarded by the answer key;
    greedy accuracy on the 40 held-out questions rises (it learns to answer with the number alone). Margins:
    RESULTS.md, seeds 1-3."""
    flags = ["--model", str(smollm2), "--dataset", write_jsonl(tmp_path / "sums.jsonl", sum_questions())]
    flags += "--lora-r 16 --lr 1e-4 --max-new-tokens 16 --steps 8 --prompts-per-step 4 --group-size 8".split()
    flags += "--grad-accum-steps 1 --beta 0 --temperature 1.0 --eval-every 8 --eval-size 40".split()
    run_script("grpo.py", *flags, *"--run-name r --output-dir out".split(), cwd=tmp_path)
    first, last = [m for m in read_metrics(tmp_path, "r") if "eval/accuracy" in m]
    assert last["eval/accuracy"] >= first["eval/accuracy"] + 0.25, (first, last)


@pytest.mark.slow
def test_ppo_with_the_accuracy_rule_raises_smollm2s_reward(smollm2, tmp_path):
    """`ppo.py --reward-funcs accuracy --lora-r 16` on the same sums, the critic set up as an untrained one needs (4
    returns of each prompt, its own lr, its head at 0): in 8 steps of 4 prompts × 4 samples the rollouts' score (the
    accuracy, −1 without an EOS) rises, the critic comes to explain part of the returns, and held-out greedy accuracy
    rises. Margins: RESULTS.md, seeds 1-3; with Â's sign flipped all three fail."""
    flags = ["--model", str(smollm2), "--dataset", write_jsonl(tmp_path / "sums.jsonl", sum_questions())]
    flags += "--reward-funcs accuracy --lora-r 16 --lr 1e-4 --critic-lr 1e-3 --zero-value-head --kl-coef 0".split()
    flags += "--max-new-tokens 16 --steps 8 --prompts-per-step 4 --samples-per-prompt 4 --temperature 1.0".split()
    flags += "--num-ppo-epochs 1 --lam 1 --eval-every 8 --eval-size 40".split()
    run_script("ppo.py", *flags, *"--run-name r --output-dir out".split(), cwd=tmp_path)
    metrics = read_metrics(tmp_path, "r")
    steps, (first, last) = [m for m in metrics if "train/lr" in m], [m for m in metrics if "eval/accuracy" in m]
    scores = [m["train/score"] for m in steps]
    assert statistics.mean(scores[-2:]) >= statistics.mean(scores[:2]) + 0.25, scores
    assert max(m["train/explained_variance"] for m in steps) >= 0.1, steps
    assert last["eval/accuracy"] > first["eval/accuracy"], (first, last)
