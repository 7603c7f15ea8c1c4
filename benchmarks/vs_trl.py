"""This project's DPO and reward model next to TRL's trainers, on identical inputs.

Agreement: the same weights (a random policy and a slightly perturbed copy as the reference; a random
reward model), the same character tokenizer and the same preference pairs of the built-in task go through
dpo.py's and reward_model.py's functions and through TRL's DPOTrainer and RewardTrainer (their own
tokenisation, collation and compute_loss). The first-step losses must agree to 1e-4 relative.

Tokenisation: TRL tokenizes prompt + completion in one call and appends EOS to the completions itself;
we tokenize them apart and append EOS too. With the character tokenizer (no merges across the boundary,
no BOS) both give the same ids; TRL pads whole sequences on the right, we left-pad prompts and pass
position ids, which gives the same positions.

    pip install -r benchmarks/requirements.txt
    python benchmarks/vs_trl.py --size tiny
    python benchmarks/vs_trl.py --size 25m
"""

import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import transformers
import tyro
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, Qwen2Config

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import common  # noqa: E402
import dpo  # noqa: E402
import reward_model  # noqa: E402
from benchmarks.results import write_section  # noqa: E402

SIZES = {  # the tiny built-in model, and a ~25M-parameter one
    "tiny": dict(hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8),
    "25m": dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=8),
}


@dataclass
class Args:
    size: Literal["tiny", "25m"] = "tiny"
    """model size (both are Qwen2-architecture, from a config, with the character tokenizer)"""
    pairs: int = 16
    """preference pairs in the batch"""
    beta: float = 0.1
    """DPO β"""
    write: bool = True
    """write the result into benchmarks/RESULTS.md"""


def models(size: str, tokenizer):
    config = Qwen2Config(vocab_size=len(tokenizer), tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None, num_labels=1, **SIZES[size])
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_config(config).eval()
    ref = AutoModelForCausalLM.from_config(config).eval()
    ref.load_state_dict({k: v + 0.02 * torch.randn_like(v) for k, v in policy.state_dict().items()})  # near the policy, not equal
    rm = AutoModelForSequenceClassification.from_config(config).eval()
    return policy, ref, rm


@torch.no_grad()
def ours(policy, ref, rm, tokenizer, rows, beta) -> dict:
    prompts = common.tokenize(tokenizer, [r["prompt"] for r in rows])
    batch = dpo.pair_batch(prompts, rows, tokenizer, 1024, "cpu")
    chosen, rejected = dpo.sequence_logps(policy, batch).chunk(2)
    ref_chosen, ref_rejected = dpo.sequence_logps(ref, batch).chunk(2)
    dpo_value = dpo.dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta)[0].mean().item()
    batch = reward_model.pair_batch(prompts, rows, tokenizer, 1024, "cpu")
    chosen, rejected = reward_model.reward_scores(rm, batch["input_ids"], batch["attention_mask"]).chunk(2)
    return {"dpo": dpo_value, "reward": reward_model.bradley_terry_loss(chosen, rejected).mean().item()}


@torch.no_grad()
def trl_losses(policy, ref, rm, tokenizer, rows, beta) -> dict:
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer, RewardConfig, RewardTrainer

    common_config = dict(per_device_train_batch_size=len(rows), use_cpu=True, bf16=False, gradient_checkpointing=False,
                         report_to=[], max_length=None, dataloader_num_workers=0)
    data = Dataset.from_list(rows)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        trainer = DPOTrainer(model=policy, ref_model=ref, args=DPOConfig(output_dir=tmp, beta=beta, **common_config),
                             train_dataset=data, processing_class=tokenizer)
        batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(rows))])  # in order, unshuffled
        out["dpo"] = trainer.compute_loss(trainer.model, batch).item()
        trainer = RewardTrainer(model=rm, args=RewardConfig(output_dir=tmp, **common_config), train_dataset=data, processing_class=tokenizer)
        batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(rows))])
        out["reward"] = trainer.compute_loss(trainer.model, batch).item()
    return out


def main(args: Args):
    import trl

    import datasets

    transformers.utils.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    tokenizer = common.build_char_tokenizer()
    rows = common.arithmetic_rows("train", "preference")[: args.pairs]
    policy, ref, rm = models(args.size, tokenizer)
    n_params = sum(p.numel() for p in policy.parameters())
    a = ours(policy, ref, rm, tokenizer, rows, args.beta)
    b = trl_losses(policy, ref, rm, tokenizer, rows, args.beta)
    lines = ["| loss (first step, same inputs) | ours | TRL " + trl.__version__ + " | relative difference | within 1e-4 |", "|---|---|---|---|---|"]
    for name, label in [("dpo", f"DPO (sigmoid, β = {args.beta})"), ("reward", "reward model (Bradley–Terry)")]:
        rel = abs(a[name] - b[name]) / abs(b[name])
        lines.append(f"| {label} | {a[name]:.8f} | {b[name]:.8f} | {rel:.1e} | {'yes' if rel <= 1e-4 else 'NO'} |")
    text = (f"### {args.size} model ({n_params / 1e6:.2f}M parameters), {args.pairs} pairs of the built-in task, CPU fp32\n\n"
            + "\n".join(lines) + f"\n\nCommand: `python benchmarks/vs_trl.py --size {args.size}`.")
    print(text)
    if args.write:
        write_section(f"vs_trl_agreement_{args.size}", text)
    if any(abs(a[k] - b[k]) / abs(b[k]) > 1e-4 for k in a):
        sys.exit("the losses disagree beyond 1e-4 relative")


if __name__ == "__main__":
    main(tyro.cli(Args))
