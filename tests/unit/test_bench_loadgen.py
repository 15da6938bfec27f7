"""The benchmark's load generator parses HTTP and SSE itself (to keep its
CPU off the server under test); these check it against each framing the
servers it measures use."""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))

from loadgen import Level, Target, run_level


def _sse(tokens: int, *, crlf: bool = False) -> list[bytes]:
    """A streamed completion of ``tokens`` chunks, usage, [DONE], as SSE events
    (with a keepalive comment first)."""
    events = [b": keepalive\n\n"]
    for i in range(tokens):
        chunk = {"choices": [{"index": 0, "text": f"t{i}", "finish_reason": None}]}
        events.append(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    final = {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}
    usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": tokens}}
    events += [b"data: " + json.dumps(final).encode() + b"\n\n"]
    events += [b"data: " + json.dumps(usage).encode() + b"\n\n", b"data: [DONE]\n\n"]
    return [e.replace(b"\n", b"\r\n") for e in events] if crlf else events


Respond = Callable[[asyncio.StreamWriter], Awaitable[bool]]


async def _serve(
    respond: Respond,
    requests: int,
    concurrency: int = 1,
    time_limit: float = 10,
    stagger: float = 0.0,
) -> tuple[Level, int]:
    """Run ``requests`` streamed requests against a stub server; returns the
    level and how many connections the server accepted."""
    accepted = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal accepted
        accepted += 1
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                )
                body = json.loads(await reader.readexactly(length))
                assert body["stream"] is True
                if not await respond(writer):
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client closed its connection
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    prompts = (f"prompt {i}" for i in itertools.count())
    async with server:
        level = await run_level(
            Target(f"http://127.0.0.1:{port}", "m"),
            prompts,
            concurrency=concurrency,
            requests_per_client=requests,
            max_tokens=5,
            request_timeout=time_limit,
            stagger=stagger,
        )
    return level, accepted


def test_chunked_keep_alive_stream_split_anywhere() -> None:
    async def chunked(writer: asyncio.StreamWriter) -> bool:
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        data = b"".join(_sse(5, crlf=True))
        # Chunks of 7 bytes: events and lines are split across chunks.
        for i in range(0, len(data), 7):
            piece = data[i : i + 7]
            writer.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        return True

    level, accepted = asyncio.run(_serve(chunked, requests=3))
    assert level.errors == 0, level.first_errors()
    assert [s.tokens for s in level.samples] == [5, 5, 5]
    assert all(len(s.arrivals) == 5 and s.prompt_tokens == 3 for s in level.samples)
    assert accepted == 1  # one keep-alive connection for all three


def test_close_delimited_http10_reconnects_for_each_request() -> None:
    async def http10(writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.0 200 OK\r\nContent-Type: text/event-stream\r\n\r\n")
        writer.write(b"".join(_sse(5)))
        await writer.drain()
        return False  # the server closes: the end of the body

    level, accepted = asyncio.run(_serve(http10, requests=2, concurrency=2))
    assert level.errors == 0, level.first_errors()
    assert [s.tokens for s in level.samples] == [5, 5, 5, 5]
    assert accepted == 4
    assert level.retries == 0


def test_an_error_status_and_a_short_stream_are_errors() -> None:
    replies = iter(["error", "short"])

    async def respond(writer: asyncio.StreamWriter) -> bool:
        if next(replies) == "error":
            body = b'{"error": {"message": "no"}}'
            writer.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: %d\r\n\r\n" % len(body))
            writer.write(body)
            return True
        data = b"".join(_sse(3))  # 3 tokens where max_tokens 5 and ignore_eos were asked
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(data) + data)
        return True

    level, _ = asyncio.run(_serve(respond, requests=2))
    first, second = (s.error or "" for s in level.samples)
    assert first.startswith("HTTP 400: ")
    assert '"no"' in first
    assert "3 tokens, not max_tokens=5" in second


def test_a_connection_closed_before_any_answer_is_retried_then_failed() -> None:
    async def hang_up(writer: asyncio.StreamWriter) -> bool:
        return False

    level, accepted = asyncio.run(_serve(hang_up, requests=1))
    (sample,) = level.samples
    assert sample.retries == 2
    assert sample.error is not None
    assert "closed the connection" in sample.error
    assert accepted == 3


def test_each_event_is_timed_by_the_read_that_completed_it() -> None:
    """Events arrive 30 ms apart, each split over two chunks sent 30 ms apart:
    an event's time is its second half's."""

    async def slow(writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for event in _sse(5):
            for half in (event[:10], event[10:]):
                writer.write(f"{len(half):x}\r\n".encode() + half + b"\r\n")
                await writer.drain()
                await asyncio.sleep(0.03)
        writer.write(b"0\r\n\r\n")
        return True

    level, _ = asyncio.run(_serve(slow, requests=1))
    assert level.errors == 0, level.first_errors()
    (sample,) = level.samples
    # Token events are events 1-5 (after the keepalive comment): each
    # completes 60 ms after the last, the first 90 ms after the reply starts.
    gaps = [b - a for a, b in itertools.pairwise(sample.arrivals)]
    assert len(gaps) == 4
    assert all(0.05 < gap < 0.2 for gap in gaps), gaps
    assert sample.arrivals[0] - sample.sent > 0.08


def test_replies_are_parsed_once_every_client_is_done(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client whose reply ended early parses nothing while another still
    streams: parsing holds the GIL, and the other's reads would wait."""
    import loadgen

    replies = itertools.count()
    parsed: list[float] = []
    read_events = loadgen._read_events

    def timed(sample: loadgen.Sample, pieces: loadgen.Pieces) -> None:
        parsed.append(time.perf_counter())
        read_events(sample, pieces)

    monkeypatch.setattr(loadgen, "_read_events", timed)

    async def fast_then_slow(writer: asyncio.StreamWriter) -> bool:
        pause = 0.0 if next(replies) == 0 else 0.05
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for event in _sse(5):
            writer.write(f"{len(event):x}\r\n".encode() + event + b"\r\n")
            await writer.drain()
            await asyncio.sleep(pause)
        writer.write(b"0\r\n\r\n")
        return True

    level, _ = asyncio.run(_serve(fast_then_slow, requests=1, concurrency=2))
    assert level.errors == 0, level.first_errors()
    assert len(parsed) == 2
    last_read = max(s.arrivals[-1] for s in level.samples)
    assert min(parsed) > last_read
    assert sorted(len(s.arrivals) for s in level.samples) == [5, 5]


def test_a_stalled_stream_ends_at_the_time_limit() -> None:
    async def stall(writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        event = _sse(1)[1]
        writer.write(f"{len(event):x}\r\n".encode() + event + b"\r\n")
        await writer.drain()
        await asyncio.sleep(3)
        return False

    started = time.perf_counter()
    level, _ = asyncio.run(_serve(stall, requests=1, time_limit=0.5))
    (sample,) = level.samples
    assert sample.error is not None
    assert sample.error.startswith("TimeoutError")
    assert time.perf_counter() - started < 2.5


def test_stagger_spreads_the_clients_and_keeps_their_offsets() -> None:
    async def quick(writer: asyncio.StreamWriter) -> bool:
        data = b"".join(_sse(5))
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(data) + data)
        await writer.drain()
        return True

    level, _ = asyncio.run(_serve(quick, requests=2, concurrency=4, stagger=0.8))
    assert level.errors == 0, level.first_errors()
    firsts = sorted(min(s.sent for s in level.samples[i * 2 : i * 2 + 2]) for i in range(4))
    gaps = [b - a for a, b in itertools.pairwise(firsts)]
    assert all(0.15 < gap < 0.45 for gap in gaps), gaps
    unstaggered, _ = asyncio.run(_serve(quick, requests=1, concurrency=4))
    sent = [s.sent for s in unstaggered.samples]
    assert max(sent) - min(sent) < 0.15


def test_the_middle_rate_leaves_out_each_streams_edges() -> None:
    """Two streams of 16 chunks at 10 ms a chunk, each with a 500 ms stall in
    its first quarter and another in its last (a wave's edges): the decode
    rate counts the stalls, the middle half's rate does not."""
    from loadgen import Sample

    def stream(tokens_per_chunk: int) -> Sample:
        gaps = [0.01] * 15
        gaps[1] = gaps[13] = 0.5
        arrivals = list(itertools.accumulate(gaps, initial=1.0))
        return Sample(sent=0.9, arrivals=arrivals, usage_tokens=16 * tokens_per_chunk)

    level = Level(2, (stream(1), stream(1)), wall=2.0)
    assert level.middle_throughput == pytest.approx(2 / 0.01)
    assert level.decode_throughput == pytest.approx(2 / (1.13 / 15))
    # Chunks of 4 tokens (--stream-interval 4): 4 tokens every 10 ms.
    assert Level(2, (stream(4), stream(4)), wall=2.0).middle_throughput == pytest.approx(800)
    # Streams too short to have a middle count for nothing.
    short = Sample(sent=0.0, arrivals=[0.1, 0.2, 0.3])
    assert Level(1, (short,), wall=1.0).middle_throughput == 0.0


def test_the_pipeline_cost_is_per_token_at_each_paired_level() -> None:
    """At concurrency c a token streams every ``time_per_token / c``: a level
    of 4 streams at 10 ms a token against a bare step of 8 ms adds 0.5 ms a
    token; a level without a bare step is left out."""
    from loadgen import Sample
    from report import OURS, Model, Section, ServerRun, pipeline_cost

    def level(concurrency: int, gap: float) -> Level:
        arrivals = [1.0 + gap * i for i in range(11)]
        stream = Sample(sent=0.9, arrivals=arrivals, usage_tokens=11)
        return Level(concurrency, (stream,) * concurrency, wall=1.0)

    run = ServerRun(OURS, levels=[level(1, 0.003), level(4, 0.010), level(64, 0.02)])
    run.paired_step = {1: 0.002, 4: 0.008}
    tiny = Model("tiny", Path("."), "tiny", ())
    section = Section("transformers", tiny, runs=[run])
    (line,) = [line for line in pipeline_cost([section]) if line.startswith("- ")]
    assert "c=1: 3000 µs per streamed token against the bare loop's 2000" in line
    assert "adds **1000 µs** (1.50x)" in line
    assert "c=4: 2500 µs per streamed token against the bare loop's 2000" in line
    assert "adds **500 µs** (1.25x)" in line
    assert "c=64" not in line
