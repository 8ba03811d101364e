"""The output format's versions: the one this normfast writes, what each version changed, and the
registry fingerprint and column layout each was released with (:mod:`normfast.data.schema` re-exports
them; a change of the registry raises the version, adds its line here and its fingerprints:
``python -m normfast.data.schema --fingerprint``)."""

from __future__ import annotations

#: version of the output format written by this normfast (``metadata["schema_version"]``).
#: Files without the key predate versioning (version 1).
SCHEMA_VERSION = 11

#: version -> what changed (one line each)
CHANGES = {
    1: "unversioned output (normfast <= 0.1.0 before the key existed)",
    2: "schema_version and objective_settings in the metadata; is_special column; encoder_note, "
    "input_fingerprints metadata",
    3: "corpus runs: doc_id, window, doc_position, word_id, word, primary columns; corpus metadata",
    4: "error bars: se_V2, se_Q (and _w), r_eq_lo/hi, r_eq_heat_lo/hi columns; uncertainty, M_initial, "
    "adaptive metadata (M is the heat's batches as run); the regime check: kappa_exempt, drift_to_heat, "
    "regime, regime_reason columns; regime metadata",
    5: "the single-snapshot predictor: r_eq_snapshot, D_snapshot, Q_snapshot columns and snapshot metadata "
    "(snapshot=True); ProbeConfig's snapshot settings in the config metadata",
    6: "truncation counted: the n_truncated column and the max_length metadata",
    7: "the heat's two parts: heat_loo, heat_rel, se_heat_rel columns and the heat_reference metadata "
    "(the run's common level and its standard error); norm_continued beside r_eq_snapshot",
    8: "intervals of the snapshot predictor: r_eq_snapshot_lo/hi and norm_continued_lo/hi columns; "
    "interval_segments in the snapshot metadata",
    9: "the resume fingerprint made sound: tokenizer_fingerprint, encoder_settings and pair_encoder metadata; "
    "model_fingerprint hashes every byte of every parameter and buffer (it sampled the values)",
    10: "the virtual objective's health: objective_health and pair_source metadata; the regime "
    "`objective saturated` (reason `objective_saturated`)",
    11: "the heat's batches drawn by their energy: heat_sampling metadata (and ProbeConfig.heat_sampling); "
    "heat_reference's se_log_level includes the pool's own level error; heat_reference's source (a "
    "Prober's reference is fixed with its directions); objective_health's chance level and saturation rule "
    "are the objective's own (chance_formula, saturation; null chance for a loss without one), so the regime "
    "thresholds no longer hold one saturated_loss_ratio",
}


#: schema version -> fingerprint of the registry it was released with
RELEASED = {
    2: "b949604baf9dad23",
    3: "9f7abe74fd67ec08",
    4: "14ef24a437463f94",
    5: "40fdbeae6940ccae",
    6: "e06d2ab48ed9b48d",
    7: "feb8b2f21ad06ca2",
    8: "859ee96b1536b587",
    9: "04665bbe53caa7ae",
    10: "ef88da408c8bc9d4",
    11: "f271eecd6b0bfbe3",
}


#: schema version -> fingerprint of its column registry (names and types, in order), from version 11 on:
#: the layout of a run's rows, which a resume compares instead of the version (:mod:`normfast.data.resume_key`),
#: so that a version that adds only metadata keys resumes the unfinished runs of the one before
COLUMN_LAYOUTS = {11: "d871d3dfec905172"}
