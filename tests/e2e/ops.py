"""Helpers of the operations tests: processes by /proc, streams read in a
thread, a client that opens a stream and never reads it."""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.e2e.harness import RunningServer


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def child_running(server: RunningServer, marker: bytes, what: str) -> int:
    """The pid of the server's child whose command line holds ``marker``."""
    for pid in children(server.process.pid):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if marker in command:
            return pid
    raise AssertionError(f"the server has no {what}")


def engine_child(server: RunningServer) -> int:
    """The pid of the server's engine process (a multiprocessing spawn child)."""
    return child_running(server, b"spawn_main", "engine process")


def chat(server: RunningServer, **fields: Any) -> dict[str, Any]:
    return {
        "model": server.model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 20,
        "temperature": 0,
        **fields,
    }


@dataclass
class Stream:
    """A streamed chat completion read in a thread: its data lines as they came."""

    server: RunningServer
    body: dict[str, Any]
    lines: list[str] = field(default_factory=list)
    status: int | None = None
    error: BaseException | None = None
    first: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    #: Set by :meth:`hang_up`: the reader closes the connection at its next line.
    leaving: threading.Event = field(default_factory=threading.Event)

    def start(self) -> Stream:
        threading.Thread(target=self._run, daemon=True).start()
        return self

    def _run(self) -> None:
        try:
            with (
                httpx.Client(timeout=120) as client,
                client.stream(
                    "POST",
                    self.server.api_url + "/chat/completions",
                    json={**self.body, "stream": True},
                    headers=self.server.auth,
                ) as reply,
            ):
                self.status = reply.status_code
                for line in reply.iter_lines():
                    if self.leaving.is_set():
                        break
                    if line.startswith("data: "):
                        self.lines.append(line[6:])
                        self.first.set()
        except BaseException as error:  # raised again in the test's thread by wait()
            self.error = error
        finally:
            self.first.set()
            self.done.set()

    def wait(self, seconds: float) -> Stream:
        """Wait for the stream to end; a stream that failed (refused, cut,
        unreadable) raises its error here, in the test."""
        assert self.done.wait(seconds), "the stream did not end"
        if self.error is not None:
            raise AssertionError(f"the stream failed: {self.error!r}") from self.error
        return self

    def hang_up(self, seconds: float) -> Stream:
        """Close the connection at the next line read, as a client that leaves."""
        self.leaving.set()
        return self.wait(seconds)

    @property
    def chunks(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.lines if line != "[DONE]"]

    @property
    def ended_well(self) -> bool:
        """Finished: a finish reason, then ``[DONE]``."""
        if self.error is not None:
            raise AssertionError(f"the stream failed: {self.error!r}") from self.error
        reasons = [c["choices"][0].get("finish_reason") for c in self.chunks if c.get("choices")]
        return bool(self.lines) and self.lines[-1] == "[DONE]" and reasons[-1] is not None

    @property
    def failed_with_event(self) -> str | None:
        """The message of the error event the stream ended with, before ``[DONE]``."""
        if len(self.lines) < 2 or self.lines[-1] != "[DONE]":
            return None
        last = json.loads(self.lines[-2])
        return last["error"]["message"] if "error" in last else None


#: The segment size the silent reader asks for, an Ethernet link's. On
#: loopback (64 KiB segments) the kernel sizes the server's send buffer at
#: 4 MB, which a slow host took minutes to fill; behind this one it is ~70 kB.
ETHERNET_MSS = 1460


class SilentReader:
    """Opens a streamed request over a socket with a tiny receive window and
    never reads the reply: the server's writes soon wait on the connection."""

    def __init__(self, server: RunningServer, body: dict[str, Any]) -> None:
        host, port = server.base_url.removeprefix("http://").split(":")
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, ETHERNET_MSS)
        self.sock.connect((host, int(port)))
        payload = json.dumps({**body, "stream": True}).encode()
        auth = "".join(f"{k}: {v}\r\n" for k, v in server.auth.items())
        self.sock.sendall(
            f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(payload)}\r\n{auth}\r\n".encode()
            + payload
        )

    def read_all(self, seconds: float) -> bytes:
        """Read what the server sends until it closes (or ``seconds`` pass)."""
        self.sock.settimeout(seconds)
        parts = []
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                part = self.sock.recv(65536)
            except (TimeoutError, ConnectionError):
                break
            if not part:
                break
            parts.append(part)
        return b"".join(parts)

    def close(self) -> None:
        self.sock.close()


def wait_for(condition: Any, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def load(server: RunningServer) -> dict[str, int]:
    body: dict[str, int] = httpx.get(server.base_url + "/health", timeout=10).json()["scheduler"]
    return body
