"""A real S3-speaking server for the tests (moto's threaded server, in this process) and a
fault-injecting reverse proxy in front of it.

The proxy forwards every request unchanged and records it (method, path with query, in order);
rules make it answer matching requests with an error (503 SlowDown, 500), drop the connection,
delay them, or hold them unanswered until it closes (a hung store), a given number of times:
faults a real store produces (throttling, outages, slow links) on demand.

``SilentServer`` accepts connections and never answers (a store that hangs); ``BlackHole``
listens but never accepts, its backlog full, so that a connect to it hangs as to an endpoint
whose packets are dropped.
"""

from __future__ import annotations

import collections
import functools
import http.client
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ("DROP", "HANG", "BlackHole", "FaultProxy", "S3Server", "SilentServer", "free_port",
           "new_bucket", "s3_client")

_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
        "proxy-authorization", "proxy-authenticate"}
_SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
              b"<Message>Please reduce your request rate.</Message></Error>")
_INTERNAL = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InternalError</Code>'
             b"<Message>We encountered an internal error. Please try again.</Message></Error>")
DROP = 0
"""A rule's ``status`` that closes the connection without an answer."""
HANG = 1
"""A rule's ``status`` that holds the request unanswered until the proxy closes."""


class S3Server:
    """moto's S3 in a thread of this process, on a port of 127.0.0.1 that the OS chose."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        self.port = self._server.get_host_and_port()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self._server.stop()


@functools.cache
def s3_client(endpoint: str) -> Any:
    """A boto3 client of ``endpoint`` for the tests' own requests (one per endpoint: making
    a client costs a good part of a second)."""
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                        aws_access_key_id="testing", aws_secret_access_key="testing")


def new_bucket(endpoint: str) -> tuple[str, dict[str, Any]]:
    """A fresh bucket at ``endpoint``; returns (its name, the tier's S3 options with
    credentials of their own, which moto accepts and the tests look for in messages)."""
    bucket = f"ckpt-{secrets.token_hex(6)}"
    s3_client(endpoint).create_bucket(Bucket=bucket)
    options = {"access_key_id": f"ckpt-key-{secrets.token_hex(8)}",
               "secret_access_key": f"ckpt-secret-{secrets.token_hex(16)}",
               "endpoint": endpoint, "region": "us-east-1"}
    return bucket, options


@dataclass
class _Rule:
    method: str
    where: Callable[[str], bool]
    count: int | None  # None: for good
    status: int | None  # None: delay only; DROP: close the connection
    seconds: float


class FaultProxy:
    """A reverse proxy to ``127.0.0.1:upstream_port`` on a port of its own; ``options`` are
    ``base`` (the tier's S3 options) pointing to the proxy instead."""

    def __init__(self, upstream_port: int, base: dict[str, Any] | None = None, *,
                 port: int = 0) -> None:
        self.upstream_port = upstream_port
        self._closed = threading.Event()
        self.requests: list[tuple[str, str]] = []
        self.answered_faults = 0
        self._seen: collections.Counter[str] = collections.Counter()
        self._rules: list[_Rule] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _handle(self) -> None:
                body = self._body()
                fault = proxy._take(self.command, self.path)
                if fault is not None:
                    if fault.seconds:
                        time.sleep(fault.seconds)
                    if fault.status == DROP:
                        self.close_connection = True
                        return
                    if fault.status == HANG:
                        proxy._closed.wait()
                        self.close_connection = True
                        return
                    if fault.status is not None:
                        self._answer_error(fault.status)
                        return
                self._forward(body)

            def _answer_error(self, status: int) -> None:
                payload = _SLOW_DOWN if status == 503 else _INTERNAL
                self.send_response(status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(payload)

            def _forward(self, body: bytes) -> None:
                conn = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=60)
                try:
                    conn.putrequest(self.command, self.path, skip_host=True,
                                    skip_accept_encoding=True)
                    for name, value in self.headers.items():
                        if name.lower() not in _HOP and name.lower() != "content-length":
                            conn.putheader(name, value)
                    conn.putheader("Content-Length", str(len(body)))
                    conn.endheaders(body)
                    answer = conn.getresponse()
                    data = answer.read()
                    self.send_response(answer.status, answer.reason)
                    head = self.command == "HEAD"  # its Content-Length is the object's
                    for name, value in answer.getheaders():
                        if name.lower() not in _HOP and (
                            head or name.lower() != "content-length"
                        ):
                            self.send_header(name, value)
                    if not head:
                        self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    if not head:
                        self.wfile.write(data)
                finally:
                    conn.close()

            def _body(self) -> bytes:
                if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                    parts = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                        if size == 0:
                            while self.rfile.readline().strip():
                                pass
                            return b"".join(parts)
                        parts.append(self.rfile.read(size))
                        self.rfile.readline()
                length = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(length) if length else b""

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,),
                                        daemon=True, name="fault-proxy")
        self._thread.start()
        self.options = {**(base or {}), "endpoint": f"http://127.0.0.1:{self.port}"}

    def fail(self, method: str, *, count: int | None, status: int = 503, match: str = "",
             where: Callable[[str], bool] | None = None) -> None:
        """Answer the next ``count`` (None: every) ``method`` requests whose path (with its
        query) contains ``match`` and satisfies ``where`` with ``status``: 503 SlowDown, 500
        InternalError, ``DROP`` (the connection closed without an answer) or ``HANG`` (no
        answer until the proxy closes)."""
        with self._lock:
            self._rules.append(_Rule(method, _predicate(match, where), count, status, 0.0))

    def delay(self, method: str, *, seconds: float, match: str = "") -> None:
        """Hold every matching request ``seconds`` before forwarding it."""
        with self._lock:
            self._rules.append(_Rule(method, _predicate(match, None), None, None, seconds))

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()

    def seen(self, method: str, match: str = "") -> int:
        """How many ``method`` requests whose path contains ``match`` arrived so far."""
        with self._lock:
            if not match:
                return self._seen[method]
            return sum(1 for m, p in self.requests if m == method and match in p)

    def _take(self, method: str, path: str) -> _Rule | None:
        with self._lock:
            self.requests.append((method, path))
            self._seen[method] += 1
            for rule in self._rules:
                if rule.method == method and rule.where(path) and (
                    rule.count is None or rule.count > 0
                ):
                    if rule.count is not None:
                        rule.count -= 1
                    if rule.status is not None:
                        self.answered_faults += 1
                    return rule
        return None

    def close(self) -> None:
        self._closed.set()
        self._server.shutdown()
        self._server.server_close()


def free_port() -> int:
    """A port of 127.0.0.1 with nothing listening on it (a store that is down)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


class SilentServer:
    """A TCP server on 127.0.0.1 that accepts every connection, reads what comes, and never
    answers: a store that hangs. ``accepted`` counts the connections."""

    def __init__(self) -> None:
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.port = self._sock.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.accepted = 0
        self._conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True, name="silent-server")
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # closed
                return
            self.accepted += 1
            self._conns.append(conn)  # held open, never answered

    def close(self) -> None:
        for conn in [self._sock, *self._conns]:
            conn.close()


class BlackHole:
    """A port of 127.0.0.1 where a connect hangs: a socket listening with a backlog of 0 that
    never accepts, its queue filled by one connection of its own, so that the kernel drops
    the SYNs of every further connect (as a firewall dropping packets would)."""

    def __init__(self) -> None:
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(0)
        self.port = self._sock.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._filler = socket.create_connection(("127.0.0.1", self.port), timeout=5)

    def connect_hangs(self, seconds: float) -> bool:
        """Whether a further connect is still pending after ``seconds``."""
        with socket.socket() as probe:
            probe.settimeout(seconds)
            try:
                probe.connect(("127.0.0.1", self.port))
            except TimeoutError:
                return True
            except OSError:
                return False
        return False

    def close(self) -> None:
        self._filler.close()
        self._sock.close()


def _predicate(match: str, where: Callable[[str], bool] | None) -> Callable[[str], bool]:
    return lambda path: match in path and (where is None or where(path))
