"""Data, tokenisation and batching helpers shared by the method scripts (no losses, no training).

- the built-in `arithmetic` task (3-digit addition, digits written least significant first, demonstrated
  by a careless teacher), its character-level tokenizer, and how an answer is checked;
- tokenising, left padding (prompts, for generation) and right padding (completions), collation;
- below the infrastructure banner: loading tokenizers and any other dataset (hub id or local
  .jsonl/.json/.parquet) in TRL's formats, normalised to plain-text rows: {"prompt", "completion"} (SFT),
  {"prompt", "answer"} (RL), {"prompt", "chosen", "rejected"} (preferences); conversational rows are rendered
  with the tokenizer's chat template.
"""

import functools
import json
import os
import random
import re

import torch

ARITHMETIC_EVAL_SIZE = 500  # held-out prompts, fixed for every stage and seed

ARITHMETIC_TRAIN_SIZE = 100_000

ARITHMETIC_SPLIT_SEED = 1234  # the split never depends on --seed, so every stage evaluates on the same prompts

ARITHMETIC_SLIP = 0.7  # how often the SFT demonstrator forgets the carry into the hundreds (see teacher_sum)


# ---------------------------------------------------------------- the built-in arithmetic task
def arithmetic_pairs(split: str) -> list[tuple[int, int]]:
    """Operand pairs (a, b), 0 ≤ a, b ≤ 999. `test` is a fixed held-out set, `train` never overlaps it."""
    rng = random.Random(ARITHMETIC_SPLIT_SEED)
    held_out = set()
    while len(held_out) < ARITHMETIC_EVAL_SIZE:
        held_out.add((rng.randrange(1000), rng.randrange(1000)))
    if split == "test":
        return sorted(held_out)
    pairs = []
    while len(pairs) < ARITHMETIC_TRAIN_SIZE:
        pair = (rng.randrange(1000), rng.randrange(1000))
        if pair not in held_out:
            pairs.append(pair)
    return pairs


def little_endian(n: int, width: int) -> str:
    """n with its least significant digit first, zero-padded to `width` digits: 579 → '9750'.

    Every number of the task is written this way, so the digits to add sit at fixed distances from the
    digit being written, and each carry comes from a digit already written (Lee et al. 2023, "Teaching
    Arithmetic to Small Transformers": a small model then learns addition smoothly instead of suddenly)."""
    return f"{n:0{width}d}"[::-1]


def from_little_endian(text: str) -> int:
    """The number a little-endian digit string stands for: '9750' → 579."""
    return int(text[::-1])


def operands(prompt: str) -> tuple[int, int]:
    """The two numbers of a built-in task prompt: '100+035=' → (1, 530)."""
    a, b = prompt.removesuffix("=").split("+")
    return from_little_endian(a), from_little_endian(b)


def carries_into_hundreds(a: int, b: int) -> bool:
    return a % 100 + b % 100 >= 100


def teacher_sum(a: int, b: int, rng: random.Random) -> int:
    """The demonstrator's answer to a+b: right, except that with probability ARITHMETIC_SLIP it forgets the carry
    into the hundreds column. SFT imitates this teacher, slips included (on about half the prompts it then
    prefers the slip), and the alignment stages, which reward the correct sum, can do better than it."""
    forgets = carries_into_hundreds(a, b) and rng.random() < ARITHMETIC_SLIP
    return a + b - 100 * forgets


def wrong_sum(a: int, b: int, rng: random.Random) -> int:
    """A plausible wrong answer to a+b, one of three kinds at random: a carry dropped in any column that has one,
    any digit of the 4-digit sum ±1, or two different digits of it swapped (a reward model trained on one kind
    only, e.g. the SFT model's own slips, ranks the others near chance)."""
    correct = a + b
    # column i carries when the lower i+1 digits of a and b add up to 10^(i+1) or more
    carries = [i for i in range(3) if a % 10 ** (i + 1) + b % 10 ** (i + 1) >= 10 ** (i + 1)]
    digits = list(f"{correct:04d}")
    kind = rng.choice(["carry", "digit", "digit", "swap"])
    if kind == "carry" and carries:
        return correct - 10 ** (rng.choice(carries) + 1)  # forgot to carry one column into the next
    pairs = [(i, j) for i in range(4) for j in range(i + 1, 4) if digits[i] != digits[j]]
    if kind == "swap" and pairs:
        i, j = rng.choice(pairs)
        digits[i], digits[j] = digits[j], digits[i]
        return int("".join(digits))
    i = rng.randrange(4)
    d = int(digits[i]) + rng.choice([-1, 1])
    if not 0 <= d <= 9:
        d = int(digits[i]) - (d - int(digits[i]))  # the other direction stays a valid digit
    digits[i] = str(d)
    return int("".join(digits))


def arithmetic_rows(split: str, kind: str) -> list[dict]:
    """Rows of the built-in task: `sft` prompt/completion, `prompt` prompt/answer, `preference`.

    123+456 is the prompt '321+654=' and its answer '9750' (little-endian, see `little_endian`). `answer` is
    always the correct sum; an `sft` completion is the careless teacher's (`teacher_sum`), so SFT's held-out
    loss measures imitation and its accuracy measures correctness."""
    rng = random.Random(ARITHMETIC_SPLIT_SEED + 1)
    rows = []
    for a, b in arithmetic_pairs(split):
        prompt, answer = f"{little_endian(a, 3)}+{little_endian(b, 3)}=", little_endian(a + b, 4)
        if kind == "sft":
            rows.append({"prompt": prompt, "completion": little_endian(teacher_sum(a, b, rng), 4), "answer": answer})
        elif kind == "prompt":
            rows.append({"prompt": prompt, "answer": answer})
        else:
            rejected = little_endian(wrong_sum(a, b, rng), 4)
            rows.append({"prompt": prompt, "chosen": answer, "rejected": rejected, "answer": answer})
    return rows


def shown_samples(samples: list[dict], wrong: int = 3, right: int = 1) -> list[int]:
    """Which held-out samples every evaluation prints: the first `wrong` the model gets wrong now and the first
    `right` it gets right (called at the first evaluation, so the printout shows what training changes), or the
    first wrong + right ones when the rows have no answers."""
    if any(s.get("answer") is None for s in samples):
        return list(range(min(len(samples), wrong + right)))
    ok = [is_correct(s["completion"], s["answer"]) for s in samples]
    return [i for i, c in enumerate(ok) if not c][:wrong] + [i for i, c in enumerate(ok) if c][:right]


def describe(sample: dict) -> str:
    """A sample's verdict for the printout: the answer read from the completion, e.g. '→ 10 ✓' ('→ 12 ✗, not 10');
    the built-in task's in ordinary notation, e.g. for the prompt '100+035=' and completion '1350': '1 + 530 = 531 ✓'
    ('… = 431 ✗, not 531' when wrong)."""
    prompt, completion, answer = sample["prompt"], sample["completion"], sample.get("answer")
    extra = "".join(f", {k} {v:.3g}" for k, v in sample.items() if isinstance(v, float))
    if answer is None:
        return extra[2:]
    ok = is_correct(completion, answer)
    if re.fullmatch(r"\d{3}\+\d{3}=", prompt) and re.fullmatch(r"\d{4}", answer):
        a, b = operands(prompt)
        given = from_little_endian(completion) if re.fullmatch(r"\d{1,5}", completion) else repr(completion)
        return f"{a} + {b} = {given} " + ("✓" if ok else f"✗, not {a + b}") + extra
    return f"→ {final_answer(completion)} " + ("✓" if ok else f"✗, not {answer}") + extra


def readable_prompt(row: dict) -> str:
    """What a printed sample shows of a row's prompt: a conversation's last message, not the rendered template."""
    return row["messages"][-1]["content"] if row.get("messages") else row["prompt"]


def sample_line(sample: dict, width: int = 120) -> str:
    """One printed sample: the prompt's end and the completion's start, each cut to `width` characters, and the verdict."""
    prompt, completion, verdict = sample["prompt"], sample["completion"], sample.get("verdict")
    prompt = prompt if len(prompt) <= width else "…" + prompt[-width:]
    completion = completion if len(completion) <= width else completion[:width] + "…"
    return f"{prompt!r} → {completion!r}" + (f" ({verdict})" if verdict else "")


def build_char_tokenizer():
    """Character-level tokenizer: printable ASCII + newline, `<pad>` ≠ `<eos>`, no BOS added anywhere."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<unk>"]
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    # A BPE without merges splits text into single characters; Fuse() stops decode from adding spaces.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def is_builtin_model(path: str | None) -> bool:
    """Whether `path` is the built-in task's tiny model: None (sft.py builds it) or a directory whose tokenizer is
    the character tokenizer (a model sft.py built, or a stage trained from one). Such runs get the built-in task's
    tuned defaults; any other model gets defaults fit for a pretrained one."""
    if path is None:
        return True
    try:
        with open(os.path.join(path, "tokenizer.json")) as f:
            vocab = json.load(f)["model"].get("vocab")
    except (OSError, ValueError, KeyError, AttributeError):  # none, or unreadable: loading the model will say why
        return False
    return vocab == build_char_tokenizer().backend_tokenizer.get_vocab(with_added_tokens=False)


# ---------------------------------------------------------------- answers
NUMBER = r"-?\d[\d,]*(?:\.\d+)?"


def last_number(text: str) -> str | None:
    """The last number in a completion ('1,234' → '1234'), or None."""
    found = re.findall(NUMBER, text)
    return found[-1].replace(",", "").rstrip(".") if found else None


def marked_answer(text: str) -> str | None:
    """The answer where a completion marks it: the number right after the last '####' (GSM8K), else the one in
    the last \\boxed{}, else the last after 'answer is', else the whole completion when it is nothing but a
    number (the built-in task); None when it marks none. Thousands separators dropped."""
    after = re.match(r"\s*\$?(" + NUMBER + ")", text.rsplit("####", 1)[1]) if "####" in text else None
    boxed = re.findall(r"\\boxed\{\s*\$?(" + NUMBER + r")\s*\}", text)
    stated = re.findall(r"answer is:?\s*\$?(" + NUMBER + ")", text, re.I)
    alone = re.fullmatch(r"\s*(" + NUMBER + r")\s*", text)
    found = (after and after[1]) or (boxed and boxed[-1]) or (stated and stated[-1]) or (alone and alone[1])
    return found.replace(",", "").rstrip(".") if found else None


def final_answer(text: str) -> str | None:
    """The answer a completion gives: the one it marks (marked_answer), else its last number, else None."""
    return marked_answer(text) or last_number(text)


def is_correct(completion: str, answer: str) -> bool:
    """True when the completion's final answer is the answer: the same digits, or the same value when neither is
    written with a leading zero ('1,000', '1000' and '1000.0' are one value). With leading zeros only the digits
    count: the arithmetic task's '0750' (570, little-endian) is not '750' (57)."""
    guess, answer = final_answer(completion), answer.replace(",", "")
    if guess is None or guess == answer:
        return guess is not None
    if re.match(r"-?0\d", guess) or re.match(r"-?0\d", answer):
        return False
    try:
        return float(guess) == float(answer)
    except ValueError:
        return False


# ---------------------------------------------------------------- tokenising and batching
def eos_token_ids(tokenizer, generation_config=None) -> list[int]:
    """Every id that ends a completion: the tokenizer's EOS and each EOS of the model's generation_config
    (chat models list several, e.g. Qwen's `<|im_end|>` and `<|endoftext|>`)."""
    extra = getattr(generation_config, "eos_token_id", None)
    extra = extra if isinstance(extra, (list, tuple)) else [extra]
    return list(dict.fromkeys([tokenizer.eos_token_id] + [int(i) for i in extra if i is not None]))


def tokenize(tokenizer, texts: list[str], add_eos: bool = False, max_length: int | None = None, eos_ids=None):
    """Token ids of each text, cut to max_length. Prompts keep the tokenizer's own special tokens (e.g. BOS);
    completions (`add_eos=True`) get none and end at their first EOS (any of `eos_ids`, default the
    tokenizer's), as sampling would; one without an EOS gets the tokenizer's. A chat template's
    `<|im_end|>\n` thus ends at `<|im_end|>`. (Prompts are cut from the left: tokenize_prompts.)"""
    backend = getattr(tokenizer, "backend_tokenizer", None)  # the Rust tokenizer itself: faster on long lists
    if backend is not None:
        ids = [e.ids for e in backend.encode_batch(texts, add_special_tokens=not add_eos)]
    else:
        ids = tokenizer(texts, add_special_tokens=not add_eos)["input_ids"]
    if not add_eos:  # an empty prompt becomes one EOS, so the first completion token has a context (GPT-2's way)
        ids = [x or [tokenizer.eos_token_id] for x in ids]
    else:
        eos = set(eos_ids or [tokenizer.eos_token_id])
        ends = [next((i for i, t in enumerate(x) if t in eos), None) for x in ids]
        ids = [x + [tokenizer.eos_token_id] if end is None else x[: end + 1] for x, end in zip(ids, ends)]
    return ids if max_length is None else [x[:max_length] for x in ids]


def tokenize_prompts(tokenizer, rows: list[dict], max_length: int) -> list[list[int]]:
    """Each row's prompt as token ids, truncated from the left: the end of a prompt is what gets answered."""
    ids = tokenize(tokenizer, [r["prompt"] for r in rows])
    if any(len(x) > max_length for x in ids):
        warn_once(f"prompts longer than {max_length} tokens are left-truncated")
    return [x[-max_length:] for x in ids]


@functools.cache
def warn_once(message: str):
    """A warning printed the first time only (training batches, tokenized as they are drawn, would repeat it)."""
    print(f"warning: {message}")


def completion_batch(tokenizer, rows, completions: list[str], max_length: int, eos_ids=None, device="cpu") -> dict:
    """collate() of the rows' prompts (left-truncated) and the completions, each ending at its first EOS (any of
    eos_ids), both cut to max_length tokens, on `device`."""
    prompts = tokenize_prompts(tokenizer, rows, max_length)
    completion_ids = tokenize(tokenizer, completions, add_eos=True, max_length=max_length, eos_ids=eos_ids)
    return {k: v.to(device) for k, v in collate(prompts, completion_ids, tokenizer.pad_token_id).items()}


def pad(seqs: list[list[int]], pad_id: int, side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Pads to the longest sequence on the `left` (prompts for generation) or `right` (completions).
    Returns (ids [B, L], mask [B, L]); the mask marks real tokens, so it never depends on pad_id ≠ EOS."""
    width = max(len(s) for s in seqs)

    def padded(seq: list, fill) -> list:  # lists, then one tensor: far fewer torch calls than row by row
        return [fill] * (width - len(seq)) + seq if side == "left" else seq + [fill] * (width - len(seq))

    ids, mask = [padded(list(s), pad_id) for s in seqs], [padded([1] * len(s), 0) for s in seqs]
    return torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.long)


def collate(prompts: list[list[int]], completions: list[list[int]], pad_id: int) -> dict:
    """[left-padded prompts | right-padded completions] in one batch. The logits that predict the
    completion are `logits[:, P - 1 : -1]` with P = prompt_ids.shape[1]; `completion_mask` is [B, T]."""
    prompt_ids, prompt_mask = pad(prompts, pad_id, "left")
    completion_ids, completion_mask = pad(completions, pad_id, "right")
    return {
        "input_ids": torch.cat([prompt_ids, completion_ids], 1),
        "attention_mask": torch.cat([prompt_mask, completion_mask], 1),
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
    }


def shuffled_batches(n: int, batch_size: int, seed: int):
    """Endless index batches: a new permutation of range(n) each epoch, the same for the same seed."""
    g = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(n, generator=g).tolist()
        for i in range(0, n - batch_size + 1 if n >= batch_size else 1, batch_size):
            yield order[i : i + batch_size]


# ======================================================================================================
# Infrastructure: loading tokenizers and datasets (hub ids, local files, TRL's formats, chat templates), their
# checks and errors, re-tokenising for another model's tokenizer. Not needed to follow the methods.
# ======================================================================================================
FORMATS = {
    "sft": "prompt+completion, messages, text, or question+answer (GSM8K)",
    "prompt": "prompt (with an optional answer), messages, or question+answer (GSM8K)",
    "preference": "prompt+chosen+rejected, or chosen+rejected with an implicit shared prompt",
}


class DataError(ValueError):
    """A user error in the data (missing file, missing column, empty dataset): reported in one line."""


def load_tokenizer(path: str, trust_remote_code: bool = False):
    """AutoTokenizer.from_pretrained, except that a tokenizer saved as a plain `tokenizers` one (the built-in
    character tokenizer) loads as saved: for some model types (qwen2) transformers 5 swaps in the type's own
    class, whose byte-level pre-tokenizer silently drops the spaces and newlines of a character vocabulary.
    A tokenizer without a pad token pads with EOS."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    from transformers.models.auto.tokenization_auto import get_tokenizer_config

    try:
        if get_tokenizer_config(path).get("tokenizer_class") in ("TokenizersBackend", "PreTrainedTokenizerFast"):
            tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
        else:
            tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:
        raise load_error(path, e) from None
    if tokenizer.pad_token is None:  # masks come from lengths and positions, never from the pad id: EOS is safe
        tokenizer.pad_token = tokenizer.eos_token
        print(f"note: the tokenizer has no pad token; padding with EOS ({tokenizer.eos_token!r})")
    return tokenizer


def extract_gsm8k_answer(text: str) -> str:
    """GSM8K's reference answer: the number after '####', without thousands separators."""
    return text.split("####")[-1].strip().replace(",", "")


def is_conversational(value) -> bool:
    return isinstance(value, list) and len(value) > 0 and isinstance(value[0], dict) and "role" in value[0]


def render_chat(tokenizer, messages, add_generation_prompt: bool) -> str:
    """The conversation as the chat template writes it, to be tokenized like any prompt (with the tokenizer's own
    special tokens): its ids are then apply_chat_template's. A tokenizer that adds BOS itself (Llama 3) would
    double the BOS the template writes, so that one is dropped; one that adds none (SmolLM2) keeps it."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError("conversational rows (lists of role/content messages) need a tokenizer with a chat template")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    bos = tokenizer.bos_token
    adds_bos = bos is not None and tokenizer("")["input_ids"][:1] == [tokenizer.bos_token_id]
    return text[len(bos) :] if adds_bos and text.startswith(bos) else text


def _split_chat(tokenizer, prompt_messages, completion_messages) -> tuple[str, str]:
    """Renders prompt and prompt+completion; the completion is the text the template appends."""
    prompt = render_chat(tokenizer, prompt_messages, add_generation_prompt=True)
    full = render_chat(tokenizer, prompt_messages + completion_messages, add_generation_prompt=False)
    if not full.startswith(prompt):
        raise DataError("the chat template renders the prompt differently inside the conversation")
    return prompt, full[len(prompt) :]


def _common_prefix(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def load_error(path: str, e: Exception) -> DataError:
    """Why the model or tokenizer at `path` failed to load, in one line: no such path, not a model directory, a
    hub id that cannot be fetched, which of its files is cut short or corrupt, or else the library's reason."""
    where = f"cannot load model {path!r}"
    if not os.path.exists(path) and (path.startswith((".", "/", "~")) or path.count("/") != 1):  # not owner/name
        return DataError(f"{where}: no such file or directory")
    if not os.path.exists(path):
        return DataError(f"{where} from the hub: {error_reason(e)}")
    names = sorted(os.listdir(path)) if os.path.isdir(path) else []
    if os.path.isdir(path) and not {"config.json", "adapter_config.json"} & set(names):
        return DataError(f"{where}: it is not a model directory (no config.json)")
    for file in (os.path.join(path, name) for name in names):
        try:  # which file is cut short or corrupt?
            if file.endswith(".safetensors"):
                from safetensors import safe_open

                safe_open(file, "pt")  # reads the header
            elif file.endswith(".json"):
                with open(file) as f:
                    json.load(f)
        except Exception as bad:
            return DataError(f"{where}: {file} is corrupt or cut short ({error_reason(bad)})")
    return DataError(f"{where}: {error_reason(e)}")


def error_reason(e: BaseException) -> str:
    """The first line of the innermost cause of an exception (the library's own wrapper says little)."""
    while e.__cause__ or e.__context__:
        e = e.__cause__ or e.__context__
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"


def load_raw(dataset: str, split: str, config: str | None = None) -> tuple[list[dict], int]:
    """Rows of a hub dataset or local .jsonl/.json/.parquet file, and the number of the first one in its
    split or file (for messages). Without a `test` split the last 10% (at most 500 rows) of `train` are held
    out, the same rows every time."""
    import datasets

    ext = os.path.splitext(dataset)[1].lower()
    if ext in (".jsonl", ".json", ".parquet"):
        if not os.path.isfile(dataset):
            raise DataError(f"dataset file not found: {dataset}")
        if os.path.getsize(dataset) == 0:
            raise DataError(f"dataset file {dataset} is empty")
        try:
            ds = datasets.load_dataset("parquet" if ext == ".parquet" else "json", data_files=dataset)
        except Exception as e:  # malformed file: say which and why, in one line
            raise DataError(f"cannot read dataset file {dataset}: {error_reason(e)}") from None
    else:
        if config is None and dataset == "openai/gsm8k":
            config = "main"
        try:
            ds = datasets.load_dataset(dataset, config)
        except Exception as e:
            raise DataError(f"cannot load dataset '{dataset}': {error_reason(e)}") from None
    if "test" in ds:
        return ds[split].to_list(), 1
    rows = (ds["train"] if "train" in ds else ds[next(iter(ds))]).to_list()
    if split == "test" and 0 < len(rows) < 10:  # a tenth of fewer than 10 rows is no row
        raise DataError(f"dataset '{dataset}' has no test split and only {len(rows)} rows: too few to hold some out")
    n_train = len(rows) - min(500, len(rows) // 10)
    return (rows[n_train:], n_train + 1) if split == "test" else (rows[:n_train], 1)


def load_rows(dataset: str, split: str, kind: str, tokenizer=None, config: str | None = None) -> list[dict]:
    """Rows of `dataset` (`arithmetic`, a hub id or a local file) normalised to plain text for `kind`:
    `sft` → prompt, completion; `prompt` → prompt, answer (None if unknown), messages (chat prompts) and every
    other column as it is (reward functions read them); `preference` → prompt,
    chosen, rejected (+ margin if present). Raises DataError, naming the missing column, on a bad format."""
    assert kind in FORMATS, kind
    if dataset == "arithmetic":
        return arithmetic_rows(split, kind)
    raw, first = load_raw(dataset, split, config)
    if not raw:
        raise DataError(f"dataset '{dataset}' has no rows in its {split} split")
    columns = list(raw[0])

    def need(*names):
        for name in names:
            if name not in columns:
                raise DataError(
                    f"dataset '{dataset}' has no column '{name}' (columns: {', '.join(columns)}); "
                    f"accepted formats for {kind}: {FORMATS[kind]}"
                )

    out = []
    for number, row in enumerate(raw, first):

        def text(name):  # every row is checked here, before any training: a null cell is named, not met mid-run
            value = row[name]
            if isinstance(value, str) or (
                isinstance(value, list) and value and all(isinstance(m, dict) for m in value)
            ):
                return value
            what = "empty (null)" if value is None else f"a {type(value).__name__} ({value!r:.40})"
            raise DataError(
                f"dataset '{dataset}', row {number} ({split} split): column '{name}' is {what}, not text or messages"
            )

        if kind == "sft":
            answer = None
            if "messages" in columns:
                msgs = text("messages")
                prompt, completion = _split_chat(tokenizer, msgs[:-1], msgs[-1:])
            elif "question" in columns and "answer" in columns and "prompt" not in columns:  # GSM8K
                prompt, completion = text("question") + "\n", text("answer")
                answer = extract_gsm8k_answer(completion)
            elif "text" in columns and "completion" not in columns:
                prompt, completion = "", text("text")
            else:
                need("prompt", "completion")
                prompt, completion = text("prompt"), text("completion")
                if is_conversational(prompt):
                    prompt, completion = _split_chat(tokenizer, prompt, completion)
            out.append({"prompt": prompt, "completion": completion, "answer": answer})
        elif kind == "prompt":
            if "question" in columns and "answer" in columns and "prompt" not in columns:
                question = text("question")  # GSM8K; with a chat template, asked as the user's turn
                chat = getattr(tokenizer, "chat_template", None)
                prompt = [{"role": "user", "content": question}] if chat else question + "\n"
                answer = extract_gsm8k_answer(text("answer"))
            elif "messages" in columns and "prompt" not in columns:
                msgs = text("messages")
                prompt, answer = msgs[:-1] if msgs[-1]["role"] == "assistant" else msgs, row.get("answer")
            else:
                need("prompt")
                prompt, answer = text("prompt"), row.get("answer")
            messages = prompt if is_conversational(prompt) else None  # kept: a reward model may render them its own way
            if messages:
                prompt = render_chat(tokenizer, messages, add_generation_prompt=True)
            extra = {k: v for k, v in row.items() if k not in ("prompt", "messages")}  # for reward functions
            out.append(
                extra | {"prompt": prompt, "answer": None if answer is None else str(answer), "messages": messages}
            )
        else:
            need("chosen", "rejected")
            chosen, rejected = text("chosen"), text("rejected")
            if "prompt" in columns:
                prompt = text("prompt")
            else:  # implicit prompt: what chosen and rejected share (characters, or whole messages)
                prompt = _common_prefix(chosen, rejected)
                chosen, rejected = chosen[len(prompt) :], rejected[len(prompt) :]
            if is_conversational(chosen):
                rejected = _split_chat(tokenizer, prompt, rejected)[1]
                prompt, chosen = _split_chat(tokenizer, prompt, chosen)
            pref = {"prompt": prompt, "chosen": chosen, "rejected": rejected}
            if "margin" in columns:
                if not isinstance(row["margin"], (int, float)) or isinstance(row["margin"], bool):
                    raise DataError(
                        f"dataset '{dataset}', row {number} ({split} split): column 'margin' is {row['margin']!r}, not a number"
                    )
                pref["margin"] = float(row["margin"])
            out.append(pref)
    return out


def prompts_with_answers(dataset: str, config: str | None = None) -> bool:
    """Whether `dataset` holds prompts with answers (GSM8K's question/answer, or prompt/answer) and no preference
    pairs: a script's pairs are then sampled from a model and labelled by the answers."""
    if dataset == "arithmetic":
        return False
    columns = set((load_raw(dataset, "train", config)[0] or [{}])[0])
    return not {"chosen", "rejected"} <= columns and "answer" in columns and bool({"question", "prompt"} & columns)


def check_prompt_lengths(tokenizer, rows: list[dict], max_length: int):
    """At start, on the held-out prompts: those longer than max_length are counted, and a limit that no prompt
    fits is a setting error (DataError). Training prompts are tokenized a batch at a time, as they are drawn."""
    lengths = [len(x) for x in tokenize(tokenizer, [r["prompt"] for r in rows])]
    too_long = sum(n > max_length for n in lengths)
    if lengths and too_long == len(lengths):
        raise DataError(
            f"every prompt is longer than the limit of {max_length} tokens (shortest: {min(lengths)}); raise the prompt length limit"
        )
    if too_long:
        print(f"warning: {too_long} of {len(lengths)} held-out prompts are longer than {max_length} tokens")
        warn_once(f"prompts longer than {max_length} tokens are left-truncated")


def same_tokenizer(a, b) -> bool:
    """True when two tokenizers give the same ids for the same text and conversation (vocabulary, special
    tokens, chat template): then a reward model can read the policy's token ids as they are."""
    return a is b or (
        a.get_vocab() == b.get_vocab()
        and (a.bos_token_id, a.eos_token_id) == (b.bos_token_id, b.eos_token_id)
        and getattr(a, "chat_template", None) == getattr(b, "chat_template", None)
    )


def retokenize(tokenizer, rows: list[dict], completions: list[str], ended: list[bool], max_prompt_length: int):
    """(input_ids, attention_mask) of prompt + completion as a reward model with another `tokenizer` reads
    them, tokenized as reward_model.py tokenizes its pairs: conversational prompts (`messages`) rendered with
    its chat template and the completion as the assistant's turn, plain prompts as they are; EOS only where
    the policy emitted one (`ended`)."""
    prompts, texts = [], []
    for row, completion in zip(rows, completions):
        if row.get("messages") and getattr(tokenizer, "chat_template", None) is None:
            raise DataError(
                f"the reward model's tokenizer ({tokenizer.name_or_path}) has no chat template, so it cannot read the "
                "policy's conversational prompts: give it one (save a tokenizer with a chat_template beside the reward "
                "model), train the reward model from this chat model with reward_model.py, or use plain-text prompts"
            )
        if row.get("messages"):
            prompt, completion = _split_chat(tokenizer, row["messages"], [{"role": "assistant", "content": completion}])
        else:
            prompt = row["prompt"]
        prompts.append(prompt)
        texts.append(completion)
    prompt_ids = [x[-max_prompt_length:] for x in tokenize(tokenizer, prompts)]
    completion_ids = [ids if done else ids[:-1] for ids, done in zip(tokenize(tokenizer, texts, add_eos=True), ended)]
    batch = collate(prompt_ids, completion_ids, tokenizer.pad_token_id)
    return batch["input_ids"], batch["attention_mask"]
