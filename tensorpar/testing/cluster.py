"""A simulated multi-machine cluster on one Linux host, for ``torchrun`` jobs.

Every machine is a network namespace with its own loopback; the machines are joined by a
veth pair (two machines) or by veth links to a bridge in a namespace of its own (more than
two), and each machine's link is rate-limited in both directions with a token bucket
(``tc qdisc ... tbf``). Addresses (``10.213.0.0/24``) exist only inside these namespaces;
nothing is added to the host's own network. `SimulatedCluster.run` starts ``torchrun`` in
every namespace with ``GLOO_SOCKET_IFNAME`` set to that machine's link, so gloo crosses a
real, slow kernel link between machines, and reports the bytes each machine's link carried
(the kernel's interface counters).

Ranks on one machine still talk over that machine's loopback: gloo binds every rank to the
address of the link interface, but the kernel delivers traffic between two local addresses
through ``lo``. Only traffic between machines crosses the link and its rate limit.

Needs root (or ``CAP_NET_ADMIN`` and ``CAP_SYS_ADMIN``) and iproute2 (``ip``, ``tc``).
Everything created is removed on exit, on error, on Ctrl-C and at interpreter exit; names
are unique, so several clusters can coexist.

Example:
    ```python
    from tensorpar.testing.cluster import SimulatedCluster

    with SimulatedCluster(machines=2, ranks_per_machine=2, link="500mbit") as cluster:
        result = cluster.run("train.py", "--steps", "10", timeout=600)
    print(result.machines[0].output, result.machines[0].tx_bytes)
    ```

Command line: ``python -m tensorpar.testing.cluster --machines 2 --ranks-per-machine 2
--link 500mbit script.py ARGS``.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tensorpar.errors import ClusterError
from tensorpar.testing import _netns
from tensorpar.testing._netns import link_bytes, remove_stale

__all__ = ["ClusterResult", "MachineResult", "SimulatedCluster", "link_bytes", "remove_stale"]



@dataclass(frozen=True)
class MachineResult:
    """What one machine's ``torchrun`` did.

    Attributes:
        machine: the machine's index (its ``--node-rank``).
        returncode: ``torchrun``'s exit status (negative: killed by that signal).
        output: ``torchrun``'s stdout and stderr, interleaved, with every local rank's output.
        tx_bytes: bytes the machine sent over its link during the run (0 with one machine).
        rx_bytes: bytes it received over its link.
        loopback_bytes: bytes sent over its loopback (traffic between its own ranks).
    """

    machine: int
    returncode: int
    output: str
    tx_bytes: int
    rx_bytes: int
    loopback_bytes: int


@dataclass(frozen=True)
class ClusterResult:
    """Every machine's `MachineResult`, indexed by machine."""

    machines: tuple[MachineResult, ...]

    @property
    def ok(self) -> bool:
        """True if every machine's ``torchrun`` exited with status 0."""
        return all(m.returncode == 0 for m in self.machines)

    def check(self) -> ClusterResult:
        """Return self if every machine succeeded.

        Returns:
            This result.

        Raises:
            ClusterError: a machine failed; the message has the end of its output.
        """
        # a machine that failed by itself first, not one stopped after it
        for m in sorted(self.machines, key=lambda m: m.returncode < 0):
            if m.returncode != 0:
                raise ClusterError(f"machine {m.machine} exited with status {m.returncode}; "
                                   f"its output ends with:\n{m.output[-4000:]}")
        return self


class SimulatedCluster:
    """Context manager: ``machines`` network namespaces joined by rate-limited links.

    Args:
        machines: number of simulated machines (1 to 250).
        ranks_per_machine: ``torchrun --nproc-per-node`` on every machine.
        link: each machine's link rate in ``tc`` notation (``"500mbit"``, ``"1gbit"``,
            ``"100mbps"`` is bytes), in each direction; ``None`` for no limit.
        port: the rendezvous port on machine 0 (each cluster has its own namespaces, so
            clusters never compete for it).

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: an argument is out of range, or ``link`` is not a rate.
        ClusterError: (on entering) not root, or ``ip`` / ``tc`` missing, or the kernel
            refused to create a namespace or link.
    """

    def __init__(self, machines: int = 2, ranks_per_machine: int = 2,
                 link: str | None = "1gbit", *, port: int = 29500) -> None:
        for name, value, low, high in (("machines", machines, 1, 250),
                                       ("ranks_per_machine", ranks_per_machine, 1, 1024),
                                       ("port", port, 1, 65535)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"SimulatedCluster: {name} must be an int, "
                                f"got {type(value).__name__}")
            if not low <= value <= high:
                raise ValueError(f"SimulatedCluster: {name} must be in [{low}, {high}], "
                                 f"got {value}")
        self.machines = machines
        self.ranks_per_machine = ranks_per_machine
        self.link = link
        self.port = port
        self._rate_bits = _netns.parse_rate(link) if link is not None else None
        base = f"tensorpar-{os.getpid()}-{secrets.token_hex(3)}"
        token = base.rsplit("-", 1)[1]
        self.namespaces = tuple(f"{base}-m{i}" for i in range(machines))
        """The network namespace of each machine (``ip netns exec NAME ...`` enters one)."""
        self.interfaces = (tuple(f"tp{token}m{i}" for i in range(machines)) if machines > 1
                           else ("lo",))
        """Each machine's link interface, as seen inside its namespace."""
        self.addresses = (tuple(f"10.213.0.{i + 1}" for i in range(machines)) if machines > 1
                          else ("127.0.0.1",))
        """Each machine's address on its link; machine 0's is the rendezvous address."""
        self._switch = f"{base}-sw" if machines > 2 else None
        self._token = token
        self._created: list[str] = []
        self._procs: list[subprocess.Popen[bytes]] = []
        self._old_sigterm: Any = None
        self._open = False

    def __repr__(self) -> str:
        return (f"SimulatedCluster(machines={self.machines}, "
                f"ranks_per_machine={self.ranks_per_machine}, link={self.link!r})")

    def __enter__(self) -> SimulatedCluster:
        _netns.check_privileges(need_tc=self.link is not None)
        atexit.register(self.close)
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL):
            self._old_sigterm = signal.signal(signal.SIGTERM, _netns.exit_on_sigterm)
        self._open = True
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self, script: str | os.PathLike[str], *args: object, timeout: float = 600.0,
            module: bool = False, env: Mapping[str, str] | None = None,
            grace: float = 10.0) -> ClusterResult:
        """Run ``torchrun ... script args`` on every machine and wait for all of them.

        Machine ``i`` runs ``python -m torch.distributed.run --nnodes M --node-rank i
        --nproc-per-node R --master-addr <machine 0> --master-port <port> script args`` in
        its namespace, with ``GLOO_SOCKET_IFNAME`` set to its link, ``OMP_NUM_THREADS=1``
        unless set, and this tensorpar importable. When one machine fails, the others get
        ``grace`` seconds to finish before they are stopped (torchrun's agents wait for each
        other at exit, so the others usually are).

        Args:
            script: the training script (or, with ``module=True``, a module name).
            *args: the script's arguments.
            timeout: seconds to wait for every machine.
            module: run ``script`` as a module (``torchrun -m``).
            env: extra environment variables for every machine.
            grace: seconds the other machines get after one fails.

        Returns:
            Every machine's exit status, output and link byte counts.

        Raises:
            ClusterError: the cluster is not open, or a machine did not finish within
                ``timeout`` (every process is stopped first; the message has each machine's
                last output).
        """
        if not self._open:
            raise ClusterError("SimulatedCluster.run: the cluster is not open; use it as "
                               "`with SimulatedCluster(...) as cluster: cluster.run(...)`")
        before = [self._counters(i) for i in range(self.machines)]
        with contextlib.ExitStack() as stack:
            stack.callback(self._stop_all)  # also on error and Ctrl-C
            files = [stack.enter_context(tempfile.TemporaryFile()) for _ in self.namespaces]
            for i, ns in enumerate(self.namespaces):
                self._procs.append(subprocess.Popen(
                    ["ip", "netns", "exec", ns, *self._torchrun(i, module), os.fspath(script),
                     *map(str, args)],
                    stdin=subprocess.DEVNULL, stdout=files[i], stderr=subprocess.STDOUT,
                    env=self._env(i, env), start_new_session=True))
            timed_out = not self._wait(timeout, grace)
            self._stop_all()
            outputs = [_netns.read(f) for f in files]
            codes = [p.returncode for p in self._procs]
            self._procs = []
        if timed_out:
            tails = "\n".join(f"--- machine {i} ---\n{out[-2000:]}" for i, out in
                              enumerate(outputs))
            raise ClusterError(f"SimulatedCluster.run({os.fspath(script)!r}): the job did "
                               f"not finish within timeout={timeout} s and was stopped; "
                               f"last output:\n{tails}")
        after = [self._counters(i) for i in range(self.machines)]
        return ClusterResult(tuple(
            MachineResult(i, codes[i], outputs[i], a[0] - b[0], a[1] - b[1], a[2] - b[2])
            for i, (b, a) in enumerate(zip(before, after, strict=True))))

    def close(self) -> None:
        """Stop every process and remove every namespace and link (idempotent)."""
        self._stop_all()
        for ns in reversed(self._created):
            _netns.kill_namespace_processes(ns)
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True, check=False)
        self._created = []
        self._open = False
        atexit.unregister(self.close)
        if self._old_sigterm is not None:
            with contextlib.suppress(ValueError):  # not the main thread any more
                signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None

    # -- building ------------------------------------------------------------------------

    def _build(self) -> None:
        for ns in (*self.namespaces, *([self._switch] if self._switch else [])):
            _netns.ip("netns", "add", ns)
            self._created.append(ns)
            _netns.ip("-n", ns, "link", "set", "lo", "up")
        if self.machines == 2:
            _netns.ip("link", "add", self.interfaces[0], "netns", self.namespaces[0], "type",
                      "veth", "peer", "name", self.interfaces[1], "netns", self.namespaces[1])
        elif self._switch is not None:
            bridge = f"tp{self._token}br"
            _netns.ip("-n", self._switch, "link", "add", bridge, "type", "bridge")
            _netns.ip("-n", self._switch, "link", "set", bridge, "up")
            for i, ns in enumerate(self.namespaces):
                port = f"tp{self._token}p{i}"
                _netns.ip("link", "add", self.interfaces[i], "netns", ns, "type", "veth",
                          "peer", "name", port, "netns", self._switch)
                _netns.ip("-n", self._switch, "link", "set", port, "master", bridge, "up")
                self._shape(self._switch, port)  # the machine's download direction
        if self.machines > 1:
            for i, ns in enumerate(self.namespaces):
                _netns.ip("-n", ns, "addr", "add", f"{self.addresses[i]}/24", "dev",
                          self.interfaces[i])
                _netns.ip("-n", ns, "link", "set", self.interfaces[i], "up")
                self._shape(ns, self.interfaces[i])  # its upload direction

    def _shape(self, ns: str, dev: str) -> None:
        if self.link is None or self._rate_bits is None:
            return
        burst = max(32 * 1024, int(self._rate_bits / 8 / 250))  # >= one 4 ms tick at the rate
        _netns.run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                    self.link, "burst", str(burst), "latency", "100ms"])

    # -- running -------------------------------------------------------------------------

    def _torchrun(self, machine: int, module: bool) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(self.machines),
                "--node-rank", str(machine), "--nproc-per-node", str(self.ranks_per_machine),
                "--master-addr", self.addresses[0], "--master-port", str(self.port),
                *(["-m"] if module else [])]

    def _env(self, machine: int, extra: Mapping[str, str] | None) -> dict[str, str]:
        env = {**os.environ, **(extra or {})}
        env["GLOO_SOCKET_IFNAME"] = self.interfaces[machine]
        env.setdefault("OMP_NUM_THREADS", "1")
        root = str(Path(__file__).resolve().parents[2])  # the directory holding tensorpar/
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        return env

    def _wait(self, timeout: float, grace: float) -> bool:
        """Wait for every process; False on timeout. A failure shortens the others' time."""
        deadline = time.monotonic() + timeout
        failed_at: float | None = None
        while time.monotonic() < deadline:
            codes = [p.poll() for p in self._procs]
            if all(c is not None for c in codes):
                return True
            if any(c not in (None, 0) for c in codes):
                failed_at = failed_at if failed_at is not None else time.monotonic()
                if time.monotonic() >= failed_at + grace:
                    return True  # the failure is the result; the stragglers are stopped
            time.sleep(0.1)
        return False

    def _stop_all(self) -> None:
        """SIGTERM each running torchrun (it stops its ranks), then SIGKILL what is left."""
        running = [p for p in self._procs if p.poll() is None]
        for p in running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        for p in running:
            try:
                p.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        if running:
            for ns in self.namespaces:  # ranks run in sessions of their own
                _netns.kill_namespace_processes(ns)

    def _counters(self, machine: int) -> tuple[int, int, int]:
        """(link tx, link rx, loopback tx) bytes of one machine, from the kernel."""
        ns = self.namespaces[machine]
        out = _netns.run(["ip", "-j", "-s", "-n", ns, "link", "show"])
        stats = {link["ifname"]: link["stats64"] for link in json.loads(out)}
        lo = stats["lo"]["tx"]["bytes"]
        if self.machines == 1:
            return 0, 0, lo
        link = stats[self.interfaces[machine]]
        return link["tx"]["bytes"], link["rx"]["bytes"], lo


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: run a torchrun script on a simulated cluster and print what it did.

    Args:
        argv: the arguments (default ``sys.argv[1:]``).

    Returns:
        0 if every machine succeeded, else the first failing machine's exit status.
    """
    parser = argparse.ArgumentParser(
        prog="python -m tensorpar.testing.cluster",
        description="Run a torchrun script on machines simulated with network namespaces and "
                    "rate-limited links (needs root).")
    parser.add_argument("--machines", type=int, default=2)
    parser.add_argument("--ranks-per-machine", type=int, default=2)
    parser.add_argument("--link", default="1gbit",
                        help="each machine's link rate in tc notation, or 'none' (default 1gbit)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds (default 600)")
    parser.add_argument("-m", "--module", action="store_true", help="run SCRIPT as a module")
    parser.add_argument("--remove-stale", action="store_true",
                        help="remove namespaces left by killed runs, then exit")
    parser.add_argument("script", nargs="?", help="the training script")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    opts = parser.parse_args(argv)
    if opts.remove_stale:
        print("\n".join(remove_stale()) or "nothing to remove")
        return 0
    if opts.script is None:
        parser.error("a script is required")
    link = None if opts.link.lower() == "none" else opts.link
    with SimulatedCluster(opts.machines, opts.ranks_per_machine, link) as cluster:
        result = cluster.run(opts.script, *opts.args, timeout=opts.timeout, module=opts.module)
    for m in result.machines:
        print(f"--- machine {m.machine}: exit status {m.returncode} ---")
        print(m.output, end="" if m.output.endswith("\n") else "\n")
    print(f"--- link {cluster.link or 'unlimited'}: bytes per machine ---")
    for m in result.machines:
        print(f"machine {m.machine}: sent {m.tx_bytes:,} received {m.rx_bytes:,} "
              f"(loopback {m.loopback_bytes:,})")
    code = next((m.returncode for m in result.machines if m.returncode), 0)
    return code if code >= 0 else 128 - code  # killed by a signal: the shell's convention


if __name__ == "__main__":
    sys.exit(main())
