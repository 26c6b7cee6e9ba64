"""The semantic cache's embedder on an https backend: it trusts what the requests trust (a private
CA through SSL_CERT_FILE), and a broken TLS record makes it unavailable (the cache skipped), never
an `ssl.SSLError` through the request."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import orjson
import pytest

from proxy.cache.embed import BackendEmbedder, EmbedderUnavailable
from proxy.policy.model import Backend
from tests.certs import self_signed, server_tls
from tests.upstream.rawserver import RawServer, read_request

VECTOR = orjson.dumps({"object": "list", "data": [{"index": 0, "embedding": [0.6, 0.8]}]})


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def embeddings(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await read_request(reader)
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
    writer.write(head % len(VECTOR) + VECTOR)
    await reader.read()


async def bad_record(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await read_request(reader)
    os.write(writer.get_extra_info("socket").fileno(), b"\x17\x03\x03\x00\x10" + b"A" * 16)
    await reader.read()


async def embed(url: str) -> list[float]:
    backend = Backend(name="private", url=url + "/v1", models=("embed",))
    embedder = BackendEmbedder(lambda: [backend], "embed", timeout_s=10)
    try:
        return list(await embedder.embed("hello"))
    finally:
        await embedder.aclose()


@pytest.mark.anyio
async def test_an_https_backend_signed_by_a_ca_in_ssl_cert_file_embeds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The requests trusted SSL_CERT_FILE and the embedder did not (certifi's CAs only): with a
    private CA every semantic lookup failed, and the cache answered nothing by meaning."""
    cert, key = self_signed(tmp_path)
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    async with RawServer(embeddings, server_tls(cert, key)) as raw:
        assert await embed(raw.url) == pytest.approx([0.6, 0.8])
        monkeypatch.delenv("SSL_CERT_FILE")
        with pytest.raises(EmbedderUnavailable, match="certificate was refused"):
            await embed(raw.url)


@pytest.mark.anyio
async def test_a_broken_tls_record_makes_the_embedder_unavailable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cert, key = self_signed(tmp_path)
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    async with RawServer(bad_record, server_tls(cert, key)) as raw:
        with pytest.raises(EmbedderUnavailable, match="TLS failed"):
            await embed(raw.url)
