"""How well a reward model can serve as PPO's reward on the built-in task. Two measurements:

1. held-out pairwise accuracy split by the highest digit the rejected answer's slip changes (thousands,
   hundreds, tens, units): which mistakes the reward model can see at all;
2. best-of-n among the policy's own samples (n per held-out prompt at the sampling temperature): how often
   the sample it scores highest is right, against a random sample and against "at least one is right".
   A reward model whose favourite is right less often than a random sample pulls PPO away from the answers.

    python benchmarks/reward_probe.py            # after sft.py and reward_model.py
"""

import os
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
import tyro
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import common  # noqa: E402
from benchmarks.results import write_section  # noqa: E402
from reward_model import reward_scores  # noqa: E402

KINDS = ["thousands", "hundreds", "tens", "units"]


@dataclass
class Args:
    policy: str = "models/sft"
    """the policy whose samples the reward model has to rank (PPO's starting point)"""
    reward_model: str = "models/reward"
    """the reward model to probe"""
    n: int = 8
    """samples per held-out prompt for best-of-n"""
    temperature: float = 0.7
    """sampling temperature (ppo.py's default)"""
    eval_size: int = 500
    """held-out prompts / pairs"""
    seed: int = 0
    """seed for sampling"""
    write_results: bool = True
    """write the table into benchmarks/RESULTS.md"""


def slip_kind(chosen: str, rejected: str) -> str:
    """The highest digit place the rejected answer changes: `thousands`, `hundreds`, `tens` or `units`.
    The task writes its 4-digit answers least significant digit first, so index i is place 10^i."""
    place = max(i for i, (c, r) in enumerate(zip(chosen, rejected)) if c != r)
    return KINDS[::-1][place]


def scores(reward, tokenizer, prompts: list[str], completions: list[str]) -> torch.Tensor:
    """r_ϕ(x, y) for each (prompt, completion + EOS), as reward_model.py trains and reads it, 256 at a time."""
    out = []
    for i in range(0, len(prompts), 256):
        batch = common.collate(
            common.tokenize(tokenizer, prompts[i : i + 256]),
            common.tokenize(tokenizer, completions[i : i + 256], add_eos=True),
            tokenizer.pad_token_id,
        )
        out.append(reward_scores(reward, batch["input_ids"], batch["attention_mask"]))
    return torch.cat(out)


@torch.no_grad()
def pairwise_by_kind(reward, tokenizer, rows: list[dict]) -> dict[str, tuple[int, int]]:
    """{kind: (pairs ranked right, pairs)} over preference rows."""
    prompts = [r["prompt"] for r in rows]
    right = scores(reward, tokenizer, prompts, [r["chosen"] for r in rows]) > scores(
        reward, tokenizer, prompts, [r["rejected"] for r in rows]
    )
    correct, total = Counter(), Counter()
    for row, ok in zip(rows, right.tolist()):
        kind = slip_kind(row["chosen"], row["rejected"])
        correct[kind] += ok
        total[kind] += 1
    return {k: (correct[k], total[k]) for k in KINDS if total[k]}


@torch.no_grad()
def best_of_n(policy, reward, tokenizer, rows: list[dict], n: int, temperature: float, seed: int) -> dict[str, float]:
    """Shares of prompts where a random sample / the reward model's top sample / any sample is right."""
    torch.manual_seed(seed)
    hits = Counter()
    for i in range(0, len(rows), 64):
        chunk = rows[i : i + 64]
        ids, mask = common.pad(common.tokenize(tokenizer, [r["prompt"] for r in chunk]), tokenizer.pad_token_id, "left")
        out = policy.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=temperature,
            top_k=0,
            top_p=1.0,
            num_return_sequences=n,
            max_new_tokens=8,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        texts = tokenizer.batch_decode(out[:, ids.shape[1] :], skip_special_tokens=True)
        r = scores(reward, tokenizer, [row["prompt"] for row in chunk for _ in range(n)], texts).view(len(chunk), n)
        for j, row in enumerate(chunk):
            right = [common.is_correct(t, row["answer"]) for t in texts[j * n : (j + 1) * n]]
            hits["random sample"] += right[0]  # samples are i.i.d.: the first is a random one
            hits[f"reward model's best of {n}"] += right[int(r[j].argmax())]
            hits[f"any of {n} (oracle)"] += any(right)
    return {k: v / len(rows) for k, v in hits.items()}


def main(args: Args):
    tokenizer = common.load_tokenizer(args.policy)
    policy = AutoModelForCausalLM.from_pretrained(args.policy).eval()
    reward = AutoModelForSequenceClassification.from_pretrained(args.reward_model).eval()
    by_kind = pairwise_by_kind(reward, tokenizer, common.arithmetic_rows("test", "preference")[: args.eval_size])
    picks = best_of_n(
        policy,
        reward,
        tokenizer,
        common.arithmetic_rows("test", "prompt")[: args.eval_size],
        args.n,
        args.temperature,
        args.seed,
    )
    all_right = sum(c for c, _ in by_kind.values()) / sum(t for _, t in by_kind.values())
    lines = [
        f"Measured {time.strftime('%Y-%m-%d')} on {os.cpu_count()} CPU cores (torch {torch.__version__}): "
        f"`python benchmarks/reward_probe.py --reward-model {args.reward_model} --policy {args.policy}` "
        f"({args.eval_size} held-out prompts, sampling seed {args.seed}; the models as `python sft.py` and "
        "`python reward_model.py` make them with their defaults when these are the paths).",
        "",
        "| held-out pairs, by the digit the slip changes | " + " | ".join(by_kind) + " | all |",
        "|---" * (len(by_kind) + 2) + "|",
        "| pairs | " + " | ".join(str(t) for _, t in by_kind.values()) + f" | {sum(t for _, t in by_kind.values())} |",
        "| ranked right | " + " | ".join(f"{c / t:.1%}" for c, t in by_kind.values()) + f" | {all_right:.1%} |",
        "",
        f"| the policy's samples (T = {args.temperature}), share of prompts where ... is right | share |",
        "|---|---|",
        *[f"| {k} | {v:.1%} |" for k, v in picks.items()],
    ]
    text = "\n".join(lines)
    print(text)
    if args.write_results:
        write_section("reward_probe", "## What the reward model can see (`reward_probe.py`)\n\n" + text)


if __name__ == "__main__":
    main(tyro.cli(Args))
