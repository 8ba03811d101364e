"""Who may call ``normfast serve``: the ASGI middleware in front of its routes.

* **Host.** A request must name this service in its ``Host`` header: a loopback name
  (``localhost``, ``127.0.0.1``, ``[::1]``) or the ``--host`` it was started with. A web page the
  user visits cannot then reach it through a name of its own that resolves to 127.0.0.1 (DNS
  rebinding): the browser sends that name as the Host, and the request is refused (400).
* **Origin.** A request that carries an ``Origin`` (browsers add it to cross-origin requests and to
  every POST) must come from the service's own page or from an origin named with ``--cors-origin``
  (403 otherwise); CORS (Starlette's ``CORSMiddleware``, inside this guard) then answers the named
  frontends' preflights. Bodies must be ``application/json`` (the routes check it: 415), which no
  plain HTML form can send and which makes a browser ask first (a preflight) for any other origin.
* **The access log**: one line per request (client, method, path, status, seconds) on the logger
  ``normfast.serve.access`` at INFO (``--log-level``).
"""

from __future__ import annotations

import ipaddress
import json
import logging
import time
from typing import Any, Iterable

#: names every service answers to: this machine's loopback
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")

access_log = logging.getLogger("normfast.serve.access")


def host_name(header: str) -> str:
    """The name of a ``Host`` header without its port, lower case (``[::1]:8765`` -> ``::1``)."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def allowed_hosts(host: str) -> tuple[str, ...]:
    """The Host names a service bound to ``host`` answers: the loopback names, and ``host`` itself unless
    it is a wildcard address (0.0.0.0, ::), which names no one host."""
    names = list(LOOPBACK_NAMES)
    bound = host_name(host) if not host.startswith("[") else host.strip("[]").lower()
    try:
        wildcard = ipaddress.ip_address(bound).is_unspecified
    except ValueError:
        wildcard = False
    if not wildcard and bound not in names:
        names.append(bound)
    return tuple(names)


class Guard:
    """The Host and Origin checks and the access log around an ASGI app (the module docstring)."""

    def __init__(self, app: Any, hosts: Iterable[str] = LOOPBACK_NAMES, cors_origins: Iterable[str] = ()):
        self.app = app
        self.hosts = frozenset(h.lower() for h in hosts)
        self.origins = frozenset(o.rstrip("/") for o in cors_origins)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = [0]

        async def sent(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            refusal = self.refusal(scope)
            if refusal is None:
                await self.app(scope, receive, sent)
            else:
                await _json(sent, *refusal)
        finally:
            client = scope.get("client")
            who = f"{client[0]}:{client[1]}" if client else "-"
            path = scope.get("path", "")
            access_log.info(
                "%s %s %s %s %.3f s", who, scope.get("method"), path, status[0] or "-", time.perf_counter() - t0
            )

    def refusal(self, scope: dict) -> tuple[int, str] | None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        host = headers.get("host")
        if host is None:
            return 400, "the request has no Host header; name this service (e.g. Host: 127.0.0.1:PORT)"
        if host_name(host) not in self.hosts:
            return (
                400,
                f"Host {host_name(host)!r} is not this service's (it answers {', '.join(sorted(self.hosts))}): "
                f"refused, so that no other site's name can reach it; start it with --host NAME to answer a name",
            )
        origin = headers.get("origin")
        if origin is not None and origin.rstrip("/") not in self.origins and origin != f"http://{host}":
            return (
                403,
                f"Origin {origin!r} may not call this service; start it with --cors-origin {origin} to let that "
                f"frontend call it",
            )
        return None


async def _json(send: Any, status: int, message: str) -> None:
    body = json.dumps({"error": message}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
