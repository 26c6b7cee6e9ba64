"""Certificates of https backends: checked by default, trusted through SSL_CERT_FILE, and a
refusal a 502 whose message says why (never a host name), on requests and on the probe."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from proxy.errors import UpstreamError, UpstreamTimeout
from proxy.policy.model import Backend, UpstreamSpec
from proxy.upstream.client import CONNECT_TIMEOUT_CODE, UpstreamClient
from tests.certs import self_signed, server_tls
from tests.contexts import admitted
from tests.upstream.rawserver import RawServer, read_request

ANSWER = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while True:
        await read_request(reader)
        writer.write(ANSWER)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def client() -> AsyncIterator[UpstreamClient]:
    upstream = UpstreamClient(UpstreamSpec(connect_timeout=5, read_timeout=10))
    yield upstream
    await upstream.aclose()


def backend(url: str) -> Backend:
    return Backend(name="private", url=url + "/v1", models=("m",))


async def refusal(client: UpstreamClient, url: str) -> tuple[str, str | None]:
    """What a request and a probe to `url` say."""
    with pytest.raises(UpstreamError) as caught:
        await client.open(admitted(), backend(url), {"model": "m"})
    assert caught.value.status == 502
    return caught.value.message, await client.probe(backend(url), 5.0)


@pytest.mark.anyio
async def test_a_self_signed_backend_is_refused_naming_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, client: UpstreamClient
) -> None:
    """It was "backend 'private' refused the connection": an operator looked for a firewall."""
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    async with RawServer(answer, server_tls(*self_signed(tmp_path))) as raw:
        message, probed = await refusal(client, raw.url)
    reason = "its TLS certificate was refused: self-signed certificate"
    assert message == f"backend 'private': {reason}"
    assert probed == reason


@pytest.mark.anyio
async def test_a_certificate_for_another_host_is_refused_without_naming_the_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, client: UpstreamClient
) -> None:
    cert, key = self_signed(tmp_path)  # for 127.0.0.1, and trusted
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    async with RawServer(answer, server_tls(cert, key)) as raw:
        assert (await client.probe(backend(raw.url), 5.0)) is None
        other_host = raw.url.replace("127.0.0.1", "localhost")
        message, probed = await refusal(client, other_host)
    assert message == (
        "backend 'private': its TLS certificate was refused: "
        "it is not valid for the backend's host name"
    )
    assert "localhost" not in str(probed)


async def plain_http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.read(1)  # a ClientHello: an http server answers it as a bad request
    writer.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
    await reader.read()


@pytest.mark.anyio
async def test_https_to_a_plain_http_port_says_tls_failed(client: UpstreamClient) -> None:
    async with RawServer(plain_http) as raw:
        message, probed = await refusal(client, raw.url.replace("http:", "https:"))
    assert message.startswith("backend 'private': TLS failed: ")
    assert str(probed).startswith("TLS failed: ")


@pytest.mark.anyio
async def test_a_tls_handshake_never_answered_is_a_connect_timeout() -> None:
    """The TCP connection taken, the TLS handshake never answered: bounded by connect_timeout
    (a connect timeout, so failed over), not the read timeout."""

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()

    upstream = UpstreamClient(UpstreamSpec(connect_timeout=0.3, read_timeout=30))
    try:
        async with RawServer(silent) as raw:
            with pytest.raises(UpstreamTimeout) as caught:
                with anyio.fail_after(10):
                    await upstream.open(admitted(), backend(raw.url.replace("http:", "https:")), {})
    finally:
        await upstream.aclose()
    assert caught.value.code == CONNECT_TIMEOUT_CODE
