"""``normfast serve MODEL``: the command that starts the service (:mod:`normfast.apps.serve.app`)."""

from __future__ import annotations

import argparse
import ipaddress
import sys
import time
from pathlib import Path
from typing import Any

from normfast.apps.options import (
    direction_arguments,
    direction_settings,
    encoder_arguments,
    load_model,
    make_objective,
    model_arguments,
    objective_arguments,
    pair_encoder_for,
    pairs_arguments,
    read_pairs_file,
)
from normfast.apps.serve.schema import MAX_CHARS, MAX_TEXTS

serve_description = """\
Serve a model on this machine: a JSON API that probes texts (POST /api/probe:
{"texts": [...]} -> every token's norm, heat V2 and drift D with their error
bars, kappa, r_eq with its 95% interval and the regime) and an interactive
page (open http://127.0.0.1:PORT/ in a browser: type or paste text, see every
token colored by heat, its numbers on hover -- the page `normfast view` writes
for a run).

The directions are made once, when the service starts: read from --directions
FOLDER when it holds them (`normfast directions` or `normfast probe
--directions` saved them; their settings are used), otherwise computed from
--pairs with the settings given here (and saved to --directions FOLDER when
given). Each request then pays only its per-item pass: about a second on a CPU
for a sentence through one layer of a MiniLM-sized model.

The service binds 127.0.0.1 (this machine only) unless --host says otherwise;
requests carry texts only (at most --max-texts of --max-chars characters) and
never reach the file system. Needs the serve extra: pip install "normfast[serve]".

examples:
  normfast serve all-MiniLM-L6-v2 --directions dirs/minilm-l5
  normfast serve all-MiniLM-L6-v2 --pairs sentences.txt --params 'encoder\\.layer\\.5\\.' \\
      --drift-batches 256 --directions dirs/minilm-l5 --port 8765
  curl -s localhost:8765/api/probe -d '{"texts": ["the river rose after the storm"]}'"""


def serve_arguments(p: argparse.ArgumentParser) -> None:
    model_arguments(p)
    p.add_argument(
        "--directions",
        metavar="FOLDER",
        default=None,
        help="saved directions to serve with (their settings are used); when FOLDER holds none, the "
        "directions computed from --pairs are saved there",
    )
    pairs_arguments(
        p,
        "virtual-batch source for computing the directions (without --directions FOLDER holding them); "
        "for simcse plain items, .txt one per line",
    )
    p.add_argument("--text-key", default="text", help="jsonl key of the items of a --pairs file (default: text)")
    objective_arguments(p)
    direction_arguments(p)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--tokens", dest="output", action="store_const", const="tokens", help="one row per token (default)")
    g.add_argument("--pooled", dest="output", action="store_const", const="pooled", help="one row per text")
    p.set_defaults(output="tokens")
    encoder_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8765, help="port to listen on (default 8765)")
    p.add_argument("--max-texts", type=int, default=MAX_TEXTS, help=f"texts per request at most (default {MAX_TEXTS})")
    p.add_argument(
        "--max-chars", type=int, default=MAX_CHARS, help=f"characters per text at most (default {MAX_CHARS:,})"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars while the directions are computed")


def serve_prober(args: argparse.Namespace) -> Any:
    """The Prober the service runs: over saved directions, or over directions computed (and saved) now."""
    from dataclasses import replace

    from normfast.engine.config import ProbeConfig
    from normfast.engine.prober import Prober
    from normfast.engine.runner.artifact import saved_config
    from normfast.engine.runner.integrity import check_directions_folder

    folder = Path(args.directions) if args.directions else None
    # a folder that cannot be used is said before the model is loaded or anything computed
    saved = folder is not None and check_directions_folder(folder, "--directions")
    encoder = load_model(args, args.device)
    progress = not args.no_progress
    if saved:  # the saved objective and settings; the pairs by their hash; every file checked
        config = replace(saved_config(folder), output=args.output)
        return Prober.load(folder, encoder, None, None, config, model_name=args.model, progress=progress)
    objective = make_objective(args)
    if not args.pairs:
        raise ValueError(
            "needs --pairs (the virtual-batch source to compute the directions from) or --directions FOLDER "
            "holding saved directions (normfast directions MODEL --pairs FILE --out FOLDER)"
        )
    pairs = read_pairs_file(Path(args.pairs), args, objective.needs)
    config = ProbeConfig(**direction_settings(args), output=args.output)
    prober = Prober(
        encoder,
        objective,
        pairs,
        config,
        pair_encoder=pair_encoder_for(encoder, objective),
        model_name=args.model,
        progress=progress,
    )
    if folder is not None:
        prober.save(folder)
    return prober


def make_server(app: Any, host: str, port: int) -> Any:
    """A uvicorn server for ``app`` (``server.run()`` serves until ``server.should_exit`` is set)."""
    import uvicorn

    return uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False))


def serve_main(args: argparse.Namespace) -> int:
    from normfast.apps.serve.app import ProbeService, create_app
    from normfast.core.checks import check_device

    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        print(
            'normfast serve: error: needs fastapi and uvicorn: pip install "normfast[serve]" '
            "(or pip install fastapi uvicorn)",
            file=sys.stderr,
        )
        return 2
    try:
        check_device("--device", args.device)
        if not 0 < args.port < 65536:
            raise ValueError(f"--port must be in 1..65535, got {args.port}")
        t0 = time.perf_counter()
        prober = serve_prober(args)
        prober.prepare()
        service = ProbeService(prober, max_texts=args.max_texts, max_chars=args.max_chars)
        service.warm_up()
        ready = time.perf_counter() - t0
    except (ValueError, TypeError, FileNotFoundError, FileExistsError, ImportError) as exc:
        print(f"normfast serve: error: {exc}", file=sys.stderr)
        return 2
    if not _loopback(args.host):
        print(
            f"normfast serve: note: --host {args.host} is reachable from other machines; the service has no "
            f"authentication",
            file=sys.stderr,
        )
    where = f"http://{args.host if ':' not in args.host else f'[{args.host}]'}:{args.port}/"
    print(f"normfast serve: {args.model} ready in {ready:.1f} s ({prober.source} directions); serving {where}")
    print('  POST /api/probe {"texts": [...]}; GET /api/schema; Ctrl+C stops it', flush=True)
    make_server(create_app(service), args.host, args.port).run()
    return 0


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
