"""The resume key (normfast.data.resume_key): an explicit allow-list of a run's metadata, documented on the
docs' Output format page, blind to metadata outside it and naming what changed inside it."""

from __future__ import annotations

from pathlib import Path

from normfast.data import resume_key, schema
from normfast.data.resume_key import PROBE_RESUME_KEY, THROUGH, WHOLE_SPEC

ROOT = Path(__file__).resolve().parents[2]

RECORD = {
    "schema_version": schema.SCHEMA_VERSION,
    "model": "m",
    "model_fingerprint": "aaaa",
    "encoder_note": None,
    "objective": "infonce",
    "objective_settings": {"temperature": 0.05},
    "temperature": 0.05,
    "lr": 0.001,
    "config": {"lr": 0.001, "seed": 0, "betas": (0.9, 0.999)},
    "input_fingerprints": {"probes": "p", "pairs": "q"},
    "n_items": 3,
}


def test_every_entry_is_a_registered_metadata_key_and_the_rest_is_accounted_for():
    registered = {k.name for k in schema.METADATA_KEYS}
    names = [e.name for e in PROBE_RESUME_KEY.entries]
    assert len(names) == len(set(names))
    derived = {e.name for e in PROBE_RESUME_KEY.entries if e.value is not None}
    assert derived == {"columns"}  # the format, by its column layout (from schema_version)
    assert set(names) - derived <= registered
    assert set(THROUGH) <= registered and set(THROUGH.values()) <= set(names)
    assert not set(THROUGH) & set(names)


def test_the_column_layout_is_registered_for_this_version():
    assert schema.COLUMN_LAYOUTS.get(schema.SCHEMA_VERSION) == schema.column_fingerprint(), (
        "the columns changed: add the version's column_fingerprint() to COLUMN_LAYOUTS "
        "(python -m normfast.data.schema --fingerprint prints it)"
    )
    earlier = schema.SCHEMA_VERSION - 1  # a version whose layout is not registered: other columns
    assert PROBE_RESUME_KEY.of({**RECORD, "schema_version": earlier})["columns"] != schema.column_fingerprint()


def test_metadata_outside_the_key_changes_nothing_and_inside_is_named():
    key = PROBE_RESUME_KEY.fingerprint(RECORD)
    added = {**RECORD, "colour": "blue", "heat_sampling": {"method": "energy"}}
    dropped = {k: v for k, v in RECORD.items() if k not in ("encoder_note", "temperature", "lr")}
    moved = {**RECORD, "model": "another/name", "versions": {"torch": "0"}, "seconds": 9.0}
    assert PROBE_RESUME_KEY.fingerprint(added) == PROBE_RESUME_KEY.fingerprint(dropped) == key
    assert PROBE_RESUME_KEY.fingerprint(moved) == key  # the model's name: not what the rows depend on
    as_float = {**RECORD, "config": {**RECORD["config"], "seed": 0.0}}
    assert PROBE_RESUME_KEY.fingerprint(as_float) == key  # numbers by their value
    changed = {**RECORD, "model": "other", "config": {**RECORD["config"], "lr": 0.01}, "model_fingerprint": "b"}
    assert PROBE_RESUME_KEY.fingerprint(changed) != key
    said = PROBE_RESUME_KEY.describe(RECORD, changed)
    assert said == 'config.lr 0.001 -> 0.01, the model "m" -> "other", the model\'s weights', said
    lacking = {k: v for k, v in RECORD.items() if k != "n_items"}
    assert PROBE_RESUME_KEY.describe(lacking, RECORD) == "the number of probe items (not recorded by the earlier run)"


def test_the_monitors_key_is_its_whole_record():
    record = {"every": 5, "probes": "p"}
    assert WHOLE_SPEC.fingerprint(record) != WHOLE_SPEC.fingerprint({**record, "colour": "blue"})
    assert WHOLE_SPEC.fingerprint(record) == WHOLE_SPEC.fingerprint({"every": 5.0, "probes": "p"})


def test_the_output_format_page_lists_the_key():
    import importlib.util

    spec = importlib.util.spec_from_file_location("normfast_docs_hooks", ROOT / "docs" / "hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    page = (ROOT / "docs" / "output-format.md").read_text()
    assert "<!-- schema:resume-key -->" in page
    rendered = hooks.expand(page, "output-format.md")
    assert resume_key.render_markdown() in rendered
    for e in PROBE_RESUME_KEY.entries:
        assert f"| `{e.name}` |" in rendered
