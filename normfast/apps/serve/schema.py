"""The JSON API of ``normfast serve``: its requests and answers as JSON Schema, the checks a request
passes (each failure one :class:`RequestError` with its HTTP status), and a probe result as the
answer's rows.

``POST /api/probe`` (and ``POST /api/view``, which answers the page of the same rows) take
:data:`REQUEST_SCHEMA`; ``/api/probe`` answers :data:`RESPONSE_SCHEMA`; every refusal answers
:data:`ERROR_SCHEMA` with status 400 (the body is not a JSON object), 413 (over the limits on the
body's size, the number of texts or a text's length) or 422 (a JSON object that breaks the schema).
"""

from __future__ import annotations

import json
import math
from typing import Any

#: default limits: texts per request and characters per text (the service's --max-texts, --max-chars)
MAX_TEXTS, MAX_CHARS = 32, 2000

NUMBER_OR_NULL = {"type": ["number", "null"]}

REQUEST_SCHEMA: dict[str, Any] = {
    "title": "probe request",
    "type": "object",
    "properties": {
        "texts": {
            "type": "array",
            "description": "the texts to probe (at most --max-texts of them, each at most --max-chars characters)",
            "items": {"type": "string", "minLength": 1},
            "minItems": 1,
        }
    },
    "required": ["texts"],
    "additionalProperties": False,
}

#: a row's statistics: (key, meaning); numbers are null where the row has no valid value
ROW_NUMBERS = (
    ("norm", "the embedding's norm R"),
    ("V2", "the stochastic heat (for AdamW: the Parquet's V2_w; heat_column says which)"),
    ("se_V2", "its standard error (delete-a-group jackknife over the K batch groups)"),
    ("D", "the radial drift (for AdamW: D_w; drift_column says which)"),
    ("se_D", "its standard error over the K group drifts"),
    ("kappa", "the effective radial damping κ"),
    ("r_eq", "the predicted equilibrium norm (full law)"),
    ("r_eq_lo", "lower end of r_eq's 95% interval"),
    ("r_eq_hi", "upper end of r_eq's 95% interval"),
    ("r_eq_heat", "the heat-only equilibrium norm (D = 0)"),
    ("heat_rel", "log heat relative to the request's median (the ranking part of the heat)"),
    ("drift_to_heat", "|D| over the heat's scale"),
)

ROW_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "position": {"type": "integer", "description": "token position in the text (-1: the whole text, pooled)"},
        "token": {"type": ["string", "null"], "description": "the token (null for pooled rows)"},
        "is_special": {"type": "boolean", "description": "[CLS], [SEP], ...: left out of the regime and scales"},
        "valid": {"type": "boolean", "description": "whether the row's statistics are valid"},
        "reason": {"type": "string", "description": "why not, when not valid (`ok` otherwise)"},
        **{key: {**NUMBER_OR_NULL, "description": meaning} for key, meaning in ROW_NUMBERS},
        "regime": {
            "type": ["string", "null"],
            "description": "`law applicable`, `heat-dominated` or `not applicable` (null for special tokens)",
        },
        "regime_reason": {"type": ["string", "null"], "description": "the check that decided the regime"},
    },
    "required": ["position", "token", "is_special", "valid", "reason", *(k for k, _ in ROW_NUMBERS), "regime"],
}

RESPONSE_SCHEMA: dict[str, Any] = {
    "title": "probe answer",
    "type": "object",
    "properties": {
        "model": {"type": "string"},
        "objective": {"type": "string"},
        "output": {"type": "string", "enum": ["tokens", "pooled"]},
        "M": {"type": "integer", "description": "virtual batches of the heat"},
        "M_D": {"type": ["integer", "null"], "description": "virtual batches of the drift"},
        "K": {"type": ["integer", "null"], "description": "batch groups behind the error bars"},
        "heat_column": {"type": "string", "description": "the Parquet column the rows' V2 is (V2 or V2_w)"},
        "drift_column": {"type": "string", "description": "the Parquet column the rows' D is (D or D_w)"},
        "regime": {
            "type": "object",
            "description": "the request's regime check: `regime`, `reason`, `explanation` (plain words)",
        },
        "seconds": {"type": "number", "description": "time of the probe on the server"},
        "texts": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"text": {"type": "string"}, "rows": {"type": "array", "items": ROW_SCHEMA}},
                "required": ["text", "rows"],
            },
        },
    },
    "required": [
        "model",
        "objective",
        "output",
        "M",
        "M_D",
        "K",
        "heat_column",
        "drift_column",
        "regime",
        "seconds",
        "texts",
    ],
}

ERROR_SCHEMA: dict[str, Any] = {
    "title": "error",
    "type": "object",
    "properties": {"error": {"type": "string", "description": "what is wrong, and the fix, in one line"}},
    "required": ["error"],
}


class RequestError(ValueError):
    """A request the service refuses: ``status`` (400, 413 or 422) and a one-line message."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def parse_request(body: bytes, max_texts: int = MAX_TEXTS, max_chars: int = MAX_CHARS) -> list[str]:
    """The texts of a request body (:data:`REQUEST_SCHEMA`), or a :class:`RequestError`."""
    limit = max_body_bytes(max_texts, max_chars)
    if len(body) > limit:
        raise RequestError(413, f"the request body has {len(body):,} bytes, the limit is {limit:,}; send fewer texts")
    try:
        data = json.loads(body)
    except ValueError as exc:
        raise RequestError(400, f'the body is not JSON ({exc}); send {{"texts": ["..."]}}') from None
    if not isinstance(data, dict):
        raise RequestError(400, f'the body is JSON {type(data).__name__}, not an object; send {{"texts": ["..."]}}')
    extra = sorted(set(data) - {"texts"})
    if extra:
        raise RequestError(422, f'unknown field(s) {extra}; the request holds only "texts"')
    texts = data.get("texts")
    if not isinstance(texts, list) or not texts:
        raise RequestError(422, '"texts" must be a non-empty list of strings, e.g. {"texts": ["a sentence"]}')
    if len(texts) > max_texts:
        raise RequestError(413, f"{len(texts)} texts in one request, the limit is {max_texts}; split the request")
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise RequestError(422, f"texts[{i}] is {type(t).__name__}, expected a string")
        if not t.strip():
            raise RequestError(422, f"texts[{i}] is empty; every text needs at least one character that is not a space")
        if len(t) > max_chars:
            raise RequestError(
                413, f"texts[{i}] has {len(t):,} characters, the limit is {max_chars:,}; shorten or split it"
            )
    return texts


def max_body_bytes(max_texts: int, max_chars: int) -> int:
    """The largest body that can hold ``max_texts`` texts of ``max_chars`` characters (JSON escapes included)."""
    return 1024 + max_texts * (max_chars * 6 + 8)


def _number(value: Any) -> float | None:
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def response_body(result: Any, texts: list[str], seconds: float, model: str) -> dict[str, Any]:
    """A probe result as the answer of ``POST /api/probe`` (:data:`RESPONSE_SCHEMA`)."""
    meta = result.metadata
    table = result.table
    names = set(table.column_names)
    heat, drift = result.heat_column, result.drift_column
    source = {"V2": heat, "se_V2": f"se_{heat}", "D": drift, "se_D": f"se_{drift}"}
    cols = {
        k: table.column(source.get(k, k)).to_pylist() if source.get(k, k) in names else None for k, _ in ROW_NUMBERS
    }
    item = table.column("item").to_pylist()
    position = table.column("position").to_pylist()
    token = table.column("token").to_pylist() if "token" in names else [None] * table.num_rows
    special = table.column("is_special").to_pylist() if "is_special" in names else [False] * table.num_rows
    valid = table.column("valid").to_pylist()
    reason = table.column("reason").to_pylist()
    regime = table.column("regime").to_pylist() if "regime" in names else [None] * table.num_rows
    regime_reason = table.column("regime_reason").to_pylist() if "regime_reason" in names else [None] * table.num_rows
    out = [{"text": t, "rows": []} for t in texts]
    for r in range(table.num_rows):
        row = {
            "position": int(position[r]),
            "token": token[r] if int(position[r]) >= 0 else None,
            "is_special": bool(special[r]),
            "valid": bool(valid[r]),
            "reason": str(reason[r]),
        }
        row.update({k: _number(cols[k][r]) if cols[k] is not None else None for k, _ in ROW_NUMBERS})
        row["regime"] = regime[r]
        row["regime_reason"] = regime_reason[r]
        out[int(item[r])]["rows"].append(row)
    run_regime = meta.get("regime") or {}
    return {
        "model": model,
        "objective": str(meta.get("objective")),
        "output": str(meta.get("output")),
        "M": int(meta["M"]),
        "M_D": meta.get("M_D"),
        "K": meta.get("groups"),
        "heat_column": heat,
        "drift_column": drift,
        "regime": {k: run_regime.get(k) for k in ("regime", "reason", "explanation")},
        "seconds": round(seconds, 4),
        "texts": out,
    }


def render_markdown() -> str:
    """The JSON API's reference for the documentation (the docs' ``<!-- schema:serve -->`` marker)."""
    props = ROW_SCHEMA["properties"]
    lines = ["One row per token (or per text with `--pooled`), in the text's order:", ""]
    lines += ["| field | type | meaning |", "|---|---|---|"]
    for key, spec in props.items():
        kind = spec["type"] if isinstance(spec["type"], str) else " or ".join(spec["type"])
        lines.append(f"| `{key}` | {kind} | {spec.get('description', '')} |")
    for title, schema in (
        ("The request (`POST /api/probe`, `POST /api/view`)", REQUEST_SCHEMA),
        ("The answer of `POST /api/probe`", RESPONSE_SCHEMA),
        ("A refusal (status 400, 404, 405, 413 or 422; 500 if the probe itself fails)", ERROR_SCHEMA),
    ):
        lines += ["", f"{title}, as JSON Schema (`GET /api/schema` serves all three):", ""]
        lines += ["```json", json.dumps(schema, indent=2, ensure_ascii=False), "```"]
    return "\n".join(lines)
