"""``normfast serve MODEL``: the command that starts the service (:mod:`normfast.apps.serve.app`)."""

from __future__ import annotations

import argparse
import contextlib
import errno
import ipaddress
import logging
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

from normfast.apps.options import (
    CONFIG_FIELD,
    DIRECTION_OPTIONS,
    PER_ITEM_OPTIONS,
    command_prober,
    computed_prober,
    direction_arguments,
    direction_settings,
    encoder_arguments,
    load_model,
    make_objective,
    model_arguments,
    objective_arguments,
    objective_options,
    output_arguments,
    pairs_arguments,
    per_item_arguments,
    read_pairs_file,
    resolve_device,
)
from normfast.apps.serve.protocol import MAX_CHARS, MAX_TEXTS

serve_description = """\
Serve a model on this machine: a JSON API that probes texts (POST /api/probe:
{"texts": [...]} -> every token's norm, heat V2 and drift D with their error
bars, kappa, r_eq with its 95% interval and the regime), its OpenAPI document
(GET /openapi.json, with an interactive page at /docs) and an interactive page
(open http://127.0.0.1:PORT/ in a browser: type or paste text, see every token
colored by heat, its numbers on hover -- the page `normfast view` writes for a
run).

The directions are made once, when the service starts: read from --directions
FOLDER when it holds them (`normfast directions` or `normfast probe
--directions` saved them; their settings are used: the options that shaped
them -- --objective, --temperature, --params, --batches, --seed, ... -- may be
given only with the saved values, while --lr, --wd, --momentum and
--tokens/--pooled act per item and apply), otherwise computed from --pairs with
the settings given here (and saved to --directions FOLDER when given). Each
request then pays only its per-item pass: about a second on a CPU for a sentence
through one layer of a MiniLM-sized model. Requests share the model fairly: each
is split into work units of at most one model window of tokens, run round robin
across requests, so a long request never holds a short one for its whole length.

The port is bound first (a taken port is said at once); "serving" is printed
once it serves. The service binds 127.0.0.1 (this machine only) unless --host
says otherwise, answers only requests that name it in their Host header (a
loopback name, or --host), takes bodies sent as application/json only, and
lets browsers on other origins call it only for the origins named with
--cors-origin. Requests carry texts only (at most --max-texts of --max-chars
characters) and never reach the file system. Needs the serve extra: pip install
"normfast[serve]".

examples:
  normfast serve all-MiniLM-L6-v2 --directions dirs/minilm-l5
  normfast serve all-MiniLM-L6-v2 --pairs sentences.txt --params 'encoder\\.layer\\.5\\.' \\
      --drift-batches 256 --directions dirs/minilm-l5 --port 8765
  normfast serve all-MiniLM-L6-v2 --directions dirs/minilm-l5 --cors-origin http://localhost:5173
  curl -s localhost:8765/api/probe -H 'Content-Type: application/json' \\
      -d '{"texts": ["the river rose after the storm"]}'"""

#: the options that act per item: given with saved directions, they apply (as for probe --directions)
PER_ITEM = tuple(PER_ITEM_OPTIONS)
LOG_LEVELS = ("debug", "info", "warning", "error")


def shaping_options() -> tuple[str, ...]:
    """The options that shaped saved directions (the objective's, read from the registry, and the
    direction settings but the heat's draw): given with saved directions, they must equal the saved values."""
    return (*objective_options(), *(o for o in DIRECTION_OPTIONS if o != "heat_sampling"))


def serve_arguments(p: argparse.ArgumentParser) -> None:
    model_arguments(p)
    p.add_argument(
        "--directions",
        metavar="FOLDER",
        default=None,
        help="saved directions to serve with (their settings are used; --lr, --wd, --momentum and "
        "--tokens/--pooled apply per item, the options that shaped them are refused when they differ); "
        "when FOLDER holds none, the directions computed from --pairs are saved there",
    )
    pairs_arguments(
        p,
        "virtual-batch source for computing the directions (without --directions FOLDER holding them); "
        "for an objective of items, plain items, .txt one per line",
    )
    objective_arguments(p)
    direction_arguments(p)
    per_item_arguments(p)
    output_arguments(p, "tokens", "one row per token (default)", "one row per text")
    encoder_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8765, help="port to listen on (default 8765)")
    p.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="a frontend that may call the API from a browser, e.g. http://localhost:5173 (repeatable; none by "
        "default: only the service's own page)",
    )
    p.add_argument("--max-texts", type=int, default=MAX_TEXTS, help=f"texts per request at most (default {MAX_TEXTS})")
    p.add_argument(
        "--max-chars", type=int, default=MAX_CHARS, help=f"characters per text at most (default {MAX_CHARS:,})"
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=LOG_LEVELS,
        help="what the service logs on stderr: info (default) one access line per request (method, path, status, "
        "seconds) and the service's notes; warning: the notes only; debug: the engine's warnings too",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars while the directions are computed")
    # an option given on the command line is not None: with saved directions, a given option is checked
    # against (or applied over) the saved settings, an option left out takes the saved value
    defaults = {a.dest: a.default for a in p._actions if a.dest in shaping_options() + PER_ITEM}
    p.set_defaults(**dict.fromkeys(defaults), _unset_defaults=defaults)


def option_value(args: argparse.Namespace, name: str) -> Any:
    """The option's value: as given, or its default when it was left out."""
    value = getattr(args, name)
    return args._unset_defaults[name] if value is None else value


def given_options(args: argparse.Namespace) -> dict[str, Any]:
    """The options of :func:`shaping_options` and :data:`PER_ITEM` given on the command line."""
    return {n: getattr(args, n) for n in shaping_options() + PER_ITEM if getattr(args, n) is not None}


def with_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with every option left out set to its default (to compute directions from them)."""
    return argparse.Namespace(**{**vars(args), **{n: option_value(args, n) for n in shaping_options() + PER_ITEM}})


def serve_prober(args: argparse.Namespace) -> Any:
    """The Prober the service runs: over saved directions (their settings, with the per-item options given
    applied and the others refused when they differ, as ``normfast probe --directions`` does), or over
    directions computed (and saved) now."""
    from normfast.engine.runner.integrity import check_directions_folder

    folder = Path(args.directions) if args.directions else None
    # a folder that cannot be used is said before the model is loaded or anything computed
    if folder is not None and check_directions_folder(folder, "--directions"):
        return _saved_prober(args, folder)
    if not args.pairs:
        raise ValueError(
            "needs --pairs (the virtual-batch source to compute the directions from) or --directions FOLDER "
            "holding saved directions (normfast directions MODEL --pairs FILE --out FOLDER)"
        )
    prober = computed_prober(args, with_defaults(args), output=args.output)
    if folder is not None:
        prober.save(folder)
    return prober


def _saved_prober(args: argparse.Namespace, folder: Path) -> Any:
    """A Prober over the saved directions in ``folder``, every option given checked by ``Prober.load``."""
    from dataclasses import replace

    from normfast.engine.directions.objectives import get_objective, objective_class
    from normfast.engine.runner.artifact import read_artifact_manifest, saved_config

    given = given_options(args)
    fields = {k: v for k, v in direction_settings(with_defaults(args)).items() if _option_of(k) in given}
    config = replace(saved_config(folder), output=args.output, **fields).resolve()  # checked once, here
    made = read_artifact_manifest(folder)["fingerprint"]["objective"]
    objective = None  # the saved one
    if given.keys() & set(objective_options()):
        # the saved objective's name and settings where an option was left out, the given ones over them
        ns = argparse.Namespace(**vars(args))
        ns.objective = args.objective or made["name"]
        for setting in objective_class(ns.objective).declared_settings:
            if getattr(args, setting.name) is None and setting.name in made["settings"]:
                setattr(ns, setting.name, made["settings"][setting.name])
        objective = make_objective(ns)
    kind = objective if objective is not None else get_objective(made["name"])
    pairs = read_pairs_file(Path(args.pairs), with_defaults(args), kind.needs) if args.pairs else None
    encoder = load_model(args, args.device)
    return command_prober(args, encoder, objective, pairs, config, saved=folder, kind=kind)


def _option_of(field: str) -> str:
    """The command-line option (its dest) that sets the ProbeConfig ``field``."""
    return next((opt for opt, f in CONFIG_FIELD.items() if f == field), field)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port``, or a ValueError in one line (a taken port, an address this
    machine does not have): bound before anything slow, so that a taken port is said at once."""
    if not 0 < port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ValueError(f"--host {host}: no such address on this machine ({exc.strerror})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port left in TIME_WAIT, not one in use
    try:
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        where = f"{address_text(host)}:{port}"
        if exc.errno == errno.EADDRINUSE:
            raise ValueError(f"{where} is in use (another server listens there); choose another --port") from None
        raise ValueError(f"cannot listen on {where} ({exc.strerror}); choose another --host or --port") from None
    return sock


def address_text(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def make_server(app: Any, host: str, port: int, log_level: str = "warning") -> Any:
    """A uvicorn server for ``app`` (``server.run()`` serves until ``server.should_exit`` is set); its
    ``interrupted`` says whether a Ctrl+C (SIGINT) stopped it."""
    import uvicorn

    class Server(uvicorn.Server):
        interrupted = False

        def handle_exit(self, sig: int, frame: Any) -> None:
            self.interrupted = self.interrupted or sig == signal.SIGINT
            super().handle_exit(sig, frame)

    level = "debug" if log_level == "debug" else "warning"  # the access lines are the service's own
    return Server(uvicorn.Config(app, host=host, port=port, log_level=level, access_log=False))


class _Stderr(logging.StreamHandler):
    """A handler that writes to whatever ``sys.stderr`` is when a record comes (not when it was made)."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


@contextlib.contextmanager
def service_logging(level: str) -> Iterator[None]:
    """While the service runs, its log (``normfast.serve``: notes; ``normfast.serve.access``: a line per
    request) on stderr, one line per record, at ``level``; as it was afterwards."""
    logger = logging.getLogger("normfast.serve")
    before = (list(logger.handlers), logger.level, logger.propagate)
    handler = _Stderr()
    handler.setFormatter(logging.Formatter("normfast serve: %(message)s"))
    logger.handlers[:] = [handler]
    logger.setLevel(level.upper())
    logger.propagate = False
    try:
        yield
    finally:
        logger.handlers[:], logger.level, logger.propagate = before


def serve_main(args: argparse.Namespace) -> int:
    try:
        import fastapi  # noqa: F401
        import fastapi_offline  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        print(
            'normfast serve: error: needs fastapi, fastapi-offline and uvicorn: pip install "normfast[serve]" '
            "(or pip install fastapi fastapi-offline uvicorn)",
            file=sys.stderr,
        )
        return 2
    with service_logging(args.log_level):
        return _serve(args)


def _serve(args: argparse.Namespace) -> int:
    from normfast.apps.serve.app import create_app
    from normfast.apps.serve.guard import allowed_hosts
    from normfast.apps.serve.protocol import Limits
    from normfast.core.checks import check_device

    try:
        args.device = resolve_device(args)
        check_device("--device", args.device)
        for name in ("max_texts", "max_chars"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
        limits = Limits(args.max_texts, args.max_chars)
        origins = [check_origin(o) for o in args.cors_origin]
        sock = bind(args.host, args.port)  # first: a taken port is said before the model loads
    except ValueError as exc:
        print(f"normfast serve: error: {exc}", file=sys.stderr)
        return 2
    hosts = allowed_hosts(args.host)
    if not _loopback(args.host):
        named = (
            f"requests must name it as {args.host} in their Host header"
            if args.host.strip("[]").lower() in hosts
            else "yet it answers only requests that name a loopback host: give --host the address or name "
            "its clients use"
        )
        print(
            f"normfast serve: note: --host {args.host} is reachable from other machines; the service has no "
            f"authentication; {named}",
            file=sys.stderr,
        )
    app = create_app(None, limits=limits, hosts=hosts, cors_origins=origins)
    port = sock.getsockname()[1]
    server = make_server(app, args.host, port, args.log_level)
    outcome: dict[str, Any] = {"rc": 0}
    loader = threading.Thread(
        target=_load, args=(args, app, server, limits, outcome, port), name="normfast-serve-loader", daemon=True
    )
    loader.start()
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        service = app.state.service
        if service is not None:
            service.close()
    if server.interrupted:  # uvicorn re-raises the Ctrl+C it shut down on, but not always past asyncio's runner
        raise KeyboardInterrupt
    return int(outcome["rc"])


def _load(args: argparse.Namespace, app: Any, server: Any, limits: Any, outcome: dict, port: int) -> None:
    """On a thread while the server answers 503: the Prober, its warm-up, then "serving" once it serves;
    on a failure one line, and the server stops (exit status 2)."""
    from normfast.apps.serve.app import ProbeService

    t0 = time.perf_counter()
    try:
        prober = serve_prober(args)
        prober.prepare()
        service = ProbeService(prober, limits=limits)
        service.warm_up()
    except (ValueError, TypeError, FileNotFoundError, FileExistsError, ImportError, OSError) as exc:
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"normfast serve: error: {message}", file=sys.stderr, flush=True)
        outcome["rc"] = 2
        server.should_exit = True
        return
    ready = time.perf_counter() - t0
    while not server.started and not server.should_exit:
        time.sleep(0.02)
    if server.should_exit:
        service.close()
        return
    app.state.service = service
    where = f"http://{address_text(args.host)}:{port}/"
    print(f"normfast serve: {args.model} ready in {ready:.1f} s ({prober.source} directions); serving {where}")
    print(
        '  POST /api/probe {"texts": [...]} (Content-Type: application/json); GET /openapi.json, /docs; '
        "Ctrl+C stops it",
        flush=True,
    )


def check_origin(origin: str) -> str:
    """A ``--cors-origin``: scheme, host and port, nothing else (what a browser sends as Origin)."""
    from urllib.parse import urlsplit

    parts = urlsplit(origin)
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.path not in ("", "/") or parts.query:
        raise ValueError(
            f"--cors-origin {origin!r}: expected an origin, scheme://host[:port] (e.g. http://localhost:5173)"
        )
    return f"{parts.scheme}://{parts.netloc}"


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
