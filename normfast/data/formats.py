"""Reading a file of a versioned format: its version checked (:func:`format_version`, used by every
format normfast writes: a probe run's, a manifest's, a training monitor's), a probe run's metadata
checked (:func:`run_metadata`) and its columns' kinds against the registry
(:func:`check_column_types`). Each reader of a format comes through one of these, so a newer format
is refused, an older one read with a warning, and a damaged one named, in the same words everywhere."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import pyarrow as pa

from normfast.data.schema import COLUMNS, SCHEMA_VERSION

__all__ = ["check_column_types", "format_version", "run_metadata"]

_BY_NAME = {c.name: c for c in COLUMNS}


def format_version(
    metadata: Mapping[str, Any],
    source: Any,
    *,
    key: str,
    current: int,
    what: str,
    older: str,
    absent: int | None = None,
    stacklevel: int = 2,
) -> int:
    """The format version a file's metadata records under ``key``, checked against ``current`` (the
    version this normfast writes): a newer one is refused (``ValueError``: the file's version, the
    versions read here, upgrade normfast), an older one is read with a ``UserWarning`` that says so,
    and one that is not a positive integer is refused as damaged. ``absent``: the version of a file
    without the key (None: such a file is damaged). ``what`` names the format in the messages
    (``output format``); ``older`` is what the warning says of an older version after "read as it
    is; " (what it lacks). Every message is one line starting with ``source``."""
    version = metadata.get(key, absent)
    if version is None:
        raise ValueError(f"{source}: its metadata has no {key}: the file is damaged or was not written by normfast")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ValueError(
            f"{source}: its metadata's {key} is {version!r}, not an integer version: the file is damaged or "
            f"was not written by normfast"
        )
    if version > current:
        raise ValueError(
            f"{source}: {what} version {version}, written by a newer normfast; this normfast reads versions up "
            f"to {current}: upgrade normfast (pip install -U normfast) to read it"
        )
    if version < current:
        warnings.warn(
            f"{source}: {what} version {version} (this normfast writes {current}): read as it is; {older}",
            UserWarning,
            stacklevel=stacklevel + 1,
        )
    return version


def run_metadata(blob: Any, source: Any, *, stacklevel: int = 2) -> dict[str, Any]:
    """A probe run's metadata as read from ``source`` (the parsed JSON), checked: a JSON object, of a
    version this normfast reads (:func:`format_version`; a file without ``schema_version`` is version 1).
    Metadata with a ``format`` of its own (a training monitor's) is returned for its reader to check,
    and so is a per-type table's of ``normfast aggregate`` (not a run: its readers refuse or handle it)."""
    if not isinstance(blob, dict):
        raise ValueError(
            f"{source}: its normfast metadata is a {type(blob).__name__}, not a JSON object: the file is damaged "
            f"or was not written by normfast"
        )
    if "format" not in blob and "aggregation" not in blob:
        format_version(
            blob,
            source,
            key="schema_version",
            current=SCHEMA_VERSION,
            what="output format",
            older="what later versions added is absent (normfast.data.schema.CHANGES lists it)",
            absent=1,
            stacklevel=stacklevel + 1,
        )
    return blob


def _kind_matches(registered: str, actual: pa.DataType) -> bool:
    """Whether a column's Arrow type can be read as its registered type (integer widths, string and
    large string, a column of nulls: the same kind)."""
    if pa.types.is_null(actual) or pa.types.is_dictionary(actual) and _kind_matches(registered, actual.value_type):
        return True
    if registered == "double":
        return pa.types.is_floating(actual) or pa.types.is_integer(actual)
    if registered.startswith("int"):
        return pa.types.is_integer(actual)
    if registered == "string":
        return pa.types.is_string(actual) or pa.types.is_large_string(actual)
    if registered == "bool":
        return pa.types.is_boolean(actual)
    if registered.startswith("list<"):
        return (pa.types.is_list(actual) or pa.types.is_large_list(actual)) and (
            pa.types.is_floating(actual.value_type) or pa.types.is_null(actual.value_type)
        )
    return str(actual) == registered


def check_column_types(schema: pa.Schema, source: Any) -> None:
    """Refuse (``ValueError``, one line naming ``source``) a registered column whose values are of another
    kind than the registry's (``V2`` as strings); columns the registry does not know are left alone."""
    for field in schema:
        registered = _BY_NAME.get(field.name)
        if registered is not None and not _kind_matches(registered.type, field.type):
            raise ValueError(
                f"{source}: column {field.name!r} holds {field.type} values, expected {registered.type}: the file "
                f"was changed after normfast wrote it, or was not written by normfast"
            )
