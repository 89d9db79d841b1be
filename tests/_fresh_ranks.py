"""Fresh rank processes with a short process-group timeout, for tests that hang or kill ranks.

The pooled ranks of `tensorpar.testing.run_distributed` live across tests, so a test that
leaves a rank dead or its process group timed out runs here instead: its ranks are spawned
for it and killed after it, whatever state they are in.
"""

import datetime
import multiprocessing
import multiprocessing.connection
import os
import sys
import tempfile
import time
import traceback


def _child(fn, rank, world_size, store, pg_timeout, conn, path, args):
    sys.path[:] = path
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # every rank at the door before the short timeout starts: on a loaded machine a rank
    # that imports torch late would otherwise make the others' connection time out
    files = dist.FileStore(store, world_size)
    files.set_timeout(datetime.timedelta(seconds=120))
    files.set(f"ready {rank}", "1")
    files.wait([f"ready {r}" for r in range(world_size)])
    files.set_timeout(datetime.timedelta(seconds=pg_timeout))
    dist.init_process_group("gloo", store=files, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=pg_timeout))
    start = time.monotonic()
    try:
        reply = ("ok", fn(*args), time.monotonic() - start)
    except BaseException as exc:
        names = [c.__name__ for c in type(exc).__mro__]
        reply = ("err", (names, str(exc), traceback.format_exc()), time.monotonic() - start)
    conn.send(reply)
    conn.close()
    os._exit(0)  # no process-group teardown: its peers may be gone


def run_fresh(fn, world_size, *args, pg_timeout=3.0, timeout=25.0):
    """Run ``fn(*args)`` on new ranks; per rank ``(status, value, seconds)`` or ``None``.

    ``status`` is ``"ok"`` (``value`` is the return value) or ``"err"`` (``value`` is the
    exception's class names, message and traceback); ``seconds`` is the time ``fn`` ran.
    ``None``: the rank sent nothing within ``timeout`` (it died or hung; it is killed).
    """
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="tensorpar-fresh-") as tmp:
        store = os.path.join(tmp, "store")
        conns, procs = [], []
        for rank in range(world_size):
            parent, child = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_child, daemon=True,
                               args=(fn, rank, world_size, store, pg_timeout, child,
                                     list(sys.path), args))
            proc.start()
            child.close()
            conns.append(parent)
            procs.append(proc)
        results = [None] * world_size
        pending = dict(enumerate(conns))
        deadline = time.monotonic() + timeout
        while pending and time.monotonic() < deadline:
            ready = multiprocessing.connection.wait(list(pending.values()),
                                                    deadline - time.monotonic())
            for rank, conn in list(pending.items()):
                if conn in ready:
                    try:
                        results[rank] = conn.recv()
                    except (EOFError, OSError):
                        results[rank] = None  # died without a word
                    del pending[rank]
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=5)
        for conn in conns:
            conn.close()
        return results
