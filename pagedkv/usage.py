"""How every `pagedkv` command reports a mistake its user made: one line on stderr that names
what is wrong and how to fix it, exit code 2, never a traceback.

`UsageError` is raised by the checks below (and by a role's CLI); `Parser.error` prints
argparse's own errors the same way; `run` turns a UsageError into that line. Imports neither
torch nor a role, so every command can use it.
"""

from __future__ import annotations

import argparse
import errno
import math
import os
import re
import socket
import sys
from collections.abc import Callable
from typing import NoReturn

USAGE_EXIT_CODE = 2


class UsageError(Exception):
    """A flag, file or environment value the user can fix; the message says how."""


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (`prog: error: ... (see prog --help)`), exit code 2."""

    def error(self, message: str) -> NoReturn:
        fail(self.prog, f"{message} (see `{self.prog} --help`)")


def fail(prog: str, message: str) -> NoReturn:
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(USAGE_EXIT_CODE)


def run(prog: str, body: Callable[[], None]) -> None:
    """Run a command's body; a UsageError becomes its one-line message and exit code 2."""
    try:
        body()
    except UsageError as exc:
        fail(prog, str(exc))


# -- flag types -------------------------------------------------------------------------------


def port_or_off(flag: str) -> Callable[[str], int | None]:
    """A --metrics-port style value: a port, 0 for any free one, `off` (or -1) for none."""

    def parse(text: str) -> int | None:
        value = text.strip().lower()
        if value in ("off", "-1", "none", ""):
            return None
        try:
            port = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: a port, 0 (any free port) or 'off'") from None
        if not 0 <= port < 65536:
            raise argparse.ArgumentTypeError(f"{flag} {port} outside 0..65535")
        return port

    return parse


def _number(flag: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{flag} {text!r} is not a number") from None


def positive_float(flag: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = _number(flag, text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{flag} {text} must be greater than 0")
        return value

    return parse


def budget_float(flag: str) -> Callable[[str], float]:
    """A finite number >= 0 (0: off)."""

    def parse(text: str) -> float:
        value = _number(flag, text)
        if not 0 <= value < math.inf:
            raise argparse.ArgumentTypeError(f"{flag} {text} must be a finite number >= 0 (0: off)")
        return value

    return parse


def positive_int(flag: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} {text!r} is not a whole number") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{flag} {value} must be at least 1")
        return value

    return parse


_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 10**6,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 10**9,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tb": 10**12,
    "tib": 1 << 40,
}


def parse_bytes(text: str) -> int:
    """ "2GiB" -> 2147483648; "512MB" -> 512000000; "1024" -> 1024."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 2GiB, 512MiB, 1000000)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


# -- ports ------------------------------------------------------------------------------------


def split_host_port(address: str, flag: str) -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host without brackets, port)."""
    host, sep, port_text = address.rpartition(":")
    if not sep or not port_text.isdigit() or not 0 <= int(port_text) < 65536:
        raise UsageError(f"{flag} {address!r} is not host:port (e.g. 127.0.0.1:50051; port 0 = any free one)")
    return host.strip("[]") or "0.0.0.0", int(port_text)


def port_in_use(what: str, flag: str, host: str, port: int) -> UsageError:
    return UsageError(
        f"{what} port {port} on {host} is already in use ({flag}): stop the process holding it "
        f"(`ss -ltnp 'sport = :{port}'` shows it) or choose another port (0 picks a free one)"
    )


def check_port_free(what: str, flag: str, host: str, port: int) -> None:
    """Raise a UsageError when `port` on `host` is taken. Port 0 is always free. A probe bind
    without SO_REUSEPORT: it fails exactly when a server of ours (which sets none) would."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise port_in_use(what, flag, host, port) from None
            if exc.errno == errno.EADDRNOTAVAIL:
                raise UsageError(f"{flag}: {host} is not an address of this machine") from None
            if exc.errno == errno.EACCES:
                raise UsageError(f"{flag}: port {port} needs privileges; use a port above 1023") from None
            raise


# -- memory -----------------------------------------------------------------------------------


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
