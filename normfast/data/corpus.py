"""Corpus input for token-level probing: documents -> token windows, every token probed in context.

Documents (:func:`read_documents`)
    * ``.jsonl``: one JSON object per line with a text field (``text_key``,
      default ``"text"``) and optionally an id field (``id_key``, default ``"id"``).
    * plain text, ``layout="lines"`` (the default): one document per non-empty line.
    * plain text, ``layout="blank"``: documents separated by one or more blank
      lines (the lines of a block are one document, newlines kept).
    A document's id is its id field, else its index among the documents (0-based,
    blank lines not counted).

Windows (:class:`CorpusWindows`)
    Each document is tokenized once, whole, without special tokens, by the
    model's own (fast) tokenizer -- lowercased first when the model does so --
    and cut into windows of at most ``window`` content tokens (default: the
    model's maximum input length less its special tokens), each then wrapped in
    the model's special tokens (``[CLS] ... [SEP]``, ``<s> ... </s>``).

    Stride policy: a window ends at a word boundary (the pieces of a word are
    never split over two windows, unless one word alone is longer than the
    window). With the default ``stride = window`` the windows do not overlap and
    every token is probed exactly once. With ``stride < window`` the next window
    starts at the first word boundary at least ``stride`` tokens after the
    previous start, so consecutive windows overlap and the tokens of the overlap
    are probed twice; each token is *owned* by one window, the boundary being
    the word boundary nearest the middle of the overlap (so a token keeps the
    window in which it has the more context on both sides). Every probed row is
    written; the column ``primary`` says whether the row is the token's owned
    occurrence, and per-type aggregation counts owned rows only.

    Words are the tokenizer's pre-tokenized words (``word_ids()`` of the fast
    tokenizer: whitespace- and punctuation-separated for BERT-style tokenizers),
    and ``word`` is the word's text as it appears in the document (after the
    model's lowercasing, when it lowercases).

Columns each token row gets (:meth:`TokenWindow.token_columns`; special tokens have
``doc_position = word_id = -1`` and ``word = ""``):

    ``doc_id``        the document's id
    ``window``        the window's index within its document
    ``doc_position``  the token's index among the document's content tokens
    ``is_special``    a special token added by the tokenizer ([CLS], [SEP], <s>, ...)
    ``word_id``       the index of the token's word within the document
    ``word``          that word's text
    ``primary``       the token's owned occurrence (always True without overlap)

A window's ``text`` is the document text it spans. Nothing is dropped: every
content token of every document is in exactly one window as its owner.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from normfast.data.records import read_jsonl
from normfast.data.textfiles import read_text

__all__ = [
    "CorpusWindows",
    "Document",
    "LAYOUTS",
    "TokenWindow",
    "as_documents",
    "read_documents",
    "special_template",
    "split_sentences",
]

LAYOUTS = ("lines", "blank")


@dataclass(frozen=True)
class Document:
    doc_id: str
    text: str


def read_documents(
    path: str | os.PathLike, *, layout: str = "lines", text_key: str = "text", id_key: str = "id"
) -> list[Document]:
    """Read a corpus file (see the module docstring for the formats)."""
    fn = "read_documents"
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{fn}: corpus file {path} is a folder; expected a file (.txt or .jsonl)")
    if not path.is_file():
        raise FileNotFoundError(f"{fn}: corpus file {path} does not exist")
    if layout not in LAYOUTS:
        raise ValueError(f"{fn}: layout must be one of {LAYOUTS}, got {layout!r}")
    docs: list[Document] = []
    if path.suffix == ".jsonl":
        # no cap on a line: a document is cut into windows that fit, however long it is
        records = read_jsonl(path, fn=fn, text_fields=(text_key,), key_fields=(id_key,), max_bytes=None)
        for _, rec in records:
            text = rec[text_key]
            if text.strip():
                docs.append(Document(str(rec.get(id_key, len(docs))), text.strip()))
    elif layout == "lines":
        for line in read_text(path, f"{fn}: corpus file").splitlines():
            if line.strip():
                docs.append(Document(str(len(docs)), line.strip()))
    else:
        block: list[str] = []
        for line in read_text(path, f"{fn}: corpus file").splitlines() + [""]:
            if line.strip():
                block.append(line.rstrip())
            elif block:
                docs.append(Document(str(len(docs)), "\n".join(block).strip()))
                block = []
    if not docs:
        raise ValueError(f"{fn}: corpus file {path} holds no documents")
    ids = [d.doc_id for d in docs]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise ValueError(f"{fn}: {path}: document id {dup!r} occurs more than once")
    return docs


def as_documents(docs: Iterable[Document | str | tuple[str, str]]) -> list[Document]:
    """Documents from strings (ids = their index), ``(id, text)`` tuples or :class:`Document` s."""
    out = []
    for i, d in enumerate(docs):
        if isinstance(d, Document):
            out.append(d)
        elif isinstance(d, str):
            out.append(Document(str(i), d))
        elif isinstance(d, tuple) and len(d) == 2 and isinstance(d[1], str):
            out.append(Document(str(d[0]), d[1]))
        else:
            raise TypeError(f"as_documents: expected str, (id, text) or Document, got {type(d).__name__} at index {i}")
    if not out:
        raise ValueError("as_documents: expected at least one document, got none")
    return out


def split_sentences(texts: Sequence[str], *, min_chars: int = 1) -> list[str]:
    """Sentences of ``texts``, in order, by NLTK's Punkt trained unsupervised on ``texts`` themselves.

    Punkt learns abbreviations and sentence starters from the text it is given, so no
    pretrained model (and no download) is needed. Sentences shorter than ``min_chars``
    characters are left out.
    """
    from nltk.tokenize.punkt import PunktSentenceTokenizer

    texts = [t for t in texts if t.strip()]
    if not texts:
        raise ValueError("split_sentences: expected at least one non-empty text")
    splitter = PunktSentenceTokenizer("\n\n".join(texts))
    out = []
    for t in texts:
        out += [s.strip() for s in splitter.tokenize(t) if len(s.strip()) >= min_chars]
    return out


# ---------------------------------------------------------------------------
# windows


def special_template(tokenizer: Any) -> tuple[list[int], list[int]]:
    """``(prefix, suffix)``: the special token ids a tokenizer puts around one sequence."""
    fn = "special_template"
    plain = list(tokenizer("a", add_special_tokens=False)["input_ids"])
    full = list(tokenizer("a", add_special_tokens=True)["input_ids"])
    for i in range(len(full) - len(plain) + 1):
        if full[i : i + len(plain)] == plain:
            return full[:i], full[i + len(plain) :]
    raise ValueError(
        f"{fn}: cannot find the content inside the special-token template of "
        f"{type(tokenizer).__name__} ({full} around {plain})"
    )


@dataclass
class _Doc:
    doc_id: str
    text: str
    ids: np.ndarray  # int64 [n] content token ids
    word_ids: np.ndarray  # int32 [n]
    word_spans: np.ndarray  # int64 [n_words, 2] character spans of the words


@dataclass(frozen=True)
class TokenWindow:
    """One probe item of a corpus run: a window of a document's tokens with special tokens added.

    :meth:`HFEncoder.prepare` accepts a list of these (``input_ids``), and the probe
    engine adds :meth:`token_columns` to the token rows.
    """

    doc_index: int
    doc_id: str
    window: int
    start: int  # first content token (document position)
    input_ids: tuple[int, ...]  # with special tokens
    is_special: tuple[bool, ...]
    doc_positions: tuple[int, ...]
    word_ids: tuple[int, ...]
    words: tuple[str, ...]
    primary: tuple[bool, ...]
    text: str

    def __len__(self) -> int:
        return len(self.input_ids)

    def token_columns(self) -> dict[str, np.ndarray | list]:
        n = len(self.input_ids)
        return {
            "doc_id": [self.doc_id] * n,
            "window": np.full(n, self.window, np.int32),
            "doc_position": np.asarray(self.doc_positions, np.int32),
            "is_special": np.asarray(self.is_special, bool),
            "word_id": np.asarray(self.word_ids, np.int32),
            "word": list(self.words),
            "primary": np.asarray(self.primary, bool),
        }

    def __repr__(self) -> str:
        return (
            f"TokenWindow(doc_id={self.doc_id!r}, window={self.window}, start={self.start}, "
            f"tokens={len(self.input_ids)})"
        )


class CorpusWindows(Sequence):
    """The token windows of a corpus, as a sequence of probe items (see the module docstring).

    Args:
        documents: :class:`Document` s, strings or ``(id, text)`` tuples.
        tokenizer: a fast Hugging Face tokenizer (offsets and word ids are needed).
        max_length: the model's maximum input length, special tokens included.
        window: content tokens per window (default ``max_length`` less the special tokens).
        stride: tokens between window starts (default ``window``: no overlap).
        lowercase: lowercase the documents before tokenizing (as the model does).

    Tokenizes every document once at construction and keeps compact arrays; windows
    are built on demand when sliced, so a slice of a large corpus costs only its own size.
    """

    def __init__(
        self,
        documents: Iterable[Document | str | tuple[str, str]],
        tokenizer: Any,
        *,
        max_length: int,
        window: int | None = None,
        stride: int | None = None,
        lowercase: bool = False,
        progress: bool = False,
    ):
        fn = "CorpusWindows"
        if not getattr(tokenizer, "is_fast", False):
            raise TypeError(
                f"{fn}: expected a fast (Rust-backed) Hugging Face tokenizer, which gives word ids "
                f"and character offsets; got {type(tokenizer).__name__}"
            )
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 3:
            raise ValueError(f"{fn}: expected max_length to be an int >= 3, got {max_length!r}")
        self.prefix, self.suffix = special_template(tokenizer)
        capacity = max_length - len(self.prefix) - len(self.suffix)
        window = capacity if window is None else window
        if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= capacity:
            raise ValueError(
                f"{fn}: expected window in [1, {capacity}] (max_length {max_length} less "
                f"{max_length - capacity} special tokens), got {window!r}"
            )
        stride = window if stride is None else stride
        if isinstance(stride, bool) or not isinstance(stride, int) or not 1 <= stride <= window:
            raise ValueError(f"{fn}: expected stride in [1, window={window}], got {stride!r}")
        self.tokenizer = tokenizer
        self.max_length, self.window, self.stride, self.lowercase = max_length, window, stride, bool(lowercase)
        self.documents = as_documents(documents)
        from tqdm.auto import tqdm

        self._docs: list[_Doc] = []
        for d in tqdm(self.documents, desc="tokenizing documents", unit="doc", disable=not progress):
            self._docs.append(self._tokenize(d))
        # windows: (doc index, window index, start, end, owned start, owned end)
        spans = []
        for di, doc in enumerate(self._docs):
            for k, (s, e, os_, oe) in enumerate(self._cut(doc)):
                spans.append((di, k, s, e, os_, oe))
        if not spans:
            raise ValueError(f"{fn}: the documents hold no tokens")
        self._spans = np.asarray(spans, dtype=np.int64)

    # -- construction ------------------------------------------------------------
    def _tokenize(self, doc: Document) -> _Doc:
        text = doc.text.lower() if self.lowercase else doc.text
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        ids = np.asarray(enc["input_ids"], dtype=np.int64)
        word_ids = np.asarray([-1 if w is None else w for w in enc.word_ids()], dtype=np.int32)
        offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
        n_words = int(word_ids.max()) + 1 if ids.size else 0
        spans = np.zeros((n_words, 2), dtype=np.int64)
        if n_words:
            spans[:, 0] = np.iinfo(np.int64).max
            ok = word_ids >= 0
            np.minimum.at(spans[:, 0], word_ids[ok], offsets[ok, 0])
            np.maximum.at(spans[:, 1], word_ids[ok], offsets[ok, 1])
        return _Doc(doc.doc_id, text, ids, word_ids, spans)

    def _cut(self, doc: _Doc) -> list[tuple[int, int, int, int]]:
        """``(start, end, owned start, owned end)`` of each window of one document."""
        n = int(doc.ids.size)
        if n == 0:
            return []
        W, S = self.window, self.stride
        w = doc.word_ids
        # word boundaries: positions where a new word starts (and the end)
        starts = np.flatnonzero(np.r_[True, w[1:] != w[:-1]])
        bounds = np.r_[starts, n]

        def boundary_at_or_before(p: int, floor: int) -> int:
            k = int(np.searchsorted(bounds, p, side="right")) - 1
            b = int(bounds[k])
            return b if b > floor else p  # one word longer than the window: cut inside it

        def boundary_at_or_after(p: int) -> int:
            return int(bounds[np.searchsorted(bounds, p, side="left")])

        windows = []
        s = 0
        while True:
            e = n if s + W >= n else boundary_at_or_before(s + W, s)
            windows.append([s, e])
            if e >= n:
                break
            nxt = boundary_at_or_after(s + S) if S < W else e
            s = min(max(nxt, s + 1), e) if S < W else e
        owned = []
        for k, (s, e) in enumerate(windows):
            lo = 0 if k == 0 else owned[-1][1]
            if k + 1 < len(windows):
                s2 = windows[k + 1][0]
                mid = (s2 + e) // 2
                hi = boundary_at_or_after(mid) if s2 < e else e
                hi = min(max(hi, s2), e)
            else:
                hi = n
            owned.append((lo, hi))
        return [(s, e, lo, hi) for (s, e), (lo, hi) in zip(windows, owned)]

    # -- the sequence ---------------------------------------------------------------
    def __len__(self) -> int:
        return int(self._spans.shape[0])

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self._window(i) for i in range(*index.indices(len(self)))]
        i = int(index)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"CorpusWindows: index {index} out of range for {len(self)} windows")
        return self._window(i)

    def _window(self, i: int) -> TokenWindow:
        di, k, s, e, lo, hi = (int(v) for v in self._spans[i])
        doc = self._docs[di]
        pre, suf = len(self.prefix), len(self.suffix)
        content = doc.ids[s:e]
        wid = doc.word_ids[s:e]
        words = []
        for w in wid.tolist():
            a, b = doc.word_spans[w] if w >= 0 else (0, 0)
            words.append(doc.text[a:b])
        pos = np.arange(s, e)
        spans = doc.word_spans[np.unique(wid[wid >= 0])]
        a, b = (int(spans[:, 0].min()), int(spans[:, 1].max())) if len(spans) else (0, 0)
        return TokenWindow(
            doc_index=di,
            doc_id=doc.doc_id,
            window=k,
            start=s,
            input_ids=tuple(self.prefix) + tuple(int(x) for x in content) + tuple(self.suffix),
            is_special=(True,) * pre + (False,) * (e - s) + (True,) * suf,
            doc_positions=(-1,) * pre + tuple(int(x) for x in pos) + (-1,) * suf,
            word_ids=(-1,) * pre + tuple(int(x) for x in wid) + (-1,) * suf,
            words=("",) * pre + tuple(words) + ("",) * suf,
            primary=(True,) * pre + tuple(bool(lo <= p < hi) for p in pos) + (True,) * suf,
            text=doc.text[a:b],
        )

    # -- summaries ----------------------------------------------------------------------
    @property
    def n_tokens(self) -> int:
        """Content tokens in the corpus (each counted once)."""
        return int(sum(d.ids.size for d in self._docs))

    @property
    def n_rows(self) -> int:
        """Token rows a probe of these windows writes (special tokens and overlaps included)."""
        per = len(self.prefix) + len(self.suffix)
        return int(sum(e - s + per for _, _, s, e, _, _ in self._spans.tolist()))

    def ids(self) -> list[str]:
        """One id per window: ``"DOC_ID/WINDOW"``."""
        return [f"{self._docs[int(d)].doc_id}/{int(k)}" for d, k in self._spans[:, :2].tolist()]

    def fingerprint(self) -> str:
        """A hash of everything that determines the windows' rows (tokens, cuts, ids, words)."""
        h = hashlib.sha256()
        h.update(json.dumps([self.prefix, self.suffix, self.window, self.stride, self.lowercase]).encode())
        for d in self._docs:
            h.update(d.doc_id.encode() + b"\x00" + d.text.encode() + b"\x00")
            h.update(d.ids.tobytes())
            h.update(d.word_ids.tobytes())
        h.update(self._spans.tobytes())
        return h.hexdigest()[:16]

    def describe(self) -> dict[str, Any]:
        """The windowing settings and counts (for a run's metadata)."""
        return {
            "documents": len(self._docs),
            "windows": len(self),
            "content_tokens": self.n_tokens,
            "token_rows": self.n_rows,
            "max_length": self.max_length,
            "window": self.window,
            "stride": self.stride,
            "lowercase": self.lowercase,
            "special_prefix": list(self.prefix),
            "special_suffix": list(self.suffix),
        }

    @classmethod
    def from_encoder(
        cls,
        documents: Iterable[Document | str | tuple[str, str]],
        encoder: Any,
        *,
        window: int | None = None,
        stride: int | None = None,
        progress: bool = False,
    ) -> "CorpusWindows":
        """Windows for a text encoder with ``tokenizer``, ``max_length`` and ``lowercase`` (``HFEncoder``)."""
        tokenizer = getattr(encoder, "tokenizer", None)
        max_length = getattr(encoder, "max_length", None)
        if tokenizer is None or max_length is None:
            raise ValueError(
                f"CorpusWindows.from_encoder: {type(encoder).__name__} has no tokenizer and "
                f"maximum length; corpus input needs a Hugging Face text encoder"
            )
        return cls(
            documents,
            tokenizer,
            max_length=int(max_length),
            window=window,
            stride=stride,
            lowercase=bool(getattr(encoder, "lowercase", False)),
            progress=progress,
        )
