"""ppo.py: GAE, KL-penalised rewards and the clipped losses against naive versions, and an end-to-end run."""

import pytest
import torch
from conftest import read_metrics, run_script
from transformers import AutoModelForCausalLM

import ppo


def random_rollout(B=5, T=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 1, 4, 6, 3])
    mask = (torch.arange(T)[None] < lengths[:, None]).long()
    return torch.randn(B, T, generator=g) * mask, torch.randn(B, T, generator=g), mask, lengths


def test_compute_gae_matches_naive_reversed_loop():
    rewards, values, mask, lengths = random_rollout()
    gamma, lam = 0.9, 0.8
    advantages, returns = ppo.compute_gae(rewards, values, mask, gamma, lam)
    for b, n in enumerate(lengths.tolist()):
        gae = 0.0
        for t in reversed(range(n)):
            next_value = values[b, t + 1].item() if t + 1 < n else 0.0  # nothing after the last real token
            delta = rewards[b, t].item() + gamma * next_value - values[b, t].item()
            gae = delta + gamma * lam * gae
            assert advantages[b, t].item() == pytest.approx(gae, abs=1e-5)
            assert returns[b, t].item() == pytest.approx(gae + values[b, t].item(), abs=1e-5)
    assert (advantages[mask == 0] == 0).all() and (returns[mask == 0] == 0).all()


def test_gae_with_lambda_one_is_return_minus_value():
    rewards, values, mask, _ = random_rollout()
    advantages, returns = ppo.compute_gae(rewards, values, mask, gamma=1.0, lam=1.0)
    reward_to_go = rewards.flip(1).cumsum(1).flip(1) * mask
    assert torch.allclose(returns, reward_to_go, atol=1e-5)


def test_kl_penalized_rewards_put_the_score_at_the_last_real_token():
    _, _, mask, lengths = random_rollout()
    logps, ref = -torch.rand(5, 7), -torch.rand(5, 7)
    scores = torch.arange(5.0) + 1
    rewards = ppo.kl_penalized_rewards(scores, logps, ref, mask, kl_coef=0.1)
    expected = -0.1 * (logps - ref) * mask
    for b, n in enumerate(lengths.tolist()):
        expected[b, n - 1] += scores[b]
    assert torch.allclose(rewards, expected) and (rewards[mask == 0] == 0).all()


def naive_policy_loss(logps, old, adv, mask, eps):
    terms = []
    for b in range(logps.shape[0]):
        for t in range(logps.shape[1]):
            if mask[b, t]:
                rho = torch.exp(logps[b, t] - old[b, t]).item()
                terms.append(max(-adv[b, t].item() * rho, -adv[b, t].item() * min(max(rho, 1 - eps), 1 + eps)))
    return sum(terms) / len(terms)


def test_policy_and_value_losses_match_naive():
    rewards, values, mask, _ = random_rollout()
    g = torch.Generator().manual_seed(1)
    logps, old = -torch.rand(5, 7, generator=g), -torch.rand(5, 7, generator=g)
    loss, stats = ppo.ppo_policy_loss(logps, old, rewards, mask, 0.2)
    assert loss.item() == pytest.approx(naive_policy_loss(logps, old, rewards, mask, 0.2), abs=1e-5)
    assert 0 < stats["clip_fraction"] < 1 and stats["approx_kl"] > 0
    old_values, returns = values + torch.randn(5, 7, generator=g) * 0.5, torch.randn(5, 7, generator=g)
    naive = []
    for b in range(5):
        for t in range(7):
            if mask[b, t]:
                v, vo, r = values[b, t].item(), old_values[b, t].item(), returns[b, t].item()
                vc = vo + min(max(v - vo, -0.2), 0.2)
                naive.append(max((v - r) ** 2, (vc - r) ** 2))
    assert ppo.ppo_value_loss(values, old_values, returns, mask, 0.2).item() == pytest.approx(
        0.5 * sum(naive) / len(naive), abs=1e-5
    )


def test_clipped_policy_loss_has_no_gradient_outside_the_trust_region():
    logps = torch.tensor([[0.5, -0.5]], requires_grad=True)  # ρ ≈ 1.65 with Â > 0, ρ ≈ 0.61 with Â < 0
    loss, stats = ppo.ppo_policy_loss(logps, torch.zeros(1, 2), torch.tensor([[1.0, -1.0]]), torch.ones(1, 2), 0.2)
    loss.backward()
    assert torch.equal(logps.grad, torch.zeros(1, 2)) and stats["clip_fraction"] == 1


@pytest.mark.slow
def test_ppo_end_to_end(sft_run, reward_run, tmp_path):
    """PPO against the session reward model raises held-out accuracy and its score, with the KL to the
    reference logged and bounded."""
    _, model_dir, _ = sft_run
    run_script(
        "ppo.py",
        "--model",
        str(model_dir),
        "--reward-model",
        str(reward_run[1]),
        *"--steps 20 --eval-every 20 --run-name p".split(),
        cwd=tmp_path,
    )
    metrics = read_metrics(tmp_path, "p")
    evals = [m for m in metrics if "eval/score" in m]
    assert evals[-1]["eval/score"] > evals[0]["eval/score"]
    assert evals[-1]["eval/accuracy"] >= evals[0]["eval/accuracy"] + 0.2, evals  # the defaults' first 20 rounds
    train = [m for m in metrics if "train/kl" in m]
    assert all(-0.05 < m["train/kl"] < 2 for m in train)  # a sampled estimate: ~0 at the start
    names = "score rlhf_reward clip_fraction approx_kl value_loss value_clip_fraction explained_variance grad_norm"
    for key in [*names.split(), "completions/clipped_ratio"]:
        assert f"train/{key}" in train[-1], key
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "models" / "ppo") is not None


@pytest.mark.slow
def test_ppo_without_a_reward_model_says_which_command_makes_it(sft_run, tmp_path):
    _, model_dir, _ = sft_run
    proc = run_script("ppo.py", "--model", str(model_dir), cwd=tmp_path, check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr and "python reward_model.py" in proc.stderr


@pytest.mark.slow
def test_grad_accumulation_takes_the_same_steps(sft_run, tmp_path):
    """Each minibatch in 2 micro-batches (token-weighted) gives the same update as in one piece."""
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification

    _, model_dir, _ = sft_run
    AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1).save_pretrained(tmp_path / "rm")
    flags = [
        "--model",
        str(model_dir),
        "--reward-model",
        str(tmp_path / "rm"),
        *"--steps 3 --prompts-per-step 16 --lr 1e-3 --eval-every 100 --eval-size 8 --no-bf16".split(),
    ]  # equal to rounding: fp32
    for accum in ("1", "2"):
        run_script(
            "ppo.py",
            *flags,
            "--grad-accum-steps",
            accum,
            "--output-dir",
            f"ppo{accum}",
            "--run-name",
            accum,
            cwd=tmp_path,
        )
    one, two = load_file(tmp_path / "ppo1/model.safetensors"), load_file(tmp_path / "ppo2/model.safetensors")
    start = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    assert max((one[k] - start[k]).abs().max().item() for k in one) > 1e-3  # the steps moved the policy
    # the attention keys' biases have a zero gradient in exact arithmetic (softmax ignores a shift shared by all
    # keys), so what they get is rounding noise, which Adam scales up to a step of its own: left out
    assert all(torch.allclose(one[k], two[k], atol=1e-5) for k in one if not k.endswith("k_proj.bias"))


@pytest.mark.slow
def test_samples_per_prompt_samples_each_prompt_several_times(sft_run, reward_run, tmp_path):
    """--samples-per-prompt 2: two completions of each prompt, side by side in the rollout. r_ϕ's scores are
    continuous, so only two samples of one prompt that came out the same tie; some do (short answers of a confident
    model), which two different prompts' completions would not."""
    flags = "--steps 2 --prompts-per-step 32 --samples-per-prompt 2 --eval-every 100 --eval-size 8 --run-name n2"
    run_script("ppo.py", "--model", str(sft_run[1]), "--reward-model", str(reward_run[1]), *flags.split(), cwd=tmp_path)
    train = [m for m in read_metrics(tmp_path, "n2") if "train/kl" in m]
    assert len(train) == 2 and all(m["train/frac_reward_zero_std"] > 0 for m in train), train


@pytest.mark.slow
def test_zero_value_head_and_critic_lr(sft_run, tmp_path):
    """--zero-value-head: V_ψ = 0 at first, so the first rollout's explained variance is exactly 0 (a random head's
    is not); --critic-lr: the critic alone learns at it (it moves off 0 at a high one, stays at 0 at ~0 while the
    policy trains)."""
    flags = ["--model", str(sft_run[1]), *"--reward-funcs accuracy --steps 3 --eval-every 100 --eval-size 8".split()]
    runs = {"random": [], "zero": ["--zero-value-head", "--critic-lr", "1e-3"]}
    runs["frozen"] = ["--zero-value-head", "--critic-lr", "1e-30"]
    ev = {}
    for name, extra in runs.items():
        run_script("ppo.py", *flags, *extra, "--run-name", name, "--output-dir", name, cwd=tmp_path)
        train = [m for m in read_metrics(tmp_path, name) if "train/kl" in m]
        ev[name] = [m["train/explained_variance"] for m in train]
        assert max(m["train/approx_kl"] for m in train) > 0  # the policy trained in every run
    assert ev["random"][0] != 0 and ev["zero"][0] == 0 and ev["frozen"][0] == 0, ev
    assert abs(ev["zero"][-1]) > 1e-4 and all(abs(x) < 1e-6 for x in ev["frozen"]), ev


@pytest.mark.slow
def test_no_whiten_advantages_keeps_their_mean(sft_run, tmp_path):
    """The first update of a rollout (one epoch, one minibatch: ρ = 1) has policy loss −mean Â: 0 when Â is whitened
    over the rollout's tokens, the raw advantages' mean with --no-whiten-advantages."""
    flags = ["--model", str(sft_run[1]), "--reward-funcs", "accuracy"]
    flags += "--steps 1 --num-ppo-epochs 1 --num-mini-batches 1 --eval-every 100 --eval-size 8".split()
    loss = {}
    for name, extra in {"whitened": [], "raw": ["--no-whiten-advantages"]}.items():
        run_script("ppo.py", *flags, *extra, "--run-name", name, "--output-dir", name, cwd=tmp_path)
        loss[name] = next(m["train/policy_loss"] for m in read_metrics(tmp_path, name) if "train/kl" in m)
    assert abs(loss["whitened"]) < 1e-5 and abs(loss["raw"]) > 0.05, loss
