"""``normfast serve`` end to end (issue 35): the service started on a free loopback port in this
process (a 2-layer BERT with MiniLM's tokenizer), its JSON API against the Prober's own rows and
against its documented JSON Schema, the refusals (400, 404, 405, 413, 422, one line each), no file
written by a request; the interactive page in headless Chromium (type a text, see its tokens
colored by heat, hover one for its numbers: those of the JSON API); and the command itself, started
as a process and stopped. Every wait is bounded."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import warnings
from pathlib import Path

import pytest

from bench.sentences import FIRST
from normfast.encoders import HFEncoder
from normfast.engine.config import ProbeConfig
from normfast.engine.prober import Prober
from tests._browser import Tab, launch
from tests._models import tiny_bert

pytest.importorskip("fastapi")
pytest.importorskip("fastapi_offline")
pytest.importorskip("uvicorn")
from normfast.apps.serve.app import ProbeService, create_app  # noqa: E402
from normfast.apps.serve.command import make_server  # noqa: E402
from normfast.apps.serve.protocol import ERROR_SCHEMA, RESPONSE_SCHEMA, Limits, RequestError, request_schema  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")

ROOT = Path(__file__).resolve().parents[2]
PAIRS = FIRST[:8]
TEXT = "democracy is a fragile idea"
LOOPBACK = ("localhost", "127.0.0.1", "::1")
#: the module service's limits: the default number of texts, shorter texts (the tiny model reads 32 tokens)
LIMITS = Limits(32, 200)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def config(**kw) -> ProbeConfig:
    base = dict(params=r"encoder\.layer\.1\.", mode="jvp", output="tokens", batches=4, drift_batches=8, groups=2)
    return ProbeConfig(**{**base, "batch_size": 4, "seed": 3, **kw})


@pytest.fixture(scope="module")
def service(minilm_tokenizer):
    encoder = HFEncoder(tiny_bert(minilm_tokenizer), minilm_tokenizer, max_length=32)
    prober = Prober(encoder, "simcse", pairs=PAIRS, config=config(), progress=False, model_name="tiny-bert")
    return ProbeService(prober.prepare(), limits=LIMITS)


def serving(app, host: str = "127.0.0.1"):
    """``app`` served from a thread on a free port of ``host``: (its URL, a function that stops it)."""
    server = make_server(app, host, free_port())
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the service did not start within 30 s"
        time.sleep(0.02)

    def stop() -> None:
        server.should_exit = True
        thread.join(timeout=10)
        assert not thread.is_alive(), "the service did not stop within 10 s"

    return f"http://{host}:{server.config.port}", stop


@pytest.fixture(scope="module")
def url(service):
    """The service on a free loopback port, served from a thread; stopped after the module's tests."""
    url, stop = serving(create_app(service, example=TEXT))
    yield url
    stop()


@pytest.fixture(scope="module")
def small_url(service):
    """The same Prober behind its own service with small limits (4 texts of 64 characters, probed in one work
    unit): what the fuzzer runs against, so that its thousand cases take a minute, not ten."""
    small = ProbeService(service.prober, limits=Limits(4, 64), unit_tokens=256)
    url, stop = serving(create_app(small))
    yield url
    stop()
    small.close()


def call(url: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url + path, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def conforms(value, schema: dict, where: str = "$") -> None:
    """A small JSON Schema check: type, enum, required, properties, additionalProperties, items, minItems."""
    kinds = schema.get("type")
    if kinds is not None:
        kinds = [kinds] if isinstance(kinds, str) else kinds
        types = {
            "object": dict,
            "array": list,
            "string": str,
            "boolean": bool,
            "null": type(None),
            "integer": int,
            "number": (int, float),
        }
        ok = any(
            isinstance(value, types[k]) and not (k in ("integer", "number") and isinstance(value, bool)) for k in kinds
        )
        assert ok, f"{where}: {value!r} is not {kinds}"
    if "enum" in schema:
        assert value in schema["enum"], f"{where}: {value!r} not in {schema['enum']}"
    if isinstance(value, dict):
        for key in schema.get("required", ()):
            assert key in value, f"{where}: missing {key!r}"
        props = schema.get("properties", {})
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(props), f"{where}: unknown keys {set(value) - set(props)}"
        for key, sub in props.items():
            if key in value:
                conforms(value[key], sub, f"{where}.{key}")
    if isinstance(value, list):
        assert len(value) >= schema.get("minItems", 0), where
        for i, item in enumerate(value):
            conforms(item, schema.get("items", {}), f"{where}[{i}]")


# ---------------------------------------------------------------------------
# the JSON API


def test_a_probe_answers_the_probers_rows_in_the_documented_schema(url, service):
    conforms({"texts": [TEXT]}, request_schema(LIMITS))
    status, body = call(url, "/api/probe", json.dumps({"texts": [TEXT, "bread was warm"]}).encode())
    assert status == 200, body
    got = json.loads(body)
    conforms(got, RESPONSE_SCHEMA)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = service.prober.probe([TEXT, "bread was warm"], progress=False).table.to_pylist()
    rows = [r for t in got["texts"] for r in t["rows"]]
    assert len(rows) == len(want) and [t["text"] for t in got["texts"]] == [TEXT, "bread was warm"]
    for r, w in zip(rows, want):
        assert (r["position"], r["token"], r["is_special"], r["regime"]) == (
            w["position"],
            w["token"],
            w["is_special"],
            w["regime"],
        )
        for key in ("norm", "V2", "se_V2", "D", "se_D", "kappa", "r_eq", "r_eq_lo", "r_eq_hi", "r_eq_heat"):
            if w[key] is None or w[key] != w[key]:  # NaN: null in JSON
                assert r[key] is None, key
            else:
                assert r[key] == w[key], key  # JSON numbers round-trip a float exactly
    assert got["M"] == 4 and got["M_D"] == 8 and got["K"] == 2 and got["model"] == "tiny-bert"
    assert got["regime"]["regime"] in ("law applicable", "heat-dominated", "not applicable")


@pytest.mark.parametrize(
    "body, status, says",
    [
        (b"not json", 400, r"not JSON"),
        (b"[1, 2]", 400, r"not an object"),
        (b"{}", 422, r"\"texts\" must be a non-empty list"),
        (b'{"texts": []}', 422, r"non-empty list"),
        (b'{"texts": [7]}', 422, r"texts\[0\] is int"),
        (b'{"texts": ["  "]}', 422, r"texts\[0\] is white space only"),
        (b'{"texts": ["a", ""]}', 422, r"texts\[1\] is empty"),
        (b'{"texts": ["a"], "out": "/tmp/x.parquet"}', 422, r"unknown field\(s\) \['out'\]"),
        (json.dumps({"texts": ["a" * 201]}).encode(), 422, r"201 characters, the limit is 200"),
        (json.dumps({"texts": ["a"] * 33}).encode(), 422, r"33 texts in one request, the limit is 32"),
        (b"x" * 100_000, 413, r"the limit is"),
    ],
)
def test_bad_requests_get_one_line_json_errors(url, body, status, says):
    import re

    got_status, got = call(url, "/api/probe", body)
    assert got_status == status, got
    error = json.loads(got)
    conforms(error, ERROR_SCHEMA)
    assert re.search(says, error["error"]) and "\n" not in error["error"], error


def test_unknown_routes_and_methods_are_json_errors(url):
    status, body = call(url, "/etc/passwd")
    assert status == 404 and "no such route" in json.loads(body)["error"]
    status, body = call(url, "/api/probe")  # GET
    assert status == 405 and json.loads(body)["error"]


def test_info_schema_and_no_file_written(url, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    status, body = call(url, "/api/info")
    info = json.loads(body)
    assert status == 200 and info["limits"]["max_texts"] == 32 and info["M"] == 4 and info["directions"] == "computed"
    status, body = call(url, "/api/schema")
    assert json.loads(body) == {"request": request_schema(LIMITS), "response": RESPONSE_SCHEMA, "error": ERROR_SCHEMA}
    for path in ("/api/probe", "/api/view"):
        assert call(url, path, json.dumps({"texts": ["../../etc/passwd"]}).encode())[0] == 200
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------
# issue 40: what a frontend engineer and an auditor hit (each test failed on the service before the fix)


def raw(url: str, method: str, path: str, body: bytes | None = None, headers: dict | None = None, conn=None):
    """One request over http.client (every header as given, Host included): (status, headers, body)."""
    import http.client
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    own = conn is None
    conn = conn or http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        sent = {"Host": parts.netloc, **({"Content-Type": "application/json"} if body is not None else {})}
        sent.update(headers or {})
        for k, v in sent.items():
            if v is not None:
                conn.putheader(k, v)
        if body is not None:
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        if own:
            conn.close()


def test_a_deeply_nested_body_is_a_400_naming_the_depth_and_the_connection_lives(url):
    import http.client
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        depth = 30_000  # within this service's body limit (78,080 bytes), far past Python's recursion limit
        nested = b'{"texts": ' + b"[" * depth + b"]" * depth + b"}"
        status, _, body = raw(url, "POST", "/api/probe", nested, conn=conn)
        assert status == 400, body
        error = json.loads(body)["error"]
        assert "nest" in error and "depth" in error and "\n" not in error, error
        status, _, body = raw(url, "POST", "/api/probe", json.dumps({"texts": [TEXT]}).encode(), conn=conn)
        assert status == 200, body  # the same keep-alive connection answers the next request
    finally:
        conn.close()


def test_a_lone_surrogate_is_a_400_naming_invalid_unicode(url):
    status, _, body = raw(url, "POST", "/api/probe", b'{"texts": ["bad \\ud800"]}')
    assert status == 400, body
    error = json.loads(body)["error"]
    assert "texts[0]" in error and "Unicode" in error and "surrogate" in error, error


def test_a_foreign_host_is_refused(url):
    body = json.dumps({"texts": [TEXT]}).encode()
    for host in ("evil.example", "evil.example:80", "127.0.0.1.nip.io"):
        status, _, got = raw(url, "POST", "/api/probe", body, {"Host": host, "Origin": "http://evil.example"})
        assert status == 400, (host, got)
        error = json.loads(got)["error"]
        assert host.split(":")[0] in error and "Host" in error, error
        status, _, got = raw(url, "GET", "/api/info", None, {"Host": host})
        assert status == 400 and b"directions" not in got, got
    port = url.rsplit(":", 1)[1]
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", f"[::1]:{port}"):
        assert raw(url, "GET", "/api/info", None, {"Host": host})[0] == 200, host
    # what a service bound elsewhere answers: the loopback names and its --host (a wildcard names no host)
    from normfast.apps.serve.guard import allowed_hosts

    assert allowed_hosts("127.0.0.1") == allowed_hosts("0.0.0.0") == allowed_hosts("::") == LOOPBACK
    assert allowed_hosts("192.168.1.5") == (*LOOPBACK, "192.168.1.5")
    assert allowed_hosts("Box.Local") == (*LOOPBACK, "box.local")


def test_a_body_that_is_not_application_json_is_a_415(url):
    body = json.dumps({"texts": [TEXT]}).encode()
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        status, _, got = raw(url, "POST", "/api/probe", body, {"Content-Type": kind})
        assert status == 415, (kind, got)
        assert "application/json" in json.loads(got)["error"]
    status, _, got = raw(url, "POST", "/api/probe", body, {"Content-Type": "application/json; charset=utf-8"})
    assert status == 200, got


@pytest.fixture(scope="module")
def saved(tiny_bert_folder, tmp_path_factory) -> Path:
    """Directions saved for the tiny BERT folder as the command loads it (``normfast serve FOLDER``)."""
    from normfast.encoders import load_encoder

    folder = tmp_path_factory.mktemp("serve-directions") / "d"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        Prober(load_encoder(str(tiny_bert_folder)), "simcse", pairs=PAIRS, config=config(), progress=False).save(folder)
    return folder


def serve_args(*argv: str):
    from normfast.cli import build_parser

    return build_parser("serve").parse_args(["serve", *argv])


def test_saved_directions_take_the_per_item_options_and_refuse_the_others(saved, tiny_bert_folder, capsys):
    from normfast.apps.serve.command import serve_prober

    base = [str(tiny_bert_folder), "--directions", str(saved), "--device", "cpu", "--no-progress"]
    prober = serve_prober(serve_args(*base, "--lr", "0.01", "--wd", "0.1"))
    assert (prober.config.lr, prober.config.weight_decay) == (0.01, 0.1)  # applied, as probe --directions does
    assert (prober.config.batches, prober.config.seed, prober.source) == (4, 3, str(saved))  # the saved ones
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r_eq = prober.probe([TEXT], progress=False).table.column("r_eq").to_pylist()
        plain = serve_prober(serve_args(*base)).probe([TEXT], progress=False).table.column("r_eq").to_pylist()
        want = Prober.load(saved, prober.encoder, config=config(lr=0.01, weight_decay=0.1), progress=False)
        want = want.probe([TEXT], progress=False).table.column("r_eq").to_pylist()
    assert r_eq == want and r_eq != plain and serve_prober(serve_args(*base)).config.lr == 1e-3
    for extra, named in (
        (["--seed", "99"], r"settings\.seed \(saved 3, given 99\)"),
        (["--batches", "7"], r"settings\.batches \(saved 4, given 7\)"),
        (["--temperature", "0.1"], r"objective\.settings\.temperature"),
        (["--seed", "99", "--lr", "0.01"], r"settings\.seed"),
    ):
        with pytest.raises(ValueError, match=named) as err:
            serve_prober(serve_args(*base, *extra))
        assert "\n" not in str(err.value)
    # the command: one line, exit status 2
    from normfast.cli import main

    capsys.readouterr()
    assert main(["serve", *base, "--seed", "99", "--port", str(free_port())]) == 2
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("normfast serve:")]
    assert len(said) == 1 and re.match(r"normfast serve: error: Prober\.load: .*settings\.seed \(saved 3", said[0])


def test_a_taken_port_is_one_line_and_exit_2_before_the_model_loads(saved, tiny_bert_folder, capsys, monkeypatch):
    from normfast.apps.serve import command
    from normfast.cli import main

    loaded = []
    real = command.load_model
    monkeypatch.setattr(command, "load_model", lambda *a, **k: loaded.append(1) or real(*a, **k))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        rc = main(["serve", str(tiny_bert_folder), "--directions", str(saved), "--port", str(port), "--device", "cpu"])
    out = capsys.readouterr()
    assert rc == 2, out
    err = out.err.strip()
    assert "\n" not in err and f"127.0.0.1:{port}" in err and "in use" in err and "--port" in err, err
    assert "serving" not in out.out and loaded == []


# ---------------------------------------------------------------------------
# issue 40: what a frontend builds on (OpenAPI, stable answers, health, the log, the fair queue)


def test_the_openapi_document_holds_every_limit(url):
    import normfast

    status, _, body = raw(url, "GET", "/openapi.json")
    assert status == 200
    doc = json.loads(body)
    assert doc["openapi"].startswith("3.") and doc["info"]["version"] == normfast.__version__
    assert {"/", "/api/health", "/api/info", "/api/schema", "/api/probe", "/api/view"} <= set(doc["paths"])
    for path in ("/api/probe", "/api/view"):
        op = doc["paths"][path]["post"]
        texts = op["requestBody"]["content"]["application/json"]["schema"]["properties"]["texts"]
        assert (texts["minItems"], texts["maxItems"]) == (1, LIMITS.max_texts)
        items = texts["items"]
        assert (items["minLength"], items["maxLength"]) == (1, LIMITS.max_chars)
        assert re.fullmatch(items["pattern"], "x") and not re.search(items["pattern"], " \t\u3000\n")
        assert {"200", "400", "413", "415", "422", "503"} <= set(op["responses"])
    answer = doc["paths"]["/api/probe"]["post"]["responses"]["200"]["content"]["application/json"]["schema"]
    assert answer == RESPONSE_SCHEMA


def test_a_method_a_route_lacks_is_a_405_that_says_allow(url):
    for method, path, allow in (
        ("TRACE", "/api/probe", "POST"),
        ("GET", "/api/probe", "POST"),
        ("DELETE", "/api/info", "GET"),
    ):  # noqa: E501
        status, headers, body = raw(url, method, path)
        assert status == 405 and headers.get("allow") == allow, (method, path, headers)
        assert f"allowed: {allow}" in json.loads(body)["error"]


def test_schemathesis_finds_no_server_error_and_no_schema_violation(small_url, tmp_path):
    """The OpenAPI document fuzzed against the live service (schemathesis, every check, a fixed seed, a fixed
    number of examples per route, a time cap):
    every answer is documented (status, content type, schema), no 5xx, a request the schema allows is probed
    and one it does not is refused, methods a route lacks are 405 with Allow."""
    report = tmp_path / "schemathesis.json"
    argv = ["st", "run", f"{small_url}/openapi.json", "--checks", "all", "--max-examples", "500", "--seed", "40"]
    argv += ["--workers", "1", "--no-color", "--report", "json", "--report-json-path", str(report)]  # 150 s cap below
    st = Path(sys.executable).with_name("st")
    # (from tmp_path: schemathesis keeps a cache of what it found in the current folder)
    done = subprocess.run([str(st), *argv[1:]], capture_output=True, text=True, timeout=150, cwd=tmp_path)
    got = json.loads(report.read_text())
    cases = got["test_cases"]
    summary = f"{cases}, failures {len(got['failures'])}, errors {len(got['errors'])}\n{done.stdout[-3000:]}"
    assert done.returncode == 0 and got["complete"], summary
    assert cases["generated"] >= 1000 and cases["with_failures"] == 0 and cases["errored"] == 0, summary
    assert got["failures"] == [] and got["errors"] == [], summary
    print(f"schemathesis: {cases['generated']} cases in {got['running_time']:.0f} s, no failure")


def _rows(answer: dict, i: int) -> list[dict]:
    return answer["texts"][i]["rows"]


def test_the_same_text_gets_the_same_heat_rel_alone_and_among_32_others(url, service):
    alone = json.loads(call(url, "/api/probe", json.dumps({"texts": [TEXT]}).encode())[1])
    crowd = [f"{w} was all {v} of us had" for w in ("bread", "salt", "rain", "ink") for v in range(8)]
    crowd[17] = TEXT
    status, body = call(url, "/api/probe", json.dumps({"texts": crowd}).encode())
    assert status == 200, body
    together = json.loads(body)
    a, b = _rows(alone, 0), _rows(together, 17)
    assert [r["token"] for r in a] == [r["token"] for r in b] and len(a) == 7
    for key in ("heat_rel", "V2", "r_eq"):
        assert all(x[key] == pytest.approx(y[key], rel=1e-6, abs=1e-6) for x, y in zip(a, b) if x[key] is not None)
    reference = json.loads(call(url, "/api/info")[1])["heat_reference"]
    assert reference["source"] == "pairs" and reference["items"] == len(PAIRS)
    assert reference["log_level"] == service.prober.heat_reference()["log_level"]


def test_health_info_and_an_access_line_per_request(url, caplog):
    import logging

    import normfast

    access = logging.getLogger("normfast.serve.access")
    access.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="normfast.serve.access"):
            status, body = call(url, "/api/health")
            assert status == 200 and json.loads(body)["status"] == "ready"
            status, body = call(url, "/api/info")
            deadline = time.monotonic() + 5
            while len([r for r in caplog.records if "/api/info" in r.getMessage()]) < 1:
                assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
                time.sleep(0.02)
    finally:
        access.removeHandler(caplog.handler)
    info = json.loads(body)
    assert info["normfast"] == normfast.__version__ and info["objective"] == "simcse"
    assert info["objective_settings"]["temperature"] == 0.05
    assert re.fullmatch(r"[0-9a-f]{16,}", info["directions_id"]) and info["pairs"] == len(PAIRS)
    line = next(r.getMessage() for r in caplog.records if "/api/info" in r.getMessage())
    assert re.fullmatch(r"127\.0\.0\.1:\d+ GET /api/info 200 \d+\.\d{3} s", line), line


def test_what_was_cut_or_unknown_is_said_per_text(url):
    long = " ".join(["a"] * 60)  # the tiny model reads 32 tokens
    status, body = call(url, "/api/probe", json.dumps({"texts": [TEXT, long, "pizza 🍕 and 🎉 tonight"]}).encode())
    assert status == 200, body
    got = json.loads(body)
    assert [t["n_truncated"] for t in got["texts"]] == [0, 62 - 32, 0]
    assert [t["n_unknown"] for t in got["texts"]] == [0, 0, 2]
    assert any(w.startswith("texts[1]: 30 tokens past the model's 32-token window") for w in got["warnings"])
    assert any(w.startswith("texts[2]: 2 tokens the vocabulary lacks") for w in got["warnings"])
    status, page = call(url, "/api/view", json.dumps({"texts": [long]}).encode())
    assert status == 200 and b"Warning: texts[0]: 30 tokens past" in page


def test_a_client_that_leaves_mid_body_logs_one_line(url, caplog):
    import logging

    port = int(url.rsplit(":", 1)[1])
    with caplog.at_level(logging.DEBUG):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(
                f"POST /api/probe HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: 1000\r\n\r\n".encode()
                + b'{"texts": ["the'
            )
            time.sleep(0.2)
        deadline = time.monotonic() + 5
        while not [r for r in caplog.records if "left after" in r.getMessage()]:
            assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
            time.sleep(0.02)
        time.sleep(0.2)
    said = [r for r in caplog.records if r.name.startswith(("normfast.serve", "uvicorn")) and "access" not in r.name]
    assert len(said) == 1 and said[0].exc_info is None, [(r.name, r.getMessage()) for r in said]
    assert said[0].getMessage().startswith("127.0.0.1:") and "left after 15 of 1000 bytes" in said[0].getMessage()


def test_the_fair_queue_runs_a_short_request_between_the_units_of_a_long_one():
    """A long request (12 units) and a short one that arrives while it runs: the short waits for one unit,
    not for the long one's whole length; a unit that fails fails its request only; a full queue is a 503."""
    from normfast.apps.serve.scheduler import FairScheduler, work_units

    assert work_units([3, 3, 3, 10, 1], 6) == [range(0, 2), range(2, 3), range(3, 4), range(4, 5)]
    assert work_units([], 6) == []
    order, started = [], threading.Event()

    def run_unit(unit):
        started.set()
        if unit == "boom":
            raise ValueError("this unit fails")
        time.sleep(0.03)
        order.append(unit)
        return unit

    fair = FairScheduler(run_unit, max_pending=3)
    try:
        long = fair.submit([f"long{i}" for i in range(12)])
        started.wait(5)
        short = fair.submit(["short"])
        bad = fair.submit(["boom", "never"])
        results, busy, queued = short.result(10)
        assert results == ["short"] and busy < 0.5
        assert order.index("short") <= 2, order  # after the unit in progress (and at most the next), not after 12
        with pytest.raises(ValueError, match="this unit fails"):
            bad.result(10)
        assert long.result(10)[0] == [f"long{i}" for i in range(12)] and "never" not in order
        blockers = [fair.submit([f"x{i}"] * 5) for i in range(3)]
        with pytest.raises(RequestError) as refused:
            fair.submit(["one too many"])
        assert refused.value.status == 503 and refused.value.headers == {"Retry-After": "5"}
        for b in blockers:
            b.result(10)
    finally:
        fair.close()


# ---------------------------------------------------------------------------
# the interactive page in a real browser


@pytest.fixture(scope="module")
def browser():
    yield from launch()


def test_the_page_colors_typed_text_and_shows_numbers_on_hover(url, browser, tmp_path):
    tab = Tab(browser, height=1000)
    page = tab.page
    page.set_default_timeout(30_000)
    try:
        page.goto(url + "/")
        page.wait_for_selector("body[data-ready='idle']")
        page.fill("#nf-input", "")
        page.locator("#nf-input").type("the violin sounded sad")
        page.click("#nf-go")
        page.wait_for_selector("body[data-ready='1']")
        frame = page.frame_locator("#nf-result")
        tokens = frame.locator(".nf-tok:not(.nf-special)")
        assert tokens.count() == 4  # the, violin, sounded, sad: each a word piece of MiniLM's vocabulary
        colors = tokens.evaluate_all("els => els.map(e => getComputedStyle(e).backgroundColor)")
        assert all(c.startswith("rgb(") and c not in ("rgba(0, 0, 0, 0)", "rgb(255, 255, 255)") for c in colors)
        assert len(set(colors)) > 1, colors  # a scale, not one flat color
        status = page.inner_text("#nf-live-status")
        assert status.startswith("probed 1 text in "), status
        # hover "violin": its numbers are the JSON API's
        _, body = call(url, "/api/probe", json.dumps({"texts": ["the violin sounded sad"]}).encode())
        row = next(r for r in json.loads(body)["texts"][0]["rows"] if r["token"] == "violin")
        frame.locator(".nf-tok", has_text="violin").hover()
        tip = frame.locator("#nf-tip")
        assert tip.is_visible()
        for q in ("V2", "D", "norm", "r_eq", "kappa"):
            shown = float(tip.locator(f"td[data-q='{q}']").get_attribute("data-value"))
            assert shown == pytest.approx(row[q], rel=1e-3), q
        assert "±" in tip.inner_text() and row["regime"] in tip.inner_text()
        # a refused request shows its error on the page
        page.fill("#nf-input", "\n".join(["x"] * 33))
        page.click("#nf-go")
        assert "at most 32" in page.inner_text("#nf-live-status")
        shot = tmp_path / "serve.png"
        page.screenshot(path=str(shot))
        assert shot.stat().st_size > 20_000  # not a blank page
        assert tab.errors == [], tab.errors
        assert all(u.startswith(url) or u.startswith("about:") for u in tab.requests), tab.requests
    finally:
        page.close()


def docs_block(lang: str, marker: str) -> str:
    """The fenced ``lang`` block of the backend page (docs/backend.md) that holds ``marker``."""
    text = (ROOT / "docs" / "backend.md").read_text()
    (block,) = [b for b in re.findall(rf"^```{lang}\n(.*?)^```", text, re.M | re.S) if marker in b]
    return block


def test_the_docs_python_client_runs_as_written(url, monkeypatch, capsys):
    monkeypatch.setenv("NORMFAST_SERVE", url)
    exec(compile(docs_block("python", "NORMFAST_SERVE"), "docs/backend.md", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 3 and printed[-1] == "warnings: none", printed
    assert re.fullmatch(r"'the violin sounded sad': hottest token '\w+' \(heat_rel [+-]\d\.\d\d\)", printed[0])


@pytest.fixture(scope="module")
def frontend():
    """A page served from another port of this machine (another origin): its URL."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    page = docs_block("html", "fetch(api")  # the backend page's browser client, as written

    class Page(BaseHTTPRequestHandler):
        def do_GET(self):
            body = page.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Page)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    thread.join(timeout=10)


def test_a_frontend_on_another_port_calls_the_api_when_cors_origin_names_it(service, url, frontend, browser):
    """Headless Chromium, a page on another port calling POST /api/probe with fetch: refused by the service
    started without --cors-origin (its preflight is refused, so the browser gives the page no answer),
    answered by the service that names the page's origin; another origin's preflight stays refused there."""
    named_url, stop = serving(create_app(service, cors_origins=[frontend]))
    try:
        page = browser.new_page()
        page.set_default_timeout(30_000)
        for api, want in ((named_url, "violin\theat_rel "), (url, "refused: TypeError: Failed to fetch")):
            page.goto(f"{frontend}/?api={api}")
            page.click("#go")
            page.wait_for_function("document.getElementById('out').textContent !== ''")
            shown = page.inner_text("#out")
            assert want in shown, (api, shown)
        page.close()
        # the same preflight from an origin the service does not name
        status, headers, _ = raw(
            named_url,
            "OPTIONS",
            "/api/probe",
            headers={"Origin": "http://127.0.0.1:1", "Access-Control-Request-Method": "POST"},
        )
        assert status == 403 and "access-control-allow-origin" not in headers
        status, headers, _ = raw(
            named_url,
            "OPTIONS",
            "/api/probe",
            headers={
                "Origin": frontend,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "content-type",
            },
        )
        assert status == 200 and headers["access-control-allow-origin"] == frontend
    finally:
        stop()


def test_the_openapi_page_works_offline(url, browser):
    """/docs: FastAPI's Swagger UI, its script and style served by the service itself (no CDN)."""
    tab = Tab(browser)
    page = tab.page
    page.set_default_timeout(30_000)
    try:
        page.goto(url + "/docs")
        page.wait_for_selector(".opblock")
        paths = page.locator(".opblock-summary-path").all_inner_texts()
        assert {"/api/probe", "/api/view", "/api/info", "/api/health"} <= {p.replace("\u200b", "") for p in paths}
        assert tab.errors == [], tab.errors
        assert all(u.startswith(url) or u.startswith("data:") for u in tab.requests), tab.requests
    finally:
        page.close()


# ---------------------------------------------------------------------------
# the command


def test_a_ctrl_c_the_server_shut_down_on_is_an_interrupt():
    """uvicorn shuts down on SIGINT and then re-raises it, which asyncio's runner does not always turn into
    KeyboardInterrupt (a rare exit 0 without "interrupted" under load): the server records the Ctrl+C, and
    ``serve`` raises it after the shutdown (exit 130); SIGTERM stops it without being an interrupt."""
    app = create_app(None)
    for sig, interrupted in ((signal.SIGTERM, False), (signal.SIGINT, True)):
        server = make_server(app, "127.0.0.1", free_port())
        assert not server.interrupted and not server.should_exit
        server.handle_exit(sig, None)
        assert server.should_exit and server.interrupted is interrupted


def test_the_command_serves_and_stops(tiny_bert_folder, tmp_path):
    """``normfast serve`` as a process: the port bound before the model loads (health says "starting"
    meanwhile), "serving" printed once it serves (the next request is answered at once), an access line
    per request, Ctrl+C stops it."""
    pairs = tmp_path / "pairs.txt"
    pairs.write_text("\n".join(PAIRS) + "\n")
    port = free_port()
    argv = [sys.executable, "-m", "normfast", "serve", str(tiny_bert_folder), "--pairs", str(pairs)]
    argv += ["--params", r"encoder\.layer\.1\.", "--batches", "4", "--drift-batches", "8", "--groups", "2"]
    argv += ["--batch-size", "4", "--device", "cpu", "--port", str(port), "--directions", str(tmp_path / "d")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    here = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        starting = None
        while not any("serving http://127.0.0.1" in line for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            if starting is None:
                try:
                    starting = call(here, "/api/health")
                except urllib.error.URLError:
                    pass  # the interpreter is still starting
            time.sleep(0.05)
        if starting is not None:  # asked before the line: 503 "starting", unless the line was on its way
            assert starting[0] in (200, 503) and json.loads(starting[1])["status"] in ("starting", "ready")
        status, body = call(here, "/api/info")  # at once: the line comes once it serves
        assert status == 200 and json.loads(body)["directions"] == "computed"
        assert json.loads(call(here, "/api/health")[1])["status"] == "ready"
        status, body = call(here, "/api/probe", json.dumps({"texts": [TEXT]}).encode())
        assert status == 200 and json.loads(body)["texts"][0]["rows"]
        assert (tmp_path / "d" / "manifest.json").is_file()  # computed at the start, saved for the next time
        while not any("POST /api/probe 200" in line for line in lines):
            assert time.monotonic() < deadline, "".join(lines)
            time.sleep(0.05)
        access = next(line for line in lines if "POST /api/probe 200" in line)
        assert re.fullmatch(r"normfast serve: 127\.0\.0\.1:\d+ POST /api/probe 200 \d+\.\d{3} s\n", access)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        reader.join(timeout=10)
    assert proc.returncode == 130 and lines[-1] == "normfast serve: interrupted\n", "".join(lines)  # Ctrl+C
    assert not any("Traceback" in line for line in lines), "".join(lines)


def test_the_command_says_what_to_install(monkeypatch, capsys):
    import builtins

    from normfast.cli import main

    real = builtins.__import__

    def no_fastapi(name, *a, **k):
        if name in ("fastapi", "fastapi_offline", "uvicorn"):
            raise ImportError(f"No module named {name!r}")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_fastapi)
    assert main(["serve", "minilm", "--directions", "nowhere"]) == 2
    err = capsys.readouterr().err.strip()
    want = (
        'needs fastapi, fastapi-offline and uvicorn: pip install "normfast[serve]" (or pip install fastapi '
        "fastapi-offline uvicorn)"
    )
    assert err == f"normfast serve: error: {want}"
