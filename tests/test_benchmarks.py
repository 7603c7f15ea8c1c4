"""The benchmarks' own logic, fast: the KL estimate, the table, RESULTS.md sections, the plot, and the GPU
profile's code path on a tiny CPU config. (The full runs are the benchmarks themselves.)"""

import random

import pytest
from conftest import run_script

from benchmarks import compare
from benchmarks.results import write_section


@pytest.mark.slow
def test_kl_of_a_policy_to_itself_is_zero_and_to_another_positive(sft_run, tmp_path):
    _, sft_dir, _ = sft_run
    assert compare.kl_to_reference(sft_dir, sft_dir, n=64) == 0.0
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    other = AutoModelForCausalLM.from_pretrained(sft_dir)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.02 * torch.randn_like(p))
    other.save_pretrained(tmp_path / "other")
    AutoTokenizer.from_pretrained(sft_dir).save_pretrained(tmp_path / "other")
    assert compare.kl_to_reference(tmp_path / "other", sft_dir, n=64) > 0.01


def fake_runs():
    def method(before, after, wall):
        return {
            "wall_s": wall,
            "peak_rss_gb": 0.5,
            "generation_share": 0.25,
            "before": before,
            "after": after,
            "kl": 0.1,
            "trainable": 540_000,
            "curve": [(1.0, before), (wall, after)],
        }

    return [
        {
            "ppo": method(0.68, 0.66, 60),
            "dpo": method(0.68, 0.70, 30),
            "grpo": method(0.68, 0.80, 80),
            "more_sft": method(0.68, 0.75, 20),
            "reward_model": {"wall_s": 90, "accuracy": 0.80},
            "sft": {"wall_s": 35},
        },
        {
            "ppo": method(0.60, 0.62, 64),
            "dpo": method(0.60, 0.64, 32),
            "grpo": method(0.60, 0.84, 84),
            "more_sft": method(0.60, 0.77, 22),
            "reward_model": {"wall_s": 92, "accuracy": 0.82},
            "sft": {"wall_s": 37},
        },
    ]


def test_table_reports_mean_and_std_over_seeds():
    text = compare.table(fake_runs(), compare.Args())
    # two seeds a and b: mean (a+b)/2, sample standard deviation |a−b|/√2
    assert (
        "| held-out accuracy before → after (%) | 64.0 ± 5.7 → 64.0 ± 2.8 | 64.0 ± 5.7 → 67.0 ± 4.2 | 64.0 ± 5.7 → 82.0 ± 2.8 | 64.0 ± 5.7 → 76.0 ± 1.4 |"
        in text
    )
    assert (
        "| wall time (s) | 62 ± 3 | 31 ± 1 | 82 ± 3 | 21 ± 1 |" in text
        and "more SFT (control)" in text
        and "| share of time generating | 25% ± 0% |" in text
    )


def test_results_sections_are_replaced_not_duplicated(tmp_path):
    path = tmp_path / "RESULTS.md"
    write_section("compare", "first", path)
    write_section("gpu", "gpu numbers", path)
    write_section("compare", "second", path)
    text = path.read_text()
    assert (
        "second" in text and "first" not in text and "gpu numbers" in text and text.count("<!-- compare:start -->") == 1
    )


def test_a_later_stage_starts_from_the_recipes_run_not_a_later_try(tmp_path, monkeypatch):
    from benchmarks import real_model

    monkeypatch.setattr(real_model, "RUNS", tmp_path / "runs.jsonl")
    recipe = real_model.recipe_of("sft")
    row = {"stage": "sft", "impl": "ours", "seed": 1, "data": real_model.DATA, "recipe": recipe, "accuracy": 0.4}
    real_model.record(row)
    real_model.record(row | {"recipe": recipe | {"bf16": True}, "accuracy": 0.5})  # a try, recorded after it
    assert real_model.last_run("sft", 1)["accuracy"] == 0.4
    with pytest.raises(SystemExit, match="run it first"):
        real_model.last_run("sft", 2)


def test_plot_is_written(tmp_path):
    pytest.importorskip("matplotlib", reason="benchmark dependency: pip install -r benchmarks/requirements.txt")
    runs = fake_runs()
    for r in runs:
        r["grpo_lora"] = r["grpo"]
    compare.plot(runs, str(tmp_path / "c.png"), compare.Args(lora_r=8))
    assert (tmp_path / "c.png").stat().st_size > 10_000


def test_lora_columns_follow_their_method_and_say_what_they_hold():
    args = compare.Args(lora_r=8)
    assert compare.columns(args) == "ppo ppo_lora dpo dpo_lora grpo grpo_lora more_sft".split()
    runs = fake_runs()
    for r in runs:  # the table keeps the runs' own order, with sft and reward_model left out wherever they are
        r.update({"dpo_lora": dict(r["dpo"], trainable=46_000)})
    text = compare.table(runs, args)
    header = text.splitlines()[0]
    assert header.index("| DPO |") < header.index("| DPO LoRA r=8 |") and "more SFT (control)" in header
    assert "| trainable parameters | 0.54M | 0.54M | 0.54M | 0.54M | 0.05M |" in text
    assert "1: policy (π_ref: its adapter off" in text


@pytest.mark.slow
def test_gpu_profile_runs_on_a_tiny_cpu_config(tmp_path):
    proc = run_script(*"benchmarks/gpu.py --device cpu --tiny --large --repeats 1 --no-write".split(), cwd=tmp_path)
    for phase in ["generation", "reference log-probs", "policy forward + backward", "optimiser"]:
        # GRPO (generation and three more phases), DPO, long DPO: full (GRPO twice: --static-cache), LoRA, large LoRA
        assert proc.stdout.count(f"| {phase} |") == (3 if phase == "generation" else 9) + 1
    for method in ["GRPO step", "DPO step", "DPO, long context step"]:
        assert f"**{method}**" in proc.stdout
        assert f"**{method}, LoRA r=16, tiny test config**" in proc.stdout
        assert f"**{method}, LoRA r=16, tiny 4-layer config**" in proc.stdout
    assert (
        "π_ref = adapter off, gradient checkpointing" in proc.stdout and "**GRPO, --static-cache step**" in proc.stdout
    )


@pytest.mark.slow
def test_logits_memory_runs_every_variant_on_a_small_config(tmp_path):
    """Full and chunked logits take the same step, LoRA starts at log 2 (the script checks both), and the
    table has a row for each variant."""
    proc = run_script(
        "benchmarks/logits_memory.py",
        *"--vocab-size 2000 --hidden-size 32 --pairs 2 --prompt-tokens 8 --completion-tokens 8 --no-write".split(),
        cwd=tmp_path,
    )
    assert "| full logits kept for backward (before) |" in proc.stdout and "`lm_head_logprobs`" in proc.stdout
    assert "| chunked + LoRA, frozen base fp32 |" in proc.stdout and "| chunked + LoRA, frozen base bf16" in proc.stdout


@pytest.mark.slow
def test_vs_trl_first_step_losses_agree(tmp_path):
    pytest.importorskip("trl", reason="benchmark dependency: pip install -r benchmarks/requirements.txt")
    proc = run_script(*"benchmarks/vs_trl.py --pairs 4 --no-write".split(), cwd=tmp_path)
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| DPO") or line.startswith("| reward model")]
    assert len(rows) == 2 and all(row.rstrip().endswith("| yes |") for row in rows), proc.stdout
    table = proc.stdout.split("| GRPO loss on identical tensors")[1].split("| GRPO rewards")[0].splitlines()[2:]
    variants = [line for line in table if line.startswith("| ")]
    assert len(variants) == 6 and all(row.rstrip().endswith("| yes |") for row in variants), proc.stdout
    rewards = [line for line in proc.stdout.splitlines() if line.startswith("| `grpo.compute_rewards` vs TRL")]
    assert len(rewards) == 1 and rewards[0].rstrip().endswith("| yes |"), proc.stdout  # reward functions, weights, None


@pytest.mark.slow
def test_vs_trl_speed_runs_both_implementations_of_each_method(tmp_path):
    pytest.importorskip("trl", reason="benchmark dependency: pip install -r benchmarks/requirements.txt")
    proc = run_script(
        "benchmarks/vs_trl.py",
        *"--part speed --steps 3 --skip 1 --repeats 1 --batch-size 4".split(),
        *"--prompts-per-step 2 --group-size 2 --no-write".split(),
        cwd=tmp_path,
    )
    rows = [line for line in proc.stdout.splitlines() if line.startswith(("| DPO", "| reward model", "| GRPO"))]
    assert len(rows) == 3, proc.stdout
    for row in rows:  # every cell measured: positive throughputs, ratios and memory
        cells = [c.strip() for c in row.strip("|").split("|")[1:]]
        numbers = [float(x) for c in cells for x in c.replace("/", " ").split()]
        assert len(numbers) == 12 and all(x > 0 for x in numbers), row


@pytest.mark.slow
def test_reward_probe_makes_each_kind_of_wrong_sum_and_counts_best_of_n(sft_run):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    import common
    from benchmarks import reward_probe

    rng = random.Random(0)
    # 58 + 27 = 85: only the units carry; 85 + 1 = 86 whichever way the ±1 goes is off by one
    assert reward_probe.dropped_carry(58, 27, 0) == 75 and reward_probe.dropped_carry(58, 27, 1) is None
    assert reward_probe.dropped_carry(958, 47, 2) == 5 and reward_probe.swapped(1111, rng) is None
    assert sorted(f"{reward_probe.swapped(1230, rng):04d}") == sorted("1230")
    assert abs(reward_probe.WRONG["off by ±1"](58, 27, rng) - 85) == 1
    replaced = f"{reward_probe.replaced_digit(85, rng):04d}"
    assert sum(x != y for x, y in zip(replaced, "0085")) == 1
    _, sft_dir, _ = sft_run
    tokenizer = AutoTokenizer.from_pretrained(sft_dir)
    policy = AutoModelForCausalLM.from_pretrained(sft_dir).eval()
    reward = AutoModelForSequenceClassification.from_pretrained(sft_dir, num_labels=1).eval()  # an untrained head
    rows = common.arithmetic_rows("test", "prompt")[:40]
    picks, own_wrong = reward_probe.best_of_n(policy, reward, tokenizer, rows[:16], 4, 0.7, seed=0)
    assert set(picks) == {"random sample", "reward model's best of 4", "any of 4 (oracle)"}
    assert picks["any of 4 (oracle)"] >= max(picks["random sample"], picks["reward model's best of 4"]) > 0
    answers = {r["prompt"]: r["answer"] for r in rows}
    assert own_wrong and not any(common.is_correct(t, answers[p]) for p, t in own_wrong.items())
    by_kind = reward_probe.pairwise_by_kind(reward, tokenizer, rows, own_wrong, seed=0)
    assert set(by_kind) == {*reward_probe.WRONG, "the SFT model's own wrong samples"}
    assert by_kind["off by ±1"][1] == 40 and by_kind["the SFT model's own wrong samples"][1] == len(own_wrong)
    assert all(0 <= c <= t for c, t in by_kind.values())
