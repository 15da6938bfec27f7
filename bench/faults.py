"""The load-and-fault burst: many streaming clients over loopback, some of
them faulty, and the checks of what the server answered.

Each client is a thread that, until the burst's deadline, sends one request
after another to a surface drawn at random (chat, completions, Responses,
Messages), each request one of:

- ``good``: a streamed generation read to its end;
- ``disconnect``: the same, but the client hangs up at a random point
  (before the reply, after its head, or some bytes into the stream);
- ``bad``: a request the server must refuse with a 4xx in the surface's
  error shape (malformed JSON, wrong types, an unknown model, deep nesting,
  a prompt longer than the context).

A few more clients are stalled readers: each opens a long stream with a tiny
receive window and never reads it, until the burst ends.

The checks: no 5xx anywhere; every good stream well formed (its terminal
event -- ``[DONE]``, ``message_stop``, ``response.completed`` or
``response.incomplete`` -- after a finish reason, and no error event); every
refusal a 4xx in its surface's error shape. ``bench/loadfault.py`` runs a
burst against a server it starts and measures memory and CPU around it;
``tests/e2e/test_operations.py`` runs a short one against the suite's
server. Both use this module, so the suite checks what the bench measures.
"""

from __future__ import annotations

import json
import os
import random
import re
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from loadgen import Connection, HttpError, NoResponse, sse_events

Json = dict[str, Any]


# --- the surfaces -------------------------------------------------------------------------


def _openai_error(body: object) -> bool:
    error = body.get("error") if isinstance(body, dict) else None
    return isinstance(error, dict) and all(
        isinstance(error.get(key), str) for key in ("message", "type")
    )


def _anthropic_error(body: object) -> bool:
    if not isinstance(body, dict) or body.get("type") != "error":
        return False
    error = body.get("error")
    return isinstance(error, dict) and all(
        isinstance(error.get(key), str) for key in ("message", "type")
    )


def _choices_end(events: list[Json], done: bool) -> str | None:
    """Chat and completions: a finish reason, then ``[DONE]``."""
    if any("error" in event for event in events):
        return "an error event"
    reasons = [c.get("finish_reason") for e in events for c in e.get("choices") or ()]
    if not any(reasons):
        return "no finish_reason"
    return None if done else "no [DONE]"


def _messages_end(events: list[Json], done: bool) -> str | None:
    """Messages: a ``message_delta`` with a stop reason, then ``message_stop`` last."""
    kinds = [event.get("type") for event in events]
    if "error" in kinds:
        return "an error event"
    stops = [e["delta"].get("stop_reason") for e in events if e.get("type") == "message_delta"]
    if not any(stops):
        return "no stop_reason"
    return None if kinds and kinds[-1] == "message_stop" else "message_stop is not last"


def _responses_end(events: list[Json], done: bool) -> str | None:
    """Responses: ``response.completed`` (or ``response.incomplete`` at the
    token limit, with its reason) last, and no failure."""
    last = events[-1] if events else {}
    kind = last.get("type")
    if kind == "response.completed" and last["response"].get("status") == "completed":
        return None
    if kind == "response.incomplete" and last["response"].get("incomplete_details"):
        return None
    return f"ends with {kind!r}"


@dataclass(frozen=True, slots=True)
class Surface:
    """One API surface: its route, a streamed request's body, how its stream
    ends well, and its error shape."""

    name: str
    path: str
    body: Callable[[str, str, int], Json]
    ended_well: Callable[[list[Json], bool], str | None]
    error_shaped: Callable[[object], bool]


def _chat(model: str, prompt: str, tokens: int) -> Json:
    messages = [{"role": "user", "content": prompt}]
    return {"model": model, "messages": messages, "max_tokens": tokens, "stream": True}


def _completions(model: str, prompt: str, tokens: int) -> Json:
    return {"model": model, "prompt": prompt, "max_tokens": tokens, "stream": True}


def _responses(model: str, prompt: str, tokens: int) -> Json:
    return {"model": model, "input": prompt, "max_output_tokens": tokens, "stream": True}


SURFACES = (
    Surface("chat", "/v1/chat/completions", _chat, _choices_end, _openai_error),
    Surface("completions", "/v1/completions", _completions, _choices_end, _openai_error),
    Surface("responses", "/v1/responses", _responses, _responses_end, _openai_error),
    Surface("messages", "/v1/messages", _chat, _messages_end, _anthropic_error),
)


# --- bad requests -------------------------------------------------------------------------


def _bad_bodies(model: str, surface: Surface, context: int) -> dict[str, bytes]:
    good = surface.body(model, "hi", 4)
    wrong = {**good, "max_tokens" if "max_tokens" in good else "max_output_tokens": "many"}
    # Words of one token each: the prompt is longer than the whole context.
    too_long = surface.body(model, "hi " * (context + 16), 4)
    return {
        "malformed": json.dumps(good).encode()[:-7],
        "wrong-type": json.dumps(wrong).encode(),
        "unknown-model": json.dumps({**good, "model": "no-such-model"}).encode(),
        "deep-nesting": b'{"model": ' + b"[" * 20_000 + b"]" * 20_000 + b"}",
        "too-long": json.dumps(too_long).encode(),
    }


BAD_KINDS = ("malformed", "wrong-type", "unknown-model", "deep-nesting", "too-long")


# --- one burst ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Burst:
    """What a burst sends, and to whom."""

    base_url: str
    model: str
    clients: int
    seconds: float
    #: Shares of requests that disconnect and that are bad; the rest are good.
    disconnects: float = 0.3
    bad: float = 0.1
    stalled: int = 3
    max_tokens: int = 48
    #: The model's context length (a "too long" prompt exceeds it).
    context: int = 8192
    headers: tuple[tuple[str, str], ...] = ()
    seed: int = 0
    #: Longest wait for one reply (a hang past it is a failure).
    request_timeout: float = 120.0


@dataclass(slots=True)
class Tally:
    """What a burst saw."""

    sent: Counter[str] = field(default_factory=Counter)
    statuses: Counter[int] = field(default_factory=Counter)
    #: Good streams that ended well, per surface.
    completed: Counter[str] = field(default_factory=Counter)
    #: Bad requests refused in the surface's error shape, per kind.
    refused: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    #: Requests the client gave up on after ``request_timeout`` (on a host
    #: too busy to serve them in time), per surface (and kind, if bad).
    timed_out: Counter[str] = field(default_factory=Counter)
    #: Good requests refused with a 429 in the surface's shape (the queue was full).
    shed: Counter[str] = field(default_factory=Counter)
    wall: float = 0.0

    @property
    def server_errors(self) -> int:
        return sum(n for status, n in self.statuses.items() if status >= 500)

    def merge(self, other: Tally) -> None:
        self.sent.update(other.sent)
        self.statuses.update(other.statuses)
        self.completed.update(other.completed)
        self.refused.update(other.refused)
        self.problems.extend(other.problems)
        self.timed_out.update(other.timed_out)
        self.shed.update(other.shed)


def run_burst(burst: Burst) -> Tally:
    """Run ``burst`` (blocking) and tally it. The stalled readers are closed
    once every client has finished."""
    context = _context_length(burst)
    deadline = time.monotonic() + burst.seconds
    tallies = [Tally() for _ in range(burst.clients)]
    stalled = [StalledReader(burst, SURFACES[i % len(SURFACES)]) for i in range(burst.stalled)]
    started = time.monotonic()
    threads = [
        threading.Thread(
            target=_client, args=(burst, context, deadline, i, tallies[i]), daemon=True
        )
        for i in range(burst.clients)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    total = Tally(wall=time.monotonic() - started)
    for reader in stalled:
        total.merge(reader.close())
    for tally in tallies:
        total.merge(tally)
    return total


def _context_length(burst: Burst) -> int:
    reply = httpx.get(
        f"{burst.base_url}/v1/models/{burst.model}", headers=dict(burst.headers), timeout=30
    )
    return int(reply.json().get("max_model_len") or burst.context)


def _client(burst: Burst, context: int, deadline: float, index: int, tally: Tally) -> None:
    rng = random.Random(burst.seed * 100_003 + index)
    connection = Connection(burst.base_url)
    try:
        while time.monotonic() < deadline:
            surface = rng.choice(SURFACES)
            draw = rng.random()
            if draw < burst.bad:
                kind = rng.choice(BAD_KINDS)
                _send_bad(burst, connection, surface, kind, context, tally)
            elif draw < burst.bad + burst.disconnects:
                _send_and_hang_up(burst, surface, rng, tally)
            else:
                _send_good(burst, connection, surface, rng, tally)
    except Exception as error:  # a failure of the client itself is a finding too
        tally.problems.append(f"client {index}: {type(error).__name__}: {error}")
    finally:
        connection.close()


WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "rain",
    "falls",
    "on",
    "quiet",
    "streets",
]


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choices(WORDS, k=rng.randint(3, 40)))


def _payload(burst: Burst, surface: Surface, rng: random.Random) -> bytes:
    body = surface.body(burst.model, _prompt(rng), rng.randint(1, burst.max_tokens))
    return json.dumps(body).encode()


def _post(
    burst: Burst, connection: Connection, path: str, payload: bytes
) -> tuple[int, bytes] | None:
    """Send one request; its status and body, or None (with no reply at all)."""
    deadline = time.perf_counter() + burst.request_timeout
    for attempt in range(3):
        try:
            reply = connection.post(path, payload, deadline, dict(burst.headers))
            return reply.status, b"".join(piece for _, piece in reply.body())
        except NoResponse:
            time.sleep(0.05 * 2**attempt)
        except (OSError, EOFError, HttpError):
            connection.close()
            raise
    return None


def _answer(
    burst: Burst, connection: Connection, path: str, payload: bytes, label: str, tally: Tally
) -> tuple[int, bytes] | None:
    """One request's status and body, counted; None (noted) when it got none."""
    try:
        answer = _post(burst, connection, path, payload)
    except TimeoutError:
        tally.timed_out[label] += 1
        return None
    except (OSError, EOFError, HttpError) as error:
        tally.problems.append(f"{label}: {type(error).__name__}: {error}")
        return None
    if answer is None:
        tally.problems.append(f"{label}: no reply")
        return None
    tally.statuses[answer[0]] += 1
    return answer


def _send_good(
    burst: Burst, connection: Connection, surface: Surface, rng: random.Random, tally: Tally
) -> None:
    tally.sent[f"good {surface.name}"] += 1
    payload = _payload(burst, surface, rng)
    if (answer := _answer(burst, connection, surface.path, payload, surface.name, tally)) is None:
        return
    status, body = answer
    if status == 429 and _shaped(surface, body):
        tally.shed[surface.name] += 1
        return
    problem = stream_problem(surface, body) if status == 200 else f"HTTP {status}"
    if problem is None:
        tally.completed[surface.name] += 1
    else:
        tally.problems.append(f"{surface.name}: {problem}: {body[-300:]!r}")


def stream_problem(surface: Surface, body: bytes) -> str | None:
    """Why a streamed body is not well formed (None: it is)."""
    events: list[Json] = []
    done = False
    try:
        for _, data in sse_events([(0.0, body)]):
            if data == b"[DONE]":
                done = True
            elif done:
                return "data after [DONE]"
            else:
                events.append(json.loads(data))
    except ValueError as error:
        return f"bad JSON in an event: {error}"
    return surface.ended_well(events, done)


def _send_bad(
    burst: Burst, connection: Connection, surface: Surface, kind: str, context: int, tally: Tally
) -> None:
    tally.sent[f"bad {kind}"] += 1
    payload = _bad_bodies(burst.model, surface, context)[kind]
    label = f"{surface.name} {kind}"
    if (answer := _answer(burst, connection, surface.path, payload, label, tally)) is None:
        return
    status, body = answer
    if not 400 <= status < 500:
        tally.problems.append(f"{label}: HTTP {status}, not a 4xx: {body[:200]!r}")
    elif not _shaped(surface, body):
        tally.problems.append(f"{label}: {status} not in its shape: {body[:200]!r}")
    else:
        tally.refused[kind] += 1


def _shaped(surface: Surface, body: bytes) -> bool:
    try:
        return surface.error_shaped(json.loads(body))
    except ValueError:
        return False


def _send_and_hang_up(burst: Burst, surface: Surface, rng: random.Random, tally: Tally) -> None:
    """Open a stream on a connection of its own and close it at a random
    point: before the reply, or after some of its bytes (a 5xx head seen
    before hanging up still counts)."""
    tally.sent[f"disconnect {surface.name}"] += 1
    host, port = burst.base_url.removeprefix("http://").split(":")
    payload = _payload(burst, surface, rng)
    with socket.create_connection((host, int(port)), timeout=burst.request_timeout) as sock:
        sock.sendall(_head(burst, surface.path, host, len(payload)) + payload)
        # Hang up at once, after the reply's first bytes, or some way into
        # it (at most a second: a short reply may end before that).
        want = rng.choice((0, 1, rng.randint(1, 4000)))
        sock.settimeout(rng.uniform(0.01, 1.0))
        got = b""
        try:
            while len(got) < want and (piece := sock.recv(want - len(got))):
                got += piece
        except OSError:  # TimeoutError included
            pass
    if (status := _status_of(got)) is not None:
        tally.statuses[status] += 1


def _head(burst: Burst, path: str, host: str, length: int) -> bytes:
    headers = "".join(f"{name}: {value}\r\n" for name, value in burst.headers)
    return (
        f"POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        f"content-length: {length}\r\n{headers}\r\n"
    ).encode()


def _status_of(head: bytes) -> int | None:
    found = re.match(rb"HTTP/1\.1 (\d{3}) ", head)
    return int(found.group(1)) if found else None


#: A stalled reader's socket: a tiny receive window on Ethernet-sized
#: segments, so the server's writes soon wait on it (see tests/e2e/ops.py).
STALLED_WINDOW = 2048
ETHERNET_MSS = 1460


class StalledReader:
    """A client that opens a long stream and never reads it."""

    def __init__(self, burst: Burst, surface: Surface) -> None:
        host, port = burst.base_url.removeprefix("http://").split(":")
        self.surface = surface
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, STALLED_WINDOW)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, ETHERNET_MSS)
        self.sock.connect((host, int(port)))
        payload = json.dumps(surface.body(burst.model, "stall " * 20, 4000)).encode()
        self.sock.sendall(_head(burst, surface.path, host, len(payload)) + payload)

    def close(self) -> Tally:
        """Hang up, and count the status the server had sent by then."""
        tally = Tally()
        tally.sent[f"stalled {self.surface.name}"] += 1
        self.sock.setblocking(False)
        try:
            head = self.sock.recv(64)
        except OSError:
            head = b""
        self.sock.close()
        if (status := _status_of(head)) is not None:
            tally.statuses[status] += 1
        return tally


# --- the server's state, from outside ------------------------------------------------------


def gauges(
    base_url: str, names: tuple[str, ...] = ("num_requests_running", "num_requests_waiting")
) -> dict[str, float]:
    """Gauges from ``/metrics`` by name without their prefix (NaN: absent)."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    found = {}
    for name in names:
        match = re.search(rf"^\w+:{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
        found[name] = float(match.group(1)) if match else float("nan")
    return found


def seconds_to_idle(base_url: str, within: float = 60.0) -> float:
    """How long until both gauges read 0 (raises after ``within`` seconds)."""
    started = time.monotonic()
    while True:
        if all(value == 0 for value in gauges(base_url).values()):
            return time.monotonic() - started
        if time.monotonic() - started > within:
            raise TimeoutError(f"gauges still {gauges(base_url)} after {within:.0f} s")
        time.sleep(0.01)


def tree_pids(root: int) -> Iterator[int]:
    """``root`` and its live descendants."""
    parents: dict[int, int] = {}
    for stat in _proc_stats():
        parents[stat[0]] = stat[1]
    for pid in parents:
        node = pid
        while node > 1:
            if node == root:
                yield pid
                break
            node = parents.get(node, 0)


def _proc_stats() -> Iterator[tuple[int, int]]:
    """Each process's pid and parent pid."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    rest = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            yield int(entry), int(rest[1])


def rss_mib(root: int) -> float:
    """Resident memory of ``root`` and its descendants (the engine's child
    process with ``--engine-process``), in MiB."""
    total = 0
    for pid in tree_pids(root):
        try:
            with open(f"/proc/{pid}/status") as status:
                for line in status:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
        except OSError:
            continue
    return total / 1024
