"""WordNet 3.0 from Debian's ``wordnet-base`` (+ ``wordnet-sense-index``), read with NLTK's
WordNet corpus reader (:func:`load_wordnet`), and the noun (lemma, gloss) pairs drawn from it."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import shutil
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from normfast.data.atomic import temporary_file
from normfast.data.system import LEXNAMES_MAN, WORDNET_APT, WORDNET_DIR, WORDNET_FILES, cache_dir

__all__ = [
    "gloss",
    "hypernym_depth",
    "lemma_names",
    "load_wordnet",
    "noun_synsets",
    "noun_table",
    "parse_lexnames_man",
    "prepare_wordnet",
    "wordnet_gloss_pairs",
]

_SYNTACTIC_CATEGORY = {"noun": 1, "verb": 2, "adj": 3, "adv": 4}


def parse_lexnames_man(path: str | os.PathLike = LEXNAMES_MAN) -> str:
    """The ``lexnames`` file, generated from the lexnames(5WN) man page.

    Output: 45 lines ``NN<TAB>name<TAB>category``.

    The page's table lists file number, lexicographer file name and a
    description; the syntactic category (1 noun, 2 verb, 3 adjective, 4
    adverb) follows from the name's prefix, as in WordNet's own file.
    """
    p = Path(path)
    opener = gzip.open if p.suffix == ".gz" else open
    with opener(p, "rt", encoding="utf-8", errors="replace") as fh:
        source = fh.read()
    rows = []
    for line in source.splitlines():
        m = re.match(r"^(\d\d)\t\s*([a-z]+)\.(\S+?)\s*\t", line)
        if m:
            number, prefix, rest = m.groups()
            if prefix not in _SYNTACTIC_CATEGORY:
                raise ValueError(f"parse_lexnames_man: unexpected lexicographer file {prefix}.{rest} in {p}")
            rows.append((int(number), f"{prefix}.{rest}", _SYNTACTIC_CATEGORY[prefix]))
    if [r[0] for r in rows] != list(range(45)):
        raise ValueError(
            f"parse_lexnames_man: expected the 45 lexicographer files 00..44 in {p}, found {len(rows)} table rows"
        )
    return "".join(f"{n:02d}\t{name}\t{cat}\n" for n, name, cat in rows)


def _wordnet_cache_root(dict_dir: Path, cache: Path) -> Path:
    # one cache per source folder, so a test pointed elsewhere never reuses it
    key = hashlib.sha1(str(dict_dir.resolve()).encode()).hexdigest()[:12]
    return cache / "wordnet-3.0" / key


def _wordnet_cache_ok(root: Path, dict_dir: Path) -> bool:
    target = root / "corpora" / "wordnet"
    if not (target / "lexnames").is_file():
        return False
    for name in WORDNET_FILES:
        f = target / name
        if not f.is_file() or f.stat().st_size != (dict_dir / name).stat().st_size:
            return False
    return True


def _check_wordnet_sources(dict_dir: Path, man_page: Path) -> None:
    missing = [n for n in WORDNET_FILES if not (dict_dir / n).is_file()]
    if missing:
        pkg = "wordnet-sense-index" if missing == ["index.sense"] else "wordnet-base"
        raise FileNotFoundError(
            f"load_wordnet: WordNet 3.0 files missing from {dict_dir} ({', '.join(missing[:4])}"
            f"{', ...' if len(missing) > 4 else ''}; package {pkg}); install with: {WORDNET_APT}"
        )
    if not man_page.is_file():
        raise FileNotFoundError(
            f"load_wordnet: the lexnames(5WN) man page {man_page} is missing (it ships with "
            f"wordnet-base and is needed to generate 'lexnames'); install with: {WORDNET_APT}"
        )


def prepare_wordnet(
    dict_dir: str | os.PathLike = WORDNET_DIR,
    *,
    man_page: str | os.PathLike = LEXNAMES_MAN,
    cache: str | os.PathLike | None = None,
) -> Path:
    """Copy WordNet 3.0 into an NLTK data folder under the cache and return that folder.

    The result ``ROOT`` holds ``ROOT/corpora/wordnet/`` with the database files
    (copies: NLTK refuses symlinks and paths outside its data path) and a
    generated ``lexnames``. Built in a temporary folder and renamed into
    place, so a crash never leaves a half-built cache.
    """
    src, man = Path(dict_dir), Path(man_page)
    _check_wordnet_sources(src, man)
    root = _wordnet_cache_root(src, Path(cache) if cache is not None else cache_dir())
    if _wordnet_cache_ok(root, src):
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".wordnet-", dir=root.parent))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is ordinary shared data
        target = tmp / "corpora" / "wordnet"
        target.mkdir(parents=True)
        for name in WORDNET_FILES:
            shutil.copyfile(src / name, target / name)
        (target / "lexnames").write_text(parse_lexnames_man(man), encoding="utf-8")
        if root.exists():  # stale or incomplete
            shutil.rmtree(root, ignore_errors=True)
        try:
            os.rename(tmp, root)
        except OSError:
            if not _wordnet_cache_ok(root, src):  # not a concurrent builder that won the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root


_READERS: dict[tuple[str, str], Any] = {}
_READERS_LOCK = threading.Lock()


def load_wordnet(
    dict_dir: str | os.PathLike = WORDNET_DIR,
    *,
    man_page: str | os.PathLike = LEXNAMES_MAN,
    cache: str | os.PathLike | None = None,
):
    """NLTK's ``WordNetCorpusReader`` over Debian's WordNet 3.0 (cached per process).

    The reader is built directly on the prepared folder rather than through
    ``nltk.corpus.wordnet``: that lazy loader searches every NLTK data path and
    prefers a ``wordnet.zip`` anywhere on it, so it could silently read another
    WordNet version. The version is checked (``get_version() == "3.0"``).
    """
    root = prepare_wordnet(dict_dir, man_page=man_page, cache=cache)
    key = (str(root), str(Path(dict_dir).resolve()))
    with _READERS_LOCK:
        reader = _READERS.get(key)
        if reader is not None:
            return reader
        import nltk
        from nltk.corpus.reader.wordnet import WordNetCorpusReader

        if str(root) not in nltk.data.path:
            nltk.data.path.insert(0, str(root))  # NLTK only opens files under its data path
        pointer = nltk.data.find("corpora/wordnet", paths=[str(root)])

        class EnglishWordNet(WordNetCorpusReader):
            def map_wn(self, version: str = "wordnet") -> None:
                # NLTK maps the Open Multilingual WordNet's 3.0 synsets onto the loaded version at start-up
                # (two passes over index.sense, about half the load time); without OMW nothing reads it
                return None

        with warnings.catch_warnings():
            # no Open Multilingual WordNet here: English only, which is all we use
            warnings.filterwarnings("ignore", message=".*multilingual.*")
            reader = EnglishWordNet(pointer, None)
        version = reader.get_version()
        if version != "3.0":
            raise RuntimeError(
                f"load_wordnet: expected WordNet 3.0 in {root}, the reader reports "
                f"{version!r}; reinstall with: {WORDNET_APT}"
            )
        _READERS[key] = reader
        return reader


def noun_synsets(wn: Any = None) -> list:
    """All noun synsets, in database (offset) order."""
    wn = load_wordnet() if wn is None else wn
    return list(wn.all_synsets("n"))


def hypernym_depth(synset: Any) -> int:
    """Minimum depth: the fewest hypernym (and instance-hypernym) steps to a root.

    ``entity.n.01`` has depth 0. The minimum, not the maximum, because a
    synset with several hypernym paths is as general as its shortest one
    says (NLTK's ``min_depth``).
    """
    return int(synset.min_depth())


def gloss(synset: Any) -> str:
    """The synset's definition (without the example sentences)."""
    return synset.definition()


def lemma_names(synset: Any) -> list[str]:
    """The synset's lemma names with underscores turned into spaces, in WordNet order."""
    return [name.replace("_", " ") for name in synset.lemma_names()]


def wordnet_gloss_pairs(
    n_pairs: int, n_probes: int, seed: int = 0, wn: Any = None
) -> tuple[list[tuple[str, str]], list[str]]:
    """A pool of WordNet noun (lemma, gloss) pairs and probe lemmas, both drawn with ``seed``.

    Every lemma of every noun synset is paired with the synset's definition;
    ``n_pairs`` distinct pairs are drawn from all of them, and ``n_probes``
    distinct lemma strings from the pool's anchors.
    """
    fn = "wordnet_gloss_pairs"
    wn = load_wordnet() if wn is None else wn
    every = _lemma_gloss_pairs(wn)
    for name, value in (("n_pairs", n_pairs), ("n_probes", n_probes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{fn}: expected {name} to be a positive int, got {value!r}")
    if n_pairs > len(every):
        raise ValueError(f"{fn}: expected n_pairs <= {len(every)} (all noun lemma-gloss pairs), got {n_pairs}")
    rng = np.random.default_rng(seed)
    pool = [every[i] for i in rng.choice(len(every), size=n_pairs, replace=False)]
    lemmas = sorted({lemma for lemma, _ in pool})
    if n_probes > len(lemmas):
        raise ValueError(f"{fn}: expected n_probes <= {len(lemmas)} (distinct lemmas in the pool), got {n_probes}")
    probes = [lemmas[i] for i in rng.choice(len(lemmas), size=n_probes, replace=False)]
    return pool, probes


# id(reader) -> (reader, table); the reader is kept so that its id is never reused
_NOUN_TABLES: dict[int, tuple[Any, list[tuple[str, str, int, str]]]] = {}


def noun_table(wn: Any) -> list[tuple[str, str, int, str]]:
    """``(synset name, document text, depth, gloss)`` for every noun synset.

    Cached per reader in memory and, keyed by a hash of the noun data file, on
    disk next to the prepared WordNet: the depths of all 82k noun synsets take
    seconds to compute and never change.
    """
    cached = _NOUN_TABLES.get(id(wn))
    if cached is not None:
        return cached[1]
    root = Path(str(getattr(wn.root, "path", wn.root)))
    data = root / "data.noun"
    key = hashlib.sha256(data.read_bytes()).hexdigest()[:16] if data.exists() else None
    disk = root / "normfast-noun-table.json"
    table = None
    if key is not None and disk.exists():
        try:
            blob = json.loads(disk.read_text())
            if blob.get("key") == key:
                table = [tuple(row) for row in blob["rows"]]
        except (OSError, ValueError, KeyError):
            table = None
    if table is None:
        table = [(s.name(), ", ".join(lemma_names(s)), hypernym_depth(s), gloss(s)) for s in noun_synsets(wn)]
        if key is not None:
            try:
                tmp = temporary_file(disk)
                with open(tmp, "w") as fh:
                    json.dump({"key": key, "rows": table}, fh)
                os.replace(tmp, disk)
            except OSError:  # a read-only data folder only costs the recomputation
                pass
    _NOUN_TABLES[id(wn)] = (wn, table)
    return table


def _lemma_gloss_pairs(wn: Any) -> list[tuple[str, str]]:
    """``(lemma, gloss)`` for every lemma of every noun synset, in synset then lemma order.

    Read from the cached noun table (seconds faster than walking the synsets);
    its lemma field joins the lemma names with ", ", which no WordNet 3.0 noun
    lemma contains (``tests/data/test_datasets.py`` checks the two agree).
    """
    return [(lemma, row[3]) for row in noun_table(wn) for lemma in row[1].split(", ")]
