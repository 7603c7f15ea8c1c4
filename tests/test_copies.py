"""Each method script stands alone, so helpers are copied between them on purpose; the copies that do the
same thing must stay textually identical, so that a fix in one is a fix in all."""

import importlib
import inspect
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BANNER = "# Infrastructure:"
ONE_TAIL = "sft reward_model dpo grpo ppo".split()  # the whole text below the banner is one copy
COPIES = {  # the method helpers above the banner that several scripts share
    "completion_mask": ["grpo", "ppo"],
    "generate": ["grpo", "ppo"],
    "reference_policy": "dpo grpo ppo".split(),  # with LoRA, π_ref is the policy with its adapter off
    "pair_batch": ["reward_model", "dpo"],  # chosen then rejected completions, one batch
    "sample_pairs": ["reward_model", "dpo"],  # pairs of the starting model's own right and wrong samples
    "greedy_completions": ["sft", "dpo"],
    "load_reward_model": ["grpo", "ppo"],
    "score_completions": ["grpo", "ppo"],  # r_ϕ(x, y) of sampled completions
    # reward functions in TRL's convention, their loading, calling, summing and metrics
    **dict.fromkeys(
        "completion_text accuracy format_reward think_format overlong load_reward_funcs call_reward_func score "
        "reward_stats reward_rules".split(),
        ["grpo", "ppo"],
    ),
}


def test_the_text_below_the_banner_is_one_copy():
    tails = {s: (ROOT / f"{s}.py").read_text().split(BANNER, 1)[1] for s in ONE_TAIL}
    assert all(tail == tails[ONE_TAIL[0]] for tail in tails.values()), f"the tails of {', '.join(ONE_TAIL)} differ"


@pytest.mark.parametrize("name", sorted(COPIES))
def test_copies_are_identical(name):
    sources = {script: inspect.getsource(getattr(importlib.import_module(script), name)) for script in COPIES[name]}
    first = sources[COPIES[name][0]]
    assert all(source == first for source in sources.values()), f"{name} differs between {', '.join(COPIES[name])}"
