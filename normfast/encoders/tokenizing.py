"""What a tokenizer makes of probe texts: long texts tokenized in bounded time, and unknown tokens.

A model reads at most ``max_length`` tokens of a text, yet a tokenizer asked to truncate
still tokenizes the whole text first: a 1 MB probe cost seconds and hundreds of MB at
every virtual batch that held it. :func:`tokenize_truncated` tokenizes a head of each long
text that is long enough to fill ``max_length``, which gives the same ids.

A tokenizer that does not match its vocabulary (a cased tokenizer on an uncased
vocabulary) turns most words into the unknown token, and every such row then measures the
one ``[UNK]`` embedding; :func:`unknown_token_warning` says so before a run.
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = [
    "HEAD_CHARS_PER_TOKEN",
    "UNKNOWN_SAMPLE",
    "UNKNOWN_SHARE_WARN",
    "text_head",
    "tokenize_truncated",
    "unknown_token_share",
    "unknown_token_warning",
]

#: characters of a long text first tokenized per token of the maximum length (English averages
#: about 4 to 5 per word-piece); a head that does not fill the maximum is read again, 4 times longer
HEAD_CHARS_PER_TOKEN = 16
#: probe texts whose tokens :func:`unknown_token_warning` counts (spread over the probes)
UNKNOWN_SAMPLE = 256
#: the share of unknown tokens from which :func:`unknown_token_warning` warns: an English text on
#: its model's vocabulary has next to none; symbols and emoji make a few percent
UNKNOWN_SHARE_WARN = 0.2


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


def unknown_token_share(tokenizer: Any, texts: Sequence[str], max_length: int | None = None) -> float | None:
    """The share of ``tokenizer``'s unknown token among the tokens of ``texts`` (special tokens
    left out; each text read up to ``max_length`` tokens, default 512); ``None`` when the
    tokenizer has no unknown token or the texts make no tokens."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None or not texts:
        return None
    length = max_length or 512
    heads = [text_head(t, length * HEAD_CHARS_PER_TOKEN) for t in texts]
    rows = tokenizer(heads, add_special_tokens=False, truncation=True, max_length=length)["input_ids"]
    total = sum(len(r) for r in rows)
    return sum(list(r).count(unk) for r in rows) / total if total else None


def unknown_token_warning(encoder: Any, items: Sequence[Any]) -> str | None:
    """One line when at least :data:`UNKNOWN_SHARE_WARN` of the tokens of (a sample of) the text
    ``items`` are the unknown token of ``encoder``'s tokenizer, with the share and the likely
    cause; ``None`` otherwise, and for encoders without a transformers tokenizer."""
    tokenizer = getattr(encoder, "tokenizer", None)
    if getattr(tokenizer, "unk_token_id", None) is None or not len(items):
        return None
    step = max(1, len(items) // UNKNOWN_SAMPLE)
    texts = [t for t in (items[i] for i in range(0, len(items), step)) if isinstance(t, str)][:UNKNOWN_SAMPLE]
    if getattr(encoder, "lowercase", False):
        texts = [t.lower() for t in texts]
    max_length = getattr(encoder, "max_length", None)
    share = unknown_token_share(tokenizer, texts, max_length)
    if share is None or share < UNKNOWN_SHARE_WARN:
        return None
    unk = getattr(tokenizer, "unk_token", None) or "the unknown token"
    lowered = unknown_token_share(tokenizer, [t.lower() for t in texts], max_length)
    if lowered is not None and lowered < min(UNKNOWN_SHARE_WARN, share / 2):
        cause = (
            f"likely a cased tokenizer on an uncased vocabulary ({lowered:.0%} when lowercased): set "
            f"do_lower_case to true in the tokenizer's tokenizer_config.json, or lowercase the probes"
        )
    else:
        cause = (
            "likely characters or a script the vocabulary lacks, or a tokenizer that is not this "
            "model's: check the tokenizer files beside the model"
        )
    return (
        f"probe: {share:.0%} of the probe tokens are the unknown token {unk} ({len(texts)} probes "
        f"sampled): the model sees all those words as one and the same token; {cause}"
    )
