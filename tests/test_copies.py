"""Each method script stands alone, so helpers are copied between them on purpose; the copies that do the
same thing must stay textually identical, so that a fix in one is a fix in all. And the part above the
infrastructure banner copies clean: a function copied out with the imports at the top of its file runs."""

import ast
import builtins
import importlib
import inspect
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BANNER = "# Infrastructure:"
REWARD_PLUMBING = "# ---------------------------------------- reward sources:"  # to the banner: one text in grpo, ppo
SCRIPTS = "sft reward_model dpo grpo ppo".split()  # the whole text below the banner is one copy
COPIES = {  # the method helpers above the banner that several scripts share
    "completion_mask": ["grpo", "ppo"],
    "generate": ["grpo", "ppo"],
    "sample": ["grpo", "ppo"],  # steps 1–2: sample completions, score them
    "reference_policy": "dpo grpo ppo".split(),  # with LoRA, π_ref is the policy with its adapter off
    "pair_batch": ["reward_model", "dpo"],  # chosen then rejected completions, one batch
    "sample_pairs": ["reward_model", "dpo"],  # pairs of the starting model's own right and wrong samples
    "greedy_completions": ["sft", "dpo"],
    # reward functions in TRL's convention
    **dict.fromkeys("completion_text accuracy format_reward think_format overlong".split(), ["grpo", "ppo"]),
}


def test_the_text_below_the_banner_is_one_copy():
    tails = {s: (ROOT / f"{s}.py").read_text().split(BANNER, 1)[1] for s in SCRIPTS}
    assert all(tail == tails[SCRIPTS[0]] for tail in tails.values()), f"the tails of {', '.join(SCRIPTS)} differ"


def test_the_reward_plumbing_is_one_copy():
    blocks = [(ROOT / f"{s}.py").read_text().split(BANNER)[0].split(REWARD_PLUMBING)[1] for s in ("grpo", "ppo")]
    assert blocks[0] == blocks[1], "the reward plumbing of grpo.py and ppo.py differs"


@pytest.mark.parametrize("name", sorted(COPIES))
def test_copies_are_identical(name):
    sources = {script: inspect.getsource(getattr(importlib.import_module(script), name)) for script in COPIES[name]}
    first = sources[COPIES[name][0]]
    assert all(source == first for source in sources.values()), f"{name} differs between {', '.join(COPIES[name])}"


def names_from_elsewhere(text: str) -> set[str]:
    """The names the part of `text` above the banner reads but neither imports nor defines above it, nor binds
    locally, leaving out builtins and the functions the tail defines (explicit dependencies, seen by name)."""
    head = text.split(BANNER, 1)[0]
    above = ast.parse(head).body
    below = ast.parse(text).body[len(above) :]
    known = set(dir(builtins)) | {n.name for n in below if isinstance(n, ast.FunctionDef)}
    for node in ast.walk(ast.Module(body=above, type_ignores=[])):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            known |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            known.add(node.name)
        elif isinstance(node, ast.arg):
            known.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            known.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            known.add(node.id)
    loaded = {n.id for n in ast.walk(ast.Module(body=above, type_ignores=[])) if isinstance(n, ast.Name)}
    return loaded - known


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_method_part_imports_what_it_uses(script):
    assert names_from_elsewhere((ROOT / f"{script}.py").read_text()) == set()


def test_the_import_check_fails_when_an_import_moves_below_the_banner():
    text = (ROOT / "grpo.py").read_text()
    assert "\nimport math\n" in text.split(BANNER)[1]  # the tail imports it too: only the top one goes
    assert names_from_elsewhere(text.replace("\nimport math\n", "\n", 1)) == {"math"}
