"""Helpers of `tensorpar.testing.cluster`: privileges, iproute2 commands, rates, counters."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import IO

from tensorpar.errors import ClusterError

_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps|tbps)$")
_UNIT_BITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
              "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12}
_CAP_NET_ADMIN, _CAP_SYS_ADMIN = 12, 21
_NAME = re.compile(r"^tensorpar-(\d+)-[0-9a-f]{6}-(m\d+|sw)$")  # SimulatedCluster's names


def parse_rate(link: str) -> float:
    """Bits per second of a ``tc`` rate such as ``"500mbit"`` (``"mbps"``: bytes)."""
    if not isinstance(link, str):
        raise TypeError(f"SimulatedCluster: link must be a str such as '500mbit' or None, "
                        f"got {type(link).__name__}")
    match = _RATE.match(link.lower())
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"SimulatedCluster: link={link!r} is not a rate; expected a number "
                         f"and one of {', '.join(_UNIT_BITS)} (tc notation), e.g. '500mbit'")
    return float(match.group(1)) * _UNIT_BITS[match.group(2)]


def check_privileges(need_tc: bool) -> None:
    """Raise `ClusterError` unless ``ip`` (and ``tc``) exist and we may create namespaces."""
    for tool in ("ip", "tc") if need_tc else ("ip",):
        if shutil.which(tool) is None:
            raise ClusterError(f"SimulatedCluster: the iproute2 command {tool!r} is not on "
                               f"PATH; install iproute2")
    if os.geteuid() == 0:
        return
    caps = 0
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                caps = int(line.split()[1], 16)
    if not (caps >> _CAP_NET_ADMIN & 1 and caps >> _CAP_SYS_ADMIN & 1):
        raise ClusterError(f"SimulatedCluster: creating network namespaces needs root, or "
                           f"CAP_NET_ADMIN and CAP_SYS_ADMIN; this process runs as uid "
                           f"{os.geteuid()} with effective capabilities {caps:#x}")


def ip(*args: str) -> None:
    """Run ``ip ARGS``; raise `ClusterError` with its message if it fails."""
    run(["ip", *args])


def run(cmd: Sequence[str]) -> str:
    """Run a command and return its stdout; raise `ClusterError` with stderr if it fails."""
    done = subprocess.run(list(cmd), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise ClusterError(f"SimulatedCluster: `{' '.join(cmd)}` failed with status "
                           f"{done.returncode}: {done.stderr.strip()}")
    return done.stdout


def kill_namespace_processes(ns: str) -> None:
    """SIGKILL the processes left inside one of our namespaces (started by us)."""
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True,
                          check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def read(f: IO[bytes]) -> str:
    """The whole content of a temporary output file, decoded."""
    f.seek(0)
    return f.read().decode(errors="replace")


def exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    """SIGTERM handler: exit through the normal unwinding, so clusters clean up."""
    raise SystemExit(128 + signum)  # unwinds through the clusters' cleanup


def link_bytes(interface: str | None = None) -> tuple[int, int]:
    """Bytes sent and received so far on this machine's link, for code running in a cluster.

    Args:
        interface: the interface; default ``GLOO_SOCKET_IFNAME``, which
            `SimulatedCluster.run` sets to the machine's link.

    Returns:
        ``(tx_bytes, rx_bytes)``, the kernel's counters since the link was created.

    Raises:
        ClusterError: no interface given and ``GLOO_SOCKET_IFNAME`` is not set, or the
            interface does not exist.
    """
    name = interface or os.environ.get("GLOO_SOCKET_IFNAME")
    if not name:
        raise ClusterError("link_bytes: no interface given and GLOO_SOCKET_IFNAME is not set "
                           "(it is set inside SimulatedCluster.run)")
    stats = Path("/sys/class/net") / name / "statistics"
    try:
        return (int((stats / "tx_bytes").read_text()), int((stats / "rx_bytes").read_text()))
    except OSError as exc:
        raise ClusterError(f"link_bytes: cannot read the counters of interface {name!r}: "
                           f"{exc}") from exc


def remove_stale() -> list[str]:
    """Remove the namespaces of simulated clusters whose creating process is gone.

    A cluster removes its namespaces itself, unless its process was killed (``SIGKILL``).

    Returns:
        The names of the namespaces removed.

    Raises:
        ClusterError: as for `SimulatedCluster`, without the privileges or ``ip``.
    """
    check_privileges(need_tc=False)
    removed = []
    for line in run(["ip", "netns", "list"]).splitlines():
        name = line.split(" ", 1)[0]
        match = _NAME.match(name)
        if match and not Path(f"/proc/{match.group(1)}").exists():
            kill_namespace_processes(name)
            subprocess.run(["ip", "netns", "delete", name], capture_output=True, check=False)
            removed.append(name)
    return removed
