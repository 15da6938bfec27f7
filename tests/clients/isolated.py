"""Running a real client and its test server where only loopback exists.

Real CLI clients reach out on their own (update checks, plugin catalogues,
telemetry). A test runs the server and the client together inside a network
namespace of their own (``unshare -rn``: a user namespace, so no privileges
are needed), where the only interface is loopback: the client can reach the
test server and nothing else.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import socket
import struct
import subprocess
from collections.abc import Sequence
from pathlib import Path

_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1


def isolation_command() -> list[str]:
    """The command prefix that runs a program in a loopback-only network
    namespace; fails the caller when this machine cannot make one."""
    unshare = shutil.which("unshare")
    if unshare is None:
        raise RuntimeError("the client tests need `unshare` (util-linux) to isolate the network")
    probe = subprocess.run([unshare, "-rn", "true"], capture_output=True, check=False)
    if probe.returncode != 0:
        raise RuntimeError(
            "this machine cannot create a network namespace (`unshare -rn true` failed: "
            f"{probe.stderr.decode(errors='replace').strip()})"
        )
    return [unshare, "-rn"]


def bring_loopback_up() -> None:
    """A new network namespace starts with loopback down: bring it up."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sh", b"lo", 0)
        flags = struct.unpack("16sh", fcntl.ioctl(sock, _SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(sock, _SIOCSIFFLAGS, struct.pack("16sh", b"lo", flags | _IFF_UP))


def only_loopback() -> bool:
    """Whether this process sees no network interface but loopback."""
    return [name for _, name in socket.if_nameindex()] == ["lo"]


def run_isolated(
    command: Sequence[str], *, cwd: Path, timeout: float
) -> subprocess.CompletedProcess[bytes]:
    """Run ``command`` (an :func:`isolation_command` line) in a process group
    of its own, and kill the whole group if the caller gives up (a timeout,
    pytest-timeout's exception, ^C): a server it started would otherwise
    outlive the test and load the host, as one once did for half an hour."""
    process = subprocess.Popen(
        command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
