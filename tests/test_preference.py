"""reward_model.py and dpo.py: losses against naive versions and the notes' properties, end-to-end runs,
and every preference format from local files."""

import contextlib
import math
import os
import re
from types import SimpleNamespace

import pytest
import torch
from conftest import RM_TEST_ARGS, read_metrics, run_script, write_jsonl
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

import common
import dpo
import reward_model


# ---------------------------------------------------------------- math
def test_bradley_terry_loss_matches_naive():
    chosen, rejected, margin = (
        torch.tensor([2.0, -1.0, 30.0]),
        torch.tensor([1.0, 0.5, -30.0]),
        torch.tensor([0.5, 0.0, 1.0]),
    )
    naive = [
        -math.log(1 / (1 + math.exp(-(c - r - m))))
        for c, r, m in zip(chosen.tolist(), rejected.tolist(), margin.tolist())
    ]
    assert torch.allclose(reward_model.bradley_terry_loss(chosen, rejected, margin), torch.tensor(naive), atol=1e-6)
    assert torch.allclose(
        reward_model.bradley_terry_loss(chosen, rejected),
        reward_model.bradley_terry_loss(chosen, rejected, torch.zeros(3)),
    )
    # stable far in the tails, where log(sigmoid()) would give inf
    assert torch.isfinite(reward_model.bradley_terry_loss(torch.tensor([-200.0]), torch.tensor([200.0]))).all()


def naive_dpo(pc, pr, rc, rr, beta, loss_type, ls):
    out = []
    for a, b, c, d in zip(pc.tolist(), pr.tolist(), rc.tolist(), rr.tolist()):
        h = (a - c) - (b - d)
        if loss_type == "ipo":
            out.append((h - 1 / (2 * beta)) ** 2)
        else:
            sig = lambda z: 1 / (1 + math.exp(-z))
            out.append(-(1 - ls) * math.log(sig(beta * h)) - ls * math.log(sig(-beta * h)))
    return torch.tensor(out)


@pytest.mark.parametrize("loss_type,ls", [("sigmoid", 0.0), ("sigmoid", 0.2), ("ipo", 0.0)])
def test_dpo_loss_matches_naive(loss_type, ls):
    g = torch.Generator().manual_seed(0)
    pc, pr, rc, rr = (-torch.rand(5, generator=g) * 10 for _ in range(4))
    losses, cr, rj = dpo.dpo_loss(pc, pr, rc, rr, 0.1, loss_type, ls)
    assert torch.allclose(losses, naive_dpo(pc, pr, rc, rr, 0.1, loss_type, ls), atol=1e-5)
    assert torch.allclose(cr, 0.1 * (pc - rc)) and torch.allclose(rj, 0.1 * (pr - rr))


def test_dpo_loss_is_log2_when_policy_equals_reference():
    logps = -torch.rand(4) * 5
    losses, cr, rj = dpo.dpo_loss(logps, logps - 1, logps, logps - 1, beta=0.1)
    assert torch.allclose(losses, torch.full((4,), math.log(2))) and cr.abs().max() == 0 and rj.abs().max() == 0


def test_dpo_gradient_raises_chosen_and_lowers_rejected():
    pc, pr = torch.tensor([-3.0], requires_grad=True), torch.tensor([-3.0], requires_grad=True)
    losses, cr, _ = dpo.dpo_loss(pc, pr, torch.tensor([-3.0]), torch.tensor([-3.0]), beta=0.1)
    losses.sum().backward()
    # gradient descent moves along −grad: up for the chosen log-ratio, down for the rejected one
    assert pc.grad.item() < 0 < pr.grad.item()
    assert not cr.requires_grad  # implicit rewards are detached


@pytest.mark.slow
def test_score_at_last_token_reads_the_last_real_token(sft_run):
    _, model_dir, _ = sft_run
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = reward_model.load_model(str(model_dir), False, AutoModelForSequenceClassification, num_labels=1).eval()
    rows = [
        {"prompt": "1+2=", "chosen": "3", "rejected": "4"},
        {"prompt": "123+456=", "chosen": "579", "rejected": "589"},
    ]
    batch = reward_model.pair_batch(tok, rows, 64, "cpu")
    scores = reward_model.score_at_last_token(model, batch["input_ids"], batch["attention_mask"])
    alone = reward_model.pair_batch(tok, rows[:1], 64, "cpu")
    single = reward_model.score_at_last_token(model, alone["input_ids"], alone["attention_mask"])
    assert torch.allclose(scores[[0, 2]], single, atol=1e-5)  # padding changes nothing


# ---------------------------------------------------------------- end to end
@pytest.mark.slow
def test_reward_model_end_to_end(reward_run):
    _, reward_dir, metrics, out = reward_run
    # pairs of the SFT model's own samples, held-out then training
    assert "for each of 500 prompts" in out and "for each of 5000 prompts" in out
    evals = [m for m in metrics if "eval/accuracy" in m]
    assert evals[-1]["eval/accuracy"] >= 0.65 and evals[-1]["eval/accuracy"] > evals[0]["eval/accuracy"] + 0.12, evals
    lr = [m["train/lr"] for m in metrics if "train/lr" in m]  # warm-up (20 steps) to 3e-4, then linearly down to 0
    steps = int(RM_TEST_ARGS[RM_TEST_ARGS.index("--steps") + 1])
    assert (
        lr[0] < lr[19] == pytest.approx(3e-4)
        and lr[150] == pytest.approx(3e-4 * (steps - 151) / (steps - 20))
        and lr[-1] == 0.0
    ), lr[:3] + lr[-3:]
    saved = AutoModelForSequenceClassification.from_pretrained(reward_dir)
    assert saved.config.num_labels == 1 and hasattr(saved.config, "reward_offset")


@pytest.mark.slow
def test_dpo_end_to_end_raises_greedy_accuracy(sft_run, tmp_path):
    """Pairs sampled from π_ref (the default on the built-in task) raise held-out greedy accuracy."""
    _, model_dir, _ = sft_run
    out = run_script(
        "dpo.py", "--model", str(model_dir), *"--steps 50 --eval-every 50 --run-name d".split(), cwd=tmp_path
    ).stdout
    assert "had a right and a wrong one" in out
    metrics = read_metrics(tmp_path, "d")
    evals = [m for m in metrics if "eval/accuracy" in m]
    assert evals[-1]["eval/accuracy"] >= evals[0]["eval/accuracy"] + 0.05, evals
    assert any(m.get("train/generation_s", 0) > 0 for m in metrics)
    train = [m for m in metrics if "train/rewards/margins" in m]
    # policy = reference at the start; in bf16 the reference's weights are rounded to bf16 (norms included)
    # while autocast keeps the policy's fp32 ones where it runs in fp32, so the two differ a little
    bf16 = bool(os.environ.get("TEST_SCRIPTS_BF16"))
    assert train[0]["train/loss"] == pytest.approx(math.log(2), abs=0.05 if bf16 else 1e-5)
    # The implicit reward log π_θ/π_ref learns what the pairs teach: π_ref's own slip (the carry into the hundreds
    # dropped) ranks below the right sum on held-out prompts. Wrong sums of other kinds, as in the dataset's fixed
    # held-out pairs (eval/rewards/accuracies), it ranks near chance: RESULTS.md, "What DPO's implicit reward can see".
    from benchmarks import reward_probe

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    policy, ref = (AutoModelForCausalLM.from_pretrained(d).eval() for d in (tmp_path / "models/dpo", model_dir))
    rows = common.arithmetic_rows("test", "prompt")[:200]
    right, pairs = reward_probe.pairwise_by_kind((policy, ref), tokenizer, rows, {}, seed=0)[
        "carry dropped (tens → hundreds)"
    ]
    assert pairs > 50 and right / pairs >= 0.9, (right, pairs)
    assert sum(m["train/rewards/margins"] for m in train[-10:]) > 0
    for (
        key
    ) in "loss rewards/chosen rewards/rejected rewards/margins rewards/accuracies logps/chosen logps/rejected".split():
        assert f"train/{key}" in train[0], key
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "models" / "dpo") is not None
    # RPO (--rpo-alpha): the chosen answers' NLL is added, so their log-probs end higher than with DPO alone
    # (same fixed pairs, 30 steps at lr 1e-4)
    chosen = {}
    for alpha in ["0", "1.0"]:
        run_script(
            "dpo.py",
            "--model",
            str(model_dir),
            *"--sample-pairs 0 --steps 30 --lr 1e-4 --eval-every 1000 --eval-size 16 --rpo-alpha".split(),
            alpha,
            "--run-name",
            f"rpo{alpha}",
            "--output-dir",
            f"models/rpo{alpha}",
            cwd=tmp_path,
        )
        rows = [m for m in read_metrics(tmp_path, f"rpo{alpha}") if "train/logps/chosen" in m]
        chosen[alpha] = sum(m["train/logps/chosen"] for m in rows[-10:]) / 10
        if alpha == "1.0":
            assert rows[0]["train/loss"] > math.log(2) + 0.01  # log 2 plus the NLL at the start
    assert chosen["1.0"] > chosen["0"] + 0.02, chosen


@pytest.mark.slow
def test_online_dpo_samples_each_round_from_the_current_policy(sft_run, tmp_path):
    """--resample-every K: every K steps the pairs are sampled afresh from π_θ as it trains, not from π_ref. π_ref
    gets a prompt with a carry into the hundreds wrong nearly every time and the others right, so few of its
    prompts give a right and a wrong sample; the policy learning the carry mixes them, so the later rounds give
    clearly more pairs than the first. Rounds sampled from π_ref give as many as the first. Margins: RESULTS.md."""
    _, model_dir, _ = sft_run
    flags = "--steps 30 --resample-every 10 --lr 3e-5 --eval-every 30 --eval-size 100 --run-name o".split()
    out = run_script("dpo.py", "--model", str(model_dir), *flags, cwd=tmp_path).stdout
    counts = [int(n) for n in re.findall(r"for each of 1280 prompts: (\d+) had a right and a wrong one", out)]
    assert len(counts) == 3 and min(counts[1:]) > 1.15 * counts[0], counts  # rounds at steps 1, 11 and 21
    rounds = [m for m in read_metrics(tmp_path, "o") if "train/pairs" in m]
    assert [m["step"] for m in rounds] == [11, 21] and [m["train/pairs"] for m in rounds] == counts[1:]


@pytest.mark.slow
def test_dpo_sample_pairs_pairs_a_right_with_a_wrong_sample(sft_run):
    _, model_dir, _ = sft_run
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    rows = common.arithmetic_rows("train", "prompt")[:64]
    torch.manual_seed(0)
    args = dpo.Args(sample_pairs=4, sample_temperature=1.0, max_new_tokens=8, batch_size=4)  # 8 × 4 prompts a batch
    run = SimpleNamespace(rank=0, world=1, device=torch.device("cpu"))
    pairs = dpo.sample_pairs(model, tok, rows, args, run, contextlib.nullcontext())
    answers = {r["prompt"]: r["answer"] for r in rows}
    assert 0 < len(pairs) <= 64
    for p in pairs:
        assert common.is_correct(p["chosen"], answers[p["prompt"]]) and not common.is_correct(
            p["rejected"], answers[p["prompt"]]
        )


CHAT = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"


@pytest.mark.slow
@pytest.mark.parametrize("chat", [False, True], ids=["text", "chat"])
def test_preference_formats_from_files_train(sft_run, tmp_path, chat):
    """TRL's explicit (prompt, chosen, rejected) and implicit (chosen, rejected sharing the prompt) forms, as text
    and as chat messages, from a local file: the implicit form splits at the same prompt, so both scripts train
    alike on both forms, and they learn."""
    _, model_dir, _ = sft_run
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.chat_template = CHAT
    tok.save_pretrained(tmp_path / "m")
    AutoModelForCausalLM.from_pretrained(model_dir).save_pretrained(tmp_path / "m")
    explicit, implicit = [], []
    for a in range(40):
        q, good, bad = f"{a}+1=", str(a + 1), str(a + 2)
        if chat:
            q, good, bad = (
                [{"role": "user", "content": q}],
                *([{"role": "assistant", "content": x}] for x in (good, bad)),
            )
        explicit.append({"prompt": q, "chosen": good, "rejected": bad})
        implicit.append({"chosen": q + good, "rejected": q + bad})
    evals = {}
    for form, rows in (("explicit", explicit), ("implicit", implicit)):
        data = write_jsonl(tmp_path / f"{form}.jsonl", rows)
        flags = ["--model", str(tmp_path / "m"), "--dataset", data, *"--steps 3 --batch-size 8 --eval-every 3".split()]
        for script in ("dpo.py", "reward_model.py"):
            run_script(script, *flags, "--run-name", f"{script}-{form}", cwd=tmp_path)
            evals[script, form] = [
                {k: v for k, v in m.items() if k.startswith("eval/")}
                for m in read_metrics(tmp_path, f"{script}-{form}")
                if any(k.startswith("eval/") for k in m)
            ]
    for script in ("dpo.py", "reward_model.py"):  # the same split, the same training (to float rounding)
        assert evals[script, "explicit"] == [pytest.approx(row, rel=1e-5) for row in evals[script, "implicit"]]
    (d0, d3), (r0, r3) = evals["dpo.py", "explicit"], evals["reward_model.py", "explicit"]
    assert "eval/accuracy" not in d0  # no answers in this data
    assert d0["eval/rewards/accuracies"] == 0 < d3["eval/rewards/accuracies"]  # π = π_ref ties every pair at step 0
    assert r3["eval/margin"] != r0["eval/margin"]  # trained (3 steps at the pretrained lr move it either way)


@pytest.mark.slow
@pytest.mark.parametrize(
    "script,flags,key,rise",
    [
        ("dpo.py", "--steps 20 --eval-every 20", "eval/rewards/accuracies", 0.9),
        (
            "reward_model.py",
            "--steps 150 --lr 3e-4 --batch-size 32 --warmup-steps 10 --eval-every 150",
            "eval/accuracy",
            0.3,
        ),
    ],
)
def test_pairs_sampled_from_a_prompt_dataset_with_answers(sft_run, tmp_path, script, flags, key, rise):
    """--sample-pairs on prompts with answers (GSM8K's format, no chosen/rejected columns): the starting model's
    own right and wrong samples make the training pairs and the held-out ones, and what is learnt from the first
    ranks the second. Margins: RESULTS.md, seeds 1-3."""
    _, model_dir, _ = sft_run
    rows = common.arithmetic_rows("train", "prompt")[:2700] + common.arithmetic_rows("test", "prompt")[:300]
    write_jsonl(tmp_path / "prompts.jsonl", rows)  # the last 300 held out
    flags = ["--model", str(model_dir), "--dataset", "prompts.jsonl", *flags.split(), "--run-name", "s"]
    out = run_script(script, *flags, cwd=tmp_path).stdout
    assert re.search(r"sampled 4 completions at T=0.7 for each of 300 prompts: \d+ had", out), out  # held out
    evals = [m for m in read_metrics(tmp_path, "s") if key in m]
    assert evals[0][key] < 0.6 and evals[-1][key] >= evals[0][key] + rise, evals
    assert not any("_fixed" in k for k in evals[-1])  # a prompt dataset has no fixed pairs
    if script == "dpo.py":  # greedy accuracy on all 300 held-out prompts, not only the ones that gave a pair
        held_out = int(re.search(r"/ (\d+) held-out pairs", out)[1])
        assert held_out < 300 and all(
            abs(m["eval/accuracy"] * 300 - round(m["eval/accuracy"] * 300)) < 1e-6 for m in evals
        ), (held_out, evals)
