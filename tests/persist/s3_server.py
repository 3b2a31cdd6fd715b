"""A real S3-speaking server for the tests (moto's threaded server, in this process) and a
fault-injecting reverse proxy in front of it.

The proxy forwards every request unchanged and records it (method, path with query, in order);
rules make it answer matching requests with an error (503 SlowDown, 500), or delay them, a given
number of times: faults a real store produces (throttling, outages, slow links) on demand.
"""

from __future__ import annotations

import http.client
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ("FaultProxy", "S3Server", "free_port")

_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
        "proxy-authorization", "proxy-authenticate"}
_SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
              b"<Message>Please reduce your request rate.</Message></Error>")
_INTERNAL = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InternalError</Code>'
             b"<Message>We encountered an internal error. Please try again.</Message></Error>")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class S3Server:
    """moto's S3 in a thread of this process, on a free port of 127.0.0.1."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self.port = free_port()
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port,
                                          verbose=False)
        self._server.start()
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def new_bucket(self) -> tuple[str, dict[str, Any]]:
        """A fresh bucket; returns (its name, fsspec options with per-bucket credentials)."""
        import fsspec

        bucket = f"ckpt-{secrets.token_hex(6)}"
        options = {"key": f"ckpt-key-{secrets.token_hex(8)}",
                   "secret": f"ckpt-secret-{secrets.token_hex(16)}",
                   "endpoint_url": self.endpoint,
                   "client_kwargs": {"region_name": "us-east-1"}}
        fs = fsspec.filesystem("s3", skip_instance_cache=True, **options)
        fs.call_s3("create_bucket", Bucket=bucket)
        return bucket, options

    def stop(self) -> None:
        self._server.stop()


@dataclass
class _Rule:
    method: str
    match: str
    count: int | None  # None: for good
    status: int | None  # None: delay only
    seconds: float


class FaultProxy:
    """A reverse proxy to ``upstream`` on a free port; ``options`` are fsspec options pointing
    to it (the same credentials as ``base``)."""

    def __init__(self, upstream_port: int, base: dict[str, Any]) -> None:
        self.upstream_port = upstream_port
        self.requests: list[tuple[str, str]] = []
        self.answered_faults = 0
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
                    if fault.status is not None:
                        payload = _SLOW_DOWN if fault.status == 503 else _INTERNAL
                        self.send_response(fault.status)
                        self.send_header("Content-Type", "application/xml")
                        self.send_header("Content-Length", str(len(payload)))
                        self.end_headers()
                        self.wfile.write(payload)
                        return
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
                    if self.command != "HEAD":
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

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="fault-proxy")
        self._thread.start()
        self.options = {**base, "endpoint_url": f"http://127.0.0.1:{self.port}"}

    def fail(self, method: str, *, count: int | None, status: int = 503,
             match: str = "") -> None:
        """Answer the next ``count`` (None: every) ``method`` requests whose path contains
        ``match`` with ``status`` (503 SlowDown, or 500 InternalError)."""
        with self._lock:
            self._rules.append(_Rule(method, match, count, status, 0.0))

    def delay(self, method: str, *, seconds: float, match: str = "") -> None:
        """Hold every matching request ``seconds`` before forwarding it."""
        with self._lock:
            self._rules.append(_Rule(method, match, None, None, seconds))

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()

    def _take(self, method: str, path: str) -> _Rule | None:
        with self._lock:
            self.requests.append((method, path))
            for rule in self._rules:
                if rule.method == method and rule.match in path and (
                    rule.count is None or rule.count > 0
                ):
                    if rule.count is not None:
                        rule.count -= 1
                    if rule.status is not None:
                        self.answered_faults += 1
                    return rule
        return None

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
