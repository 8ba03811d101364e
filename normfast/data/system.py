"""Where the offline data lives: the Debian data sets and the cache (nothing is downloaded).

The Debian data is looked up under ``$NORMFAST_SYSTEM_ROOT`` (default ``/``):
pointing it at an empty folder simulates a machine without the packages.
:func:`missing_system_data` says which data set is absent and how to install it.
Data derived from it is cached under ``$NORMFAST_CACHE`` (default
``~/.cache/normfast``, :func:`cache_dir`), never inside the repo.
"""

from __future__ import annotations

import os
from pathlib import Path

#: prefix of the Debian data paths ($NORMFAST_SYSTEM_ROOT, default "/"), read once at import
SYSTEM_ROOT = Path(os.environ.get("NORMFAST_SYSTEM_ROOT") or "/")
WORDNET_DIR = SYSTEM_ROOT / "usr/share/wordnet"
LEXNAMES_MAN = SYSTEM_ROOT / "usr/share/man/man5/lexnames.5WN.gz"
FASHION_MNIST_DIR = SYSTEM_ROOT / "usr/share/datasets/fashion-mnist"

WORDNET_APT = "apt-get install wordnet-base wordnet-sense-index"
FASHION_APT = "apt-get install dataset-fashion-mnist"
#: split -> (images file, labels file, number of examples) of Fashion-MNIST
FASHION_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", 60000),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz", 10000),
}

# The files NLTK's WordNetCorpusReader opens. index.sense comes from
# wordnet-sense-index; lexnames is generated from the lexnames(5WN) man page.
WORDNET_FILES = (
    "cntlist.rev",
    "index.sense",
    "index.adj",
    "index.adv",
    "index.noun",
    "index.verb",
    "data.adj",
    "data.adv",
    "data.noun",
    "data.verb",
    "adj.exc",
    "adv.exc",
    "noun.exc",
    "verb.exc",
)


def missing_system_data(name: str) -> str | None:
    """None when the Debian data set ``name`` (``"wordnet"`` or ``"fashion-mnist"``) is installed,
    else a one-line reason that names the packages to install."""
    if name == "wordnet":
        missing = [n for n in WORDNET_FILES if not (WORDNET_DIR / n).is_file()]
        if not LEXNAMES_MAN.is_file():
            missing.append(LEXNAMES_MAN.name)
        if missing:
            return f"WordNet 3.0 not installed (missing {missing[0]} under {SYSTEM_ROOT}): {WORDNET_APT}"
        return None
    if name == "fashion-mnist":
        missing = [f for files in FASHION_FILES.values() for f in files[:2] if not (FASHION_MNIST_DIR / f).is_file()]
        if missing:
            return f"Fashion-MNIST not installed (missing {missing[0]} under {SYSTEM_ROOT}): {FASHION_APT}"
        return None
    raise ValueError(f"missing_system_data: expected 'wordnet' or 'fashion-mnist', got {name!r}")


def cache_dir() -> Path:
    """``$NORMFAST_CACHE`` if set, else ``~/.cache/normfast``."""
    env = os.environ.get("NORMFAST_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "normfast"
