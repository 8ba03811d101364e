"""Real text and human similarity judgments from the test data that ships inside gensim's wheel.

The files sit under ``gensim/test/test_data/`` of an installed ``gensim``
(LGPL-2.1; the extra ``normfast[gensim]``). They are located with
``importlib.util.find_spec("gensim")``, which finds the package folder without
importing gensim, and read as plain text here:

* ``lee_background.cor`` -- 300 Australian news articles, one per line
  (:func:`lee_background`), the corpus of the token-heat job;
* ``lee.cor`` -- 50 further articles, one per line, Latin-1 encoded
  (:func:`lee_documents`), with ``similarities0-1.txt``, the mean human
  similarity of every pair on a 0..1 scale, stored as the upper triangle of a
  50 x 50 matrix (:func:`lee_similarity`; Lee, Pincombe & Welsh 2005);
* ``wordsim353.tsv`` -- 353 word pairs with mean relatedness scores on 0..10
  (:func:`wordsim353`; Finkelstein et al. 2002);
* ``simlex999.txt`` -- 999 word pairs with mean similarity scores on 0..10
  (:func:`simlex999`; Hill, Reichart & Korhonen 2015).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

from normfast.data.records import RecordError, read_tsv

__all__ = [
    "GENSIM_EXTRA",
    "gensim_test_data",
    "lee_background",
    "lee_documents",
    "lee_pairs",
    "lee_similarity",
    "simlex999",
    "wordsim353",
]

GENSIM_EXTRA = 'pip install "normfast[gensim]"'


def gensim_test_data(root: str | Path | None = None) -> Path:
    """The folder ``gensim/test/test_data`` of the installed gensim (without importing gensim).

    ``root`` overrides the search (a folder holding the files). Raises
    ``ModuleNotFoundError`` naming the extra when gensim is not installed.
    """
    if root is not None:
        folder = Path(root)
        if not folder.is_dir():
            raise FileNotFoundError(f"gensim_test_data: {folder} is not a folder")
        return folder
    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"gensim's test data (Lee corpus, WordSim353, SimLex999) needs the gensim "
            f"package; install it with {GENSIM_EXTRA}"
        )
    folder = Path(list(spec.submodule_search_locations)[0]) / "test" / "test_data"
    if not folder.is_dir():
        raise FileNotFoundError(
            f"gensim_test_data: the installed gensim has no test data folder ({folder}); "
            f"reinstall it with {GENSIM_EXTRA}"
        )
    return folder


def _file(name: str, root: str | Path | None) -> Path:
    path = gensim_test_data(root) / name
    if not path.is_file():
        raise FileNotFoundError(f"gensim test data: {path} is missing; reinstall gensim ({GENSIM_EXTRA})")
    return path


def _lines(path: Path, encoding: str) -> list[str]:
    docs = [ln.strip() for ln in path.read_text(encoding=encoding).split("\n")]
    return [d for d in docs if d]


def lee_background(root: str | Path | None = None) -> list[str]:
    """The 300 articles of ``lee_background.cor`` (one per line), in file order."""
    docs = _lines(_file("lee_background.cor", root), "utf-8")
    if len(docs) != 300:
        raise ValueError(f"lee_background: expected 300 documents, got {len(docs)}")
    return docs


def lee_documents(root: str | Path | None = None) -> list[str]:
    """The 50 articles of ``lee.cor`` (one per line, Latin-1), in the order of the similarity matrix."""
    docs = _lines(_file("lee.cor", root), "latin-1")
    if len(docs) != 50:
        raise ValueError(f"lee_documents: expected 50 documents, got {len(docs)}")
    return docs


def lee_similarity(root: str | Path | None = None) -> np.ndarray:
    """The 50 x 50 mean human similarity matrix (symmetric, ones on the diagonal, values in [0, 1])."""
    path = _file("similarities0-1.txt", root)
    m = np.loadtxt(path, dtype=float)
    if m.shape != (50, 50):
        raise ValueError(f"lee_similarity: expected a 50 x 50 matrix in {path}, got shape {m.shape}")
    upper = np.triu(m, 1)
    if np.any(np.tril(m, -1) != 0):
        raise ValueError(f"lee_similarity: expected the upper triangle only (zeros below) in {path}")
    return upper + upper.T + np.diag(np.diag(m))


def lee_pairs(root: str | Path | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(i, j, score)`` for the 1 225 document pairs ``i < j`` of the Lee matrix."""
    m = lee_similarity(root)
    i, j = np.triu_indices(m.shape[0], 1)
    return i, j, m[i, j]


def _word_pairs(path: Path, expected: int) -> list[tuple[str, str, float]]:
    fn, pairs = "gensim test data", []
    for ln, cols in read_tsv(path, fn=fn, n_fields=3, comment="#"):
        try:
            score = float(cols[2])
        except ValueError:
            raise RecordError(f"{fn}: {path}:{ln}: score {cols[2]!r} is not a number") from None
        pairs.append((cols[0].strip(), cols[1].strip(), score))
    if len(pairs) != expected:
        raise ValueError(f"{path}: expected {expected} word pairs, got {len(pairs)}")
    return pairs


def wordsim353(root: str | Path | None = None) -> list[tuple[str, str, float]]:
    """The 353 ``(word1, word2, mean human relatedness 0..10)`` pairs of WordSim353."""
    return _word_pairs(_file("wordsim353.tsv", root), 353)


def simlex999(root: str | Path | None = None) -> list[tuple[str, str, float]]:
    """The 999 ``(word1, word2, mean human similarity 0..10)`` pairs of SimLex999."""
    return _word_pairs(_file("simlex999.txt", root), 999)
