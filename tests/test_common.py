"""common.py: the built-in task, the character tokenizer, every dataset format, padding and collation."""

import json
import random

import pandas as pd
import pytest
import torch
from conftest import run_script
from transformers import AutoTokenizer

import common

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture
def chat_tokenizer():
    tok = common.build_char_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return tok


def write(path, rows):
    if path.suffix == ".parquet":
        pd.DataFrame(rows).to_parquet(path)
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


# ---------------------------------------------------------------- built-in task
def test_arithmetic_splits_fixed_and_disjoint():
    train, test = common.arithmetic_pairs("train"), common.arithmetic_pairs("test")
    assert len(test) == common.ARITHMETIC_EVAL_SIZE and len(train) == common.ARITHMETIC_TRAIN_SIZE
    assert not set(train) & set(test)
    assert test == common.arithmetic_pairs("test")  # the same held-out prompts every time
    assert all(0 <= a <= 999 and 0 <= b <= 999 for a, b in train[:1000] + test)


def test_numbers_are_written_least_significant_digit_first():
    assert common.little_endian(579, 4) == "9750" and common.from_little_endian("9750") == 579
    assert common.little_endian(7, 3) == "700" and common.from_little_endian("700") == 7
    row = common.arithmetic_rows("test", "prompt")[0]
    a, b = common.operands(row["prompt"])
    assert (
        row["prompt"] == f"{str(a).zfill(3)[::-1]}+{str(b).zfill(3)[::-1]}="
        and common.from_little_endian(row["answer"]) == a + b
    )


def test_arithmetic_rows_each_kind():
    sft = common.arithmetic_rows("test", "sft")[0]
    a, b = common.operands(sft["prompt"])
    assert len(sft["prompt"]) == 8 and len(sft["answer"]) == 4 and common.from_little_endian(sft["answer"]) == a + b
    rl = common.arithmetic_rows("test", "prompt")[0]
    assert rl == {"prompt": sft["prompt"], "answer": sft["answer"]}


def test_the_teacher_forgets_the_carry_into_the_hundreds_and_nothing_else():
    rows = common.arithmetic_rows("train", "sft")[:20000]
    slips = {True: [], False: []}
    for r in rows:
        a, b = common.operands(r["prompt"])
        assert common.from_little_endian(r["answer"]) == a + b  # `answer` is always the correct sum
        given = common.from_little_endian(r["completion"])
        assert given in (a + b, a + b - 100)
        slips[common.carries_into_hundreds(a, b)].append(given != a + b)
    assert not any(slips[False])
    rate = sum(slips[True]) / len(slips[True])  # ~10k Bernoulli(0.7) draws: std ≈ 0.005
    assert abs(rate - common.ARITHMETIC_SLIP) < 0.02, rate
    assert 0.4 < len(slips[True]) / len(rows) < 0.6  # so about half the prompts get a slip more often than not


def test_preference_rows_pair_the_right_sum_with_a_wrong_one():
    for r in common.arithmetic_rows("train", "preference")[:3000]:
        chosen, rejected = common.from_little_endian(r["chosen"]), common.from_little_endian(r["rejected"])
        assert rejected != chosen and rejected >= 0 and r["chosen"] == r["answer"] and len(r["rejected"]) == 4


def test_wrong_sums_are_of_every_kind_and_never_right():
    rng, kinds = random.Random(0), set()
    for a, b in common.arithmetic_pairs("train")[:3000]:
        wrong, right = common.wrong_sum(a, b, rng), a + b
        assert wrong != right and 0 <= wrong <= 9999
        w, r = f"{wrong:04d}", f"{right:04d}"
        changed = [i for i in range(4) if w[i] != r[i]]
        if sorted(w) == sorted(r) and len(changed) == 2:
            kinds.add("swap")
        elif right - wrong in (10, 100, 1000) and (a % (right - wrong) + b % (right - wrong) >= right - wrong):
            kinds.add("carry")  # the carry out of the column below that power of ten was dropped
        else:
            assert len(changed) == 1 and abs(int(w[changed[0]]) - int(r[changed[0]])) == 1, (a, b, wrong)
            kinds.add("digit")
    assert kinds == {"swap", "carry", "digit"}


def test_the_printed_samples_are_the_first_wrong_ones_then_a_right_one_in_ordinary_notation():
    rows = common.arithmetic_rows("test", "prompt")[:6]
    samples = [{"prompt": r["prompt"], "completion": r["answer"], "answer": r["answer"]} for r in rows]
    samples[2]["completion"] = samples[4]["completion"] = "0000"
    assert common.shown_samples(samples) == [2, 4, 0]
    assert common.shown_samples([{**s, "answer": None} for s in samples]) == [0, 1, 2, 3]
    sample = {"prompt": "100+035=", "completion": "1350", "answer": "1350", "reward": 1.0}
    assert common.describe(sample) == "1 + 530 = 531 ✓, reward 1"
    assert common.describe({**sample, "completion": "1340"}) == "1 + 530 = 431 ✗, not 531, reward 1"
    assert common.describe({**sample, "completion": "oops"}) == "1 + 530 = 'oops' ✗, not 531, reward 1"
    assert (
        common.describe({"prompt": "Q?", "completion": "so 6 * 7 = 42.\n#### 42", "answer": "41"}) == "→ 42 ✗, not 41"
    )
    assert (
        common.describe({"prompt": "Q?", "completion": "#### 41 then 9", "answer": "41"}) == "→ 41 ✓"
    )  # the answer read


def test_a_printed_sample_shows_the_question_and_cuts_long_text():
    row = {"prompt": "<|im_start|>system\nYou are a helpful AI…<|im_start|>user\nHow many?", "messages": [
        {"role": "user", "content": "How many?"}]}  # fmt: skip
    assert common.readable_prompt(row) == "How many?" and common.readable_prompt({"prompt": "1+1="}) == "1+1="
    line = common.sample_line({"prompt": "x" * 200 + "Q?", "completion": "A" + "y" * 300, "verdict": "→ 1 ✓"})
    assert line == f"'…{'x' * 118}Q?' → 'A{'y' * 119}…' (→ 1 ✓)"
    assert common.sample_line({"prompt": "p", "completion": "c", "verdict": ""}) == "'p' → 'c'"


def test_is_correct_compares_digits_when_zeros_lead():
    assert common.is_correct("0750", "0750") and common.is_correct("The answer is 1,234.", "1234")
    assert common.is_correct("72.0", "72") and not common.is_correct("73", "72") and not common.is_correct("none", "72")
    # little-endian: '0750' is 570, '750' is 57 and '07500' is 5700
    assert not common.is_correct("750", "0750") and not common.is_correct("07500", "0750")


# ---------------------------------------------------------------- tokenizer
def test_char_tokenizer_round_trip(tmp_path):
    tok = common.build_char_tokenizer()
    assert tok.pad_token_id != tok.eos_token_id
    ids = tok("123+458=")["input_ids"]
    assert len(ids) == 8 and tok.eos_token_id not in ids  # one id per character, no BOS/EOS added
    assert tok.decode(ids) == "123+458="  # no spaces inserted between characters
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again("12 + x\n")["input_ids"] == tok("12 + x\n")["input_ids"]
    assert (again.pad_token_id, again.eos_token_id) == (tok.pad_token_id, tok.eos_token_id)


def test_tokenize_adds_exactly_one_eos_and_truncates():
    tok = common.build_char_tokenizer()
    eos = tok.eos_token_id
    assert common.tokenize(tok, ["58"], add_eos=True) == [
        [tok.convert_tokens_to_ids("5"), tok.convert_tokens_to_ids("8"), eos]
    ]
    assert common.tokenize(tok, ["58<eos>"], add_eos=True)[0].count(eos) == 1
    assert common.tokenize_prompts(tok, [{"prompt": "12345"}, {"prompt": "1"}], 2) == common.tokenize(tok, ["45", "1"])
    assert common.tokenize(tok, ["12345"], max_length=2) == common.tokenize(tok, ["12"])
    assert common.tokenize(tok, [""]) == [[eos]]  # an empty prompt still gives the completion a context


def test_tokenize_matches_the_tokenizer_call_with_and_without_special_tokens():
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    backend = common.build_char_tokenizer().backend_tokenizer
    backend.post_processor = TemplateProcessing(
        single="<unk> $A", special_tokens=[("<unk>", backend.token_to_id("<unk>"))]
    )
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
    texts = ["12+34=", "a b\nc", "5<eos>"]
    assert (
        common.tokenize(tok, texts) == tok(texts)["input_ids"] and common.tokenize(tok, texts)[0][0] == tok.unk_token_id
    )
    assert common.tokenize(tok, texts, add_eos=True) == [
        x + [tok.eos_token_id] * (x[-1] != tok.eos_token_id) for x in tok(texts, add_special_tokens=False)["input_ids"]
    ]


# ---------------------------------------------------------------- padding and collation
def test_pad_left_and_right():
    ids, mask = common.pad([[5, 6, 7], [8]], pad_id=0, side="left")
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    ids, mask = common.pad([[5, 6, 7], [8]], pad_id=0, side="right")
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0]] and mask.tolist() == [[1, 1, 1], [1, 0, 0]]


def test_pad_mask_does_not_depend_on_pad_equal_to_eos():
    eos = 1
    ids, mask = common.pad([[4, eos], [eos]], pad_id=eos, side="right")
    assert mask.tolist() == [[1, 1], [1, 0]]  # the EOS of row 2 is real, its padding is not


def test_collate_layout():
    batch = common.collate([[1, 2, 3], [4]], [[7, 8], [9, 10, 11]], pad_id=0)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 7, 8, 0], [0, 0, 4, 9, 10, 11]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    assert batch["completion_mask"].tolist() == [[1, 1, 0], [1, 1, 1]]
    P = batch["prompt_ids"].shape[1]
    # position P-1+t of input_ids is followed by completion token t
    assert torch.equal(batch["input_ids"][:, P:], batch["completion_ids"])


def test_shuffled_batches_deterministic_and_cover_each_epoch():
    a, b = common.shuffled_batches(10, 5, seed=3), common.shuffled_batches(10, 5, seed=3)
    first = [next(a) for _ in range(4)]
    assert first == [next(b) for _ in range(4)]
    assert sorted(first[0] + first[1]) == list(range(10)) and sorted(first[2] + first[3]) == list(range(10))


# ---------------------------------------------------------------- dataset formats
@pytest.mark.parametrize("suffix", ".jsonl .json .parquet".split())
def test_sft_prompt_completion_from_each_file_type(tmp_path, suffix):
    path = write(tmp_path / f"d{suffix}", [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(20)])
    train = common.load_rows(path, "train", "sft")
    test = common.load_rows(path, "test", "sft")
    assert len(train) == 18 and len(test) == 2  # 10% held out, the last rows
    assert test[0] == {"prompt": "q18", "completion": "a18", "answer": None}


def test_sft_text_and_gsm8k(tmp_path):
    rows = common.load_rows(write(tmp_path / "t.jsonl", [{"text": "hello"}] * 3), "train", "sft")
    assert rows[0]["prompt"] == "" and rows[0]["completion"] == "hello"
    gsm = [{"question": "Tom has 2+3 apples?", "answer": "2+3=5\n#### 1,005"}] * 3
    row = common.load_rows(write(tmp_path / "g.jsonl", gsm), "train", "sft")[0]
    assert row["completion"].endswith("#### 1,005") and row["answer"] == "1005"


def test_sft_conversational(tmp_path, chat_tokenizer):
    msgs = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    row = common.load_rows(write(tmp_path / "m.jsonl", [{"messages": msgs}] * 3), "train", "sft", chat_tokenizer)[0]
    assert row["prompt"] == "<user>2+2?\n<assistant>" and row["completion"] == "4\n"
    pc = [{"prompt": msgs[:1], "completion": msgs[1:]}] * 3
    assert common.load_rows(write(tmp_path / "pc.jsonl", pc), "train", "sft", chat_tokenizer)[0] == row


def test_prompt_rows(tmp_path, chat_tokenizer):
    rows = common.load_rows(write(tmp_path / "p.jsonl", [{"prompt": "1+1=", "answer": 2}] * 3), "train", "prompt")
    assert rows[0] == {"prompt": "1+1=", "answer": "2", "messages": None}
    msgs = [{"role": "user", "content": "hi"}]
    rows = common.load_rows(write(tmp_path / "pm.jsonl", [{"prompt": msgs}] * 3), "train", "prompt", chat_tokenizer)
    assert rows[0] == {"prompt": "<user>hi\n<assistant>", "answer": None, "messages": msgs}  # kept for other tokenizers
    gsm = [{"question": "How many?", "answer": "so\n#### 42"}] * 3
    plain = common.load_rows(write(tmp_path / "g.jsonl", gsm), "train", "prompt", common.build_char_tokenizer())[0]
    assert plain == {
        "question": "How many?",
        "prompt": "How many?\n",
        "answer": "42",
        "messages": None,
    }  # every column kept
    chat = common.load_rows(str(tmp_path / "g.jsonl"), "train", "prompt", chat_tokenizer)[0]
    assert chat == {
        "question": "How many?",
        "prompt": "<user>How many?\n<assistant>",
        "answer": "42",
        "messages": [{"role": "user", "content": "How many?"}],
    }


def test_preference_explicit_and_implicit_prompt(tmp_path):
    explicit = [{"prompt": "1+1=", "chosen": "2", "rejected": "3", "margin": 0.5}] * 3
    row = common.load_rows(write(tmp_path / "e.jsonl", explicit), "train", "preference")[0]
    assert row == {"prompt": "1+1=", "chosen": "2", "rejected": "3", "margin": 0.5}
    implicit = [{"chosen": "1+1=2", "rejected": "1+1=3"}] * 3
    row = common.load_rows(write(tmp_path / "i.jsonl", implicit), "train", "preference")[0]
    assert row == {"prompt": "1+1=", "chosen": "2", "rejected": "3"}


def test_preference_conversational(tmp_path, chat_tokenizer):
    user = [{"role": "user", "content": "1+1?"}]
    good, bad = [{"role": "assistant", "content": "2"}], [{"role": "assistant", "content": "3"}]
    want = {"prompt": "<user>1+1?\n<assistant>", "chosen": "2\n", "rejected": "3\n"}
    explicit = [{"prompt": user, "chosen": good, "rejected": bad}] * 3
    assert common.load_rows(write(tmp_path / "e.jsonl", explicit), "train", "preference", chat_tokenizer)[0] == want
    implicit = [{"chosen": user + good, "rejected": user + bad}] * 3
    assert common.load_rows(write(tmp_path / "i.jsonl", implicit), "train", "preference", chat_tokenizer)[0] == want


def test_conversational_rows_need_a_chat_template(tmp_path):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    with pytest.raises(common.DataError, match="chat template"):
        common.load_rows(
            write(tmp_path / "m.jsonl", [{"messages": msgs}] * 3), "train", "sft", common.build_char_tokenizer()
        )


@pytest.mark.parametrize(
    "kind,row,missing",
    [
        ("sft", {"prompt": "x", "answer_text": "y"}, "completion"),
        ("preference", {"prompt": "x", "chosen": "y"}, "rejected"),
        ("prompt", {"query": "x"}, "prompt"),
    ],
)
def test_missing_column_is_one_clear_line(tmp_path, kind, row, missing):
    with pytest.raises(common.DataError) as err:
        common.load_rows(write(tmp_path / "bad.jsonl", [row] * 3), "train", kind)
    msg = str(err.value)
    assert "\n" not in msg and f"'{missing}'" in msg and "columns: " in msg and common.FORMATS[kind] in msg
    for column in row:
        assert column in msg


def test_missing_file_and_empty_split(tmp_path):
    with pytest.raises(common.DataError, match="not found"):
        common.load_rows(str(tmp_path / "nope.jsonl"), "train", "sft")
    with pytest.raises(common.DataError, match="no test split and only 3 rows: too few to hold some out"):
        common.load_rows(write(tmp_path / "few.jsonl", [{"prompt": "a", "completion": "b"}] * 3), "test", "sft")


@pytest.mark.slow
def test_cli_bad_dataset_exits_2_with_one_line(tmp_path):
    path = write(tmp_path / "bad.jsonl", [{"question_text": "x"}] * 3)
    proc = run_script("sft.py", "--dataset", path, "--steps", "1", cwd=tmp_path, check=False)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: dataset") and "question_text" in proc.stderr


def test_prompts_with_answers_tells_prompt_datasets_from_pair_datasets(tmp_path):
    gsm8k = write(tmp_path / "g.jsonl", [{"question": "How many?", "answer": "#### 4"}] * 3)
    prompts = write(tmp_path / "p.jsonl", [{"prompt": "1+1=", "answer": "2"}] * 3)
    pairs = write(tmp_path / "c.jsonl", [{"prompt": "1+1=", "chosen": "2", "rejected": "3", "answer": "2"}] * 3)
    sft = write(tmp_path / "s.jsonl", [{"prompt": "1+1=", "completion": "2"}] * 3)
    assert common.prompts_with_answers(gsm8k) and common.prompts_with_answers(prompts)
    assert not any(common.prompts_with_answers(d) for d in (pairs, sft, "arithmetic"))
