"""The probe loop's chunks, watched or broken from a test: a run interrupted at a chunk (the chunks
before it written, as a killed run leaves them) and the chunks a run computes (a resumed run skips
the finished ones). The loop's per-chunk function is patched in one place, here."""

from __future__ import annotations

import contextlib
from typing import Iterator


@contextlib.contextmanager
def _chunk_hook(hook) -> Iterator[None]:
    import normfast.engine.runner.chunks as engine

    real = engine._jvp_chunk

    def watched(run, items, c, *a, **k):
        hook(c)
        return real(run, items, c, *a, **k)

    engine._jvp_chunk = watched
    try:
        yield
    finally:
        engine._jvp_chunk = real


def interrupted_at(chunk: int, error: BaseException | None = None):
    """Inside: the probe loop raises ``error`` (default ``KeyboardInterrupt("injected")``) when it reaches
    chunk ``chunk``; the loop is restored on the way out."""

    def hook(c: int) -> None:
        if c == chunk:
            raise error if error is not None else KeyboardInterrupt("injected")

    return _chunk_hook(hook)


@contextlib.contextmanager
def chunks_computed() -> Iterator[list[int]]:
    """Inside: the list of the chunks the probe loop computes, in order."""
    seen: list[int] = []
    with _chunk_hook(seen.append):
        yield seen
