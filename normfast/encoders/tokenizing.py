"""What a tokenizer makes of probe texts: long texts tokenized in bounded time, and unknown tokens.

A model reads at most ``max_length`` tokens of a text, yet a tokenizer asked to truncate
still tokenizes the whole text first: a 1 MB probe cost seconds and hundreds of MB at
every virtual batch that held it. :func:`tokenize_truncated` tokenizes a head of each long
text that is long enough to fill ``max_length``, which gives the same ids.
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["HEAD_CHARS_PER_TOKEN", "text_head", "tokenize_truncated"]

#: characters of a long text first tokenized per token of the maximum length (English averages
#: about 4 to 5 per word-piece); a head that does not fill the maximum is read again, 4 times longer
HEAD_CHARS_PER_TOKEN = 16


def text_head(text: str, chars: int) -> str:
    """The first (about) ``chars`` characters of ``text``, cut before a run of whitespace.

    Every word of the head is whole, and tokenizers split words at whitespace before
    anything else, so the head's tokens are the first tokens of the whole text. ``text``
    itself when it is no longer than ``chars`` or has no whitespace to cut at.
    """
    if len(text) <= chars:
        return text
    cut = chars
    while cut > 0 and not text[cut].isspace():
        cut -= 1
    while cut > 0 and text[cut - 1].isspace():
        cut -= 1
    return text[:cut] if cut else text


def tokenize_truncated(tokenizer: Any, texts: Sequence[str], max_length: int) -> Any:
    """``tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")``,
    tokenizing of each long text only a head (:func:`text_head`) that fills ``max_length``.

    A head that falls short of ``max_length`` tokens (long words, many unknown characters)
    is read again, four times longer, up to the whole text: the ids are always those of the
    whole text, truncated, at a cost bounded by ``max_length`` for any text that fills it.
    """
    chars = max_length * HEAD_CHARS_PER_TOKEN
    while True:
        heads = [text_head(t, chars) for t in texts]
        batch = tokenizer(heads, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
        mask = batch.get("attention_mask")
        if mask is None:  # no way to see which heads filled the maximum: tokenize the whole texts
            return tokenizer(list(texts), padding=True, truncation=True, max_length=max_length, return_tensors="pt")
        kept = mask.sum(dim=1).tolist()
        if all(len(h) == len(t) or n >= max_length for h, t, n in zip(heads, texts, kept)):
            return batch
        chars *= 4
