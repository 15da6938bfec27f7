"""What the server notes about one HTTP request, for its access-log line and
its metrics: the request id, the route, the status, the tokens and when the
first and last deltas went out. No API key and no prompt text are kept."""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from sluiceway.protocol.messages import Usage
from sluiceway.surfaces.base import Headers

#: A client's ``x-request-id`` is taken when it looks like an id (a
#: gateway's, a tracing system's), and replaced otherwise: it goes into the
#: log and back into a header, so it must not carry anything else.
_REQUEST_ID = re.compile(rb"^[A-Za-z0-9._:/+=-]{1,128}$")


def request_id(headers: Headers) -> str:
    """The client's ``x-request-id`` if it is a plausible id, else a new one."""
    for name, value in headers:
        if name == b"x-request-id" and _REQUEST_ID.match(value):
            return value.decode("ascii")
    return secrets.token_hex(16)


@dataclass(slots=True)
class RequestRecord:
    """One HTTP request, as its log line and metrics see it."""

    request_id: str
    method: str
    path: str
    started: float = field(default_factory=time.monotonic)
    status: int | None = None
    #: The route's path pattern (``/v1/models/{model}``); bounded, unlike the path.
    route: str = "unmatched"
    surface: str = ""
    #: Whether the request submitted generation jobs.
    generated: bool = False
    prompt_tokens: int = 0
    completion_tokens: int = 0
    first_delta: float | None = None
    last_delta: float | None = None
    #: Observes the time between two deltas (the inter-token latency histogram).
    on_gap: Callable[[float], None] | None = None

    def delta(self) -> None:
        """A delta went out to the client now."""
        now = time.monotonic()
        if self.first_delta is None:
            self.first_delta = now
        elif self.on_gap is not None and self.last_delta is not None:
            self.on_gap(now - self.last_delta)
        self.last_delta = now

    def usage(self, usage: Usage) -> None:
        self.prompt_tokens += usage.prompt_tokens
        self.completion_tokens += usage.completion_tokens

    @property
    def ttft(self) -> float | None:
        return None if self.first_delta is None else self.first_delta - self.started

    def duration(self) -> float:
        return time.monotonic() - self.started

    def log_line(self) -> str:
        """The access-log line: method, path, status, tokens, TTFT, duration."""
        ttft = "-" if self.ttft is None else f"{self.ttft:.3f}"
        # The path is the client's: escaped, so that it cannot forge a line.
        path = self.path.encode("unicode_escape").decode("ascii").replace('"', '\\"')
        return (
            f'{self.request_id} "{self.method} {path}" {self.status or "-"} '
            f"prompt_tokens={self.prompt_tokens} completion_tokens={self.completion_tokens} "
            f"ttft={ttft} duration={self.duration():.3f}"
        )
