"""The relayed answer's tap: what a relay calls with each chunk, for the cache and the log."""

from __future__ import annotations

from proxy.upstream.capture import Capture


def test_a_capture_that_only_follows_hands_each_chunk_to_its_follower_and_keeps_none() -> None:
    folded: list[bytes] = []
    capture = Capture(0, folded.append)
    tap = capture.tap()
    for chunk in (b"data: 1\n\n", b"data: 2\n\n"):
        tap(chunk)
    capture.add(b"data: [DONE]\n\n")  # the stream's end goes through `add`
    assert folded == [b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"]
    assert not capture.kept
    assert capture.data() is None


def test_a_capture_that_keeps_the_answer_too_keeps_it_and_feeds_its_follower() -> None:
    folded: list[bytes] = []
    capture = Capture(64, folded.append)
    tap = capture.tap()
    tap(b"data: 1\n\n")
    tap(b"data: 2\n\n")
    assert folded == [b"data: 1\n\n", b"data: 2\n\n"]
    assert capture.data() == b"data: 1\n\ndata: 2\n\n"
    tap(b"x" * 64)  # past the limit: a cut answer is kept not at all
    assert capture.data() is None
    assert len(folded) == 3


def test_a_capture_with_no_follower_keeps_within_its_limit() -> None:
    capture = Capture(16)
    tap = capture.tap()
    tap(b"0123456789")
    assert capture.kept
    assert capture.data() == b"0123456789"
