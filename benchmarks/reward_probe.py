"""How well a reward model can serve as PPO's reward on the built-in task. Two measurements:

1. held-out pairwise accuracy by kind of wrong answer: the right sum against wrong sums made here, apart
   from the project's own `common.wrong_sum` (off by ±1, ±10 or ±100, one digit replaced by any other, a
   carry dropped in one column, two digits swapped), and against the starting policy's own wrong samples:
   which mistakes the reward model can see at all;
2. best-of-n among the policy's own samples (n per held-out prompt at the sampling temperature): how often
   the sample it scores highest is right, against a random sample and against "at least one is right".
   A reward model whose favourite is right less often than a random sample pulls PPO away from the answers.

With --dpo-policy the same two measurements probe DPO's implicit reward log π_θ(y|x) − log π_ref(y|x) (β, which
scales every pair alike, left out) of a dpo.py policy π_θ against its reference π_ref = --policy.

    python benchmarks/reward_probe.py                              # after sft.py and reward_model.py
    python benchmarks/reward_probe.py --dpo-policy models/dpo      # after sft.py and dpo.py
"""

import os
import random
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
from dpo import sequence_logps  # noqa: E402
from reward_model import score_at_last_token  # noqa: E402


@dataclass
class Args:
    policy: str = "models/sft"
    """the policy whose samples the reward model has to rank (PPO's starting point)"""
    reward_model: str = "models/reward"
    """the reward model to probe"""
    dpo_policy: str | None = None
    """probe this DPO policy's implicit reward instead (its reference: --policy)"""
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


def dropped_carry(a: int, b: int, column: int) -> int | None:
    """a + b with the carry out of `column` (0: units) forgotten, or None when that column does not carry."""
    low = 10 ** (column + 1)
    return a + b - low if a % low + b % low >= low else None


def swapped(total: int, rng: random.Random) -> int | None:
    digits = list(f"{total:04d}")
    pairs = [(i, j) for i in range(4) for j in range(i + 1, 4) if digits[i] != digits[j]]
    if not pairs:
        return None
    i, j = rng.choice(pairs)
    digits[i], digits[j] = digits[j], digits[i]
    return int("".join(digits))


def replaced_digit(total: int, rng: random.Random) -> int:
    digits = list(f"{total:04d}")
    i = rng.randrange(4)
    digits[i] = rng.choice([d for d in "0123456789" if d != digits[i]])
    return int("".join(digits))


WRONG = {  # kind → (a, b, rng) → a wrong sum, or None where the kind does not apply
    "off by ±1": lambda a, b, rng: a + b + rng.choice([-1, 1]) if a + b else 1,
    "off by ±10": lambda a, b, rng: a + b + rng.choice([-10, 10]) if a + b >= 10 else a + b + 10,
    "off by ±100": lambda a, b, rng: a + b + rng.choice([-100, 100]) if a + b >= 100 else a + b + 100,
    "one digit replaced": lambda a, b, rng: replaced_digit(a + b, rng),
    "carry dropped (units → tens)": lambda a, b, rng: dropped_carry(a, b, 0),
    "carry dropped (tens → hundreds)": lambda a, b, rng: dropped_carry(a, b, 1),
    "carry dropped (hundreds → thousands)": lambda a, b, rng: dropped_carry(a, b, 2),
    "two digits swapped": lambda a, b, rng: swapped(a + b, rng),
}


def scores(reward, tokenizer, prompts: list[str], completions: list[str]) -> torch.Tensor:
    """The reward of each (prompt, completion + EOS), 256 at a time: r_ϕ(x, y) as reward_model.py trains and reads
    it, or for `reward` = (π_θ, π_ref) DPO's implicit reward log π_θ(y|x) − log π_ref(y|x)."""
    out = []
    for i in range(0, len(prompts), 256):
        batch = common.collate(
            common.tokenize(tokenizer, prompts[i : i + 256]),
            common.tokenize(tokenizer, completions[i : i + 256], add_eos=True),
            tokenizer.pad_token_id,
        )
        if isinstance(reward, tuple):
            out.append(sequence_logps(reward[0], batch) - sequence_logps(reward[1], batch))
        else:
            out.append(score_at_last_token(reward, batch["input_ids"], batch["attention_mask"]))
    return torch.cat(out)


@torch.no_grad()
def pairwise_by_kind(reward, tokenizer, rows: list[dict], own_wrong: dict, seed: int) -> dict[str, tuple[int, int]]:
    """{kind: (pairs ranked right, pairs)}: each held-out prompt's right sum against one wrong sum of each kind
    that applies to it, and against the policy's own wrong sample (`own_wrong`: prompt → a wrong completion)."""
    rng = random.Random(seed)
    pairs = {kind: [] for kind in [*WRONG, "the SFT model's own wrong samples"]}
    for row in rows:
        a, b = common.operands(row["prompt"])
        for kind, make in WRONG.items():
            wrong = make(a, b, rng)
            if wrong is not None and wrong != a + b and 0 <= wrong <= 9999:
                pairs[kind].append((row["prompt"], row["answer"], common.little_endian(wrong, 4)))
        if row["prompt"] in own_wrong:
            pairs["the SFT model's own wrong samples"].append((row["prompt"], row["answer"], own_wrong[row["prompt"]]))
    out = {}
    for kind, kind_pairs in ((k, v) for k, v in pairs.items() if v):
        prompts, chosen, rejected = zip(*kind_pairs)
        right = scores(reward, tokenizer, prompts, chosen) > scores(reward, tokenizer, prompts, rejected)
        out[kind] = (int(right.sum()), len(kind_pairs))
    return out


@torch.no_grad()
def best_of_n(policy, reward, tokenizer, rows: list[dict], n: int, temperature: float, seed: int):
    """Shares of prompts where a random sample / the reward model's top sample / any sample is right; and, for
    each prompt with a wrong sample, the first wrong one."""
    torch.manual_seed(seed)
    hits, own_wrong = Counter(), {}
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
            if not all(right):
                own_wrong[row["prompt"]] = texts[j * n + right.index(False)]
            hits["random sample"] += right[0]  # samples are i.i.d.: the first is a random one
            hits[f"reward model's best of {n}"] += right[int(r[j].argmax())]
            hits[f"any of {n} (oracle)"] += any(right)
    return {k: v / len(rows) for k, v in hits.items()}, own_wrong


def main(args: Args):
    tokenizer = common.load_tokenizer(args.policy)
    policy = AutoModelForCausalLM.from_pretrained(args.policy).eval()
    if args.dpo_policy:
        reward = (AutoModelForCausalLM.from_pretrained(args.dpo_policy).eval(), policy)
    else:
        reward = AutoModelForSequenceClassification.from_pretrained(args.reward_model).eval()
    rows = common.arithmetic_rows("test", "prompt")[: args.eval_size]
    picks, own_wrong = best_of_n(policy, reward, tokenizer, rows, args.n, args.temperature, args.seed)
    by_kind = pairwise_by_kind(reward, tokenizer, rows, own_wrong, args.seed)
    probed = f"--dpo-policy {args.dpo_policy}" if args.dpo_policy else f"--reward-model {args.reward_model}"
    lines = [
        f"Measured {time.strftime('%Y-%m-%d')} on {os.cpu_count()} CPU cores (torch {torch.__version__}): "
        f"`python benchmarks/reward_probe.py {probed} --policy {args.policy}` ({args.eval_size} held-out prompts, "
        f"sampling seed {args.seed}; the models as `python sft.py` and `python {'dpo' if args.dpo_policy else 'reward_model'}.py` "
        "make them with their defaults when these are the paths).",
        "",
        "| held-out pairs: the right sum vs ... | pairs | ranked right |",
        "|---|---|---|",
        *[f"| {kind} | {t} | {c / t:.1%} |" for kind, (c, t) in by_kind.items()],
        "",
        f"| the policy's samples (T = {args.temperature}), share of prompts where ... is right | share |",
        "|---|---|",
        *[f"| {k} | {v:.1%} |" for k, v in picks.items()],
    ]
    text = "\n".join(lines)
    print(text)
    if args.write_results and args.dpo_policy:
        write_section("implicit_reward_probe", "### What DPO's implicit reward can see (`reward_probe.py`)\n\n" + text)
    elif args.write_results:
        write_section("reward_probe", "### What the reward model can see (`reward_probe.py`)\n\n" + text)


if __name__ == "__main__":
    main(tyro.cli(Args))
