"""What ``normfast probe`` reads: a probes file, a pairs file as the objective needs it, and images
(opened when a virtual batch draws them). Nothing here imports torch at import time."""

from __future__ import annotations

from pathlib import Path

from normfast.data.records import read_jsonl, read_lines, read_tsv

__all__ = ["image_pairs", "load_images", "read_pairs_file", "read_probe_file"]


def read_probe_file(path: Path, text_key: str) -> tuple[list[str], list[str] | None]:
    """``(items, ids or None)`` of ``--probes``: a .txt (one item per line), .jsonl (``text_key``, ``id``) or .tsv."""
    fn = "probes file"
    if path.is_dir():
        raise ValueError(
            f"{fn}: {path} is a folder; expected a file of probe items (.txt one per line, .jsonl or .tsv)"
        )
    if path.suffix == ".jsonl":
        records = [rec for _, rec in read_jsonl(path, fn=fn, text_fields=(text_key,), key_fields=("id",))]
        items = [rec[text_key] for rec in records]
        has_ids = any("id" in rec for rec in records)
        ids = [str(rec.get("id", i)) for i, rec in enumerate(records)]
    elif path.suffix == ".tsv":
        items, ids, has_ids = [fields[0] for _, fields in read_tsv(path, fn=fn, columns=[0])], [], False
    else:
        items, ids, has_ids = [line for _, line in read_lines(path, fn=fn)], [], False
    if not items:
        raise ValueError(f"probes file {path} holds no probe items")
    return items, (ids if has_ids else None)


def read_pairs_file(path: Path, args, needs: str):
    """The virtual-batch source of ``--pairs``, as the objective needs it (``"pairs"``, ``"labels"`` or
    ``"items"``); for items (SimCSE), a pairs file gives its anchors."""
    from normfast.data.pairs import PairSource

    fn = "pairs file"
    if path.is_dir():
        raise ValueError(
            f"{fn}: {path} is a folder; expected a file (.jsonl or .tsv; for simcse also .txt, one item per line)"
        )
    if path.suffix == ".jsonl":
        if needs != "items":
            return PairSource.from_jsonl(
                path,
                anchor_key=args.anchor_key,
                positive_key=args.positive_key,
                label_key=args.label_key,
                text_key=args.text_key,
                kind=needs,
            )
        first = next(read_jsonl(path, fn=fn), (0, {}))[1]
        key = args.anchor_key if args.text_key not in first and args.anchor_key in first else args.text_key
        return PairSource.from_jsonl(path, text_key=key, kind="items")
    if needs != "items":
        return PairSource.from_tsv(path, kind=needs)
    if path.suffix == ".tsv":  # one column of items, or the anchors of a pairs file
        return PairSource.from_tsv(path, columns=(0,), kind="items")
    items = [line for _, line in read_lines(path, fn=fn)]
    if not items:
        raise ValueError(f"{fn} {path} holds no items")
    return PairSource.from_iterable(items, kind="items")


def load_images(paths: list[str], what: str = "probe") -> list:
    """The images at ``paths`` as RGB, each file closed once read; a path that is no image is one ``ValueError``."""
    from PIL import Image, UnidentifiedImageError

    images = []
    for path in paths:
        try:
            with Image.open(path) as image:
                images.append(image.convert("RGB"))
        except (OSError, UnidentifiedImageError) as exc:
            raise ValueError(f"{what} {path!r}: cannot read it as an image ({exc})") from None
    return images


def image_pairs(source, positives_are_images: bool):
    """A pairs file's image paths, opened when a virtual batch draws them: the anchors (or items) for an
    image tower, the positives too unless CLIP's text tower encodes them. (The class is made here: pair
    sources import torch, which `normfast probe --help` never loads.)"""
    from normfast.data.pairs import PairSource

    class _ImagePairs(PairSource):
        def __init__(self, source: PairSource):
            self.__dict__.update(source.__dict__)
            self.positives_are_images = positives_are_images

        def batch(self, indices):
            drawn = super().batch(indices)
            if self.kind == "items":
                return load_images(drawn, "pairs file: item")
            first, second = drawn
            first = load_images(first, "pairs file: anchor" if self.kind == "pairs" else "pairs file: item")
            if self.kind == "pairs" and self.positives_are_images:
                second = load_images(second, "pairs file: positive")
            return first, second

    return _ImagePairs(source)
