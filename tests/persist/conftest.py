"""Fixtures of the persistent tier's tests: moto's S3 server (one per session), a fresh bucket
per test, and fault-injecting proxies in front of the server."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from .s3_server import FaultProxy, S3Server, new_bucket


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """The endpoint URL of moto's S3, started once for the session."""
    pytest.importorskip("moto.server")
    pytest.importorskip("obstore")
    server = S3Server()
    try:
        yield server.endpoint
    finally:
        server.stop()


@pytest.fixture
def s3_url(s3_server: str) -> tuple[str, dict[str, Any]]:
    """``("s3://<fresh bucket>/run", S3 options)``: an empty persistent tier on S3."""
    bucket, options = new_bucket(s3_server)
    return f"s3://{bucket}/run", options


@pytest.fixture
def fault_proxy(s3_server: str) -> Iterator[Callable[[dict[str, Any]], FaultProxy]]:
    """``fault_proxy(options)``: a proxy in front of the server, with ``options`` rewritten
    to go through it; closed after the test."""
    proxies: list[FaultProxy] = []
    port = int(s3_server.rsplit(":", 1)[1])

    def make(options: dict[str, Any]) -> FaultProxy:
        proxy = FaultProxy(port, options)
        proxies.append(proxy)
        return proxy

    yield make
    for proxy in proxies:
        proxy.close()
