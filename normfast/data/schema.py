"""The Parquet output contract: every column and metadata key of a probe run, in one registry.

Other frontends read normfast's output, so its shape is versioned. This module is the single
place that lists it: :data:`COLUMNS` (name, Arrow type, when the column is present, meaning) and
:data:`METADATA_KEYS` (the keys of the JSON object stored under the schema metadata key
``normfast``). The docs' "Output format" page is rendered from it when the site is built
(:func:`render_markdown`, called by docs/hooks.py), and the tests check that what the engine
writes is exactly what is registered.

Adding, removing, renaming or retyping a column or a metadata key:

1. change the registry below (keep related entries together);
2. bump :data:`SCHEMA_VERSION` and add the new version with its
   :func:`schema_fingerprint` to :data:`RELEASED` and its :func:`column_fingerprint`
   to :data:`COLUMN_LAYOUTS` (``python -m normfast.data.schema --fingerprint``
   prints both), with one line in :data:`CHANGES`.

``tests/data/test_schema.py`` fails, with these steps in its message, when any of
this is forgotten.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Callable

import pyarrow as pa

from normfast.data.schema_versions import CHANGES, COLUMN_LAYOUTS, RELEASED, SCHEMA_VERSION  # noqa: F401 - re-exported

#: the Parquet schema metadata key under which a run's metadata (:data:`METADATA_KEYS`) is stored, as JSON
METADATA_KEY = b"normfast"


@dataclass(frozen=True)
class Column:
    """One output column: its name, Arrow type, when it is present, and what it holds."""

    name: str
    type: str  # an Arrow type name as ``str(pa.<type>())`` prints it
    when: str  # "always", or the condition under which the engine writes it
    meaning: str


@dataclass(frozen=True)
class MetadataKey:
    name: str
    meaning: str


_U = "SGD-like parameters (a `u` branch)"
_W = "AdamW parameters (a `w` branch)"

#: every column of a probe table, in the order the engine writes them
COLUMNS: tuple[Column, ...] = (
    # -- identity of the row
    Column("item", "int64", "always", "index of the probe input (0-based, in the order given)"),
    Column("id", "string", "always", "the input's id (from `ids=` / the probes file's `id`; else the item index)"),
    Column("text", "string", "always", "the input text (empty for non-text inputs)"),
    Column("position", "int32", "always", "token position inside the input; -1 for pooled rows"),
    Column("token_id", "int64", "always", "vocabulary id of the token; -1 for pooled rows and untokenized inputs"),
    Column(
        "token", "string", "always", "the token's text as the tokenizer writes it (e.g. `##ing`); empty for pooled rows"
    ),
    Column(
        "is_special",
        "bool",
        "always",
        "the token was added by the tokenizer (`[CLS]`, `[SEP]`, `<s>`, padding, ...); False for pooled rows. "
        "Summaries and figures leave these rows out",
    ),
    Column(
        "n_truncated",
        "int32",
        "always",
        "tokens cut off the end of the input because it was longer than the model's maximum length "
        "(metadata `max_length`), on every row of that input; 0 when it fit, and for inputs normfast does "
        "not tokenize (images, tensors, corpus windows, which are never cut)",
    ),
    # -- corpus runs (probe items that are windows of documents: `normfast probe --corpus`)
    Column("doc_id", "string", "corpus runs", "the document's id"),
    Column("window", "int32", "corpus runs", "index of the window in its document"),
    Column(
        "doc_position", "int32", "corpus runs", "the token's index among the document's tokens; -1 for special tokens"
    ),
    Column(
        "word_id", "int32", "corpus runs", "index of the word (the tokenizer's pre-tokenized word) the piece belongs to"
    ),
    Column("word", "string", "corpus runs", "that word, as written in the document"),
    Column("primary", "bool", "corpus runs", "False only for the second occurrence of a token in overlapping windows"),
    # -- the embedding and the statistics of the scale-invariant (u) branch
    Column("norm", "double", "always", "observed norm R = ‖z‖ of the raw embedding"),
    Column("D", "double", _U, "radial drift, mean over batches of ẑ·u^B"),
    Column("se_D", "double", _U, "standard error of D"),
    Column("sign_stability", "double", _U, "share of batches whose radial displacement has the sign of D"),
    Column("V2", "double", _U, "stochastic heat, Σ_B ‖u^B − ū‖² / (M − 1)"),
    Column("m2", "double", _U, "‖ū‖², the squared mean displacement"),
    Column("Q", "double", _U, "second moment m2 + V2"),
    Column(
        "se_V2",
        "double",
        _U,
        "standard error of V2 (delete-a-group jackknife over the K batch groups, "
        "K − 1 degrees of freedom); NaN without error bars",
    ),
    Column("se_Q", "double", _U, "standard error of Q (the same jackknife); NaN without error bars"),
    # -- the scale-free (w) branch and the cross term
    Column("D_w", "double", _W, "radial drift of the scale-free branch"),
    Column("se_D_w", "double", _W, "standard error of D_w"),
    Column("sign_stability_w", "double", _W, "sign stability of D_w"),
    Column("V2_w", "double", _W, "heat of the scale-free branch"),
    Column("m2_w", "double", _W, "‖w̄‖²"),
    Column("Q_w", "double", _W, "second moment of the scale-free branch"),
    Column("se_V2_w", "double", _W, "standard error of V2_w"),
    Column("se_Q_w", "double", _W, "standard error of Q_w"),
    Column(
        "C_uw",
        "double",
        "both branches (parameter groups with different optimizers)",
        "cross term, mean over batches of u·w",
    ),
    # -- the heat split into the run's common level and each row's relative heat
    #    (normfast.engine.diagnostics.relative_heat)
    Column(
        "heat_loo",
        "list<element: double>",
        "error bars (`uncertainty=True`)",
        "the heat (V2; V2_w for AdamW-only runs) recomputed without each of the K batch groups: the "
        "jackknife's replicates, from which se_heat_rel and a type-level error bar (`normfast aggregate`) "
        "are computed",
    ),
    Column(
        "heat_rel",
        "double",
        "always",
        "relative heat: log(V2) minus the reference level (metadata `heat_reference`: the median log V2 of "
        "valid non-special rows: the run's own, or a Prober's pair-source items); natural log, 0.2 is ×1.22",
    ),
    Column(
        "se_heat_rel",
        "double",
        "always",
        "standard error of heat_rel (the delete-a-group jackknife, the reference recomputed without each "
        "group): the error of the row's place in the ranking, without the common factor that moves every "
        "row's V2 together (that one is `heat_reference.se_log_level`); NaN without error bars",
    ),
    # -- the law
    Column("kappa", "double", "always", "radial damping ẑ·(J θ_decayed)/R"),
    Column("r_eq", "double", "always", "equilibrium norm: the largest positive root of the law's quartic (NaN: none)"),
    Column("r_eq_heat", "double", "always", "the same with the drift set to zero (heat-only law)"),
    Column(
        "r_eq_lo",
        "double",
        "always",
        "lower end of the 95% interval of r_eq (jackknife over the K groups, "
        "Student t with K − 1 degrees of freedom); NaN without error bars",
    ),
    Column("r_eq_hi", "double", "always", "upper end of the 95% interval of r_eq"),
    Column("r_eq_heat_lo", "double", "always", "lower end of the 95% interval of r_eq_heat"),
    Column("r_eq_heat_hi", "double", "always", "upper end of the 95% interval of r_eq_heat"),
    Column(
        "r_eq_snapshot",
        "double",
        "`snapshot=True` (`--snapshot`)",
        "single-snapshot predictor: the stationary norm from a virtual continuation of the model from this "
        "snapshot (shrunk trajectory drift, heat + curvature heat); scope in `normfast.engine.trajectory.snapshot`",
    ),
    Column(
        "r_eq_snapshot_lo",
        "double",
        "`snapshot=True`",
        "lower end of its 95% interval: the predictor recomputed without each of the continuation's "
        "contiguous segments in turn (jackknife, Student t with segments − 1 degrees of freedom); the "
        "continuation's sampling error only, not the law's error (E1 measures the coverage)",
    ),
    Column("r_eq_snapshot_hi", "double", "`snapshot=True`", "upper end of that interval"),
    Column(
        "D_snapshot",
        "double",
        "`snapshot=True`",
        "the drift it used (D; AdamW: D_w), averaged along the virtual trajectory and shrunk by empirical Bayes",
    ),
    Column(
        "Q_snapshot",
        "double",
        "`snapshot=True`",
        "the heat it used (Q; AdamW: Q_w), trajectory mean plus the curvature heat",
    ),
    Column(
        "norm_continued",
        "double",
        "`snapshot=True`",
        "the plain baseline beside r_eq_snapshot: sqrt of the mean R² over the measured steps of the same "
        "virtual continuation (the norm the continued copy kept); r_eq_snapshot predicts no better than it, "
        "its use is the decomposition into heat, drift and decay",
    ),
    Column("norm_continued_lo", "double", "`snapshot=True`", "lower end of its 95% interval (the same jackknife)"),
    Column("norm_continued_hi", "double", "`snapshot=True`", "upper end of that interval"),
    Column("n_pos_roots", "int8", "always", "number of positive roots (> 1: bistable)"),
    # -- status
    Column("valid", "bool", "always", "the row's statistics are finite and usable"),
    Column(
        "reason",
        "string",
        "always",
        "`ok`, or why the row is not valid: `zero_norm`, `non_finite_embedding`, "
        "`non_finite_displacement`, `non_finite_kappa`, `no_positive_root`",
    ),
    # -- the regime check (normfast.engine.diagnostics.regime): does the law apply to this row?
    Column(
        "kappa_exempt",
        "double",
        "always",
        "radial grip of the probed parameters exempt from decay, ẑ·(J θ_exempt)/R (0 when none is exempt); "
        "when it outweighs kappa, the exempt parameters set the scale and the law has no equilibrium",
    ),
    Column(
        "drift_to_heat",
        "double",
        "always",
        "|D| / sqrt(2λκηQ): the drift against the heat (below 0.3: r_eq within about 15% of r_eq_heat)",
    ),
    Column(
        "regime",
        "string",
        "always",
        "`law applicable`, `heat-dominated` (r_eq_heat is the prediction), `not applicable` "
        "(r_eq is no prediction; V2 and D are still measured) or `objective saturated` (the virtual "
        "loss is near 0: r_eq is no finding about the row; its relative heat still ranks it)",
    ),
    Column(
        "regime_reason",
        "string",
        "always",
        "the check that decided the row: `invalid`, `no_update`, `no_decay`, `undecayed_sets_scale`, "
        "`kappa_nonpositive`, `kappa_small`, `objective_saturated`, `drift_small`, `drift_resolved`, "
        "`drift_unresolved`",
    ),
)

#: every key of the run metadata (``normfast.read_metadata(path)``)
METADATA_KEYS: tuple[MetadataKey, ...] = (
    MetadataKey("schema_version", "version of this format (an int; absent: 1)"),
    MetadataKey("model", "the model as given (spec string or class name)"),
    MetadataKey(
        "model_fingerprint",
        "content hash of the model: every parameter and buffer, by name, with its shape, dtype and every byte",
    ),
    MetadataKey(
        "tokenizer_fingerprint",
        "content hash of the tokenizer's whole state (a transformers tokenizer's saved files: vocabulary, "
        "normalizer, lowercasing, special tokens); null without a tokenizer",
    ),
    MetadataKey(
        "encoder_settings",
        "every choice of the adapter that changes an embedding (`Encoder.settings()`): the adapter, the head, "
        "a hash of its module tree, and per family the pooling, lowercasing, staging and configuration hash "
        "(transformers), the projection and the modules.json modules not run (sentence-transformers), the "
        "tower, projection and preprocessing hash (open_clip), the pooling and collate functions (nn.Module)",
    ),
    MetadataKey(
        "pair_encoder",
        "the encoder of the positive side, when it is another model (open_clip's other tower): its "
        "`settings`, `model_fingerprint` and `tokenizer_fingerprint`; null otherwise",
    ),
    MetadataKey(
        "encoder_note",
        "how the model was wrapped, when normfast decided something for the user "
        "(e.g. an `nn.Sequential` split into stages with its last Linear as the head); "
        "null otherwise",
    ),
    MetadataKey("objective", "objective name (`infonce`, `clip`, `supcon`, `simcse`, or a user objective's name)"),
    MetadataKey("temperature", "the objective's temperature; null for an objective without one"),
    MetadataKey(
        "objective_settings", 'every setting of the objective, e.g. `{"temperature": 0.05, "symmetric": false}`'
    ),
    MetadataKey("optimizer", "`sgd`, `adamw`, or `{regex: preset}` for parameter groups"),
    MetadataKey("lr", "η of the law"),
    MetadataKey("weight_decay", "λ of the law (decoupled)"),
    MetadataKey("momentum", "heavy-ball momentum β (the law uses η/(1−β))"),
    MetadataKey("M", "number of virtual batches of the heat, as run (with `target_rse`: the M adaptive M chose)"),
    MetadataKey("M_initial", "number of heat batches asked for (`batches`; adaptive M starts there)"),
    MetadataKey(
        "M_D",
        "number of virtual batches of the drift (its mean direction); null: the drift of the M heat batches, per batch",
    ),
    MetadataKey("groups", "K, the groups of batches behind the standard errors"),
    MetadataKey("uncertainty", "whether the run has error bars (the grouped estimators; false: the bare estimates)"),
    MetadataKey("batch_size", "pairs / items per virtual batch"),
    MetadataKey("seed", "seed of the batch draw and dropout"),
    MetadataKey("mode", "`head` or `jvp`, as run"),
    MetadataKey("output", "`pooled` or `tokens`"),
    MetadataKey("params", "the probed-parameter selector as given"),
    MetadataKey("n_probed_parameters", "number of parameter tensors probed"),
    MetadataKey("cut_stage", "first encoder stage that owns a probed parameter (the stages before it are frozen)"),
    MetadataKey("branch", "`u`, `w` or `uw`: which statistics columns are present"),
    MetadataKey("n_items", "number of probe inputs"),
    MetadataKey("n_pairs", "size of the virtual-batch source"),
    MetadataKey("chunk_size", "probe inputs per streamed chunk"),
    MetadataKey(
        "max_length",
        "the longest input, in tokens, the encoder keeps (longer ones are cut to it and "
        "counted in `n_truncated`); null when it truncates nothing",
    ),
    MetadataKey("config", "the whole `ProbeConfig` as a JSON object (see its docstring)"),
    MetadataKey(
        "input_fingerprints",
        "hashes of the probes, the pair source, the ids and given second moments "
        "(in the resume key; a refused resume names which changed)",
    ),
    MetadataKey(
        "spec_fingerprint",
        "hash of the resume key: the allow-list of what the rows depend on (below); a resume compares it",
    ),
    MetadataKey("versions", "library versions (normfast, torch, numpy, pyarrow, python, ...)"),
    MetadataKey("device", "where the model ran"),
    MetadataKey("world_size", "number of processes of a sharded run (1: not sharded)"),
    MetadataKey("seconds", "wall time of the probe loop"),
    MetadataKey(
        "corpus",
        "corpus runs: the windowing and its counts (documents, windows, content tokens, token rows, max_length, "
        "window, stride, lowercase, special tokens added)",
    ),
    MetadataKey(
        "adaptive",
        "adaptive M only (`target_rse`): the target, the quantile, and every round's M and quantile of se(V2)/V2",
    ),
    MetadataKey(
        "snapshot",
        "`snapshot=True` only: the virtual trajectory's steps, the relaxation times asked "
        "and covered, the median κ at the snapshot, the shrinkage (weight, error and signal "
        "variance, the regression of drift on heat), the intervals' jackknife segments "
        "(`interval_segments`), seconds, and the predictor's scope",
    ),
    MetadataKey(
        "heat_reference",
        "the relative heat's reference level: `source` (`run`: the run's own rows; `pairs`: a Prober's, "
        "fixed with its directions: `items` items of the pair source probed once for this `output`), "
        "`column` (the heat), `rows` (valid non-special rows with a positive heat), `log_level` (median of "
        "their log heat), `level` (its exp), `se_log_level` (standard error of the common level, log units: "
        "the factor every row's heat shares; the groups' jackknife `se_log_level_groups` and the heat pool's "
        "own `se_log_level_pool` in quadrature) and `loo_log_levels` (the level without each of the K groups)",
    ),
    MetadataKey(
        "regime",
        "the run's regime check: `regime` (the class of most valid rows), `reason`, the "
        "share of rows in each class (`fractions`), the thresholds, and a sentence in plain "
        "words (see `normfast.engine.diagnostics.regime`)",
    ),
    MetadataKey(
        "objective_health",
        "the virtual objective's health over every batch the run computed: `batches`, `groups`, `loss_mean` "
        "± `loss_se` (over the K groups), `batch_size`, `chance` (the objective's chance level at the batch size, "
        "e.g. log batch size; null for a loss without one) and its `chance_formula`, `loss_to_chance`, "
        "`grad_norm` (p10/median/p90 of the gradient norm over the probed parameters), `saturated` (the "
        "objective's verdict), its loss-to-chance threshold `saturated_below` (null without one) and the rule "
        "in words, `saturation` (see `normfast.engine.diagnostics.health`)",
    ),
    MetadataKey(
        "heat_sampling",
        "how the heat's M batches were chosen: `asked` (the setting), `method` (`energy`: drawn from the M_D "
        "drift batches by their gradient energy and weighted; `uniform`: the first M, unweighted), `note` (why "
        "the plain draw ran when energy was asked for), and for `energy` the `proposal`, the `pool` (M_D), the "
        "`draws` and `distinct_batches`, the weights' `effective_sample_size` (Kish's; small when the draws mix "
        "batches of high and low energy, which is how the draw steadies the heat, so not the estimate's error: "
        "that is se_V2) and `pool_level_se` (the pool's own error of the heat's level, log units, part of every "
        "interval)",
    ),
    MetadataKey(
        "pair_source",
        "what the virtual batches are drawn from: `kind` (`pairs`, `labels`, `items`), `n` (how many) "
        "and `what` (in words, e.g. `sentences of the corpus`)",
    ),
)

COLUMN_NAMES = tuple(c.name for c in COLUMNS)
_BY_NAME = {c.name: c for c in COLUMNS}


def schema_fingerprint(
    columns: Iterable[Column] = COLUMNS, metadata_keys: Iterable[MetadataKey] = METADATA_KEYS
) -> str:
    """Hash of the column names and types (in order) and of the metadata key names."""
    blob = json.dumps(
        {"columns": [[c.name, c.type] for c in columns], "metadata": [k.name for k in metadata_keys]}
    ).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def column_fingerprint(columns: Iterable[Column] = COLUMNS) -> str:
    """Hash of the column names and types, in order: the layout of a run's rows (a resume compares it,
    :mod:`normfast.data.resume_key`; a version that adds only metadata keys keeps it)."""
    blob = json.dumps([[c.name, c.type] for c in columns]).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def column(name: str) -> Column:
    """The registered column ``name`` (KeyError naming the registry when it is not registered)."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"column {name!r} is not in the output registry normfast.data.schema.COLUMNS") from None


def registry_problems(schema: pa.Schema, columns: tuple[Column, ...], where: str) -> list[str]:
    """Problems with a table's columns against a column registry ``columns`` (named ``where`` in
    the messages): unregistered columns, other types, another order. Empty: it conforms."""
    by_name = {c.name: c for c in columns}
    problems = []
    for field in schema:
        if field.name not in by_name:
            problems.append(f"column {field.name!r} ({field.type}) is not registered in {where}")
        elif str(field.type) != by_name[field.name].type:
            problems.append(f"column {field.name!r} is {field.type}, registered as {by_name[field.name].type}")
    order = [c.name for c in columns if c.name in schema.names]
    if not problems and list(schema.names) != order:
        problems.append(f"columns out of the registered order: {list(schema.names)} (registered: {order})")
    return problems


def unregistered_keys(metadata: dict[str, Any], keys: tuple[MetadataKey, ...], where: str) -> list[str]:
    """Problems with metadata keys against a key registry ``keys`` (empty: every key is registered)."""
    known = {k.name for k in keys}
    return [f"metadata key {k!r} is not registered in {where}" for k in metadata if k not in known]


def check_table(schema: pa.Schema) -> list[str]:
    """Problems with a probe table's columns against the registry (empty: it conforms)."""
    return registry_problems(schema, COLUMNS, "normfast/data/schema.py COLUMNS")


def check_metadata(metadata: dict[str, Any]) -> list[str]:
    """Problems with a run's metadata keys against the registry (empty: it conforms)."""
    return unregistered_keys(metadata, METADATA_KEYS, "normfast/data/schema.py METADATA_KEYS")


# ----------------------------------------------------------------------------
# the rendered tables (the docs' Output format page; any file with these markers)
# ----------------------------------------------------------------------------


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def column_rows(columns: tuple[Column, ...]) -> list[str]:
    """A column registry as a Markdown table (header included)."""
    return [
        "| column | type | present | meaning |",
        "|---|---|---|---|",
        *(f"| `{c.name}` | {c.type} | {_cell(c.when)} | {_cell(c.meaning)} |" for c in columns),
    ]


def key_rows(keys: tuple[MetadataKey, ...], header: str = "metadata key") -> list[str]:
    """A key registry as a Markdown table (header included)."""
    return [f"| {header} | meaning |", "|---|---|", *(f"| `{k.name}` | {_cell(k.meaning)} |" for k in keys)]


def render_markdown() -> str:
    """The "Output format" tables (columns, then metadata keys), as the docs page shows them."""
    lines = [
        f"Schema version {SCHEMA_VERSION} (`normfast.data.schema.SCHEMA_VERSION`).",
        "",
        *column_rows(COLUMNS),
        "",
        *key_rows(METADATA_KEYS),
    ]
    return "\n".join(lines)


def fingerprint_main(module: str, fingerprints: Callable[[], str], argv: list[str] | None = None) -> int:
    """``python -m MODULE --fingerprint`` of a format's registry: print ``fingerprints()`` (what to add to
    its released versions when it changes)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv != ["--fingerprint"]:
        print(f"usage: python -m {module} --fingerprint", file=sys.stderr)
        return 2
    print(fingerprints())
    return 0


def main(argv: list[str] | None = None) -> int:
    def fingerprints() -> str:
        return f"RELEASED: {schema_fingerprint()}\nCOLUMN_LAYOUTS: {column_fingerprint()}"

    return fingerprint_main("normfast.data.schema", fingerprints, argv)


if __name__ == "__main__":
    raise SystemExit(main())
