"""The resume key: what a probe run's rows depend on, as an explicit allow-list of its metadata.

A run resumes (``resume=True``, CLI ``--resume``) when every entry of :data:`PROBE_RESUME_KEY` is the
same as when it started; a finished run is returned as it is under the same rule. A refusal names the
entries that differ (and the model as given, when it changed too). Everything else in the metadata --
library versions, the device, descriptions in words, the run's outcomes, and any key a later normfast
adds -- may differ: new metadata never makes an unfinished run unresumable. An entry belongs here when
the rows depend on it; the docs' "Output format" page renders the list beside the columns and the
metadata keys (:func:`render_markdown`, called by docs/hooks.py).

The comparison projects both runs' records through the list (the work folder's ``run.json`` keeps the
whole record, the finished file its metadata), so a run written before an entry was added or a
metadata key removed is compared on what both record. The format itself enters through its column
layout, not its ``schema_version``: a version that only adds metadata keys writes the same rows.

The key of the training monitor's folder is its own settings, whole (:data:`WHOLE_SPEC`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from normfast.data.io import describe_spec_change, fingerprint
from normfast.data.schema import METADATA_KEYS, MetadataKey, key_rows
from normfast.data.schema_versions import COLUMN_LAYOUTS

__all__ = ["KeyEntry", "PROBE_RESUME_KEY", "THROUGH", "ResumeKey", "WHOLE_SPEC", "render_markdown"]


def _column_layout(spec: Mapping[str, Any]) -> str:
    """The column layout of the format a record was written in (an older version's, whose layout is not
    registered, stands for itself: it compares unequal to every registered one)."""
    version = spec.get("schema_version", 1)
    return COLUMN_LAYOUTS.get(version, f"the columns of schema_version {version}")


@dataclass(frozen=True)
class KeyEntry:
    """One entry of a resume key: a metadata key (or a value derived from the record: ``value``) and why
    the rows depend on it."""

    name: str
    why: str
    value: Callable[[Mapping[str, Any]], Any] | None = None


@dataclass(frozen=True)
class ResumeKey:
    """What a resume compares in a run's record (``entries``; None: the whole record), how it is hashed
    (:meth:`fingerprint`), and how a difference is named (:meth:`describe`; ``named_with``: keys left out
    of the comparison that a refusal still names when they changed too, so that it reads as the user
    thinks of the run)."""

    entries: tuple[KeyEntry, ...] | None
    named_with: tuple[str, ...] = ()

    def of(self, spec: Mapping[str, Any]) -> dict[str, Any]:
        """The entries of ``spec`` the key compares (those it records; a derived one always)."""
        plain = json.loads(json.dumps(dict(spec), default=str))
        if self.entries is None:
            return plain
        out = {}
        for e in self.entries:
            if e.value is not None:
                out[e.name] = e.value(plain)
            elif e.name in plain:
                out[e.name] = plain[e.name]
        return out

    def fingerprint(self, spec: Mapping[str, Any]) -> str:
        """The key's hash (numbers by their value: ``2048`` and ``2048.0`` are one setting)."""
        return fingerprint(self.of(spec))

    def describe(self, old: Mapping[str, Any], new: Mapping[str, Any]) -> str:
        """The key's entries that differ between two records, in words (for a refused resume)."""
        a, b = self.of(old), self.of(new)
        for name in self.named_with:
            if name in old and name in new and old[name] != new[name]:
                a[name], b[name] = old[name], new[name]
        return describe_spec_change(a, b)


#: the whole record is the key (the training monitor's settings)
WHOLE_SPEC = ResumeKey(None)

_PLAN = (
    "the run's plan as resolved against the model (`mode='auto'` made `head` or `jvp`, the probed "
    "parameters and their branches): a normfast that resolves it otherwise does not mix its rows with these"
)

#: what a probe run's rows depend on (the docs' Output format page lists it, with the reasons)
PROBE_RESUME_KEY = ResumeKey(
    (
        KeyEntry(
            "columns",
            "the output's column layout, from `schema_version` (`normfast.data.schema_versions.COLUMN_LAYOUTS`): "
            "the finished chunks hold these columns; a version that only adds metadata keys keeps the layout",
            _column_layout,
        ),
        KeyEntry("model_fingerprint", "every byte of every parameter and buffer of the model"),
        KeyEntry("tokenizer_fingerprint", "the tokenizer's whole state: the token ids of every input"),
        KeyEntry(
            "encoder_settings",
            "every choice of the adapter that changes an embedding (pooling, head, projection, tower, "
            "lowercasing, the model's configuration and module tree)",
        ),
        KeyEntry("pair_encoder", "the positives' encoder (settings, weights, tokenizer) when it is another model"),
        KeyEntry("max_length", "the longest input the encoder keeps: longer ones are cut"),
        KeyEntry("objective", "the virtual objective the directions come from"),
        KeyEntry("objective_settings", "its settings (temperature, symmetric, ...)"),
        KeyEntry(
            "config",
            "every `ProbeConfig` setting as checked: the law's η, λ and β, the presets, M, M_D, K, the batch "
            "size, the seed and the explicit batches; the chunk size (the unit of a resume, and adaptive M's "
            "pilot); the memory budget and the directions per pass (the loop order, the passes' batching, "
            "equal only up to float rounding, and the directions-outer state kept in the work folder)",
        ),
        KeyEntry("mode", _PLAN),
        KeyEntry("branch", "the branches of the statistics (`u`, `w`, `uw`): which columns a row has"),
        KeyEntry("cut_stage", _PLAN),
        KeyEntry("n_probed_parameters", _PLAN),
        KeyEntry(
            "input_fingerprints",
            "the content of the probe items, of the pairs the virtual batches draw (every pair with the "
            "snapshot, whose trajectory draws its own), of the ids and of given second moments",
        ),
        KeyEntry("n_items", "the number of probe items: the chunks' layout"),
        KeyEntry("n_pairs", "the size of the pair source: the virtual batches are drawn from it"),
        KeyEntry("corpus", "corpus runs: the windowing (window, stride, max_length, special tokens)"),
    ),
    named_with=("model",),
)


#: metadata keys the key holds through another of its entries: the format's version by its column layout, and
#: copies, at the top of the metadata, of settings it holds in ``config`` or ``objective_settings``
THROUGH = {
    "schema_version": "columns",
    "temperature": "objective_settings",
    **{
        k: "config"
        for k in (
            "optimizer",
            "lr",
            "weight_decay",
            "momentum",
            "M_initial",
            "M_D",
            "groups",
            "uncertainty",
            "batch_size",
            "seed",
            "output",
            "params",
            "chunk_size",
        )
    },
}


def render_markdown() -> str:
    """The resume key as the docs' Output format page shows it: its entries with the reasons, the metadata
    keys it holds through them, and those it leaves out."""
    entries = PROBE_RESUME_KEY.entries or ()
    keyed = {e.name for e in entries}
    left = [k.name for k in METADATA_KEYS if k.name not in keyed and k.name not in THROUGH]
    through: dict[str, list[str]] = {}
    for name, entry in THROUGH.items():
        through.setdefault(entry, []).append(f"`{name}`")
    rows = key_rows(tuple(MetadataKey(e.name, e.why) for e in entries), header="resume key entry")
    return "\n".join(
        [
            *rows,
            "",
            "In the key through another entry: "
            + "; ".join(f"{', '.join(names)} (`{entry}`)" for entry, names in through.items())
            + ". Not in the key (a resume ignores them, and metadata a later normfast adds joins them unless "
            "the rows depend on it): " + ", ".join(f"`{name}`" for name in left) + ". The model as given "
            "(`model`) is named in a refusal when it changed beside an entry of the key.",
        ]
    )
