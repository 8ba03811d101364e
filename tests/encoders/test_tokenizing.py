"""normfast.encoders.tokenizing: a head of a long text gives the ids of the whole text, truncated."""

from __future__ import annotations

import random

import pytest
import torch

from normfast.encoders.tokenizing import HEAD_CHARS_PER_TOKEN, text_head, tokenize_truncated


def _texts(seed: int) -> list[str]:
    rnd = random.Random(seed)
    pieces = ["river", "Démocratie", "naïve", "don't", "e-mail", "3.14", "東京都", "😀", "---", "supercalifragilistic"]
    spaces = [" ", "  ", "\t", "\n", " \u00a0", "\u3000"]
    text = "".join(rnd.choice(pieces) + rnd.choice(spaces) for _ in range(3000))
    return [
        text,
        "x" * 5000 + " " + text,  # a first word far longer than a head: the head grows
        " " * 3000 + text,  # whitespace before the first word
        "y" * 40_000,  # no whitespace at all: read whole
        "a short one",
        "",
    ]


@pytest.mark.parametrize("max_length", [8, 64, 512])
def test_heads_give_the_whole_texts_ids(minilm_tokenizer, max_length):
    texts = _texts(max_length)
    got = tokenize_truncated(minilm_tokenizer, texts, max_length)
    want = minilm_tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    for key in ("input_ids", "attention_mask", "token_type_ids"):
        assert torch.equal(got[key], want[key]), key


def test_a_head_ends_before_whitespace_and_keeps_short_texts_whole():
    assert text_head("ab cd ef", 5) == "ab cd"  # "cd" is whole: a space follows it
    assert text_head("ab cd ef", 4) == "ab"  # "c" is not: the head ends before the space
    assert text_head("ab  cd", 3) == "ab"
    assert text_head("abcdef", 3) == "abcdef"  # no whitespace to cut at
    assert text_head("short", 64 * HEAD_CHARS_PER_TOKEN) == "short"
