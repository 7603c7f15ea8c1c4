"""Hub chat models, offline: a Qwen2-style fixture with a ChatML template, two EOS ids and a
generation_config with sampling settings; a reward model with another tokenizer. Sampling must be exactly
the distribution of the ratio, every EOS id must end a completion, and every script must run on such
models with TRL's conversational formats."""

import re

import pytest
import torch
from conftest import CHAT_GENERATION, moved, read_metrics, run_script, write_jsonl
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, GenerationConfig

import common
import grpo
import ppo
import sft

# a few PPO steps on the GSM8K-style file: enough to run every part of the loop
TINY_PPO = "--steps 2 --prompts-per-step 8 --max-new-tokens 6 --eval-every 2 --eval-size 8 --kl-coef 0.05".split()


def chat_ids(path):
    tok = common.load_tokenizer(path)
    return tok, tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")


def test_fixture_is_hub_like(chat_model):
    tok, im_end, endoftext = chat_ids(chat_model)
    model = AutoModelForCausalLM.from_pretrained(chat_model)
    assert tok.eos_token_id == im_end and tok.pad_token_id == endoftext
    assert (
        model.generation_config.eos_token_id == [im_end, endoftext]
        and model.generation_config.repetition_penalty == 1.05
    )
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Add 2 and 3."}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|im_start|>user\nAdd 2 and 3.<|im_end|>\n<|im_start|>assistant\n"
    assert common.eos_token_ids(tok, model.generation_config) == [im_end, endoftext]


# ---------------------------------------------------------------- sampling == the ratio's distribution
def sampled_logq_and_forward_logps(script, model, tok, temperature, static_cache=False):
    """Runs script.generate on three left-padded chat prompts, capturing generate's processed scores:
    returns (log q(sampled token) under those scores, the script's forward_logps of the same tokens, mask)."""
    texts = [
        tok.apply_chat_template([{"role": "user", "content": c}], tokenize=False, add_generation_prompt=True)
        for c in ["Add 1 and 2.", "What is 123+456?", "Tom has 7 apples."]
    ]
    ids, mask = common.pad(common.tokenize(tok, texts), tok.pad_token_id, "left")
    captured, plain_generate = {}, model.generate

    def spy(**kwargs):  # what the script asked for, plus the scores generate sampled from
        captured["config"] = model.generation_config
        out = plain_generate(**kwargs, output_scores=True, return_dict_in_generate=True)
        captured["scores"] = torch.stack(out.scores, 1)
        return out.sequences

    model.generate = spy
    eos = torch.tensor(common.eos_token_ids(tok, model.generation_config))
    args = script.Args(max_new_tokens=12, temperature=temperature, static_cache=static_cache)
    torch.manual_seed(0)
    completion_ids, cmask, _ = script.generate(model, ids, mask, tok, eos, args)
    model.generate = plain_generate
    log_q = captured["scores"].float().log_softmax(-1).gather(-1, completion_ids[..., None])[..., 0]
    with torch.no_grad():
        input_ids, attention_mask = torch.cat([ids, completion_ids], 1), torch.cat([mask, cmask], 1)
        fwd = script.forward_logps(model, input_ids, attention_mask, completion_ids.shape[1], temperature)
    return log_q, fwd, cmask, captured["config"]


@pytest.mark.parametrize("static_cache", [False, True], ids=["dynamic cache", "static cache"])
@pytest.mark.parametrize("script", [grpo, ppo])
def test_sampling_is_exactly_softmax_over_temperature_whatever_the_model_ships(chat_model, script, static_cache):
    """The fixture's generation_config (after save + reload) with repetition_penalty and min_p on top:
    the log-prob of each sampled token under generate's own processed scores equals forward_logps, with the
    default KV cache and with --static-cache."""
    tok = common.load_tokenizer(chat_model)
    model = AutoModelForCausalLM.from_pretrained(chat_model).eval()
    model.generation_config.update(repetition_penalty=1.3, min_p=0.2, no_repeat_ngram_size=2, typical_p=0.9)
    shipped = model.generation_config.to_dict()
    log_q, fwd, cmask, used = sampled_logq_and_forward_logps(script, model, tok, 0.7, static_cache)
    assert cmask.sum() > 20
    assert (log_q - fwd).abs().mul(cmask).max() < 1e-5
    assert used.eos_token_id == common.eos_token_ids(tok, model.generation_config)  # stops at every EOS id
    assert used.cache_implementation == ("static" if static_cache else None)
    assert model.generation_config.to_dict() == shipped  # the model keeps its own settings (and saves them)
    if static_cache:
        return

    # the check has teeth: generate left with the model's own settings samples from another distribution
    ids, mask = common.pad(common.tokenize(tok, ["What is 123+456?"] * 4), tok.pad_token_id, "left")
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=12,
        temperature=0.7,
        output_scores=True,
        return_dict_in_generate=True,
    )
    completion = out.sequences[:, ids.shape[1] :]
    log_q = torch.stack(out.scores, 1).float().log_softmax(-1).gather(-1, completion[..., None])[..., 0]
    with torch.no_grad():
        fwd = grpo.forward_logps(model, out.sequences, torch.ones_like(out.sequences), completion.shape[1], 0.7)
    assert (log_q - fwd).abs().max() > 1e-2


def test_temperature_divides_fp32_logits():
    """token_logprobs divides the logits by T after the cast to fp32, as sampling does (not in bf16)."""
    torch.manual_seed(0)
    logits, tokens = (torch.randn(2, 5, 50) * 8).bfloat16(), torch.randint(0, 50, (2, 5))
    exact = (logits.float() / 0.7).log_softmax(-1).gather(-1, tokens[..., None])[..., 0]
    assert torch.allclose(sft.token_logprobs(logits, tokens, 0.7), exact, atol=1e-5)  # one text in every script


# ---------------------------------------------------------------- every EOS id
class ScriptedModel:
    """Stands in for a causal LM whose generate() returns fixed completions: rows ending in `<|im_end|>`,
    in `<|endoftext|>` (also the pad), and one cut by the length limit."""

    def __init__(self, completions):
        self.completions, self.generation_config, self.eos_seen = completions, GenerationConfig(), None

    def generate(self, input_ids, attention_mask, synced_gpus):
        self.eos_seen = self.generation_config.eos_token_id
        return torch.cat([input_ids, self.completions], 1)


@pytest.mark.parametrize("script", [grpo, ppo])
def test_completions_end_at_any_eos_id(chat_model, script):
    tok, im_end, endoftext = chat_ids(chat_model)
    x, y = tok.convert_tokens_to_ids(["a", "b"])
    completions = torch.tensor([[x, im_end, endoftext, endoftext], [x, y, endoftext, endoftext], [x, y, x, y]])
    model = ScriptedModel(completions)
    eos = torch.tensor([im_end, endoftext])
    ids, mask, ended = script.generate(
        model,
        torch.tensor([[x]] * 3),
        torch.ones(3, 1, dtype=torch.long),
        tok,
        eos,
        script.Args(max_new_tokens=8, temperature=0.7),
    )
    assert model.eos_seen == [im_end, endoftext]  # generation stops at either
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]  # the EOS itself is a completion token
    assert ended.tolist() == [True, True, False]  # PPO's missing-EOS penalty and GRPO's format bonus read this
    assert script.completion_mask(completions, eos).tolist() == mask.tolist()
    # the reward model's read position: the last real token, i.e. the EOS that ended the row
    attention = torch.cat([torch.ones(3, 1, dtype=torch.long), mask], 1)
    last = attention.shape[1] - 1 - attention.flip(1).argmax(1)
    assert torch.cat([torch.tensor([[x]] * 3), ids], 1)[torch.arange(3), last].tolist() == [im_end, endoftext, y]


def test_training_completions_end_at_their_first_eos(chat_model):
    """A chat template's `…<|im_end|>\\n` ends at `<|im_end|>`; `<|endoftext|>` ends a completion too."""
    tok, im_end, endoftext = chat_ids(chat_model)
    eos = [im_end, endoftext]
    rendered = common.tokenize(tok, ["The sum is 5.<|im_end|>\n", "5<|endoftext|>junk", "5"], add_eos=True, eos_ids=eos)
    assert [r[-1] for r in rendered] == [im_end, endoftext, im_end]
    assert [sum(t in eos for t in r) for r in rendered] == [1, 1, 1]
    assert tok.decode(rendered[0]) == "The sum is 5.<|im_end|>"


# ---------------------------------------------------------------- reward models with their own tokenizer
def test_retokenize_for_a_reward_model_with_another_tokenizer(chat_model, char_reward_model):
    policy_tok = common.load_tokenizer(chat_model)
    rm_tok = common.load_tokenizer(char_reward_model)
    assert common.same_tokenizer(policy_tok, common.load_tokenizer(chat_model))
    assert not common.same_tokenizer(policy_tok, rm_tok)
    question = [{"role": "user", "content": "Add 2 and 3."}]
    rows = [{"prompt": "<policy-rendered>", "messages": question}, {"prompt": "2+3=", "messages": None}]
    ids, mask = common.retokenize(rm_tok, rows, ["5", "5"], ended=[True, False], max_prompt_length=512)
    texts = [rm_tok.decode(i[m.bool()]) for i, m in zip(ids, mask)]
    # conversational: rendered with the reward model's own template, completion as the assistant's turn (+ its EOS)
    assert (
        texts[0]
        == rm_tok.apply_chat_template(question + [{"role": "assistant", "content": "5"}], tokenize=False) + "<eos>"
    )
    assert texts[1] == "2+3=5"  # plain text as it is; no EOS where the policy emitted none (cut by the length limit)


def test_a_character_tokenizer_beside_a_qwen2_config_loads_as_saved(char_reward_model):
    """transformers 5 would load it as Qwen2Tokenizer, whose byte-level pre-tokenizer drops spaces and newlines."""
    tok = common.load_tokenizer(char_reward_model)
    assert tok.decode(tok("Add 2 and 3.\n")["input_ids"]) == "Add 2 and 3.\n"


def run_fails(script, *args, cwd):
    proc = run_script(script, *args, cwd=cwd, check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    return [line for line in lines if line.startswith("error:")]


@pytest.mark.parametrize("script", ["grpo.py", "ppo.py"])
def test_a_causal_lm_is_refused_as_reward_model(chat_model, tmp_path, script):
    errors = run_fails(
        script, "--model", str(chat_model), "--reward-model", str(chat_model), "--steps", "1", cwd=tmp_path
    )
    assert len(errors) == 1 and "is not a reward model" in errors[0] and "score" in errors[0], errors


# ---------------------------------------------------------------- every script on the fixture, TRL's formats
def user(text):
    return [{"role": "user", "content": text}]


def assistant(text):
    return [{"role": "assistant", "content": text}]


def gsm8k_file(path):
    return write_jsonl(
        path,
        [
            {
                "question": f"Tom has {a} apples and buys {a + 3} more. How many now?",
                "answer": f"{a} + {a + 3} = {2 * a + 3}\n#### {2 * a + 3}",
            }
            for a in range(40)
        ],
    )


def assert_reloads_with_own_generation_config(path):
    model = AutoModelForCausalLM.from_pretrained(path)
    assert {k: getattr(model.generation_config, k) for k in CHAT_GENERATION} == CHAT_GENERATION
    assert len(model.generation_config.eos_token_id) == 2
    assert common.load_tokenizer(path).chat_template is not None


@pytest.mark.slow
def test_sft_on_messages(chat_model, tmp_path):
    rows = [{"messages": user(f"Add {a} and {a + 1}.") + assistant(f"The sum is {2 * a + 1}.")} for a in range(40)]
    data = write_jsonl(tmp_path / "messages.jsonl", rows)
    out = run_script(
        "sft.py",
        "--model",
        str(chat_model),
        "--dataset",
        data,
        *"--steps 4 --batch-size 8 --lr 1e-3 --eval-every 4 --run-name s".split(),
        cwd=tmp_path,
    ).stdout
    losses = [m["eval/loss"] for m in read_metrics(tmp_path, "s") if "eval/loss" in m]
    assert len(losses) == 2 and losses[1] < losses[0]
    assert_prints_samples_without_answers(out)
    assert_reloads_with_own_generation_config(tmp_path / "models" / "sft")


def assert_prints_samples_without_answers(out: str):
    """Rows without answers: each of the 2 evaluations prints 4 samples, the completion alone (no verdict), the
    rendered prompt cut to its end (where the question is)."""
    shown = re.findall(r"^  '(.*)' → '(.*)'$", out, re.M)
    assert len(shown) == 8 and all(prompt.endswith("<|im_start|>assistant\\n") for prompt, _ in shown), out[-2000:]


def preference_file(path):
    return write_jsonl(
        path,
        [
            {
                "prompt": user(f"Add {a} and 3."),
                "chosen": assistant(f"The sum is {a + 3}."),
                "rejected": assistant(f"The sum is {a + 4}."),
            }
            for a in range(40)
        ],
    )


@pytest.mark.slow
def test_reward_model_then_ppo_on_conversational_rows(chat_model, tmp_path):
    """reward_model.py on conversational preference rows; PPO then reads its scores on the policy's own ids
    (same tokenizer) with the critic started from it."""
    run_script(
        "reward_model.py",
        "--model",
        str(chat_model),
        "--dataset",
        preference_file(tmp_path / "pref.jsonl"),
        *"--steps 3 --batch-size 8 --eval-every 3 --run-name rm".split(),
        cwd=tmp_path,
    )
    rm_dir = tmp_path / "models" / "reward"
    assert AutoModelForSequenceClassification.from_pretrained(rm_dir).config.num_labels == 1
    assert "eval/accuracy" in read_metrics(tmp_path, "rm")[-1] and moved(chat_model, rm_dir)
    out = run_script(
        "ppo.py",
        "--model",
        str(chat_model),
        "--reward-model",
        str(rm_dir),
        "--dataset",
        gsm8k_file(tmp_path / "gsm.jsonl"),
        *TINY_PPO,
        "--run-name",
        "p",
        cwd=tmp_path,
    ).stdout
    assert "own tokenizer" not in out
    assert moved(chat_model, tmp_path / "models" / "ppo")
    assert_reloads_with_own_generation_config(tmp_path / "models" / "ppo")


@pytest.mark.slow
def test_dpo_on_conversational_rows(chat_model, tmp_path):
    out = run_script(
        "dpo.py",
        "--model",
        str(chat_model),
        "--dataset",
        preference_file(tmp_path / "pref.jsonl"),
        *"--steps 3 --batch-size 8 --eval-every 3 --run-name d".split(),
        cwd=tmp_path,
    ).stdout
    evals = [m for m in read_metrics(tmp_path, "d") if "eval/rewards/accuracies" in m]
    assert [m["step"] for m in evals] == [0, 3] and "eval/accuracy" not in evals[0]
    assert evals[0]["eval/rewards/accuracies"] == 0 < evals[1]["eval/rewards/accuracies"]  # π = π_ref ties at step 0
    assert moved(chat_model, tmp_path / "models" / "dpo")
    assert_prints_samples_without_answers(out)
    assert_reloads_with_own_generation_config(tmp_path / "models" / "dpo")


@pytest.mark.slow
def test_grpo_on_gsm8k_through_the_chat_template(chat_model, char_reward_model, tmp_path):
    """Rule-based rewards, then the reward model with the character tokenizer: completions are decoded and
    re-tokenized with its own tokenizer and template."""
    data = gsm8k_file(tmp_path / "gsm.jsonl")
    common_args = [
        "--model",
        str(chat_model),
        "--dataset",
        data,
        *"--group-size 4 --prompts-per-step 4 --max-new-tokens 6 --steps 2 --eval-every 2 --eval-size 8".split(),
    ]
    run_script("grpo.py", *common_args, "--run-name", "rule", cwd=tmp_path)
    assert "eval/accuracy" in read_metrics(tmp_path, "rule")[-1]
    assert_reloads_with_own_generation_config(tmp_path / "models" / "grpo")
    out = run_script(
        "grpo.py",
        *common_args,
        "--reward-model",
        str(char_reward_model),
        *"--output-dir models/grpo-rm --run-name rm".split(),
        cwd=tmp_path,
    ).stdout
    assert "has its own tokenizer" in out
    train = [m for m in read_metrics(tmp_path, "rm") if "train/reward_std" in m]
    assert len(train) == 2 and all(m["train/reward_std"] > 0 for m in train)  # the reward model tells completions apart


@pytest.mark.slow
def test_ppo_with_a_reward_model_of_another_tokenizer(chat_model, char_reward_model, tmp_path):
    out = run_script(
        "ppo.py",
        "--model",
        str(chat_model),
        "--reward-model",
        str(char_reward_model),
        "--dataset",
        gsm8k_file(tmp_path / "gsm.jsonl"),
        *TINY_PPO,
        *"--save-every 2 --run-name p".split(),
        cwd=tmp_path,
    ).stdout
    assert "has its own tokenizer" in out and "critic starts from the policy" in out
    metrics = read_metrics(tmp_path, "p")
    assert all(torch.isfinite(torch.tensor(m["train/score"])) for m in metrics if "train/score" in m)
    critic = AutoModelForSequenceClassification.from_pretrained(tmp_path / "models" / "ppo" / "checkpoint-2" / "critic")
    # the critic reads the policy's tokens
    assert critic.config.vocab_size == common.load_tokenizer(chat_model).vocab_size
    assert_reloads_with_own_generation_config(tmp_path / "models" / "ppo")
