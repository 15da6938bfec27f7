"""A loopback load generator: closed-loop, streaming ``/v1/completions`` clients.

``concurrency`` clients each send ``requests_per_client`` requests one after
the other (a new one as soon as the last finished), every request streamed,
greedy, with a fixed prompt length and ``max_tokens``. Every request gets its
own prompt (prompts never repeat within a server's run), so that a server's
prefix cache cannot skip the prefill that another server has to do.

Per request it records when it was sent, when each token-carrying chunk
arrived, and how many tokens the server says it generated (``usage``, where
the server sends it; else the count of token chunks).

Each client speaks HTTP/1.1 over one keep-alive connection of its own, with a
minimal parser (chunked, ``Content-Length`` or close-delimited bodies), not an
HTTP library: on a small host the load generator's CPU is taken from the
server under test, and httpx spent 2-4x more CPU per streamed chunk
(512 against 129 µs at concurrency 1).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx
import numpy as np


@dataclass(frozen=True, slots=True)
class Target:
    """One server under load and what it accepts."""

    base_url: str
    model: str
    #: Send ``ignore_eos: true`` (a vLLM extension; not every server takes it).
    ignore_eos: bool = True
    #: Send ``stream_options.include_usage`` (else rely on a usage the server sends anyway).
    include_usage: bool = True


@dataclass(slots=True)
class Sample:
    """One request, as the client saw it."""

    sent: float
    arrivals: list[float] = field(default_factory=list)
    usage_tokens: int | None = None
    prompt_tokens: int | None = None
    finished: bool = False
    error: str | None = None
    #: Attempts that failed to connect or got no response before this one.
    retries: int = 0

    @property
    def tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else len(self.arrivals)


def prompts_of_length(tokenizer_json: str, text: str, length: int, count: int) -> list[str]:
    """``count`` distinct prompts that each tokenize to exactly ``length`` ids.

    Each prompt is a window of ``text`` starting at a different word, cut to
    ``length`` tokens and kept only if its text encodes back to ``length``
    tokens (a cut can fall inside a merge).
    """
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(tokenizer_json)
    words = text.split()
    found: list[str] = []
    seen: set[str] = set()
    for start in range(len(words)):
        ids: list[int] = []
        end = start
        while len(ids) < length and end < len(words):
            end = min(len(words), end + 16)
            ids = tokenizer.encode(" ".join(words[start:end]), add_special_tokens=False).ids
        if len(ids) < length:
            break
        prompt = tokenizer.decode(ids[:length], skip_special_tokens=False)
        if prompt in seen:
            continue
        if len(tokenizer.encode(prompt, add_special_tokens=False).ids) == length:
            seen.add(prompt)
            found.append(prompt)
            if len(found) == count:
                return found
    raise ValueError(f"the text yields only {len(found)} prompts of {length} tokens")


#: Connection failures before any response are retried, as the OpenAI SDK does (twice).
CONNECT_RETRIES = 2
CONNECT_TIMEOUT = 30.0


class HttpError(Exception):
    """The server broke HTTP: a malformed status line, header or chunk."""


class Connection:
    """One client's keep-alive HTTP/1.1 connection, reopened when the server closes it."""

    def __init__(self, base_url: str) -> None:
        parts = urlsplit(base_url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self._streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def post(self, path: str, payload: bytes) -> Reply:
        """Send a JSON POST and read the status line and headers."""
        streams = self._streams
        if streams is None or streams[0].at_eof():
            self.close()
            streams = self._streams = await asyncio.wait_for(
                asyncio.open_connection(self.host, self.port), CONNECT_TIMEOUT
            )
        reader, writer = streams
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            "Content-Type: application/json\r\nAccept: text/event-stream\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n"
        )
        writer.write(head.encode() + payload)
        status_line = await reader.readline()
        if not status_line:
            self.close()
            raise ConnectionResetError("the server closed the connection before answering")
        fields = status_line.decode("latin-1").split(" ", 2)
        version, status = fields[0], fields[1] if len(fields) > 1 else ""
        if not version.startswith("HTTP/") or not status.isdigit():
            raise HttpError(f"bad status line {status_line[:80]!r}")
        headers: dict[str, str] = {}
        while (line := await reader.readline()).strip():
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        keep = version == "HTTP/1.1" and headers.get("connection", "").lower() != "close"
        return Reply(int(status), headers, reader, self, keep_alive=keep)

    def close(self) -> None:
        if self._streams is not None:
            self._streams[1].close()
        self._streams = None


@dataclass(slots=True)
class Reply:
    status: int
    headers: dict[str, str]
    reader: asyncio.StreamReader
    connection: Connection
    #: Keep the connection once the body is read (else close it).
    keep_alive: bool

    async def body(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive, whatever its framing."""
        reader = self.reader
        try:
            if "chunked" in self.headers.get("transfer-encoding", "").lower():
                while size := int((await reader.readline()).split(b";")[0].strip() or b"x", 16):
                    yield (await reader.readexactly(size + 2))[:-2]
                while (await reader.readline()).strip():  # trailers
                    pass
            elif "content-length" in self.headers:
                left = int(self.headers["content-length"])
                while left > 0:
                    piece = await reader.read(min(left, 65536))
                    if not piece:
                        raise asyncio.IncompleteReadError(b"", left)
                    left -= len(piece)
                    yield piece
            else:
                while piece := await reader.read(65536):
                    yield piece
                self.keep_alive = False
        except ValueError as error:  # int() of a bad chunk size
            self.keep_alive = False
            raise HttpError(f"bad chunk size: {error}") from error
        finally:
            if not self.keep_alive:
                self.connection.close()

    async def events(self) -> AsyncIterator[bytes]:
        """The ``data:`` payloads of an SSE body, in order (comments skipped)."""
        pending = b""
        async for piece in self.body():
            pending += piece.replace(b"\r\n", b"\n")
            *complete, pending = pending.split(b"\n\n")
            for event in complete:
                for line in event.split(b"\n"):
                    if line.startswith(b"data:"):
                        yield line[5:].strip()

    async def drain(self) -> bytes:
        return b"".join([piece async for piece in self.body()])


async def stream_one(
    connection: Connection, target: Target, prompt: str, max_tokens: int, time_limit: float
) -> Sample:
    body: dict[str, object] = {
        "model": target.model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    if target.ignore_eos:
        body["ignore_eos"] = True
    if target.include_usage:
        body["stream_options"] = {"include_usage": True}
    payload = json.dumps(body).encode()
    sample = Sample(sent=time.perf_counter())
    for attempt in range(CONNECT_RETRIES + 1):
        responded = await _stream_into(sample, connection, payload, time_limit)
        if responded or attempt == CONNECT_RETRIES:
            break
        sample.retries += 1
        sample.error = None
        await asyncio.sleep(0.05 * 2**attempt)
    if sample.error is not None:
        return sample
    if not sample.finished:
        sample.error = "the stream ended without a finish_reason"
    elif target.ignore_eos and sample.tokens != max_tokens:
        sample.error = f"{sample.tokens} tokens, not max_tokens={max_tokens}, with ignore_eos"
    elif not sample.arrivals:
        sample.error = "no token chunk"
    return sample


async def _stream_into(
    sample: Sample, connection: Connection, payload: bytes, time_limit: float
) -> bool:
    """One attempt; returns whether the server answered at all (else it may be retried)."""
    responded = False
    try:
        async with asyncio.timeout(time_limit):
            reply = await connection.post("/v1/completions", payload)
            responded = True
            if reply.status != 200:
                text = (await reply.drain()).decode(errors="replace")
                sample.error = f"HTTP {reply.status}: {text[:200]}"
                return True
            # Read to the end of the body (past [DONE]), so that the
            # connection is ready for the next request.
            async for data in reply.events():
                now = time.perf_counter()
                if data == b"[DONE]":
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    sample.error = f"stream error: {str(chunk['error'])[:200]}"
                    connection.close()  # the rest of the body is not read
                    return True
                usage = chunk.get("usage")
                if usage:
                    sample.usage_tokens = int(usage["completion_tokens"])
                    sample.prompt_tokens = int(usage["prompt_tokens"])
                for choice in chunk.get("choices") or ():
                    if choice.get("finish_reason"):
                        sample.finished = True
                    elif choice.get("text") is not None:
                        sample.arrivals.append(now)
    except (
        OSError,
        TimeoutError,
        HttpError,
        asyncio.IncompleteReadError,
        ValueError,
        KeyError,
    ) as error:
        # ValueError covers json.JSONDecodeError.
        connection.close()
        sample.error = f"{type(error).__name__}: {error}"[:200]
    return responded


@dataclass(frozen=True, slots=True)
class Level:
    """One concurrency level's requests and wall time."""

    concurrency: int
    samples: tuple[Sample, ...]
    wall: float
    #: ``time.perf_counter()`` when the first request was sent.
    started: float = 0.0

    @property
    def good(self) -> list[Sample]:
        return [s for s in self.samples if s.error is None]

    @property
    def errors(self) -> int:
        return len(self.samples) - len(self.good)

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.samples if s.error is None)

    @property
    def throughput(self) -> float:
        """Output tokens per second over the level's wall time (prefill included)."""
        return self.tokens / self.wall

    @property
    def decode_throughput(self) -> float:
        """``concurrency`` over the mean time per token after each request's
        first: the batch's steady decode rate as the streams saw it."""
        return self.concurrency / self.time_per_token if self.time_per_token else 0.0

    @property
    def time_per_token(self) -> float:
        """Seconds per token after the first, over all requests (token-weighted)."""
        spans = [(s.arrivals[-1] - s.arrivals[0], s.tokens - 1) for s in self.good if s.tokens > 1]
        tokens = sum(n for _, n in spans)
        return sum(t for t, _ in spans) / tokens if tokens else 0.0

    def ttft(self, q: float) -> float:
        values = [s.arrivals[0] - s.sent for s in self.good]
        return float(np.percentile(values, q)) if values else float("nan")

    def itl(self, q: float) -> float:
        gaps = np.concatenate([np.diff(s.arrivals) for s in self.good] or [np.zeros(0)])
        return float(np.percentile(gaps, q)) if gaps.size else float("nan")

    @property
    def tokens_per_request(self) -> float:
        good = self.good
        return sum(s.tokens for s in good) / len(good) if good else 0.0

    @property
    def prompt_tokens(self) -> set[int]:
        return {s.prompt_tokens for s in self.good if s.prompt_tokens is not None}

    @property
    def retries(self) -> int:
        return sum(s.retries for s in self.samples)

    def first_errors(self, limit: int = 3) -> list[str]:
        return [s.error for s in self.samples if s.error is not None][:limit]


async def run_level(
    target: Target,
    prompts: Iterator[str],
    *,
    concurrency: int,
    requests_per_client: int,
    max_tokens: int,
    request_timeout: float = 900.0,
) -> Level:
    """``concurrency`` closed-loop clients, each sending ``requests_per_client`` requests."""

    async def one_client(batch: Sequence[str]) -> list[Sample]:
        connection = Connection(target.base_url)
        try:
            return [
                await stream_one(connection, target, prompt, max_tokens, request_timeout)
                for prompt in batch
            ]
        finally:
            connection.close()

    batches = [[next(prompts) for _ in range(requests_per_client)] for _ in range(concurrency)]
    started = time.perf_counter()
    results = await asyncio.gather(*(one_client(batch) for batch in batches))
    wall = time.perf_counter() - started
    return Level(concurrency, tuple(s for batch in results for s in batch), wall, started)


async def wait_healthy(
    base_url: str, within: float, alive: Callable[[], bool] | None = None
) -> None:
    """Poll ``GET /health`` until it answers 200 (``alive()`` false: give up)."""
    deadline = time.monotonic() + within
    async with httpx.AsyncClient(timeout=5.0) as client:
        while time.monotonic() < deadline:
            if alive is not None and not alive():
                raise RuntimeError("the server exited before it was ready")
            try:
                if (await client.get(f"{base_url}/health")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.25)
    raise TimeoutError(f"{base_url} was not healthy within {within:.0f} s")
