"""BEIR-format collections: ``corpus.jsonl``, ``queries.jsonl``, ``qrels/<split>.tsv``."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from normfast.core.paths import inside_folder
from normfast.data.records import RecordError, read_jsonl, read_tsv

# ---------------------------------------------------------------------------
# BEIR format
# ---------------------------------------------------------------------------


class BeirFormatError(RecordError):
    """A BEIR file that cannot be read; the message names the file and line."""


@dataclass
class BeirData:
    """A BEIR collection. Unpacks like BEIR's loader: ``corpus, queries, qrels = data``.

    ``corpus``: ``{doc_id: {"title": str, "text": str}}``;
    ``queries``: ``{query_id: text}``; ``metadata``: ``{query_id: dict}`` for
    queries that carry one; ``qrels``: ``{query_id: {doc_id: relevance}}``.
    """

    corpus: dict[str, dict[str, str]]
    queries: dict[str, str]
    qrels: dict[str, dict[str, int]]
    metadata: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __iter__(self):
        return iter((self.corpus, self.queries, self.qrels))

    def doc_text(self, doc_id: str) -> str:
        """Title and text joined by a space (BEIR's convention for encoding)."""
        d = self.corpus[doc_id]
        return f"{d.get('title', '')} {d.get('text', '')}".strip()

    def strata(self, key: str) -> dict[str, str]:
        """``{query_id: str(metadata[key])}`` for queries whose metadata has ``key``."""
        return {q: str(m[key]) for q, m in self.metadata.items() if key in m}


def load_beir(folder: str | os.PathLike, split: str = "test") -> BeirData:
    """Read a BEIR collection: ``corpus.jsonl``, ``queries.jsonl``, ``qrels/{split}.tsv``.

    Corpus lines need ``_id`` and ``text`` (``title`` optional); query lines
    need ``_id`` and ``text`` and may carry a ``metadata`` object. The qrels
    file is tab separated ``query-id corpus-id score`` with an optional header
    line. Errors name the file and line.
    """
    fn = "load_beir"
    root = Path(folder)
    if not root.is_dir():
        raise FileNotFoundError(f"{fn}: {root} is not a directory")
    paths = {
        "corpus": root / "corpus.jsonl",
        "queries": root / "queries.jsonl",
        "qrels": inside_folder(root / "qrels", f"{split}.tsv", f"load_beir: split {split!r} of {root}"),
    }
    for name, p in paths.items():
        if not p.is_file():
            hint = ""
            if name == "qrels" and (root / "qrels").is_dir():
                have = sorted(x.stem for x in (root / "qrels").glob("*.tsv"))
                hint = f" (splits present: {', '.join(have) or 'none'})"
            raise FileNotFoundError(f"{fn}: missing {name} file {p}{hint}")

    corpus: dict[str, dict[str, str]] = {}
    for lineno, obj in read_jsonl(
        paths["corpus"], fn=fn, fields=("_id", "text"), key_fields=("_id",), error=BeirFormatError
    ):
        did = str(obj["_id"])
        if did in corpus:
            raise BeirFormatError(f"{fn}: {paths['corpus']}:{lineno}: duplicate _id {did!r}")
        for key in ("title", "text"):  # null stands for an empty title or text, as before; nothing else does
            if not isinstance(obj.get(key), (str, type(None))):
                raise BeirFormatError(
                    f"{fn}: {paths['corpus']}:{lineno}: field {key!r} must be a string (or "
                    f"null), got {type(obj[key]).__name__}"
                )
        corpus[did] = {"title": obj.get("title") or "", "text": obj["text"] or ""}
    queries: dict[str, str] = {}
    metadata: dict[str, dict[str, Any]] = {}
    for lineno, obj in read_jsonl(
        paths["queries"], fn=fn, text_fields=("text",), key_fields=("_id",), fields=("_id",), error=BeirFormatError
    ):
        qid = str(obj["_id"])
        if qid in queries:
            raise BeirFormatError(f"{fn}: {paths['queries']}:{lineno}: duplicate _id {qid!r}")
        queries[qid] = str(obj["text"])
        meta = obj.get("metadata")
        if meta is not None:
            if not isinstance(meta, dict):
                raise BeirFormatError(
                    f"{fn}: {paths['queries']}:{lineno}: metadata must be a JSON object, got {type(meta).__name__}"
                )
            metadata[qid] = meta
    qrels: dict[str, dict[str, int]] = {}
    for lineno, parts in read_tsv(paths["qrels"], fn=fn, n_fields=3, error=BeirFormatError):
        if lineno == 1 and [p.strip() for p in parts] == ["query-id", "corpus-id", "score"]:
            continue
        qid, did, score = (p.strip() for p in parts)
        try:
            rel = int(score)
        except ValueError:
            raise BeirFormatError(f"{fn}: {paths['qrels']}:{lineno}: score must be an integer, got {score!r}") from None
        qrels.setdefault(qid, {})[did] = rel
    return BeirData(corpus=corpus, queries=queries, qrels=qrels, metadata=metadata)


def write_beir(
    folder: str | os.PathLike,
    corpus: Mapping[str, Any],
    queries: Mapping[str, Any],
    qrels: Mapping[str, Mapping[str, int]],
    split: str = "test",
    *,
    metadata: Mapping[str, Mapping[str, Any]] | None = None,
) -> Path:
    """Write a BEIR collection readable by :func:`load_beir` (and by BEIR itself).

    ``corpus`` values are strings or ``{"title", "text"}`` dicts; ``queries``
    values are strings or ``{"text", "metadata"}`` dicts; ``metadata`` (per
    query id) is an alternative way to attach query metadata.
    """
    fn = "write_beir"
    root = Path(folder)
    (root / "qrels").mkdir(parents=True, exist_ok=True)
    with open(root / "corpus.jsonl", "w", encoding="utf-8") as fh:
        for did, doc in corpus.items():
            if isinstance(doc, str):
                doc = {"title": "", "text": doc}
            elif not isinstance(doc, Mapping) or "text" not in doc:
                raise TypeError(f"{fn}: corpus[{did!r}] must be a string or a dict with 'text'")
            fh.write(
                json.dumps(
                    {"_id": str(did), "title": str(doc.get("title", "")), "text": str(doc["text"])}, ensure_ascii=False
                )
                + "\n"
            )
    metadata = metadata or {}
    with open(root / "queries.jsonl", "w", encoding="utf-8") as fh:
        for qid, q in queries.items():
            meta = metadata.get(qid)
            if isinstance(q, Mapping):
                if "text" not in q:
                    raise TypeError(f"{fn}: queries[{qid!r}] must be a string or a dict with 'text'")
                meta = q.get("metadata", meta)
                q = q["text"]
            obj: dict[str, Any] = {"_id": str(qid), "text": str(q)}
            if meta is not None:
                obj["metadata"] = dict(meta)
            fh.write(json.dumps(obj, ensure_ascii=False) + "\n")
    with open(root / "qrels" / f"{split}.tsv", "w", encoding="utf-8") as fh:
        fh.write("query-id\tcorpus-id\tscore\n")
        for qid, judged in qrels.items():
            for did, rel in judged.items():
                if any(c in str(qid) + str(did) for c in "\t\n"):
                    raise ValueError(f"{fn}: ids may not contain tabs or newlines: {qid!r}, {did!r}")
                fh.write(f"{qid}\t{did}\t{int(rel)}\n")
    return root
