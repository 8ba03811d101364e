"""English (and other) word frequencies from the ``wordfreq`` package: :func:`zipf_frequency`,
:func:`top_words`."""

from __future__ import annotations

from typing import Iterable

import numpy as np

from normfast.core.checks import check_positive_int

__all__ = ["top_words", "zipf_frequency"]


def _check_wordfreq_lang(fn: str, lang: str) -> None:
    import wordfreq

    langs = wordfreq.available_languages()
    if lang not in langs:
        raise ValueError(f"{fn}: wordfreq has no word list for lang={lang!r} (available: {', '.join(sorted(langs))})")


def zipf_frequency(words: str | Iterable[str], lang: str = "en") -> float | np.ndarray:
    """Zipf frequency (log10 of occurrences per billion words) from ``wordfreq``.

    A string gives a float, an iterable of strings a float64 array. Unknown
    words get 0.
    """
    import wordfreq

    _check_wordfreq_lang("zipf_frequency", lang)
    if isinstance(words, str):
        return float(wordfreq.zipf_frequency(words, lang))
    return np.array([wordfreq.zipf_frequency(w, lang) for w in words], dtype=np.float64)


def top_words(n: int, lang: str = "en", *, alpha_only: bool = True, min_len: int = 2) -> list[str]:
    """The ``n`` most frequent words of ``lang`` (wordfreq's ranking, deterministic).

    ``alpha_only`` keeps words made of letters only (no digits, apostrophes or
    hyphens); ``min_len`` drops shorter words.
    """
    import wordfreq

    fn = "top_words"
    n = check_positive_int(fn, "n", n)
    _check_wordfreq_lang(fn, lang)
    out = []
    for word in wordfreq.iter_wordlist(lang):
        if len(word) < min_len or (alpha_only and not word.isalpha()):
            continue
        out.append(word)
        if len(out) == n:
            return out
    raise ValueError(
        f"{fn}: wordfreq's {lang!r} list has only {len(out)} words that pass the "
        f"filters (alpha_only={alpha_only}, min_len={min_len}), asked for {n}"
    )
