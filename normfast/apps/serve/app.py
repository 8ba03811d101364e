"""The web service of ``normfast serve``: a :class:`ProbeService` (a Prober behind the fair queue, the
limits, the answers) and :func:`create_app`, its FastAPI application.

Routes: ``GET /`` the interactive page; ``POST /api/probe`` texts -> rows (JSON,
:mod:`normfast.apps.serve.protocol`); ``POST /api/view`` texts -> the ``normfast view`` page of their
rows (HTML); ``GET /api/health`` ready or not; ``GET /api/info`` the version, the model, the
objective, the settings, the directions' identity, the heat reference and the limits; ``GET
/api/schema`` the JSON Schemas; ``GET /openapi.json`` the OpenAPI document (every limit in it) and
``GET /docs`` its interactive page (Swagger UI served from this machine: ``fastapi-offline``'s
copy). Every refusal is JSON ``{"error": "..."}`` in one line (statuses: :mod:`.protocol`); a 405
says which methods the route has (``Allow``). A request names texts only: nothing in it reaches the
file system (the probe runs in memory). Who may call: :mod:`.guard`; how requests share the model:
:mod:`.scheduler`.

(No ``from __future__ import annotations`` here: FastAPI reads the routes' annotations, and
``Request`` is imported inside :func:`create_app`, where the annotations must be evaluated.)
"""

import copy
import logging
import warnings
from dataclasses import dataclass
from typing import Any, Sequence

from normfast.apps.serve.guard import LOOPBACK_NAMES, Guard
from normfast.apps.serve.protocol import (
    ERROR_SCHEMA,
    RESPONSE_SCHEMA,
    Limits,
    RequestError,
    parse_request,
    request_schema,
    response_body,
)
from normfast.apps.serve.scheduler import MAX_PENDING, FairScheduler, work_units

log = logging.getLogger("normfast.serve")

#: tokens of a work unit when the model names no window
UNIT_TOKENS = 256


@dataclass(frozen=True)
class Unit:
    """Texts ``start`` .. ``start + len(texts)`` of a request: probed together, in one go."""

    start: int
    texts: list[str]


@dataclass
class Answer:
    """A request's texts probed: the rows of all its units as one result, and what the texts hold."""

    texts: list[str]
    result: Any
    seconds: float
    queued: float
    unknown: list[int]


class ProbeService:
    """A :class:`~normfast.engine.prober.Prober` serving requests through the fair queue: each request
    split into work units of at most one model window of tokens (:func:`~.scheduler.work_units`),
    one unit at a time, round robin across requests (the model is shared)."""

    def __init__(
        self,
        prober: Any,
        *,
        max_texts: int | None = None,
        max_chars: int | None = None,
        limits: Limits | None = None,
        max_pending: int = MAX_PENDING,
        unit_tokens: int | None = None,
    ):
        from normfast.apps.serve.protocol import MAX_CHARS, MAX_TEXTS
        from normfast.data.io import fingerprint

        if limits is None:
            limits = Limits(
                MAX_TEXTS if max_texts is None else max_texts, MAX_CHARS if max_chars is None else max_chars
            )
        self.limits = limits
        self.prober = prober
        encoder = prober.encoder
        # a copy to count tokens with: requests are counted on other threads than the worker's, and a
        # fast tokenizer's settings (truncation, padding) are not safe to share across threads
        tokenizer = getattr(encoder, "tokenizer", None)
        self.tokenizer = copy.deepcopy(tokenizer) if tokenizer is not None else None
        self.max_length = getattr(encoder, "max_length", None)
        self.unit_tokens = int(unit_tokens or self.max_length or UNIT_TOKENS)
        # what the directions are, by content: equal for the same model, objective, pairs and settings
        self.directions_id = fingerprint(prober.fingerprint())
        prober.heat_reference()  # now, before the worker runs: /api/info shows it, every unit uses it
        self.scheduler = FairScheduler(self._probe_unit, max_pending=max_pending)

    @property
    def max_texts(self) -> int:
        return self.limits.max_texts

    @property
    def max_chars(self) -> int:
        return self.limits.max_chars

    @property
    def body_limit(self) -> int:
        return self.limits.body_bytes

    # -- one request ---------------------------------------------------------------------
    def split(self, body: bytes) -> tuple[list[str], list[Unit], list[int]]:
        """The texts of ``body``, their work units and each text's unknown tokens (a RequestError if the
        body is refused)."""
        texts = parse_request(body, self.limits)
        lengths, unknown = self.token_counts(texts)
        units = [Unit(r.start, texts[r.start : r.stop]) for r in work_units(lengths, self.unit_tokens)]
        return texts, units, unknown

    def token_counts(self, texts: Sequence[str]) -> tuple[list[int], list[int]]:
        """Each text's tokens as the model reads them (at most its window, special tokens included) and
        how many of them are the unknown token; without a transformers tokenizer, an estimate (4
        characters a token) and no unknown count."""
        from normfast.encoders.tokenizing import HEAD_CHARS_PER_TOKEN, text_head

        tok = self.tokenizer
        if tok is None or not callable(tok):
            return [min(len(t) // 4 + 2, self.unit_tokens) for t in texts], [0] * len(texts)
        length = self.max_length or 512
        if getattr(self.prober.encoder, "lowercase", False):
            texts = [t.lower() for t in texts]
        heads = [text_head(t, length * HEAD_CHARS_PER_TOKEN) for t in texts]
        ids = tok(heads, truncation=True, max_length=length)["input_ids"]
        unk = getattr(tok, "unk_token_id", None)
        return [len(r) for r in ids], [list(r).count(unk) if unk is not None else 0 for r in ids]

    def _probe_unit(self, unit: Unit) -> Any:
        """One work unit on the worker thread; the engine's warnings about the texts (truncation, unknown
        tokens) are in the answer (``warnings``), so here they go to the debug log only."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ids = [str(unit.start + i) for i in range(len(unit.texts))]
            try:
                return self.prober.probe(unit.texts, ids=ids, progress=False)
            except ValueError as exc:  # what the engine refuses in these texts
                raise RequestError(422, str(exc).splitlines()[0]) from None
            finally:
                for w in caught:
                    log.debug("%s", w.message)

    def combine(self, texts: list[str], units: list[Unit], results: list[Any], busy: float) -> Any:
        """The units' results as one result of the whole request (items numbered as in the request)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        from normfast.engine.diagnostics.regime import run_regime
        from normfast.engine.result import ProbeResult

        tables = []
        for unit, result in zip(units, results):
            t = result.table.replace_schema_metadata(None)
            at = t.schema.get_field_index("item")
            tables.append(t.set_column(at, "item", pc.add(t.column("item"), pa.scalar(unit.start, pa.int64()))))
        table = pa.concat_tables(tables)
        metadata = dict(results[0].metadata)
        metadata.update(n_items=len(texts), seconds=round(busy, 3), regime=run_regime([table]))
        return ProbeResult(table, metadata)

    def finish(self, texts: list[str], units: list[Unit], unknown: list[int], done: tuple) -> Answer:
        results, busy, queued = done
        return Answer(texts, self.combine(texts, units, results, busy), busy, queued, unknown)

    def probe(self, body: bytes) -> Answer:
        """A request, start to end, on the caller's thread (tests, the warm-up): parse, queue, combine."""
        texts, units, unknown = self.split(body)
        return self.finish(texts, units, unknown, self.scheduler.run(units))

    # -- the answers ---------------------------------------------------------------------
    def answer(self, got: Answer | bytes) -> dict[str, Any]:
        """``POST /api/probe``: the rows of the texts (:data:`~normfast.apps.serve.protocol.RESPONSE_SCHEMA`)."""
        got = self.probe(got) if isinstance(got, bytes) else got
        return response_body(
            got.result,
            got.texts,
            got.seconds,
            self.prober.model_name,
            queued=got.queued,
            unknown=got.unknown,
            max_length=self.max_length,
        )

    def view(self, got: Answer | bytes) -> str:
        """``POST /api/view``: the page ``normfast view`` writes, for the rows of the texts (what was cut
        or unknown said in its notes)."""
        from normfast.apps.serve.protocol import text_warnings
        from normfast.engine.report.page import page_html

        got = self.probe(got) if isinstance(got, bytes) else got
        n = len(got.texts)
        note = f"Probed by normfast serve in {got.seconds:.2f} s ({n} text{'s' if n > 1 else ''})."
        said = text_warnings(self.answer(got)["texts"], self.max_length)
        if said:
            note += " " + " ".join(f"Warning: {w}." for w in said)
        return page_html(got.result, notes=note, docs=n)

    def warm_up(self) -> None:
        """Pay the one-off costs of a first request now (the first pass through the model, the page's
        word-frequency table): the first request is then as fast as the next."""
        got = self.probe(b'{"texts": ["warm up"]}')
        self.answer(got)
        self.view(got)

    def close(self) -> None:
        self.scheduler.close()

    def info(self) -> dict[str, Any]:
        """``GET /api/info``: the version, the model, the objective with its settings, the probe's settings,
        where the directions came from and their identity, the heat reference, the limits, the queue."""
        from normfast import __version__
        from normfast.engine.directions.objectives import objective_settings

        p = self.prober
        cfg = p.config
        reference = p.heat_reference()
        return {
            "normfast": __version__,
            "model": p.model_name,
            "objective": p.objective.name,
            "objective_settings": objective_settings(p.objective),
            "params": cfg.params,
            "output": cfg.output,
            "optimizer": cfg.optimizer,
            "lr": cfg.lr,
            "weight_decay": cfg.weight_decay,
            "momentum": cfg.momentum,
            "M": cfg.batches,
            "M_D": cfg.drift_batches if cfg.drift_from_mean else None,
            "K": cfg.effective_groups,
            "batch_size": cfg.batch_size,
            "seed": cfg.seed,
            "directions": p.source,
            "directions_id": self.directions_id,
            "pairs": len(p.pairs),
            "heat_reference": None
            if reference is None
            else {k: reference.get(k) for k in ("source", "items", "output", "column", "rows", "log_level", "level")},
            "max_length": self.max_length,
            "limits": {
                "max_texts": self.max_texts,
                "max_chars": self.max_chars,
                "max_body_bytes": self.body_limit,
                "max_pending": self.scheduler.max_pending,
                "unit_tokens": self.unit_tokens,
            },
        }

    def page(self, example: str = "") -> str:
        """``GET /``: the interactive page."""
        from normfast.engine.report.page import live_html

        i = self.info()
        runline = (
            f"{i['objective']} · {i['optimizer']} lr={i['lr']} wd={i['weight_decay']} · M={i['M']}, "
            f"M_D={i['M_D'] or 'per batch'}, K={i['K']} · params {i['params']} · {i['output']}"
        )
        source = (
            "directions computed when the service started"
            if i["directions"] == "computed"
            else f"directions read from {i['directions']}"
        ) + "; each probe pays only its per-item pass."
        return live_html(
            title=f"normfast serve — {i['model']}",
            runline=runline,
            source=source,
            max_texts=self.max_texts,
            max_chars=self.max_chars,
            example=example,
        )


#: the statuses a route may answer besides 200, and why (the OpenAPI document's responses)
REFUSALS = {
    400: "the body is not a JSON object, nests too deep or holds invalid Unicode; or a foreign Host",
    403: "an Origin that may not call this service",
    413: "a body over the limit on its size",
    415: "a body not sent as Content-Type: application/json",
    422: "a JSON object that breaks the schema (missing, unknown or blank fields; too many or too long texts)",
    503: "the service is starting, or its queue is full (Retry-After)",
}


def create_app(
    service: ProbeService | None = None,
    example: str = "",
    *,
    limits: Limits | None = None,
    hosts: Sequence[str] = LOOPBACK_NAMES,
    cors_origins: Sequence[str] = (),
) -> Any:
    """The FastAPI application of ``service`` (needs the ``serve`` extra: ``pip install "normfast[serve]"``).

    ``service`` may be set later (``app.state.service``): until then every route but ``/api/health``
    and the OpenAPI document answers 503 (the command binds its port before the model loads).
    ``hosts``: the Host names it answers (:mod:`.guard`); ``cors_origins``: the frontends (origins)
    that may call it from a browser."""
    import asyncio

    from fastapi import Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.middleware.cors import CORSMiddleware
    from fastapi.responses import HTMLResponse, JSONResponse
    from fastapi_offline import FastAPIOffline
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect

    from normfast import __version__

    if limits is None:
        limits = service.limits if service is not None else Limits()
    app = FastAPIOffline(
        title="normfast serve",
        version=__version__,
        description="Probe texts with a contrastive encoder: every token's norm, heat and drift with their "
        "error bars, and the equilibrium norm the law predicts. See the docs' backend page.",
        openapi_url="/openapi.json",
        docs_url="/docs",
        redoc_url=None,
        static_url="/docs-static",
    )
    app.state.service = service
    app.state.example = example

    def refused(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse({"error": message}, status_code=status, headers=headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        what = {
            404: f"no such route {request.url.path}; see GET /openapi.json",
            405: f"method {request.method} not allowed here; allowed: {(exc.headers or {}).get('Allow', 'none')}",
        }
        return refused(exc.status_code, what.get(exc.status_code, str(exc.detail)), exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return refused(422, "the request does not match its schema (GET /openapi.json)")

    @app.exception_handler(Exception)
    async def failed(request: Request, exc: Exception) -> JSONResponse:
        first = str(exc).splitlines()[0] if str(exc) else ""
        log.error("%s %s failed: %s: %s", request.method, request.url.path, type(exc).__name__, first)
        return refused(500, f"the probe failed on the server: {type(exc).__name__}: {first}")

    def ready() -> ProbeService:
        if app.state.service is None:
            starting = "the service is starting (loading the model and its directions); see GET /api/health"
            raise RequestError(503, starting, {"Retry-After": "2"})
        return app.state.service

    async def body_of(request: Request) -> bytes | None:
        """The body, read no further than the limit (413 beyond it); None when the client left mid-body."""
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind != "application/json":
            raise RequestError(
                415, f"the body must be JSON sent as Content-Type: application/json, got {kind or 'no Content-Type'}"
            )
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limits.body_bytes:
            raise RequestError(413, f"the request body has {int(declared):,} bytes, the limit is {limits.body_bytes:,}")
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limits.body_bytes:
                    raise RequestError(413, f"the request body exceeds the limit of {limits.body_bytes:,} bytes")
                chunks.append(chunk)
        except ClientDisconnect:
            client = request.client
            log.warning(
                "%s left after %s of %s bytes of its %s %s body; nothing probed",
                f"{client.host}:{client.port}" if client else "a client",
                f"{size:,}",
                declared or "?",
                request.method,
                request.url.path,
            )
            return None
        return b"".join(chunks)

    async def answered(request: Request, respond: Any, kind: Any) -> Any:
        try:
            service = ready()
            body = await body_of(request)
            if body is None:
                return refused(400, "the client left before sending the whole body")
            texts, units, unknown = await run_in_threadpool(service.split, body)
            done = await asyncio.wrap_future(service.scheduler.submit(units))
            got = await run_in_threadpool(service.finish, texts, units, unknown, done)
            return kind(await run_in_threadpool(respond, service, got))
        except RequestError as exc:
            return refused(exc.status, str(exc), exc.headers)

    body = {"content": {"application/json": {"schema": request_schema(limits)}}, "required": True}
    html = {"text/html": {"schema": {"type": "string"}}}

    def documented(ok: dict[str, Any], *statuses: int) -> dict[int, Any]:
        """The OpenAPI responses of a route: 200 with ``ok``'s content, and its refusals (:data:`REFUSALS`)."""
        out: dict[int, Any] = {200: {"description": "the answer", "content": ok}}
        for status in statuses:
            content = {"application/json": {"schema": ERROR_SCHEMA}}
            out[status] = {"description": REFUSALS[status], "content": content}
        return out

    def as_json(schema: dict[str, Any]) -> dict[str, Any]:
        return {"application/json": {"schema": schema}}

    health_docs = documented(as_json(HEALTH_SCHEMA))
    health_docs[503] = {"description": "starting", "content": as_json(HEALTH_SCHEMA)}
    probe_errors = (400, 403, 413, 415, 422, 503)

    @app.get("/", response_class=HTMLResponse, summary="the interactive page", responses=documented(html, 503))
    def page() -> Any:
        try:
            return HTMLResponse(ready().page(app.state.example))
        except RequestError as exc:
            return refused(exc.status, str(exc), exc.headers)

    @app.get("/api/health", summary="ready or not", responses=health_docs)
    def health() -> Any:
        service = app.state.service
        body = {"status": "ready" if service is not None else "starting", "normfast": __version__}
        if service is not None:
            body.update(model=service.prober.model_name, pending=service.scheduler.pending)
        return JSONResponse(body, status_code=200 if service is not None else 503)

    info_summary = "the version, model, settings, directions, heat reference and limits"

    @app.get("/api/info", summary=info_summary, responses=documented(as_json({"type": "object"}), 503))
    def info() -> Any:
        try:
            return JSONResponse(ready().info())
        except RequestError as exc:
            return refused(exc.status, str(exc), exc.headers)

    @app.get("/api/schema", summary="the JSON Schemas", responses=documented(as_json({"type": "object"})))
    def schema() -> Any:
        return JSONResponse({"request": request_schema(limits), "response": RESPONSE_SCHEMA, "error": ERROR_SCHEMA})

    probe_docs = dict(
        openapi_extra={"requestBody": body}, responses=documented(as_json(RESPONSE_SCHEMA), *probe_errors)
    )
    view_docs = dict(openapi_extra={"requestBody": body}, responses=documented(html, *probe_errors))

    @app.post("/api/probe", summary="texts -> every token's (or text's) statistics", **probe_docs)
    async def probe(request: Request) -> Any:
        return await answered(request, ProbeService.answer, JSONResponse)

    @app.post("/api/view", summary="texts -> their page", response_class=HTMLResponse, **view_docs)
    async def view(request: Request) -> Any:
        return await answered(request, ProbeService.view, HTMLResponse)

    if cors_origins:  # inside the guard, which has already refused every other origin
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(cors_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Content-Type"],
        )
    app.add_middleware(Guard, hosts=hosts, cors_origins=cors_origins)
    return app


HEALTH_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "status": {"type": "string", "enum": ["ready", "starting"]},
        "normfast": {"type": "string", "description": "the version"},
        "model": {"type": "string"},
        "pending": {"type": "integer", "description": "requests waiting or running"},
    },
    "required": ["status", "normfast"],
}
