"""A loopback load generator: closed-loop, streaming ``/v1/completions`` clients
(or ``/v1/chat/completions``, or ``/inference/v1/generate`` with token ids).

``concurrency`` clients each send ``requests_per_client`` requests one after
the other (a new one as soon as the last finished), every request streamed,
greedy, with a fixed prompt length and ``max_tokens``. Every request gets its
own prompt (prompts never repeat within a server's run), so that a server's
prefix cache cannot skip the prefill that another server has to do.

Per request it records when it was sent, when each token-carrying chunk
arrived, and how many tokens the server says it generated (``usage``, where
the server sends it; else the count of token chunks).

On a small host the load generator's CPU is taken from the server under test
(and the bare engine it is compared with has no client at all), so it is kept
lean. Each client is a thread with one keep-alive HTTP/1.1 connection, a
blocking socket, and a minimal parser (chunked, ``Content-Length`` or
close-delimited bodies), not an HTTP library: while a reply streams, each read
costs one ``recv``, a timestamp and the chunk framing; the SSE events and their
JSON are parsed once every client of the level is done (parsing a finished
reply while other clients stream held the GIL and delayed their reads: at
c=16 on the tiny model the streams' last tokens read gaps of up to 16 ms
against ~4 ms steps, and their last ten steps ~1 ms longer than the middle
ones; half of that went). At concurrency 1 on the large bench model this
client uses about 100 µs of CPU per streamed token, everything
included; the asyncio client it replaced, with the same parser, about 220, and
httpx 2-4x more than that.
"""

from __future__ import annotations

import asyncio
import json
import math
import select
import socket
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal
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
    #: Which endpoint: a text prompt to ``/v1/completions``, or as a user
    #: message to ``/v1/chat/completions``; token ids to ``/inference/v1/generate``.
    api: Literal["completions", "chat", "generate"] = "completions"
    #: More fields for every request's body (``structured_outputs``, say).
    extra: tuple[tuple[str, object], ...] = ()


#: A request's prompt: text, or token ids for ``/inference/v1/generate``.
Prompt = str | list[int]

PATHS = {
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
    "generate": "/inference/v1/generate",
}


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


def prompts_of_length(
    tokenizer_json: str, text: str, length: int, count: int, minimum: int | None = None
) -> list[str]:
    """``count`` distinct prompts that each tokenize to exactly ``length`` ids
    (or as many as the text yields, when that is at least ``minimum``).

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
    if minimum is not None and len(found) >= minimum:
        return found
    raise ValueError(f"the text yields only {len(found)} prompts of {length} tokens")


#: Connection failures before any response are retried, as the OpenAI SDK does (twice).
CONNECT_RETRIES = 2
CONNECT_TIMEOUT = 30.0


class HttpError(Exception):
    """The server broke HTTP: a malformed status line, header or chunk."""


class NoResponse(ConnectionError):
    """The connection failed or closed before the server answered (may be retried)."""


#: What one request's body became: each piece of payload with the time the
#: read that completed it returned.
Pieces = list[tuple[float, bytes]]


class Connection:
    """One client's keep-alive HTTP/1.1 connection, a blocking socket reopened
    when the server closes it. Reads block in ``recv``, which holds no lock
    and costs no event-loop turn per streamed chunk."""

    def __init__(self, base_url: str) -> None:
        parts = urlsplit(base_url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self._socket: socket.socket | None = None
        #: Bytes read past what has been parsed.
        self._buffer = b""
        self._deadline = math.inf
        self.arrived = 0.0

    def post(
        self, path: str, payload: bytes, deadline: float, headers: Mapping[str, str] | None = None
    ) -> Reply:
        """Send a JSON POST (with ``headers`` besides its own) and read the
        status line and headers."""
        self._deadline = deadline
        if self._socket is None or _readable(self._socket):
            # Never used, or closed (or talking) while idle: a fresh connection.
            self.close()
            try:
                self._socket = socket.create_connection((self.host, self.port), CONNECT_TIMEOUT)
            except OSError as error:
                raise NoResponse(f"{type(error).__name__}: {error}") from error
            self._socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # One timeout for the whole exchange, set once rather than per read (a
        # streamed reply is read some hundred times); reads check the deadline.
        self._socket.settimeout(max(0.001, deadline - time.perf_counter()))
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            "Content-Type: application/json\r\nAccept: text/event-stream\r\n"
            f"Content-Length: {len(payload)}\r\n"
            + "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
            + "\r\n"
        )
        try:
            self._socket.sendall(head.encode() + payload)
            status_line = self.line()
        except (OSError, EOFError) as error:
            self.close()
            raise NoResponse("the server closed the connection before answering") from error
        fields = status_line.decode("latin-1").split(" ", 2)
        version, status = fields[0], fields[1] if len(fields) > 1 else ""
        if not version.startswith("HTTP/") or not status.isdigit():
            raise HttpError(f"bad status line {status_line[:80]!r}")
        answered: dict[str, str] = {}
        while line := self.line():
            name, _, value = line.decode("latin-1").partition(":")
            answered[name.strip().lower()] = value.strip()
        keep = version == "HTTP/1.1" and answered.get("connection", "").lower() != "close"
        return Reply(int(status), answered, self, keep_alive=keep)

    def recv(self) -> bytes:
        """The next bytes from the server (``b""`` at its end), within the
        deadline; :attr:`arrived` is when the read returned."""
        if self._buffer:
            data, self._buffer = self._buffer, b""
            return data
        assert self._socket is not None
        data = self._socket.recv(65536)
        self.arrived = time.perf_counter()
        if self.arrived > self._deadline:
            raise TimeoutError("the request's time limit passed")
        return data

    def push_back(self, data: bytes) -> None:
        self._buffer = data + self._buffer

    def line(self) -> bytes:
        """One header line without its line ending (EOFError at the end of the stream)."""
        data = b""
        while (end := data.find(b"\n")) < 0:
            piece = self.recv()
            if not piece:
                raise EOFError
            data += piece
        self.push_back(data[end + 1 :])
        return data[:end].rstrip(b"\r")

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
        self._socket = None
        self._buffer = b""


def _readable(sock: socket.socket) -> bool:
    return bool(select.select([sock], [], [], 0)[0])


@dataclass(slots=True)
class Reply:
    status: int
    headers: dict[str, str]
    connection: Connection
    #: Keep the connection once the body is read (else close it).
    keep_alive: bool

    def body(self) -> Pieces:
        """The whole body, whatever its framing, timed piece by piece."""
        try:
            if "chunked" in self.headers.get("transfer-encoding", "").lower():
                return self._chunked()
            if "content-length" in self.headers:
                return self._sized(int(self.headers["content-length"]))
            self.keep_alive = False
            return self._sized(None)
        except ValueError as error:  # int() of a bad size
            self.keep_alive = False
            raise HttpError(f"bad chunk size: {error}") from error
        finally:
            if not self.keep_alive:
                self.connection.close()

    def _sized(self, left: int | None) -> Pieces:
        """``left`` bytes, or (``None``) everything up to the end of the stream."""
        pieces: Pieces = []
        while left is None or left > 0:
            piece = self.connection.recv()
            if not piece:
                if left is None:
                    return pieces
                raise EOFError(f"the body ended {left} bytes short")
            if left is not None:
                self.connection.push_back(piece[left:])
                piece = piece[:left]
                left -= len(piece)
            pieces.append((self.connection.arrived, piece))
        return pieces

    def _chunked(self) -> Pieces:
        pieces: Pieces = []
        pending = b""
        size: int | None = None  # of the chunk being read, once its size line is in
        connection = self.connection
        while True:
            if size is None and (end := pending.find(b"\r\n")) >= 0:
                size = int(pending[:end].split(b";")[0].strip() or b"x", 16)
                pending = pending[end + 2 :]
                if size == 0:
                    connection.push_back(pending)
                    while connection.line():  # trailers
                        pass
                    return pieces
            if size is not None and len(pending) >= size + 2:
                pieces.append((connection.arrived, pending[:size]))
                pending, size = pending[size + 2 :], None
                continue
            piece = connection.recv()
            if not piece:
                raise EOFError("the body ended inside a chunk")
            pending = pending + piece if pending else piece


def sse_events(pieces: Pieces) -> Iterator[tuple[float, bytes]]:
    """The ``data:`` payloads of an SSE body, each with the time the piece
    that completed it arrived (comments skipped)."""
    pending = b""
    for arrived, piece in pieces:
        pending += piece.replace(b"\r\n", b"\n")
        *complete, pending = pending.split(b"\n\n")
        for event in complete:
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    yield arrived, line[5:].strip()


def request_body(target: Target, prompt: Prompt, max_tokens: int) -> dict[str, object]:
    """A greedy streamed request of ``max_tokens`` for the target's endpoint."""
    sampling: dict[str, object] = {"max_tokens": max_tokens, "temperature": 0}
    if target.ignore_eos:
        sampling["ignore_eos"] = True
    body: dict[str, object] = {"model": target.model, "stream": True}
    if target.include_usage:
        body["stream_options"] = {"include_usage": True}
    if target.api == "generate":
        return body | {"token_ids": prompt, "sampling_params": sampling}
    if target.api == "chat":
        return body | {"messages": [{"role": "user", "content": prompt}]} | sampling
    return body | {"prompt": prompt} | sampling


def read_one(
    connection: Connection, target: Target, prompt: Prompt, max_tokens: int, time_limit: float
) -> tuple[Sample, Pieces]:
    """Send one request and read its reply, timed piece by piece, without
    parsing it (:func:`parse_one`)."""
    body = request_body(target, prompt, max_tokens) | dict(target.extra)
    payload = json.dumps(body).encode()
    sample = Sample(sent=time.perf_counter())
    path = PATHS[target.api]
    for attempt in range(CONNECT_RETRIES + 1):
        try:
            return sample, _exchange(sample, connection, path, payload, sample.sent + time_limit)
        except NoResponse as error:
            sample.error = str(error)[:200]
            if attempt == CONNECT_RETRIES:
                break
            sample.retries += 1
            time.sleep(0.05 * 2**attempt)
    return sample, []


def parse_one(sample: Sample, pieces: Pieces, target: Target, max_tokens: int) -> Sample:
    """Fill ``sample`` from its reply's pieces and check it is whole."""
    if sample.error is None:
        _read_events(sample, pieces)
    if sample.error is not None:
        return sample
    if not sample.finished:
        sample.error = "the stream ended without a finish_reason"
    elif target.ignore_eos and sample.tokens != max_tokens:
        sample.error = f"{sample.tokens} tokens, not max_tokens={max_tokens}, with ignore_eos"
    elif not sample.arrivals:
        sample.error = "no token chunk"
    return sample


def _exchange(
    sample: Sample, connection: Connection, path: str, payload: bytes, deadline: float
) -> Pieces:
    """One attempt: the body's pieces, or ``sample.error`` set. Raises
    :class:`NoResponse` when the server did not answer (it may be retried)."""
    try:
        reply = connection.post(path, payload, deadline)
        sample.error = None
        pieces = reply.body()
        if reply.status != 200:
            text = b"".join(piece for _, piece in pieces).decode(errors="replace")
            sample.error = f"HTTP {reply.status}: {text[:200]}"
        return pieces
    except NoResponse:
        raise
    except (OSError, EOFError, HttpError) as error:
        # OSError covers TimeoutError.
        connection.close()
        sample.error = f"{type(error).__name__}: {error}"[:200]
        return []


def _read_events(sample: Sample, pieces: Pieces) -> None:
    """Fill ``sample`` from a streamed body (after it was read, so that parsing
    JSON costs no CPU while the server streams)."""
    try:
        for arrived, data in sse_events(pieces):
            if data == b"[DONE]":
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                sample.error = f"stream error: {str(chunk['error'])[:200]}"
                return
            usage = chunk.get("usage")
            if usage:
                sample.usage_tokens = int(usage["completion_tokens"])
                sample.prompt_tokens = int(usage["prompt_tokens"])
            for choice in chunk.get("choices") or ():
                if choice.get("finish_reason"):
                    sample.finished = True
                elif _carries_output(choice):
                    sample.arrivals.append(arrived)
    except (ValueError, KeyError, TypeError) as error:
        # ValueError covers json.JSONDecodeError.
        sample.error = f"{type(error).__name__}: {error}"[:200]


def _carries_output(choice: dict[str, object]) -> bool:
    """Whether a streamed choice carries output: completion text (even empty,
    as the other servers send it), token ids, or chat text."""
    if choice.get("text") is not None or choice.get("token_ids"):
        return True
    delta = choice.get("delta")
    return isinstance(delta, dict) and any(
        delta.get(key) for key in ("content", "reasoning_content", "reasoning")
    )


@dataclass(frozen=True, slots=True)
class Level:
    """One concurrency level's requests and wall time."""

    concurrency: int
    samples: tuple[Sample, ...]
    wall: float
    #: ``time.perf_counter()`` when the first request was sent.
    started: float = 0.0
    #: Cores the load generator used while the level ran (its whole process).
    client_cpu: float = 0.0

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
    def middle_throughput(self) -> float:
        """:attr:`decode_throughput` over each request's middle half only
        (from a quarter of its chunks to three quarters; its tokens spread
        evenly over its chunks). A diagnostic beside the decode rate: when a
        level's requests start together, the decode rate also counts the
        wave's edges, where the first streams wait through later prompts'
        prefill and the last finish in a shrinking batch; the middle is the
        batch decoding whole, as the bare loop does."""
        spans: list[tuple[float, float]] = []
        for sample in self.good:
            chunks = len(sample.arrivals)
            if chunks >= 8:
                low, high = chunks // 4, 3 * chunks // 4
                seconds = sample.arrivals[high] - sample.arrivals[low]
                spans.append((seconds, (high - low) * sample.tokens / chunks))
        seconds = sum(t for t, _ in spans)
        return self.concurrency * sum(n for _, n in spans) / seconds if seconds else 0.0

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
    prompts: Iterator[Prompt],
    *,
    concurrency: int,
    requests_per_client: int,
    max_tokens: int,
    request_timeout: float = 900.0,
    stagger: float = 0.0,
) -> Level:
    """``concurrency`` closed-loop clients, each sending ``requests_per_client``
    requests, each client in a thread of its own (awaited, so that the caller's
    event loop keeps running).

    Closed-loop clients whose requests take equally long start and end in
    step: each round's prompts are all prefilled before its first decode.
    ``stagger`` spreads them: client ``i`` starts ``i / concurrency *
    stagger`` seconds late, and keeps that offset, so that prompts arrive
    while other streams decode (as under continuous arrivals)."""

    def one_client(offset: float, batch: Sequence[Prompt]) -> list[tuple[Sample, Pieces]]:
        time.sleep(offset)
        connection = Connection(target.base_url)
        try:
            return [
                read_one(connection, target, prompt, max_tokens, request_timeout)
                for prompt in batch
            ]
        finally:
            connection.close()

    batches = [[next(prompts) for _ in range(requests_per_client)] for _ in range(concurrency)]
    loop = asyncio.get_running_loop()
    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="client") as clients:
        cpu = time.process_time()
        started = time.perf_counter()
        results = await asyncio.gather(
            *(
                loop.run_in_executor(clients, one_client, i / concurrency * stagger, batch)
                for i, batch in enumerate(batches)
            )
        )
        wall = time.perf_counter() - started
        cpu = time.process_time() - cpu
    # Parsed once every client is done: a client that parsed its finished
    # reply while others still streamed held the process's GIL for a
    # millisecond or more, and the others' reads (their arrival times) waited.
    samples = tuple(
        parse_one(sample, pieces, target, max_tokens)
        for batch in results
        for sample, pieces in batch
    )
    return Level(concurrency, samples, wall, started, client_cpu=cpu / wall)


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
