"""The JSON API of ``normfast serve``: its requests and answers as JSON Schema, the checks a request
passes (each failure one :class:`RequestError` with its HTTP status), and probe results as the
answer's rows.

``POST /api/probe`` (and ``POST /api/view``, which answers the page of the same rows) take
:func:`request_schema` (its limits: :class:`Limits`); ``/api/probe`` answers :data:`RESPONSE_SCHEMA`;
every refusal answers :data:`ERROR_SCHEMA`: 400 (the body is not a JSON object, nests deeper than
:data:`MAX_DEPTH`, holds text that is not valid Unicode; a Host that is not this service's), 403 (an
Origin that is not allowed), 413 (a body over the limit on its size), 415 (a body not sent as
``application/json``), 422 (a JSON object that breaks the schema: a missing, unknown or blank field,
more texts or longer texts than the limits), 503 (the service is starting, or its queue is full).
The schema and the checks are one: every limit of :func:`parse_request` is in the schema, and a
request the schema allows is probed.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

#: default limits: texts per request and characters per text (the service's --max-texts, --max-chars)
MAX_TEXTS, MAX_CHARS = 32, 2000
#: arrays and objects inside each other that a request may nest (a valid one nests 2: {"texts": [...]})
MAX_DEPTH = 16
#: a character that is not white space: a text needs one. The class is written out (rather than
#: ``\S``) so that JSON Schema's regular expressions (ECMA 262) and Python's agree on it exactly:
#: Python's str.isspace() characters and ECMA's \s (which adds U+FEFF)
WHITESPACE = (
    "\\t\\n\\u000b\\f\\r \\u001c-\\u001f\\u0085\\u00a0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f\\u205f\\u3000\\ufeff"
)
NOT_BLANK = f"[^{WHITESPACE}]"
_NOT_BLANK = re.compile(NOT_BLANK)
#: bytes of JSON one character may take: an astral character (an emoji) as two \u escapes, as
#: Python's json.dumps writes it by default
BYTES_PER_CHAR = 12


@dataclass(frozen=True)
class Limits:
    """What one request may hold: ``max_texts`` texts of at most ``max_chars`` characters each (code
    points, as JSON Schema's ``maxLength`` counts them), in a body of at most :attr:`body_bytes`."""

    max_texts: int = MAX_TEXTS
    max_chars: int = MAX_CHARS

    def __post_init__(self) -> None:
        for name in ("max_texts", "max_chars"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Limits: {name} must be a positive integer, got {value!r}")

    @property
    def body_bytes(self) -> int:
        """The largest body that can hold the texts (every character JSON-escaped at its longest)."""
        return max_body_bytes(self.max_texts, self.max_chars)


def request_schema(limits: Limits = Limits()) -> dict[str, Any]:
    """The request of ``POST /api/probe`` and ``POST /api/view`` as JSON Schema, with its limits."""
    return {
        "title": "probe request",
        "type": "object",
        "properties": {
            "texts": {
                "type": "array",
                "description": f"the texts to probe: 1 to {limits.max_texts} (--max-texts), each of 1 to "
                f"{limits.max_chars:,} characters (--max-chars), not all white space",
                "items": {"type": "string", "minLength": 1, "maxLength": limits.max_chars, "pattern": NOT_BLANK},
                "minItems": 1,
                "maxItems": limits.max_texts,
            }
        },
        "required": ["texts"],
        "additionalProperties": False,
    }


NUMBER_OR_NULL = {"type": ["number", "null"]}

#: the request at the default limits (what the docs show)
REQUEST_SCHEMA: dict[str, Any] = request_schema()

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
    (
        "heat_rel",
        "log heat relative to the service's fixed reference (GET /api/info: heat_reference, the median "
        "log heat of the pair source's own items): the same for a text whatever else its request holds",
    ),
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
        "seconds": {"type": "number", "description": "time of the probe on the server (its work units)"},
        "queued": {
            "type": "number",
            "description": "time the request waited for other requests' work units (the fair queue)",
        },
        "warnings": {
            "type": "array",
            "items": {"type": "string"},
            "description": "what was changed or unknown in the texts, one line each (`texts[i]: ...`)",
        },
        "texts": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "text": {"type": "string"},
                    "n_truncated": {
                        "type": "integer",
                        "description": "tokens past the model's window that it never read (the text was cut)",
                    },
                    "n_unknown": {
                        "type": "integer",
                        "description": "tokens the vocabulary lacks (the tokenizer's unknown token, e.g. [UNK])",
                    },
                    "rows": {"type": "array", "items": ROW_SCHEMA},
                },
                "required": ["text", "n_truncated", "n_unknown", "rows"],
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
        "queued",
        "warnings",
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
    """A request the service refuses: ``status`` (400, 403, 413, 415, 422 or 503) and a one-line message."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.headers = headers or {}


def parse_request(body: bytes, limits: Limits = Limits()) -> list[str]:
    """The texts of a request body (:func:`request_schema`), or a :class:`RequestError` naming what is wrong."""
    if len(body) > limits.body_bytes:
        raise RequestError(
            413, f"the request body has {len(body):,} bytes, the limit is {limits.body_bytes:,}; send fewer texts"
        )
    depth = nesting_depth(body)
    if depth > MAX_DEPTH:
        raise RequestError(
            400,
            f"the body's nesting depth is {depth:,} (arrays and objects inside each other), the limit is "
            f'{MAX_DEPTH}; send {{"texts": ["..."]}}',
        )
    try:
        data = json.loads(body)
    except UnicodeDecodeError as exc:
        raise RequestError(400, f"the body is not valid UTF-8 ({exc.reason} at byte {exc.start:,}); send UTF-8 JSON")
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
    if len(texts) > limits.max_texts:
        raise RequestError(
            422, f"{len(texts)} texts in one request, the limit is {limits.max_texts}; split the request"
        )
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise RequestError(422, f"texts[{i}] is {type(t).__name__}, expected a string")
        if not _NOT_BLANK.search(t):
            what = "empty" if not t else "white space only"
            raise RequestError(422, f"texts[{i}] is {what}; every text needs a character that is not white space")
        if len(t) > limits.max_chars:
            raise RequestError(
                422, f"texts[{i}] has {len(t):,} characters, the limit is {limits.max_chars:,}; shorten or split it"
            )
        try:
            t.encode("utf-8")
        except UnicodeEncodeError as exc:  # JSON's \ud800 escapes decode to lone surrogates
            raise RequestError(
                400,
                f"texts[{i}] is not valid Unicode: a lone surrogate (\\u{ord(t[exc.start]):04x}) at character "
                f"{exc.start:,}; JSON \\u escapes must pair a high and a low surrogate",
            ) from None
    return texts


def nesting_depth(body: bytes) -> int:
    """How deep the arrays and objects of the JSON ``body`` nest (strings skipped), read without recursion."""
    if body.count(b"[") + body.count(b"{") <= MAX_DEPTH:
        return MAX_DEPTH  # cannot nest deeper: not worth a scan
    depth = deepest = 0
    for m in re.finditer(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]', body, re.S):
        c = m.group()
        if c in (b"[", b"{"):
            depth += 1
            deepest = max(deepest, depth)
        elif c in (b"]", b"}"):
            depth -= 1
    return deepest


def max_body_bytes(max_texts: int, max_chars: int) -> int:
    """The largest body that can hold ``max_texts`` texts of ``max_chars`` characters, each character
    JSON-escaped at its longest (:data:`BYTES_PER_CHAR`), with room for the object around them."""
    return 1024 + max_texts * (max_chars * BYTES_PER_CHAR + 8)


def _number(value: Any) -> float | None:
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def response_body(
    result: Any,
    texts: list[str],
    seconds: float,
    model: str,
    *,
    queued: float = 0.0,
    unknown: list[int] | None = None,
    max_length: int | None = None,
) -> dict[str, Any]:
    """A probe result as the answer of ``POST /api/probe`` (:data:`RESPONSE_SCHEMA`); ``unknown``: the
    unknown tokens of each text, ``max_length``: the model's window (for the warnings' words)."""
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
    cut = table.column("n_truncated").to_pylist() if "n_truncated" in names else [0] * table.num_rows
    unknown = list(unknown) if unknown is not None else [0] * len(texts)
    out = [{"text": t, "n_truncated": 0, "n_unknown": int(unknown[i]), "rows": []} for i, t in enumerate(texts)]
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
        text = out[int(item[r])]
        text["n_truncated"] = max(text["n_truncated"], int(cut[r] or 0))
        text["rows"].append(row)
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
        "queued": round(queued, 4),
        "warnings": text_warnings(out, max_length),
        "texts": out,
    }


def text_warnings(texts: list[dict[str, Any]], max_length: int | None) -> list[str]:
    """One line per text that was cut at the model's window or holds tokens its vocabulary lacks."""
    lines = []
    window = f"the model's {max_length}-token window" if max_length else "the model's window"
    for i, t in enumerate(texts):
        if t["n_truncated"]:
            lines.append(f"texts[{i}]: {t['n_truncated']:,} tokens past {window} were not read (split the text)")
        if t["n_unknown"]:
            lines.append(
                f"texts[{i}]: {t['n_unknown']:,} token{'s' if t['n_unknown'] > 1 else ''} the vocabulary lacks "
                f"(read as the unknown token: emoji, scripts or symbols the model never saw)"
            )
    return lines


def render_markdown() -> str:
    """The JSON API's reference for the documentation (the docs' ``<!-- schema:serve -->`` marker)."""
    props = ROW_SCHEMA["properties"]
    lines = ["One row per token (or per text with `--pooled`), in the text's order:", ""]
    lines += ["| field | type | meaning |", "|---|---|---|"]
    for key, spec in props.items():
        kind = spec["type"] if isinstance(spec["type"], str) else " or ".join(spec["type"])
        lines.append(f"| `{key}` | {kind} | {spec.get('description', '')} |")
    for title, schema in (
        ("The request (`POST /api/probe`, `POST /api/view`) at the default limits", REQUEST_SCHEMA),
        ("The answer of `POST /api/probe`", RESPONSE_SCHEMA),
        ("A refusal (status 400, 403, 404, 405, 413, 415, 422 or 503)", ERROR_SCHEMA),
    ):
        lines += ["", f"{title}, as JSON Schema (`GET /openapi.json` holds all three, with the limits):", ""]
        lines += ["```json", json.dumps(schema, indent=2, ensure_ascii=False), "```"]
    return "\n".join(lines)
