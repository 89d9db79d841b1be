"""Run a function on N ranks and collect the results: the multi-rank test harness.

`run_distributed` keeps a pool of worker processes per ``(world_size, backend)``
alive across calls, each with an initialised process group, so a test suite pays the
process spawn once. Any rank's exception is re-raised in the caller with the rank's
number and traceback; a rank that does not finish within ``timeout`` shuts the pool down
and fails the call instead of hanging.

``fn`` and its arguments travel by pickle, so ``fn`` must be importable (a module-level
function). Scripts that call `run_distributed` need the usual
``if __name__ == "__main__":`` guard, as for any spawned process.

Example (a test module):

```python
import torch.distributed as dist
from tensorpar.testing import run_distributed

def _rank_and_size():
    return dist.get_rank(), dist.get_world_size()

def test_ranks():
    assert run_distributed(_rank_and_size, 3) == [(0, 3), (1, 3), (2, 3)]
```
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import multiprocessing
import multiprocessing.connection
import os
import pickle
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

from tensorpar.errors import RankError, RankTimeoutError

__all__ = ["RankError", "RankTimeoutError", "run_distributed", "shutdown_pools"]

T = TypeVar("T")

ERROR_GRACE_S = 3.0
"""After one rank raises, how long the others get to finish before the pool is replaced."""


class _RemoteTraceback(Exception):
    def __init__(self, text: str) -> None:
        super().__init__(text)

    def __str__(self) -> str:
        return str(self.args[0])


def run_distributed(fn: Callable[..., T], world_size: int, *args: Any, backend: str = "gloo",
                    timeout: float = 60.0) -> list[T]:
    """Run ``fn(*args)`` on ``world_size`` ranks with an initialised process group.

    Args:
        fn: an importable (module-level) function; it runs once on every rank, where
            ``torch.distributed`` is initialised with ``backend`` and ``world_size``.
        world_size: number of ranks (>= 1).
        *args: positional arguments for ``fn``, the same on every rank (picklable).
        backend: the process-group backend (``"gloo"``; ``"nccl"`` needs one GPU per rank).
        timeout: seconds to wait for every rank.

    Returns:
        Each rank's return value, indexed by rank.

    Raises:
        Exception: the exception of the lowest rank that raised, re-created in the caller
            with ``[rank r]`` prefixed to its message and the rank's traceback as its cause.
        RankTimeoutError: a rank did not finish within ``timeout``; the pool is shut down.
        RankError: a rank raised an exception that cannot be unpickled, or died.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"run_distributed: world_size must be an int >= 1, got {world_size!r}")
    key = (world_size, backend)
    pool = _POOLS.get(key)
    if pool is None or not pool.alive():
        pool = _POOLS[key] = _RankPool(world_size, backend)
    try:
        return pool.run(fn, args, timeout)
    except BaseException as exc:
        # a timeout or a dead rank leaves ranks hung; ranks left blocked after another
        # rank's error were already shut down: either way, the next call starts afresh
        if isinstance(exc, (RankTimeoutError, RankError)) or not pool.alive():
            pool.shutdown()
            _POOLS.pop(key, None)
        raise


def shutdown_pools() -> None:
    """Stop every pooled rank process (also done automatically at interpreter exit)."""
    for pool in list(_POOLS.values()):
        pool.shutdown()
    _POOLS.clear()


class _RankPool:
    """``world_size`` worker processes, each rank of one process group."""

    def __init__(self, world_size: int, backend: str) -> None:
        self.world_size = world_size
        self.backend = backend
        self._tmp = tempfile.TemporaryDirectory(prefix="tensorpar-ranks-")
        self._generation = 0
        ctx = multiprocessing.get_context("spawn")
        self.conns: list[multiprocessing.connection.Connection] = []
        self.procs: list[Any] = []
        store = self._store_path()
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker_main,
                               args=(rank, world_size, backend, store, child, sys.path),
                               daemon=True, name=f"tensorpar-rank-{rank}")
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    def _store_path(self) -> str:
        self._generation += 1
        return os.path.join(self._tmp.name, f"store-{self._generation}")

    def alive(self) -> bool:
        return bool(self.procs) and all(p.is_alive() for p in self.procs)

    def run(self, fn: Callable[..., T], args: tuple[Any, ...], timeout: float) -> list[T]:
        task = pickle.dumps(("run", sys.path, fn, args))
        for conn in self.conns:
            conn.send_bytes(task)
        replies = self._collect(fn, timeout)
        errors = {r: reply for r, reply in replies.items() if reply[0] == "err"}
        if errors:
            # A rank gave up mid-way: start a fresh process group so no stale message
            # from this call can reach the next one.
            reinit = pickle.dumps(("reinit", self._store_path()))
            for conn in self.conns:
                conn.send_bytes(reinit)
            self._collect(fn, timeout)
            _reraise(min(errors), errors[min(errors)], self.world_size)
        return [pickle.loads(replies[r][1]) for r in range(self.world_size)]

    def _collect(self, fn: Callable[..., Any], timeout: float) -> dict[int, tuple[Any, ...]]:
        deadline = time.monotonic() + timeout
        replies: dict[int, tuple[Any, ...]] = {}
        pending = {conn: r for r, conn in enumerate(self.conns)}
        while pending:
            wait = deadline - time.monotonic()
            if wait <= 0:
                break
            for conn in multiprocessing.connection.wait(list(pending), wait):
                assert isinstance(conn, multiprocessing.connection.Connection)
                rank = pending.pop(conn)
                try:
                    replies[rank] = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    code = self.procs[rank].exitcode
                    raise RankError(f"rank {rank} of {self.world_size} died (exit code {code}) "
                                    f"while running {_name(fn)}") from None
                if replies[rank][0] == "err":
                    deadline = min(deadline, time.monotonic() + ERROR_GRACE_S)
        if pending:
            late = sorted(pending.values())
            errors = {r: v for r, v in replies.items() if v[0] == "err"}
            if errors:
                first = min(errors)
                self.shutdown()
                _reraise(first, errors[first], self.world_size,
                         note=f"{_ranks(late)} {'was' if len(late) == 1 else 'were'} still "
                              f"blocked {ERROR_GRACE_S:.0f} s later, so the rank pool was "
                              f"restarted")
            raise RankTimeoutError(
                f"run_distributed({_name(fn)}, world_size={self.world_size}): {_ranks(late)} "
                f"did not finish within {timeout} s ({_ranks(sorted(replies)) or 'none'} did); "
                f"the rank pool was shut down. A rank waiting in a collective that its peers "
                f"never issued is the usual cause.")
        return replies

    def shutdown(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError, ValueError):
                conn.send_bytes(pickle.dumps(("stop",)))
        deadline = time.monotonic() + 1.0  # one second for all of them, not for each
        for proc in self.procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5.0)
        for conn in self.conns:
            conn.close()
        self.procs = []
        self.conns = []
        self._tmp.cleanup()


def _ranks(ranks: list[int]) -> str:
    """``"rank 2"``, ``"ranks 0,1"``, or ``""`` for none."""
    if not ranks:
        return ""
    return f"rank{'s' * (len(ranks) > 1)} {','.join(map(str, ranks))}"


def _name(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}"


def _reraise(rank: int, reply: tuple[Any, ...], world_size: int, note: str = "") -> None:
    _, exc_bytes, tb_text, summary = reply
    cause = _RemoteTraceback(f"rank {rank} of {world_size} raised:\n{tb_text}")
    exc: BaseException | None = None
    if exc_bytes is not None:
        try:
            exc = pickle.loads(exc_bytes)
        except Exception:
            exc = None
    if exc is None:
        raise RankError(f"[rank {rank}] {summary}" + (f" ({note})" if note else "")) from cause
    suffix = f" ({note})" if note else ""
    if exc.args and isinstance(exc.args[0], str):
        exc.args = (f"[rank {rank}] {exc.args[0]}{suffix}", *exc.args[1:])
    elif not exc.args:
        exc.args = (f"[rank {rank}]{suffix}",)
    raise exc from cause


_POOLS: dict[tuple[int, str], _RankPool] = {}
atexit.register(shutdown_pools)


# ---------------------------------------------------------------------------------------
# worker side
# ---------------------------------------------------------------------------------------

def _init_group(rank: int, world_size: int, backend: str, store: str) -> None:
    import torch.distributed as dist

    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=300))


def _worker_main(rank: int, world_size: int, backend: str, store: str,
                 conn: multiprocessing.connection.Connection, path: list[str]) -> None:
    sys.path[:] = path
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    _init_group(rank, world_size, backend, store)
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        if message[0] == "stop":
            dist.destroy_process_group()
            return
        if message[0] == "reinit":
            dist.destroy_process_group()
            _init_group(rank, world_size, backend, message[1])
            conn.send_bytes(pickle.dumps(("ok", pickle.dumps(None))))
            continue
        _, path, fn, args = message
        sys.path[:] = path
        reply: tuple[Any, ...]
        try:
            result = fn(*args)
            reply = ("ok", pickle.dumps(result))
        except BaseException as exc:
            try:
                exc_bytes: bytes | None = pickle.dumps(exc)
            except Exception:
                exc_bytes = None
            reply = ("err", exc_bytes, traceback.format_exc(), f"{type(exc).__name__}: {exc}")
        conn.send_bytes(pickle.dumps(reply))
