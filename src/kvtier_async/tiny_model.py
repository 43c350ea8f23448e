"""A tiny Llama-style model written locally: random weights, a tokenizer trained here.

Nothing is downloaded. The model is small enough that vLLM's CPU backend runs a 4k-token
prompt in about a second on two cores, and real enough that every layer of the engine runs
on it: its weights load through vLLM's loader, its KV cache is vLLM's paged cache, its
tokenizer turns text into ids and back, so ``vllm serve`` takes text. Greedy decoding of
random weights is deterministic, which is all the e2e checks need: the same token ids with
and without a connector.

float32: on a CPU without AVX-512 bfloat16 support, vLLM's bfloat16 and float16 paths fall
back to slow code. The byte-level BPE tokenizer decodes any id it knows; `VOCAB_IDS` is the
range of ids a prompt may use so that every id maps to text.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

__all__ = ["MODEL_CONFIG", "STAMP", "build_tiny_model", "prompt_ids"]

#: The model: hidden 256, 4 layers, 4 attention heads, 2 KV heads, vocabulary 4096.
MODEL_CONFIG: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 4,
    "vocab_size": 4096,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}
#: Written last: a directory without it is an interrupted build, rebuilt.
STAMP = ".kvtier-tiny-model"
_WORDS = ("alpha", "beta", "gamma", "delta", "kv", "cache", "tier", "block", "prompt", "token")
_SPECIAL = ("<unk>", "<s>", "</s>")


def build_tiny_model(path: str | os.PathLike[str], *, seed: int = 0) -> Path:
    """Write the model and tokenizer to ``path`` (made if needed) unless a finished build
    of the same seed is there; returns the directory. Needs torch, transformers and
    tokenizers (vLLM brings all three)."""
    out = Path(path)
    stamp = out / STAMP
    wanted = json.dumps({"seed": seed, "config": MODEL_CONFIG}, sort_keys=True)
    if stamp.is_file() and stamp.read_text() == wanted:
        return out
    out.mkdir(parents=True, exist_ok=True, mode=0o700)
    _write_model(out, seed)
    _write_tokenizer(out, seed)
    stamp.write_text(wanted)
    return out


def _write_model(out: Path, seed: int) -> None:
    import importlib

    import torch

    transformers: Any = importlib.import_module("transformers")  # untyped
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**MODEL_CONFIG, torch_dtype="float32")
    transformers.LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)


def _write_tokenizer(out: Path, seed: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    rng = random.Random(seed)
    corpus = [
        " ".join(f"{rng.choice(_WORDS)}{rng.randrange(1000)}" for _ in range(64))
        for _ in range(2000)
    ]
    trainer = trainers.BpeTrainer(
        vocab_size=int(MODEL_CONFIG["vocab_size"]),
        special_tokens=list(_SPECIAL),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(corpus, trainer)
    tokenizer.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "model_max_length": int(MODEL_CONFIG["max_position_embeddings"]),
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config))


def prompt_ids(count: int, length: int, *, seed: int, vocab: int = 1200) -> list[list[int]]:
    """``count`` seeded prompts of ``length`` token ids each, from ids every tokenizer
    build knows (3 up to ``vocab``: after the special tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(len(_SPECIAL), vocab) for _ in range(length)] for _ in range(count)]
