"""Slow and idle clients and connection floods, with real sockets against a real uvicorn server
on loopback (the app on a runtime of fakes), for both of uvicorn's HTTP implementations."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Iterator

import pytest
import uvicorn

from telerag.config.settings import ServerSettings
from telerag.server.process.connections import OVER_BOUND_GRACE_S, ConnectionLimits, uvicorn_options
from tests.fake_app import HEADER_TIMEOUT_S, KEEP_ALIVE_S, MAX_CONNECTIONS, serving_on_fakes

SLACK_S = 3.0  # how much later than its deadline a close may come on a busy machine (never asserted as a timing)

GET_HEALTH = b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n"


@pytest.fixture(params=["httptools", "h11"])
def address(request) -> Iterator[tuple[str, int]]:
    with serving_on_fakes(request.param) as addr:
        yield addr


def connect(address: tuple[str, int]) -> socket.socket:
    sock = socket.create_connection(address, timeout=HEADER_TIMEOUT_S + KEEP_ALIVE_S + SLACK_S)
    return sock


def closed_by_server(sock: socket.socket) -> bool:
    """True when the server closes the connection (before the socket's own timeout)."""
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True
    return True


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", 0))
    while len(body) < length:
        body += sock.recv(65536)
    return int(lines[0].split()[1]), headers, body


def test_a_complete_request_is_served_and_the_connection_kept_alive(address):
    with connect(address) as sock:
        for _ in range(2):
            sock.sendall(GET_HEALTH)
            status, headers, _ = read_response(sock)
            assert status == 200 and headers.get("connection") != "close"


def test_headers_sent_a_byte_at_a_time_are_cut_off(address):
    with connect(address) as sock:
        started = time.monotonic()
        request = b"GET /health HTTP/1.1\r\nHost: t\r\nX-Slow: " + b"a" * 200 + b"\r\n\r\n"
        with pytest.raises(OSError):  # the server closes the connection while the client still writes
            for byte in request:
                sock.sendall(bytes([byte]))
                time.sleep(0.05)
        # what the server sent, if anything, is no response
        with contextlib.suppress(OSError):
            assert not sock.recv(65536)
    assert time.monotonic() - started < HEADER_TIMEOUT_S + SLACK_S


def test_a_connection_that_sends_nothing_is_closed(address):
    with connect(address) as sock:
        assert closed_by_server(sock)


def test_the_next_request_on_a_kept_alive_connection_has_the_same_header_deadline(address):
    with connect(address) as sock:
        sock.sendall(GET_HEALTH)
        assert read_response(sock)[0] == 200
        with pytest.raises(OSError):
            for byte in GET_HEALTH * 20:
                sock.sendall(bytes([byte]))
                time.sleep(0.05)


def test_an_idle_keep_alive_connection_is_closed(address):
    with connect(address) as sock:
        sock.sendall(GET_HEALTH)
        assert read_response(sock)[0] == 200
        assert closed_by_server(sock)


def test_past_the_connection_bound_new_connections_are_refused_at_once_and_the_probes_answer(address):
    idle = [connect(address) for _ in range(MAX_CONNECTIONS)]  # hold every place (until their header deadline)
    try:
        time.sleep(0.2)  # let the server accept them all
        with connect(address) as sock:
            sock.sendall(
                b"POST /v1/rag/query HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                b'Content-Length: 15\r\n\r\n{"query": "q?"}'
            )
            status, headers, body = read_response(sock)
            assert status == 503 and headers["retry-after"] == "1" and headers["connection"] == "close"
            assert json.loads(body)["error"]["type"] == "too_many_connections"
            assert closed_by_server(sock)
        for path in (b"/health", b"/metrics"):
            with connect(address) as sock:
                sock.sendall(b"GET " + path + b" HTTP/1.1\r\nHost: t\r\n\r\n")
                status, headers, _ = read_response(sock)
                assert status == 200 and headers["connection"] == "close"
                assert closed_by_server(sock)
        with connect(address) as sock:  # past the bound, a silent connection gets only the short grace
            sock.settimeout(OVER_BOUND_GRACE_S + SLACK_S - 0.5)
            assert closed_by_server(sock)
    finally:
        for sock in idle:
            sock.close()
    time.sleep(0.2)
    with connect(address) as sock:  # below the bound again: a request is served as usual
        sock.sendall(b"GET /v1/pipelines HTTP/1.1\r\nHost: t\r\n\r\n")
        assert read_response(sock)[0] == 200


def metric(address: tuple[str, int], name: str) -> float:
    with connect(address) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: t\r\n\r\n")
        _, _, body = read_response(sock)
    values = [float(line.rsplit(" ", 1)[1]) for line in body.decode().splitlines() if line.startswith(name + " ")]
    assert len(values) == 1, f"{name} not in /metrics"
    return values[0]


def test_the_guards_actions_and_the_open_connections_are_in_the_metrics(address):
    late = 'telerag_connections_guarded_total{action="header_timeout"}'
    over = 'telerag_connections_guarded_total{action="over_bound"}'
    before = metric(address, late), metric(address, over)
    with connect(address) as sock:
        assert closed_by_server(sock)
    assert metric(address, late) == before[0] + 1
    idle = [connect(address) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.2)
        # the scrape itself is past the bound: it is answered, and counted
        assert metric(address, over) >= before[1] + 1
        assert metric(address, "telerag_connections_open") == MAX_CONNECTIONS + 1
    finally:
        for sock in idle:
            sock.close()
    time.sleep(0.2)
    assert metric(address, "telerag_connections_open") == 1  # the scrape's own


def test_uvicorn_options_come_from_the_settings():
    options = uvicorn_options(ServerSettings(header_timeout_s=3, keep_alive_timeout_s=7, max_connections=99))
    assert options["timeout_keep_alive"] == 7
    assert options["http"].limits == ConnectionLimits(header_timeout_s=3, max_connections=99)
    config = uvicorn.Config(lambda scope, receive, send: None, **options)
    config.load()
    assert config.http_protocol_class is options["http"]
