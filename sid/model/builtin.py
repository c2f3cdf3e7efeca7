"""Small checkpoints Sid can build by itself: the default model and test fixtures.

No weights can be downloaded, so tests (and a fresh machine without the shared trained
model) make real Hugging Face checkpoints locally: a byte-level BPE tokenizer trained on
Python's own standard library sources, and random weights from ``transformers``.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

TRAINED_MODEL_NAME = "tiny-pycode-llama"
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)

TINY_SHAPE = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def trained_model_path() -> Path | None:
    """The shared trained test model, if this checkout has ``../shared`` beside it."""
    env = os.environ.get("SID_TRAINED_MODEL")
    candidates = [Path(env)] if env else []
    repo = Path(__file__).resolve().parents[2]
    candidates += [
        repo.parent / "shared" / "models" / TRAINED_MODEL_NAME, repo / ".carry" / "models" / TRAINED_MODEL_NAME
    ]
    return next((p for p in candidates if (p / "config.json").is_file()), None)


def default_model_path() -> Path:
    """``$SID_DEFAULT_MODEL``, else the trained tiny model, else a built-in random tiny Llama."""
    env = os.environ.get("SID_DEFAULT_MODEL")
    if env:
        return Path(env)
    trained = trained_model_path()
    if trained is not None:
        return trained
    path = Path(os.environ.get("SID_CACHE_DIR", Path.home() / ".cache" / "sid")) / "builtin-tiny-llama"
    if not (path / "config.json").is_file():
        write_checkpoint(path, "LlamaForCausalLM")
    return path


def train_tokenizer(path: Path, vocab_size: int = TINY_SHAPE["vocab_size"]) -> None:
    """Train a byte-level BPE on a few stdlib modules and save it as a HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    corpus = [(stdlib / name).read_text() for name in ("functools.py", "textwrap.py", "string.py", "json/decoder.py")]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))


def write_checkpoint(
    path: Path, architecture: str, *, seed: int = 0, tokenizer: bool = True, **overrides: object
) -> Path:
    """Save a random-weight checkpoint of ``architecture`` (float32, safetensors) to ``path``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type = {
        "LlamaForCausalLM": "llama",
        "MistralForCausalLM": "mistral",
        "Qwen2ForCausalLM": "qwen2",
        "Qwen3ForCausalLM": "qwen3",
    }[architecture]
    fields = {**TINY_SHAPE, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3, **overrides}
    cfg = AutoConfig.for_model(model_type, **fields)
    cfg.architectures = [architecture]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    if tokenizer:
        train_tokenizer(path, int(fields["vocab_size"]))  # type: ignore[arg-type]
    return path
