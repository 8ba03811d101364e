"""The web service of ``normfast serve``: a :class:`ProbeService` (a Prober behind a lock, the limits,
the answers) and :func:`create_app`, its FastAPI application.

Routes: ``GET /`` the interactive page; ``POST /api/probe`` texts -> rows (JSON,
:mod:`normfast.apps.serve.schema`); ``POST /api/view`` texts -> the ``normfast view`` page of their
rows (HTML); ``GET /api/info`` the model, settings and limits; ``GET /api/schema`` the JSON Schemas.
Every refusal is JSON ``{"error": "..."}`` with status 400, 404, 405, 413 or 422. A request names
texts only: nothing in it reaches the file system (the probe runs in memory).

(No ``from __future__ import annotations`` here: FastAPI reads the routes' annotations, and
``Request`` is imported inside :func:`create_app`, where the annotations must be evaluated.)
"""

import threading
import time
from typing import Any

from normfast.apps.serve.schema import (
    ERROR_SCHEMA,
    MAX_CHARS,
    MAX_TEXTS,
    REQUEST_SCHEMA,
    RESPONSE_SCHEMA,
    RequestError,
    max_body_bytes,
    parse_request,
    response_body,
)


class ProbeService:
    """A :class:`~normfast.engine.prober.Prober` serving requests one at a time (the model is shared)."""

    def __init__(self, prober: Any, *, max_texts: int = MAX_TEXTS, max_chars: int = MAX_CHARS):
        for name, value in (("max_texts", max_texts), ("max_chars", max_chars)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ProbeService: {name} must be a positive integer, got {value!r}")
        self.prober = prober
        self.max_texts = max_texts
        self.max_chars = max_chars
        self.lock = threading.Lock()
        self.body_limit = max_body_bytes(max_texts, max_chars)

    def run(self, body: bytes) -> tuple[list[str], Any, float]:
        texts = parse_request(body, self.max_texts, self.max_chars)
        with self.lock:
            t0 = time.perf_counter()
            try:
                result = self.prober.probe(texts, progress=False)
            except ValueError as exc:  # what the engine refuses in these texts
                raise RequestError(422, str(exc).splitlines()[0]) from None
            return texts, result, time.perf_counter() - t0

    def answer(self, body: bytes) -> dict[str, Any]:
        """``POST /api/probe``: the rows of the texts (:data:`~normfast.apps.serve.schema.RESPONSE_SCHEMA`)."""
        texts, result, seconds = self.run(body)
        return response_body(result, texts, seconds, self.prober.model_name)

    def view(self, body: bytes) -> str:
        """``POST /api/view``: the page ``normfast view`` writes, for the rows of the texts."""
        from normfast.engine.report.page import page_html

        texts, result, seconds = self.run(body)
        note = f"Probed by normfast serve in {seconds:.2f} s ({len(texts)} text{'s' if len(texts) > 1 else ''})."
        return page_html(result, notes=note, docs=len(texts))

    def warm_up(self) -> None:
        """Pay the one-off costs of a first request now (the first pass through the model, the page's
        word-frequency table): the first request is then as fast as the next."""
        body = b'{"texts": ["warm up"]}'
        self.answer(body)
        self.view(body)

    def info(self) -> dict[str, Any]:
        """``GET /api/info``: the model, the settings, where the directions came from, the limits."""
        p = self.prober
        cfg = p.config
        return {
            "model": p.model_name,
            "objective": p.objective.name,
            "params": cfg.params,
            "output": cfg.output,
            "optimizer": cfg.optimizer,
            "lr": cfg.lr,
            "weight_decay": cfg.weight_decay,
            "M": cfg.batches,
            "M_D": cfg.drift_batches if cfg.drift_from_mean else None,
            "K": cfg.effective_groups,
            "batch_size": cfg.batch_size,
            "seed": cfg.seed,
            "directions": p.source,
            "limits": {"max_texts": self.max_texts, "max_chars": self.max_chars, "max_body_bytes": self.body_limit},
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


def create_app(service: ProbeService, example: str = "") -> Any:
    """The FastAPI application of ``service`` (needs ``fastapi``: ``pip install "normfast[serve]"``)."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import HTMLResponse, JSONResponse
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException

    app = FastAPI(title="normfast serve", docs_url=None, redoc_url=None, openapi_url=None)

    def refused(status: int, message: str) -> JSONResponse:
        return JSONResponse({"error": message}, status_code=status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        what = {404: f"no such route {request.url.path}; see GET /api/info", 405: "method not allowed here"}
        return refused(exc.status_code, what.get(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def failed(request: Request, exc: Exception) -> JSONResponse:
        first = str(exc).splitlines()[0] if str(exc) else ""
        return refused(500, f"the probe failed on the server: {type(exc).__name__}: {first}")

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return refused(422, "the request does not match its schema (GET /api/schema)")

    async def body_of(request: Request) -> bytes:
        """The body, read no further than the limit (413 beyond it)."""
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > service.body_limit:
            raise RequestError(
                413, f"the request body has {int(declared):,} bytes, the limit is {service.body_limit:,}"
            )
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > service.body_limit:
                raise RequestError(413, f"the request body exceeds the limit of {service.body_limit:,} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    async def answered(request: Request, fn: Any) -> Any:
        try:
            return await run_in_threadpool(fn, await body_of(request))
        except RequestError as exc:
            return refused(exc.status, str(exc))

    @app.get("/", response_class=HTMLResponse)
    def page() -> HTMLResponse:
        return HTMLResponse(service.page(example))

    @app.get("/api/info")
    def info() -> dict[str, Any]:
        return service.info()

    @app.get("/api/schema")
    def schema() -> dict[str, Any]:
        return {"request": REQUEST_SCHEMA, "response": RESPONSE_SCHEMA, "error": ERROR_SCHEMA}

    @app.post("/api/probe")
    async def probe(request: Request) -> Any:
        got = await answered(request, service.answer)
        return got if isinstance(got, JSONResponse) else JSONResponse(got)

    @app.post("/api/view")
    async def view(request: Request) -> Any:
        got = await answered(request, service.view)
        return got if isinstance(got, JSONResponse) else HTMLResponse(got)

    return app
