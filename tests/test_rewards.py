"""Reward functions in TRL's convention (--reward-funcs, --reward-weights): the built-ins on tricky strings, a
user's own file read from the command line, the weighted nansum, the per-source metrics, and the errors."""

import json
import math
import re
import statistics
from types import SimpleNamespace

import pytest
import torch
from conftest import read_metrics, run_script, write_jsonl

import common
import grpo
import ppo


@pytest.mark.parametrize(
    "text,final,marked",
    [
        ("Maya has 12. 12 - 7 = 5.\n#### 5", "5", "5"),
        ("#### 18\n\nStep 2: add 3", "18", "18"),  # '####' then more text
        ("$18 every day. Step 2.", "2", None),  # a last number, no marked answer
        ("so it is \\boxed{1,000} of 7", "1000", "1000"),
        ("The answer is -12, since 4 - 16 = -12 and 3", "-12", "-12"),
        ("#### -1,234.", "-1234", "-1234"),
        (" 0750 ", "0750", "0750"),  # the built-in task: the completion is the number
        ("no number here", None, None),
    ],
)
def test_final_and_marked_answers(text, final, marked):
    assert common.final_answer(text) == final and common.marked_answer(text) == marked


def test_accuracy_compares_numbers_and_skips_rows_without_an_answer():
    completions = ["#### 1,000", "1000.0", "The answer is 999.", "0750", "750", "#### 3"]
    answers = ["1000", "1,000", "1000", "0750", "0750", None]
    assert grpo.accuracy(completions, answers) == [1.0, 1.0, 0.0, 1.0, 0.0, None]
    chat = [[{"role": "assistant", "content": "#### 4"}]]
    assert grpo.accuracy(chat, ["4"]) == [1.0]


def test_format_pays_a_marked_answer_that_ended_not_a_number_anywhere():
    completions = ["so #### 4", "\\boxed{4}", "I think 4 apples", "#### 4", "4"]
    assert grpo.format_reward(completions, [True, True, True, False, True]) == [1.0, 1.0, 0.0, 0.0, 1.0]


def test_think_format():
    completions = [
        "<think>4 + 4 = 8</think> #### 8",
        "<think>unterminated #### 8",
        "<think>a</think>",  # no answer after it
        "#### 8 <think>late</think> x",  # not first
        "<think>a</think><think>b</think> 8",  # two blocks
        "\n<think>\nmulti\nline\n</think>\nThe answer is 8",
    ]
    assert grpo.think_format(completions) == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0]


def test_overlong_ramp_at_its_three_segments():
    # L_max 10, L_cache 2: 0 up to 8 tokens, then linear, −1 at 10
    lengths = [1, 8, 9, 10]
    assert grpo.overlong([[0] * n for n in lengths], 10) == [0.0, 0.0, -0.5, -1.0]


def reward_sources(*funcs, model=None):
    return SimpleNamespace(funcs=[(f.__name__, f) for f in funcs], model=model, tokenizer=None)


def test_compute_rewards_is_the_weighted_nansum_and_functions_get_trls_keywords():
    seen = {}

    def spy(prompts, completions, completion_ids, trainer_state, hint, **kwargs):
        seen.update(prompts=prompts, completions=completions, ids=completion_ids, step=trainer_state.global_step)
        seen.update(hint=hint, kwargs=sorted(kwargs))
        return [2.0, None, 3.0]

    rows = [
        {"prompt": "p1", "answer": "4", "hint": "a", "messages": None},
        {"prompt": "p2", "answer": "5", "hint": "b", "messages": None},
        {"prompt": "p3", "answer": None, "hint": "c", "messages": None},
    ]
    args = grpo.Args(reward_weights=(1.0, 0.5), max_new_tokens=8, steps=4)
    ids = [[1, 2], [3], [4, 5, 6]]
    r, values = grpo.compute_rewards(reward_sources(grpo.accuracy, spy), rows, ["4", "6", "7"], ids, torch.tensor([1, 1, 0]).bool(),
                           torch.zeros(3, 1), None, args, 3)  # fmt: skip
    # accuracy: 1, 0, None; spy: 2, None, 3 → 1 + 0.5·2, 0 (None skipped), 0.5·3 (None skipped)
    assert r.tolist() == [2.0, 0.0, 1.5] and values == {"accuracy": [1.0, 0.0, None], "spy": [2.0, None, 3.0]}
    assert seen == {
        "prompts": ["p1", "p2", "p3"],
        "completions": ["4", "6", "7"],
        "ids": ids,
        "step": 3,
        "hint": ["a", "b", "c"],
        "kwargs": ["answer", "ended", "max_completion_length"],
    }
    stats = grpo.reward_stats(values)
    assert stats["rewards/spy/mean"] == 2.5 and stats["rewards/accuracy/mean"] == 0.5
    assert stats["rewards/spy/std"] == pytest.approx(statistics.stdev([2.0, 3.0]))


def test_chat_prompts_give_message_lists():
    seen = {}

    def spy(prompts, completions, **_):
        seen.update(prompts=prompts, completions=completions)
        return [1.0]

    messages = [{"role": "user", "content": "2+2?"}]
    rows = [{"prompt": "<rendered>", "answer": "4", "messages": messages}]
    grpo.compute_rewards(
        reward_sources(spy), rows, ["4"], [[1]], torch.tensor([True]), torch.zeros(1, 1), None, grpo.Args(), 1
    )
    assert seen == {"prompts": [messages], "completions": [[{"role": "assistant", "content": "4"}]]}


def test_every_source_none_warns_and_gives_zero(capsys):
    r, _ = grpo.compute_rewards(reward_sources(grpo.accuracy), [{"prompt": "p", "answer": None}], ["1"], [[1]], torch.tensor([True]),
                      torch.zeros(1, 1), None, grpo.Args(), 1)  # fmt: skip
    assert r.tolist() == [0.0] and "every reward source returned None" in capsys.readouterr().out


def failing(completions, **_):
    return [1.0 / (c != "boom") for c in completions]


def short(completions, **_):
    return [1.0]


@pytest.mark.parametrize(
    "func,message",
    [
        (failing, r"^error: reward function failing failed on completion 'boom' of prompt 'p2': ZeroDivisionError"),
        (short, r"^error: reward function short returned 1 rewards for 2 completions"),
    ],
)
def test_a_reward_function_that_fails_stops_the_run_naming_it_and_the_completion(func, message, capsys):
    rows = [{"prompt": "p1", "answer": "1"}, {"prompt": "p2", "answer": "2"}]
    with pytest.raises(SystemExit) as stopped:
        grpo.compute_rewards(reward_sources(func), rows, ["ok", "boom"], [[1], [2]], torch.tensor([True, True]), torch.zeros(2, 1),
                   None, grpo.Args(), 1)  # fmt: skip
    errors = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code == 2 and len(errors) == 1 and re.search(message, errors[0]), errors


REWARD_FILE = '''
import json
import os


def hinted(prompts, completions, completion_ids, hint, **kwargs):
    """TRL's signature: reads the dataset's extra column `hint`; writes what it returned for the test to check."""
    rewards = [float(c.strip() == h) - 0.25 * len(ids) / 8 for c, ids, h in zip(completions, completion_ids, hint)]
    with open(os.environ["REWARD_LOG"], "a") as f:
        f.write(json.dumps(rewards) + "\\n")
    return rewards
'''


def test_load_reward_funcs_from_a_file_a_module_and_the_built_ins(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(REWARD_FILE)
    monkeypatch.chdir(tmp_path)
    funcs = grpo.load_reward_funcs(["accuracy", f"{tmp_path}/my_rewards.py:hinted", "my_rewards.hinted", "overlong"])
    assert [name for name, _ in funcs] == ["accuracy", "hinted", "hinted", "overlong"]
    assert funcs[0][1] is grpo.accuracy and funcs[1][1].__doc__.startswith("TRL's signature")


@pytest.mark.parametrize(
    "name,message",
    [
        ("acuracy", "--reward-funcs acuracy: ValueError: no such built-in (give a built-in: accuracy, format"),
        ("missing.py:fn", "--reward-funcs missing.py:fn: FileNotFoundError"),
        ("os.no_such_function", "--reward-funcs os.no_such_function: AttributeError"),
    ],
)
def test_an_unknown_reward_function_is_one_error_line(name, message, capsys):
    with pytest.raises(SystemExit) as stopped:
        ppo.load_reward_funcs([name])
    errors = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code == 2 and len(errors) == 1 and errors[0].startswith(f"error: {message}"), errors


def hint_rows(path):
    """Built-in-task prompts with an extra column: `hint`, the right answer."""
    rows = common.arithmetic_rows("train", "prompt")[:200] + common.arithmetic_rows("test", "prompt")[:20]
    return write_jsonl(path, [r | {"hint": r["answer"]} for r in rows])


@pytest.mark.slow
@pytest.mark.parametrize("script", ["grpo.py", "ppo.py"])
def test_a_users_reward_file_drives_training_and_its_metrics_are_what_it_returned(script, sft_run, tmp_path):
    """The file above, passed as `path:function` with a weight, on rows with an extra column: the logged
    train/rewards/hinted/mean is the mean of what the function returned for that step's completions, and
    train/reward (grpo) is the weighted sum."""
    _, model_dir, _ = sft_run
    (tmp_path / "my_rewards.py").write_text(REWARD_FILE)
    flags = ["--model", str(model_dir), "--dataset", hint_rows(tmp_path / "hint.jsonl")]
    flags += "--reward-funcs my_rewards.py:hinted --reward-weights 2 --steps 2 --eval-every 2 --eval-size 4".split()
    flags += ["--run-name", "t", *(["--prompts-per-step", "4", "--group-size", "4"] if script == "grpo.py" else [])]
    run_script(script, *flags, cwd=tmp_path, env={"REWARD_LOG": str(tmp_path / "log.jsonl")})
    returned = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    train = [m for m in read_metrics(tmp_path, "t") if "train/loss" in m or "train/policy_loss" in m]
    evals = [m for m in read_metrics(tmp_path, "t") if "eval/rewards/hinted/mean" in m]
    # calls: eval at 0, step 1, step 2, eval at 2
    assert len(returned) == 4 and len(train) == 2 and len(evals) == 2
    for m, rewards in zip(train, returned[1:3]):
        assert m["train/rewards/hinted/mean"] == pytest.approx(statistics.mean(rewards), abs=1e-6)
        assert m["train/rewards/hinted/std"] == pytest.approx(statistics.stdev(rewards), abs=1e-6)
        if script == "grpo.py":
            assert m["train/reward"] == pytest.approx(2 * statistics.mean(rewards), abs=1e-6)
    assert evals[0]["eval/rewards/hinted/mean"] == pytest.approx(statistics.mean(returned[0]), abs=1e-6)
    sampled = returned[1] + returned[2]  # they differ, so mean and std check something
    assert not all(math.isclose(x, sampled[0]) for x in sampled)


@pytest.mark.slow
@pytest.mark.parametrize(
    "script,flags",
    [
        ("grpo.py", "--reward-funcs accuracy format --reward-weights 1 0.1 --steps 10 --eval-every 10"),
        ("ppo.py", "--reward-funcs accuracy --steps 20 --eval-every 20"),  # a rule, no reward model
    ],
)
def test_rule_rewards_raise_held_out_accuracy(script, flags, sft_run, tmp_path):
    _, model_dir, _ = sft_run
    run_script(script, "--model", str(model_dir), *flags.split(), "--run-name", "r", cwd=tmp_path)
    metrics = read_metrics(tmp_path, "r")
    evals = [m for m in metrics if "eval/accuracy" in m]
    assert evals[-1]["eval/accuracy"] >= evals[0]["eval/accuracy"] + 0.2, evals  # margin: RESULTS.md, seeds 1-3
    train = [m for m in metrics if "train/rewards/accuracy/mean" in m]
    assert train[-1]["train/rewards/accuracy/mean"] > train[0]["train/rewards/accuracy/mean"]
    assert evals[-1]["eval/rewards/accuracy/mean"] == pytest.approx(
        evals[-1]["eval/accuracy"]
    )  # the reward is the check
