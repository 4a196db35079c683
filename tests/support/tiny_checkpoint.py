"""Tiny random Llama / Qwen2 / Qwen3 checkpoints with a local word-level tokenizer (no hub access)."""

from __future__ import annotations

import os

import torch

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "a",
    "cat",
    "sat",
    "on",
    "mat",
    "hello",
    "world",
    "how",
    "are",
    "you",
    "today",
    "i",
    "am",
    "fine",
    "thank",
    "tell",
    "me",
    "story",
    "about",
    "robot",
    "who",
    "learned",
    "to",
    "paint",
    "once",
    "upon",
    "time",
    "there",
    "was",
    "small",
    "village",
    "near",
    "river",
    "and",
    "people",
    "lived",
    "happily",
    "STOP",
    "end",
]
SPECIALS = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
VOCAB_SIZE = 128


def build_tokenizer(path: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = list(dict.fromkeys(WORDS))
    vocab_list = SPECIALS + words
    vocab_list += [f"w{i}" for i in range(VOCAB_SIZE - len(vocab_list))]
    vocab = {tok: i for i, tok in enumerate(vocab_list)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=["<|user|>", "<|assistant|>", "<|system|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)


def build_model(
    path: str, arch: str = "llama", *, layers: int = 2, seed: int = 0, hidden_size: int = 64
) -> str:
    """Save a random fp32 model (weights scaled so greedy choices have clear margins) plus the
    tokenizer into `path`; returns `path`."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden_size,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.3,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        dtype="float32",
    )
    if arch == "llama":
        config = LlamaConfig(**common)
    elif arch == "qwen3":
        config = Qwen3Config(head_dim=16, **common)
    elif arch == "qwen2":
        config = Qwen2Config(**common)
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    build_tokenizer(path)
    return path


def hf_greedy(
    path: str | torch.nn.Module, prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, one prompt at a time, by the model at
    `path` (or the model itself)."""
    from transformers import AutoModelForCausalLM

    model = (
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        if isinstance(path, str)
        else path
    )
    outs = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                pad_token_id=0,
            )
            outs.append(y[0, len(ids) :].tolist())
    return outs
