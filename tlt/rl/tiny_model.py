"""A tiny random Llama + character-level tokenizer with a chat template, built locally (no downloads).

`model.path: tiny-random` in a config means `tiny_random_model_path()`: the model is built once into
$TLT_CACHE/tiny-random-llama (else ~/.cache/tlt/tiny-random-llama) and reused. The smoke recipe and the tests
use it; it learns nothing useful, it only exercises the whole pipeline in seconds.

    python -m tlt.rl.tiny_model        # build (if needed) and print the path
"""
from __future__ import annotations

import os
import string
from pathlib import Path

from tlt.cache import build_atomically, cache_root

TINY_MODEL_NAME = "tiny-random"
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
SPECIAL_TOKENS = ["<|pad|>", "<|unk|>", "<|end|>", "<|user|>", "<|system|>", "<|assistant|>"]


def build_tiny_tokenizer(out_dir: str | os.PathLike):
    """Save a character-level tokenizer (printable ASCII + chat specials, ~106 ids) into out_dir; returns it."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\x0b\x0c\r"]
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|unk|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token per character
    tok.decoder = decoders.Fuse()  # characters join without spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<|unk|>", pad_token="<|pad|>",
                                   eos_token="<|end|>", additional_special_tokens=SPECIAL_TOKENS[3:])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return fast


def build_tiny_model(out_dir: str | os.PathLike, hidden_size: int = 64, num_layers: int = 2, seed: int = 0) -> str:
    """Write a tiny random LlamaForCausalLM (vocab = the tiny tokenizer's) plus its tokenizer into out_dir."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    tok = build_tiny_tokenizer(out_dir)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                      num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=None,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg).eval()
    model.save_pretrained(str(out_dir))
    return str(out_dir)


def tiny_random_model_path() -> Path:
    """The cached tiny model directory; built on first use, atomically (temp sibling + rename), and again when it
    fails verification (tlt.cache)."""
    from tlt.models.weights_check import check_model_weights
    done = lambda p: (p / "config.json").is_file() and (p / "model.safetensors").is_file()  # noqa: E731
    return build_atomically(cache_root() / "tiny-random-llama", build_tiny_model, done, verify=check_model_weights)


if __name__ == "__main__":
    print(tiny_random_model_path())
