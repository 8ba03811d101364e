"""``ProbeResult``: a probe run's table (in memory or lazily over Parquet files) and its metadata."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa

from normfast.data.io import open_run


class ProbeResult:
    """One row per probe item; ``table`` is a ``pyarrow.Table``, ``metadata`` the run's settings.

    A result backed by files (a run written with ``out=``, or :meth:`load`) is
    lazy: ``len``, :meth:`column`, :attr:`column_names` and :meth:`iter_batches`
    read the Parquet footers, one column, or one batch at a time, so a result of
    any size costs no memory until asked; :attr:`table` reads everything (and
    keeps it). ``path`` is the Parquet file or the manifest of a sharded run.
    """

    def __init__(self, table: pa.Table, metadata: Mapping[str, Any], path: Path | None = None):
        self._table = table
        self._files: list[Path] | None = None
        self.metadata = dict(metadata)
        self.path = path

    @classmethod
    def from_files(
        cls, files: Sequence[str | Path], metadata: Mapping[str, Any], path: str | Path | None = None
    ) -> "ProbeResult":
        """A lazy result over Parquet files holding the rows in item order (nothing is read yet)."""
        files = [Path(f) for f in files]
        if not files:
            raise ValueError("ProbeResult.from_files: expected at least one Parquet file, got none")
        result = cls(None, metadata, Path(path) if path is not None else files[0])  # type: ignore[arg-type]
        result._files = files
        return result

    @classmethod
    def load(cls, path: str | Path) -> "ProbeResult":
        """Open a run: a Parquet file written by :func:`probe`, a sharded run's ``.manifest.json``,
        or a folder holding one of them."""
        from normfast.data.manifest import resolve_run

        path = resolve_run(path)
        return cls.from_files(*open_run(path), path)

    @property
    def files(self) -> list[Path] | None:
        """The Parquet files behind a lazy result, in item order (None for an in-memory one)."""
        return None if self._files is None else list(self._files)

    @property
    def table(self) -> pa.Table:
        """The whole table (read from the files on first access for a lazy result)."""
        if self._table is None:
            from normfast.data.io import read_table

            self._table = read_table(self._files)
        return self._table

    @table.setter
    def table(self, value: pa.Table) -> None:
        self._table = value

    @property
    def schema(self) -> pa.Schema:
        if self._table is not None:
            return self._table.schema
        import pyarrow.parquet as pq

        return pq.read_schema(self._files[0])

    @property
    def column_names(self) -> list[str]:
        return list(self.schema.names)

    def __len__(self) -> int:
        if self._table is not None:
            return self._table.num_rows
        from normfast.data.io import count_rows

        return count_rows(self._files)

    def column(self, name: str) -> np.ndarray:
        if self._table is not None:
            return self._table.column(name).to_numpy(zero_copy_only=False)
        if name not in self.column_names:
            raise KeyError(f"ProbeResult.column: no column {name!r}; columns are {self.column_names}")
        from normfast.data.io import read_table

        return read_table(self._files, columns=[name]).column(name).to_numpy(zero_copy_only=False)

    def iter_batches(self, columns: Sequence[str] | None = None, batch_size: int = 65536):
        """Stream the rows in item order as ``pyarrow.RecordBatch`` es of at most ``batch_size`` rows."""
        if self._table is not None:
            table = self._table if columns is None else self._table.select(list(columns))
            yield from table.to_batches(max_chunksize=batch_size)
            return
        from normfast.data.io import iter_batches

        yield from iter_batches(self._files, columns=columns, batch_size=batch_size)

    def to_pandas(self):
        """The table as a ``pandas.DataFrame`` (needs pandas: ``pip install "normfast[pandas]"``)."""
        try:
            import pandas  # noqa: F401
        except ImportError:
            raise ImportError(
                "ProbeResult.to_pandas needs pandas, which normfast does not install by default: "
                'pip install "normfast[pandas]" (or pip install pandas). The same data is '
                "available without it as result.table (a pyarrow.Table)."
            ) from None
        return self.table.to_pandas()

    @property
    def heat_column(self) -> str:
        return "V2" if "V2" in self.column_names else "V2_w"

    @property
    def drift_column(self) -> str:
        return "D" if "D" in self.column_names else "D_w"

    def types(self, by: str = "token", *, min_count: int = 1, casefold: bool = False, **options: Any) -> pa.Table:
        """Per-type statistics of a token-level run: one row per vocabulary entry (``by="token"``) or
        whole word (``by="word"``, corpus runs), with the count of occurrences and the mean, spread
        and standard error of every quantity and of the relative heat -- the table ``normfast
        aggregate RUN --by token|word`` writes (:func:`normfast.engine.report.aggregate.aggregate`;
        ``options``: ``quantities``, ``batch_size``, ``progress``). Most frequent first; rank it by
        ``heat_rel_mean`` (see :func:`normfast.engine.report.ranking.rank_types`)."""
        from normfast.engine.report.aggregate import aggregate

        return aggregate(self, by=by, min_count=min_count, casefold=casefold, **options)

    def summary(self) -> dict[str, Any]:
        from normfast.engine.report.summary import summarize

        return summarize(self)

    def format_summary(self) -> str:
        from normfast.engine.report.summary import format_summary

        return format_summary(self)

    def plots(self, outdir: str | Path, prefix: str = "probe") -> list[Path]:
        from normfast.engine.report.figures import make_plots

        return make_plots(self, outdir, prefix=prefix)

    def to_html(self, path: str | Path, **options: Any) -> Path:
        """Write the run's page: one self-contained HTML file (no network needed) with the header
        in words, the type and row tables, the text colored by a statistic and the figures.

        ``options``: ``stat``, ``docs``, ``min_count``, ``max_rows``, ``max_types``, ``seed``,
        ``notes`` (see :func:`normfast.engine.report.page.page_html`). Returns ``path``.
        """
        from normfast.engine.report.page import write_page

        return write_page(self, path, **options)

    def view(self, height: int = 900, **options: Any):
        """The page inline in a notebook (an object whose ``_repr_html_`` is the page in an iframe)."""
        from normfast.engine.report.page import InlinePage, page_html

        return InlinePage(page_html(self, **options), height=height)

    def compare(self, other: "ProbeResult", **options: Any) -> pa.Table:
        """This run (A) against ``other`` (B) over the same inputs, type by type: the differences
        ``B − A`` of ``heat_rel``, the drift and ``r_eq`` with their standard errors, z and p, and the
        Benjamini-Hochberg flags of what changed (``normfast compare``; refused in one line when the
        runs' inputs differ).

        ``options``: ``q`` (the false-discovery rate, default 0.05), ``min_count`` (see
        :func:`normfast.engine.report.compare.compare`). Returns the table (a ``pyarrow.Table``).
        """
        from normfast.engine.report.compare import compare

        return compare(self, other, **options)

    def _repr_html_(self) -> str:
        from normfast.engine.report.page import summary_html

        return summary_html(self)

    def __repr__(self) -> str:
        return (
            f"ProbeResult({len(self)} rows, model={self.metadata.get('model')!r}, "
            f"objective={self.metadata.get('objective')!r}, M={self.metadata.get('M')})"
        )


# ----------------------------------------------------------------------------
