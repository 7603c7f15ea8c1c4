"""Each method script stands alone, so helpers are copied between them on purpose; the copies that do the
same thing must stay textually identical, so that a fix in one is a fix in all."""

import importlib
import inspect

import pytest

ALL = ["sft", "reward_model", "dpo", "grpo", "ppo"]
COPIES = {
    "token_logprobs": ["sft", "dpo", "grpo", "ppo"],
    "lm_head_logprobs": ["sft", "dpo", "grpo", "ppo"],
    "generate_exactly": ALL,  # sampling exactly from softmax(logits / T), whatever the model's generation_config says
    "completion_mask": ["grpo", "ppo"],
    "generate": ["grpo", "ppo"],
    "load_model": ALL,  # a LoRA adapter directory loads as its base with the adapter merged in
    "add_lora": ALL,
    "unwrap": ALL,
    "is_lora": ALL,
    "reference_policy": ["dpo", "grpo", "ppo"],  # with LoRA, π_ref is the policy with its adapter off
    "pair_batch": ["reward_model", "dpo"],  # chosen then rejected completions, one batch
    "sample_pairs": ["reward_model", "dpo"],  # pairs of the starting model's own right and wrong samples
    "greedy_completions": ["sft", "dpo"],
    "check_lora": ALL,
    "load_reward_model": ["grpo", "ppo"],
    "start_run": ALL,  # the infrastructure section: every script's
    "begin_training": ALL,
    "process_share": ALL,
    "log": ALL,
    "log_eval": ALL,
    "print_model": ALL,
    "enable_checkpointing": ALL,
    "check_stage_input": ["reward_model", "dpo", "grpo", "ppo"],
    "lr_schedule": ALL,
    "gradient_sync": ["sft", "dpo", "grpo", "ppo"],
    "optimizer_step": ALL,
    "maybe_checkpoint": ALL,
    "finish_run": ALL,
    "save_checkpoint": ["sft", "reward_model", "dpo", "grpo"],  # ppo's also writes the critic
    "wrap": ["sft", "dpo", "grpo", "ppo"],
    "average_gradients": ["reward_model", "ppo"],
    "init_distributed": ALL,
    "mean_over_processes": ALL,
    "gather_lists": ["reward_model", "dpo"],
    "save_model": ALL,
    "fail": ALL,
    "checkpoints": ALL,
    "load_checkpoint": ALL,
    "restore_rng": ALL,
    "open_metrics": ALL,
    "check_ranges": ALL,
    "probe_writable": ALL,
    "load_failure": ALL,
    "write_failed": ALL,
    "save_final_model": ALL,
    "on_stop_signal": ALL,
}


@pytest.mark.parametrize("name", sorted(COPIES))
def test_copies_are_identical(name):
    sources = {script: inspect.getsource(getattr(importlib.import_module(script), name)) for script in COPIES[name]}
    first = sources[COPIES[name][0]]
    assert all(source == first for source in sources.values()), f"{name} differs between {', '.join(COPIES[name])}"
