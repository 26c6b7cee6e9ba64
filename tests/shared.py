"""Test access to ../shared/data (tokenizer files): skipped when absent, failed in CI.

CI sets TOKENWEIR_REQUIRE_SHARED=1, so a test needing the files can never silently skip there.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"
_REASON = "needs ../shared/data (tokenizer files), present in CI"

# tiktoken's cache names (sha1 of the download URL) and the sha256 it checks on every read.
_TIKTOKEN_CACHE = {
    "cl100k_base": (
        "9b5ad71b2ce5302211f9c61530b329a4922fc6a4",
        "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7",
    ),
    "o200k_base": (
        "fb374d419588a4632f3f557e76b4b70aebbca790",
        "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d",
    ),
}


def _missing(reason: str) -> None:
    if os.environ.get("TOKENWEIR_REQUIRE_SHARED") == "1":
        pytest.fail(reason)
    pytest.skip(reason)


def shared_data() -> Path:
    """`<repo>/../shared/data`; skips the test when absent (fails it under CI)."""
    if not SHARED_DATA.is_dir():
        _missing(_REASON)
    return SHARED_DATA


def tokenizer_file(relative: str) -> Path:
    """A file under shared/data/tokenizers, e.g. "qwen2.5/qwen.tiktoken"."""
    path = shared_data() / "tokenizers" / relative
    if not path.exists():
        _missing(f"{_REASON}: {path} is missing")
    return path


@contextmanager
def offline_tiktoken(cache_dir: Path) -> Iterator[Path]:
    """tiktoken's encodings served from `cache_dir`, with any download failing at once.

    The shared files are linked under tiktoken's cache names after checking the hash tiktoken
    checks (a mismatch would make it delete the file and download), and while the context is
    open tiktoken's file reader fails any URL at once, as a dropped connection would.
    """
    import tiktoken.load

    for name, (cache_name, sha256) in _TIKTOKEN_CACHE.items():
        source = tokenizer_file(f"{name}.tiktoken")
        if hashlib.sha256(source.read_bytes()).hexdigest() != sha256:
            pytest.fail(f"{source} does not have the sha256 tiktoken expects")
        (cache_dir / cache_name).symlink_to(source)
    read_file = tiktoken.load.read_file

    def local_only(blobpath: str) -> bytes:
        if "://" in blobpath:
            raise ConnectionError(f"a test tried to download {blobpath}")
        return read_file(blobpath)

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TIKTOKEN_CACHE_DIR", str(cache_dir))
        patch.setattr(tiktoken.load, "read_file", local_only)
        yield cache_dir
