"""grpo.py: the contract functions against naive loops and the notes' properties, generation log-probs,
and end-to-end runs as a user starts them."""

import json
import re

import pytest
import torch
from conftest import read_metrics, run_script, tiny_reward_model
from transformers import AutoModelForCausalLM, AutoTokenizer

import common
import grpo
import sft


def naive_group_advantages(rewards, G, scale, eps):
    values = [float(r) for r in rewards]
    everyone = sum(values) / len(values)
    batch_std = (sum((r - everyone) ** 2 for r in values) / (len(values) - 1)) ** 0.5
    out = []
    for i in range(0, len(values), G):
        group = values[i : i + G]
        mean = sum(group) / G
        std = (sum((r - mean) ** 2 for r in group) / (G - 1)) ** 0.5
        out += [
            (r - mean) / ({"group": std, "batch": batch_std}[scale] + eps) if scale != "none" else r - mean
            for r in group
        ]
    return torch.tensor(out)


@pytest.mark.parametrize("scale", "group batch none".split())
def test_group_advantages_matches_naive_loop(scale):
    torch.manual_seed(0)
    rewards = torch.randn(12)
    got = grpo.group_advantages(rewards, 4, scale=scale, eps=1e-4)
    assert torch.allclose(got, naive_group_advantages(rewards, 4, scale, 1e-4), atol=1e-5)
    assert torch.allclose(got.view(3, 4).mean(1), torch.zeros(3), atol=1e-6)  # zero-mean per group


def test_group_with_equal_rewards_gets_zero_advantage():
    adv = grpo.group_advantages(torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0]), 3)
    assert torch.equal(adv[:3], torch.zeros(3)) and adv[3:].abs().sum() > 0


def naive_grpo_loss(logps, old, ref, adv, mask, eps, beta, loss_type, L):
    B, T = logps.shape
    seq_means, total, count = [], 0.0, 0
    for b in range(B):
        s, n = 0.0, 0
        for t in range(T):
            if mask[b, t]:
                rho = torch.exp(logps[b, t] - old[b, t])
                term = -min(rho * adv[b], min(max(rho, 1 - eps), 1 + eps) * adv[b])
                if beta:
                    term += beta * (torch.exp(ref[b, t] - logps[b, t]) - (ref[b, t] - logps[b, t]) - 1)
                s, n = s + term, n + 1
        seq_means.append(s / n)
        total, count = total + s, count + n
    return {"grpo": sum(seq_means) / B, "dapo": total / count, "dr_grpo": total / (B * L)}[loss_type]


def random_batch(B=4, T=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(B, T, generator=g) * 3
    old = logps + torch.randn(B, T, generator=g) * 0.3
    ref = logps + torch.randn(B, T, generator=g) * 0.3
    lengths = torch.tensor([6, 3, 1, 5])
    mask = (torch.arange(T)[None] < lengths[:, None]).long()
    return logps, old, ref, torch.randn(B, generator=g), mask


@pytest.mark.parametrize("loss_type", "grpo dapo dr_grpo".split())
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_grpo_loss_matches_naive_loop(loss_type, beta):
    logps, old, ref, adv, mask = random_batch()
    loss, stats = grpo.grpo_loss(
        logps, old, ref if beta else None, adv, mask, 0.2, beta, loss_type, max_completion_length=8
    )
    assert torch.allclose(loss, naive_grpo_loss(logps, old, ref, adv, mask, 0.2, beta, loss_type, 8), atol=1e-5)
    assert 0 <= stats["clip_fraction"] <= 1 and ("kl" in stats) == (beta != 0)


def naive_variant_loss(logps, old, adv, mask, eps, eps_high, level):
    """grpo_loss (β = 0, grpo reduction) as a loop over sequences and tokens: clip-higher, and GSPO's sequence ratio
    s_i = exp(mean_t(logp − old)) as a function of the whole sequence (no stop-gradient trick)."""
    total = 0.0
    for b in range(len(logps)):
        n = int(mask[b].sum())
        s = torch.exp(sum(logps[b, t] - old[b, t] for t in range(n)) / n)
        seq = 0.0
        for t in range(n):
            rho = s if level == "sequence" else torch.exp(logps[b, t] - old[b, t])
            seq = seq - torch.min(
                rho * adv[b], rho.clamp(1 - eps, 1 + (eps if eps_high is None else eps_high)) * adv[b]
            )
        total = total + seq / n
    return total / len(logps)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("eps_high", [None, 0.28])
def test_clip_higher_and_sequence_ratios_match_naive_loop_values_and_gradients(eps_high, level):
    logps, old, _, adv, mask = random_batch()
    old = logps + (old - logps) * 0.6  # ratios on both sides of the clip range, and inside it
    logps = logps.requires_grad_(True)
    loss, _ = grpo.grpo_loss(
        logps, old, None, adv, mask, 0.2, 0.0, clip_eps_high=eps_high, importance_sampling_level=level
    )
    naive = naive_variant_loss(logps, old, adv, mask, 0.2, eps_high, level)
    (g,) = torch.autograd.grad(loss, logps)
    (g_naive,) = torch.autograd.grad(naive, logps)
    assert torch.allclose(loss, naive, atol=1e-6) and torch.allclose(g, g_naive, atol=1e-6)
    assert g.abs().sum() > 0 and (g * (1 - mask)).abs().sum() == 0


def test_variants_reduce_to_the_lecture_objective():
    logps, old, ref, adv, mask = random_batch()
    plain = grpo.grpo_loss(logps, old, ref, adv, mask, 0.2, 0.04)
    same = grpo.grpo_loss(logps, old, ref, adv, mask, 0.2, 0.04, clip_eps_high=0.2)  # ε_h = ε
    assert torch.equal(plain[0], same[0]) and plain[1]["clip_fraction"] == same[1]["clip_fraction"]
    one = torch.ones(4, 1, dtype=torch.long)  # one-token completions: the sequence ratio is the token ratio
    token = grpo.grpo_loss(logps[:, :1], old[:, :1], None, adv, one, 0.2, 0.0)[0]
    sequence = grpo.grpo_loss(logps[:, :1], old[:, :1], None, adv, one, 0.2, 0.0, importance_sampling_level="sequence")
    assert torch.allclose(token, sequence[0], atol=1e-7)


def test_overlong_filter_gives_truncated_completions_no_gradient():
    logps, old, _, adv, mask = random_batch()
    logps.requires_grad_(True)
    ended = torch.tensor([True, False, True, False])
    loss, _ = grpo.grpo_loss(logps, old, None, adv, grpo.overlong_filter(mask, ended), 0.2, 0.0, "dapo")
    loss.backward()
    assert logps.grad[~ended].abs().sum() == 0 and logps.grad[ended].abs().sum() > 0
    all_cut = grpo.overlong_filter(mask, torch.zeros(4, dtype=torch.bool))  # every row cut: a zero loss, not NaN
    assert grpo.grpo_loss(logps, old, None, adv, all_cut, 0.2, 0.0, "dapo")[0].item() == 0


def test_informative_groups_are_those_whose_rewards_differ():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    assert grpo.informative_groups(rewards, 3).tolist() == [False, True, False]


def test_entropy_from_the_chunked_head_equals_the_full_softmax(monkeypatch):
    torch.manual_seed(0)
    model = sft.tiny_model(common.build_char_tokenizer(), sft.Args())
    V = model.config.vocab_size
    hidden, tokens = torch.randn(3, 5, model.config.hidden_size), torch.randint(0, V, (3, 5))
    monkeypatch.setattr(grpo, "LOGITS_CHUNK", V * 4)  # 4 positions a chunk: several chunks
    logps, entropy = grpo.lm_head_logprobs(model, hidden, tokens, 0.7, entropy=True)
    full = (model.lm_head(hidden) / 0.7).log_softmax(-1)
    assert torch.allclose(logps, full.gather(-1, tokens[..., None])[..., 0], atol=1e-5)
    assert torch.allclose(entropy, -(full.exp() * full).sum(-1), atol=1e-5) and not entropy.requires_grad


def test_no_gradient_once_clipped():
    """Â > 0 with ρ > 1+ε, or Â < 0 with ρ < 1−ε: the clipped term is constant, so the gradient is 0."""
    old = torch.zeros(2, 1)
    logps = torch.tensor([[0.5], [-0.5]], requires_grad=True)  # ρ = e^0.5 ≈ 1.65 and e^-0.5 ≈ 0.61
    loss, stats = grpo.grpo_loss(logps, old, None, torch.tensor([1.0, -1.0]), torch.ones(2, 1), clip_eps=0.2, beta=0.0)
    loss.backward()
    assert torch.equal(logps.grad, torch.zeros(2, 1)) and stats["clip_fraction"] == 1
    # inside the trust region the gradient is Â·ρ (per sequence, averaged over the batch)
    logps = torch.tensor([[0.1]], requires_grad=True)
    grpo.grpo_loss(logps, torch.zeros(1, 1), None, torch.tensor([1.0]), torch.ones(1, 1), 0.2, 0.0)[0].backward()
    assert torch.allclose(logps.grad, -torch.exp(torch.tensor([[0.1]])))


def test_k3_kl_nonnegative_and_zero_at_reference():
    logps, _, ref, adv, mask = random_batch()
    assert (grpo.kl_k3(logps, ref) >= 0).all()
    assert torch.equal(grpo.kl_k3(logps, logps), torch.zeros_like(logps))
    _, stats = grpo.grpo_loss(logps, logps, logps, adv, mask, beta=0.04)
    assert stats["kl"] == 0


def test_mu_one_ratio_is_exactly_one():
    logps, _, _, adv, mask = random_batch()
    logps.requires_grad_(True)
    loss, stats = grpo.grpo_loss(logps, logps.detach(), None, adv, mask, beta=0.0)
    # ρ = 1: the loss is −mean(Â) and nothing is clipped; the gradient is the plain policy gradient −Â
    assert torch.allclose(loss, -adv.mean()) and stats["clip_fraction"] == 0
    loss.backward()
    expected = -(adv[:, None] * mask / mask.sum(1, keepdim=True)) / len(adv)
    assert torch.allclose(logps.grad, expected)


def test_completion_mask_ends_at_first_eos_even_when_pad_is_eos():
    eos = 1
    ids = torch.tensor([[5, 6, eos, eos, eos], [5, eos, 7, eos, eos], [5, 6, 7, 8, 9]])
    assert grpo.completion_mask(ids, torch.tensor([eos])).tolist() == [
        [1, 1, 1, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 1, 1],
    ]


def test_generation_logprobs_match_forward_pass():
    """Sampled tokens' log-probs from generate's own logits (temperature 0.7, left-padded prompts) equal
    those recomputed by a training forward pass, fp32, to 1e-4."""
    tok = common.build_char_tokenizer()
    torch.manual_seed(0)
    model = sft.tiny_model(tok, sft.Args()).eval()
    ids, mask = common.pad(common.tokenize(tok, "1+2= 123+456= 77+8=".split()), tok.pad_token_id, "left")
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=6,
        do_sample=True,
        temperature=0.7,
        top_k=0,
        top_p=1.0,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        return_dict_in_generate=True,
        output_logits=True,
    )
    completion = out.sequences[:, ids.shape[1] :]
    cmask = grpo.completion_mask(completion, torch.tensor([tok.eos_token_id]))
    gen_logps = grpo.token_logprobs(torch.stack(out.logits, 1) / 0.7, completion)
    with torch.no_grad():
        fwd = grpo.forward_logps(
            model, torch.cat([ids, completion], 1), torch.cat([mask, cmask], 1), completion.shape[1], 0.7
        )
    assert cmask.sum() > 3
    assert (fwd - gen_logps).abs().mul(cmask).max() < 1e-4


@pytest.mark.slow
def test_grpo_end_to_end_improves_accuracy(sft_run, tmp_path):
    _, model_dir, _ = sft_run
    out = run_script(
        "grpo.py", "--model", str(model_dir), *"--steps 10 --eval-every 10 --run-name g".split(), cwd=tmp_path
    ).stdout
    evals = [m for m in read_metrics(tmp_path, "g") if "eval/accuracy" in m]
    before, after = evals[0]["eval/accuracy"], evals[-1]["eval/accuracy"]
    assert after >= before + 0.2, (before, after)  # the first 10 of the default 60 steps
    # each evaluation prints the same held-out prompts: three the model got wrong at step 0, one it got right
    shown = re.findall(r"^  '(\d{3}\+\d{3}=)' → '\d*' \(\d+ \+ \d+ = \d+ ([✓✗])", out, re.M)
    assert len(shown) == 8 and [p for p, _ in shown[:4]] == [p for p, _ in shown[4:]], out
    assert [v for _, v in shown[:4]] == "✗ ✗ ✗ ✓".split(), shown
    train = [m for m in read_metrics(tmp_path, "g") if "train/kl" in m]
    assert 0 < train[-1]["train/kl"] < 1  # the KL to the reference is measured and stays bounded
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "models" / "grpo") is not None


DAPO_STYLE = "--dynamic-sampling --clip-eps-high 0.28 --mask-truncated-completions --loss-type dapo".split()


@pytest.mark.slow
@pytest.mark.parametrize("seed", ["1", "2"])
def test_dapo_style_grpo_improves_accuracy_and_trains_only_informative_groups(sft_run, tmp_path, seed):
    _, model_dir, _ = sft_run
    flags = ["--model", str(model_dir), *"--steps 10 --eval-every 10 --seed".split(), seed, *DAPO_STYLE]
    run_script("grpo.py", *flags, "--run-name", "d", cwd=tmp_path)
    metrics = read_metrics(tmp_path, "d")
    evals = [m["eval/accuracy"] for m in metrics if "eval/accuracy" in m]
    assert evals[-1] >= evals[0] + 0.2, evals  # as the default GRPO over its first 10 steps
    train = [m for m in metrics if "train/loss" in m]
    assert any(m["train/sampling_rounds"] > 1 for m in train)  # the SFT model ties on many groups: more were sampled
    assert all(m["train/groups_trained"] == 64 or m["train/sampling_rounds"] == 4 for m in train)
    assert all(m["train/entropy"] > 0 for m in train)


@pytest.mark.slow
def test_dynamic_sampling_stops_at_its_cap_when_every_group_ties(sft_run, tmp_path):
    """No completion can be right (the answers are not numbers): every group ties, every round. Each step samples
    --max-sampling-rounds times, says so once, and trains on nothing: the saved model is the one it started from."""
    from safetensors.torch import load_file

    _, model_dir, _ = sft_run
    (tmp_path / "tie.jsonl").write_text(
        "".join(json.dumps({"prompt": f"{i}+1=", "answer": "x"}) + "\n" for i in range(40))
    )
    flags = ["--model", str(model_dir), "--dataset", str(tmp_path / "tie.jsonl"), "--dynamic-sampling"]
    flags += "--max-sampling-rounds 3 --steps 2 --prompts-per-step 4 --group-size 2".split()
    flags += "--max-new-tokens 8 --lr 1e-3 --eval-size 4".split()
    proc = run_script("grpo.py", *flags, *"--run-name t --output-dir out".split(), cwd=tmp_path)
    assert proc.stdout.count("every group's rewards tied in 3 rounds") == 1
    train = [m for m in read_metrics(tmp_path, "t") if "train/loss" in m]
    assert [(m["train/sampling_rounds"], m["train/groups_trained"]) for m in train] == [(3, 0), (3, 0)]
    start, end = load_file(model_dir / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert all(torch.equal(start[k], end[k]) for k in start)


@pytest.mark.slow
def test_grpo_gsm8k_format_with_group_16(sft_run, tmp_path):
    """The user's example, at a tiny scale: --model <path> --dataset <GSM8K-format jsonl> --group-size 16."""
    _, model_dir, _ = sft_run
    rows = [{"question": f"{a}+{a}=", "answer": f"{a} plus {a}\n#### {2 * a}"} for a in range(40)]
    (tmp_path / "gsm.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = run_script(
        "grpo.py",
        "--model",
        str(model_dir),
        "--dataset",
        str(tmp_path / "gsm.jsonl"),
        *"--group-size 16 --prompts-per-step 4 --steps 3 --eval-every 3 --run-name gsm".split(),
        *"--loss-type dr_grpo --num-iterations 2".split(),
        cwd=tmp_path,
    )
    metrics = read_metrics(tmp_path, "gsm")
    assert [m["step"] for m in metrics if "eval/accuracy" in m] == [0, 3]
    assert sum("train/loss" in m for m in metrics) == 3
    # each held-out row's answer is read after its '####' (the tiny model answers none of these right)
    verdicts = re.findall(r"✗, not (\d+)", out.stdout)
    assert verdicts and set(verdicts) <= {str(2 * a) for a in range(36, 40)}, out.stdout[-2000:]


@pytest.mark.slow
def test_grpo_with_a_reward_model(sft_run, tmp_path):
    _, model_dir, _ = sft_run
    tiny_reward_model(AutoTokenizer.from_pretrained(model_dir)).save_pretrained(tmp_path / "rm")
    run_script(
        "grpo.py",
        "--model",
        str(model_dir),
        "--reward-model",
        str(tmp_path / "rm"),
        *"--steps 2 --eval-every 2 --eval-size 32 --beta 0 --run-name rm".split(),
        cwd=tmp_path,
    )
    metrics = read_metrics(tmp_path, "rm")
    evals = [m for m in metrics if "eval/reward" in m]
    assert evals and "eval/accuracy" in evals[0]  # arithmetic still has answers
    train = [m for m in metrics if "train/loss" in m]
    assert train and not any(
        "train/kl" in m for m in train
    )  # β = 0: no KL term, none logged (not a 0 that reads as no drift)
    assert all(m["train/reward"] == m["train/rewards/reward_model/mean"] for m in train)  # the one source


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_grad_accumulation_takes_the_same_steps(sft_run, tmp_path, loss_type):
    """The round's 32 sequences in 3 uneven micro-batches (11, 11, 10) give the same steps as in one piece:
    each micro-batch's loss is weighted by its share of the sequences (grpo) or of the tokens (dapo). At T = 2
    the completions differ in length, so the two weightings differ."""
    from safetensors.torch import load_file

    _, model_dir, _ = sft_run
    flags = "--steps 3 --prompts-per-step 8 --group-size 4 --temperature 2 --lr 1e-3 --warmup-steps 1 --eval-every 100"
    for accum in ("1", "3"):
        run_script(
            "grpo.py",
            "--model",
            str(model_dir),
            *flags.split(),
            *"--eval-size 8 --loss-type".split(),
            loss_type,
            "--no-bf16",  # equal to rounding: fp32
            "--grad-accum-steps",
            accum,
            "--output-dir",
            f"grpo{accum}",
            "--run-name",
            accum,
            cwd=tmp_path,
        )
    one, three = ([m for m in read_metrics(tmp_path, r) if "train/loss" in m] for r in ("1", "3"))
    # the lengths vary: a mean of 32 equal lengths is whole (a whole mean does not prove them equal, so: any step)
    assert len(one) == len(three) == 3 and any(m["train/completions/mean_length"] % 1 for m in one)
    for a, b in zip(one, three):
        assert a["train/completions/mean_length"] == b["train/completions/mean_length"]  # the same samples
        assert a["train/loss"] == pytest.approx(b["train/loss"], abs=1e-6)
        assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=3e-5)
    one, three = load_file(tmp_path / "grpo1/model.safetensors"), load_file(tmp_path / "grpo3/model.safetensors")
    start = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    assert max((one[k] - start[k]).abs().max().item() for k in one) > 1e-3  # the steps moved the policy
    assert all(torch.allclose(one[k], three[k], atol=1e-4) for k in one)  # looser: Adam turns rounding noise into steps
