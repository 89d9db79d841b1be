"""The hierarchical (2-D) all-reduce: within machines, along the rails, within machines.

On ``M`` machines of ``R`` ranks, a flat ring all-reduce of ``n`` bytes sends
``2 (M R - 1) / (M R) * n`` bytes through every rank, and the ring crosses each machine's
network link with that much. The hierarchical algorithm sends only ``2 (M - 1) / M * n``
bytes over each machine's link:

1. **reduce-scatter within the machine**: rank ``j`` of the machine gets the machine's sum of
   shard ``j`` (``n / R`` elements);
2. **all-reduce along the rails**: rank ``j`` of every machine all-reduces shard ``j``, so
   ``R`` exchanges of ``n / R`` elements share the network, one per rail;
3. **all-gather within the machine**: every rank gets every reduced shard, in place.

Large tensors are cut into slices that flow through the three stages as a pipeline: slice
``k`` crosses the network while slice ``k + 1`` is reduced within the machine and slice
``k - 1`` is gathered. Successive calls on one `Topology` join the same pipeline, so
back-to-back buckets overlap the same way. Sizes that ``R`` does not divide keep their last
``numel % R`` elements out of the scatter: those few elements are all-reduced within the
machine and then along the rails, in place too.

All collectives on a topology's subgroups are issued by one thread per topology, in call
order, so the ranks always issue them in the same order whatever the caller's threads do.
The same code runs on gloo (CPU) and NCCL (CUDA).

That thread is stopped and joined, after the calls it has queued, when its topology is
collected, at interpreter exit (before the interpreter finalizes) or by
`shutdown_hierarchical`; a later call starts a new one. A thread left to run into the
interpreter's finalization would release its last work handles there, and a thread that
needs the GIL during finalization is killed, which aborts the process.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections import deque
from typing import Any, Literal

import torch
import torch.distributed as dist

from tensorpar import _comm
from tensorpar._group import Group, resolve_group
from tensorpar.errors import TensorparError
from tensorpar.topology import Topology

__all__ = ["DEFAULT_SLICE_BYTES", "HierarchicalWork", "hierarchical_all_reduce",
           "shutdown_hierarchical"]

DEFAULT_SLICE_BYTES = 4 * 2**20
"""Bytes per pipeline slice (on the simulated 2 x 2 cluster, 2 and 4 MiB slices were fastest
at 64 MiB; 8 and 16 MiB were 4-6% slower)."""

_SUM: Any = dist.ReduceOp.SUM if dist.is_available() else None

_EXIT_TIMEOUT = 30.0
"""Seconds the interpreter's exit waits for each engine thread (its queued calls included)."""
_THREAD_NAME = "tensorpar-hierarchical"


def hierarchical_all_reduce(tensor: torch.Tensor, topology: Topology, *,
                            op: Literal["sum", "mean"] = "sum", async_op: bool = False,
                            slice_bytes: int = DEFAULT_SLICE_BYTES) -> HierarchicalWork | None:
    """All-reduce ``tensor`` in place over the ranks of ``topology``, machine by machine.

    Forward: every rank's ``tensor`` becomes the sum (or mean) over the group, in place.
    Backward: none (an in-place primitive for gradient buckets, outside autograd;
    ``tensorpar.all_reduce(..., algorithm="hierarchical")`` is the differentiable form).

    Every rank of the topology's group must call it with a tensor of the same numel and dtype,
    in the same order with respect to other calls on the same topology. ``"mean"`` divides
    by the group size once, before reducing (no overflow in low precision, no double
    division). With one machine or one rank per machine this is a single all-reduce on the
    topology's own subgroup.

    Shape:
        Any shape; the tensor must be contiguous and is reduced as a flat view.

    Args:
        tensor: the tensor to reduce in place (CPU with gloo, CUDA with NCCL).
        topology: the layout of the group, from `Topology.detect` or `Topology.grid`.
        op: ``"sum"`` or ``"mean"``.
        async_op: return a `HierarchicalWork` at once instead of waiting.
        slice_bytes: pipeline slice size in bytes (rounded down to a whole number of
            elements, a multiple of the ranks per machine, at least one element each).

    Returns:
        ``None``, or with ``async_op=True`` a `HierarchicalWork`: ``tensor`` holds the result
        only after its ``wait()``.

    Raises:
        TypeError: ``tensor`` or ``topology`` has the wrong type, ``op="mean"`` on an
            integer tensor, or ``slice_bytes`` is not an int.
        ValueError: ``op`` is unknown, ``tensor`` is not contiguous, ``slice_bytes < 1``.
        TensorparError: a collective of the pipeline failed (raised by ``wait()``).

    Example:
        >>> import torch
        >>> from tensorpar.topology import Topology
        >>> x = torch.arange(4.0)
        >>> hierarchical_all_reduce(x, Topology.grid(1), op="mean")  # one rank: no-op
        >>> x
        tensor([0., 1., 2., 3.])
    """
    fn = "hierarchical_all_reduce"
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{fn}: tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if not isinstance(topology, Topology):
        raise TypeError(f"{fn}: topology must be a tensorpar.topology.Topology (from "
                        f"Topology.detect or Topology.grid), got {type(topology).__name__}")
    if op not in ("sum", "mean"):
        raise ValueError(f"{fn}: op must be 'sum' or 'mean', got {op!r}")
    if op == "mean" and not (tensor.is_floating_point() or tensor.is_complex()):
        raise TypeError(f"{fn}: op='mean' needs a floating-point tensor, got {tensor.dtype}")
    if not tensor.is_contiguous():
        raise ValueError(f"{fn}: tensor must be contiguous (it is reduced in place through a "
                         f"flat view), got shape {tuple(tensor.shape)} with strides "
                         f"{tensor.stride()}")
    if isinstance(slice_bytes, bool) or not isinstance(slice_bytes, int):
        raise TypeError(f"{fn}: slice_bytes must be an int, got {type(slice_bytes).__name__}")
    if slice_bytes < 1:
        raise ValueError(f"{fn}: slice_bytes must be >= 1, got {slice_bytes}")
    work = HierarchicalWork()
    if tensor.numel() == 0 or topology.size == 1:
        work._issued.set()
        return work if async_op else None
    flat = tensor.detach().view(-1)  # the same memory, outside autograd (buckets are leaves)
    if op == "mean":
        flat.div_(topology.size)
    per_slice = slice_bytes // tensor.element_size()
    r = topology.ranks_per_machine
    _engine(topology).submit(work, flat, max(r, per_slice - per_slice % r))
    if async_op:
        return work
    work.wait()
    return None


def shutdown_hierarchical(topology: Topology | None = None, *,
                          timeout: float | None = None) -> bool:
    """Stop the thread that issues ``topology``'s hierarchical collectives, and wait for it.

    The thread first finishes the calls already queued (their handles stay valid); a later
    call on the topology starts a new thread, after this one has ended, so calls keep their
    order. Topologies that are collected, and every topology at interpreter exit, get this
    automatically; call it to release the thread earlier (`BucketedAllReduce.remove` does,
    for its topology). Local: it issues no collective, but queued calls may wait for peers.

    Args:
        topology: the topology whose thread to stop (``None``: every topology's).
        timeout: seconds to wait for each thread (``None``: as long as it takes).

    Returns:
        ``True`` if every thread stopped within ``timeout``.

    Raises:
        TypeError: ``topology`` is not a `Topology` (or ``None``).

    Example:
        >>> from tensorpar.topology import Topology
        >>> shutdown_hierarchical(Topology.grid(1))  # no thread was started: nothing to stop
        True
    """
    if topology is not None and not isinstance(topology, Topology):
        raise TypeError(f"shutdown_hierarchical: topology must be a tensorpar.topology.Topology "
                        f"or None, got {type(topology).__name__}")
    return _engine.close(topology, timeout)


class HierarchicalWork:
    """Handle of an asynchronous `hierarchical_all_reduce`: the result is ready after `wait`.

    Waiting on CPU (gloo) blocks until the data is in place; on CUDA (NCCL) it makes the
    caller's current stream wait for it, as ``torch.distributed`` works do. A handle dropped
    without waiting still completes, in order with the topology's later calls.
    """

    def __init__(self) -> None:
        self._issued = threading.Event()
        self._final: list[Any] = []
        self._error: BaseException | None = None
        self._event: Any = None  # the caller's stream position, on accelerators
        self._tasks_left = 0

    def wait(self) -> bool:
        """Wait for the all-reduce (idempotent).

        Returns:
            ``True``.

        Raises:
            TensorparError: a collective of the pipeline failed; the topology's subgroups
                are then out of step and the topology must not be used again.
        """
        self._issued.wait()
        if self._error is not None:
            raise TensorparError(f"hierarchical_all_reduce: a collective of the pipeline "
                                 f"failed: {self._error}") from self._error
        for work in self._final:
            work.wait()
        return True

    def is_completed(self) -> bool:
        """True once every collective of the call has completed (never blocks)."""
        return self._issued.is_set() and all(w.is_completed() for w in self._final)


# ---------------------------------------------------------------------------------------
# the pipeline: tasks (a slice, the tail, or a whole tensor) of 1-3 stages each
# ---------------------------------------------------------------------------------------

class _Task:
    """One piece of one call; `issue` starts its next stage and returns the work."""

    stages = 1

    def __init__(self, job: HierarchicalWork, part: torch.Tensor, groups: tuple[Group, ...]
                 ) -> None:
        self.job = job
        self.part = part
        self.groups = groups  # the group of each stage
        self.next = 0  # the next stage to issue
        self.work: Any = None  # the pending stage's work
        self.event: Any = None  # first task of a call on an accelerator: the caller's stream

    def issue(self) -> Any:
        """Issue stage ``next`` (all-reduce of the whole part on its group)."""
        self.next += 1
        return _comm.all_reduce(self.part, _SUM, self.groups[self.next - 1], async_op=True)


class _TailTask(_Task):
    """The last ``numel % R`` elements: all-reduced within the machine, then along a rail."""

    stages = 2


class _SliceTask(_Task):
    """A slice of ``R * k`` elements: reduce-scatter, rails all-reduce, all-gather."""

    stages = 3
    shard: torch.Tensor

    def issue(self) -> Any:
        """Issue stage ``next``: the scatter, the rails exchange or the gather."""
        self.next += 1
        scatter, rails, gather = self.groups
        if self.next == 1:
            self.shard = self.part.new_empty(self.part.numel() // scatter.size)
            return _comm.reduce_scatter_into(self.shard, self.part, _SUM, scatter,
                                             async_op=True)
        if self.next == 2:
            return _comm.all_reduce(self.shard, _SUM, rails, async_op=True)
        return _comm.all_gather_into(self.part, self.shard, gather, async_op=True)


class _Engine:
    """The one thread that issues every collective on a topology's subgroups (at a time).

    A task's stage is issued once its previous stage has completed (``wait`` on gloo blocks;
    on NCCL it orders this thread's stream, so the thread runs ahead). A new task starts
    whenever no started task is still in its first stage, so while one slice crosses the
    network the next is reduce-scattered and the previous all-gathered. Final stages are
    left to the caller's ``wait``.

    Why the ranks stay in step: each subgroup carries one stage only (scatters on the intra
    group, rails exchanges on the rails group, gathers on the gather group), so each group
    sees its collectives in task order on every rank, however the stages of different tasks
    interleave. This thread waits on stages in the fixed order ``s0, r0, s1, r1, ...``
    (scatter, rails), each issued everywhere before anyone waits on it.
    """

    def __init__(self, topology: Topology) -> None:
        def group(pg: dist.ProcessGroup | None) -> Group | None:
            return resolve_group(pg) if pg is not None else None

        self.intra = group(topology.intra_group)
        self.rails = group(topology.rails_group)
        self.gather = group(topology.gather_group)
        self.calls: queue.SimpleQueue[list[_Task] | None] = queue.SimpleQueue()
        self.failed: BaseException | None = None
        self.thread: threading.Thread | None = None  # the newest thread (it may be stopping)
        self.running = False  # whether self.thread takes new calls
        self._lock = threading.Lock()  # orders submit against close

    def submit(self, job: HierarchicalWork, flat: torch.Tensor, slice_elems: int) -> None:
        """Queue one call, starting the thread if it is stopped."""
        tasks = self._tasks(job, flat, slice_elems)
        job._tasks_left = len(tasks)
        if flat.device.type != "cpu":  # start after the caller's stream has produced the data
            tasks[0].event = torch.Event(device=flat.device)
            tasks[0].event.record(torch.accelerator.current_stream(flat.device))
        with self._lock:
            if self.failed is not None:
                job._error = self.failed
                job._issued.set()
                return
            if not self.running:  # it starts after the previous thread has ended
                self.thread = threading.Thread(target=self._run, args=(self.thread,),
                                               name=_THREAD_NAME, daemon=True)
                self.thread.start()
                self.running = True
            self.calls.put(tasks)

    def close(self, timeout: float | None = None) -> bool:
        """Stop the thread after the calls queued so far, and wait for it to end.

        Returns ``True`` once no thread of this engine runs (``False`` if ``timeout`` passed).
        From an engine's own thread (a finalizer run there) it only stops the thread.
        """
        with self._lock:
            thread = self.thread
            if self.running:
                self.calls.put(None)  # the thread finishes what was queued before this
                self.running = False
        if thread is None or threading.current_thread().name == _THREAD_NAME:
            return thread is None or not thread.is_alive()
        thread.join(timeout)
        return not thread.is_alive()

    def _tasks(self, job: HierarchicalWork, flat: torch.Tensor, slice_elems: int
               ) -> list[_Task]:
        if self.rails is None or self.intra is None:  # one machine, or one rank per machine
            group = self.intra if self.rails is None else self.rails
            assert group is not None  # a topology of size > 1 has one of them
            return [_Task(job, flat, (group,))]
        assert self.gather is not None  # created with the other two
        n = flat.numel()
        main = n - n % self.intra.size
        groups = (self.intra, self.rails, self.gather)
        tasks: list[_Task] = [_SliceTask(job, flat[s: min(s + slice_elems, main)], groups)
                              for s in range(0, main, slice_elems)]
        if main < n:
            tasks.append(_TailTask(job, flat[main:], groups[:2]))
        return tasks

    def _run(self, previous: threading.Thread | None) -> None:
        if previous is not None:  # a stopped thread may still be finishing its calls
            previous.join()
        waiting: deque[_Task] = deque()  # queued, not started
        started: deque[_Task] = deque()  # each with a pending non-final stage, in issue order
        accepting = True
        while accepting or waiting or started:
            try:
                if accepting and not waiting:
                    call = self._next_call(block=not started)
                    if call is None:
                        accepting = False
                    else:
                        waiting.extend(call)
                    del call
                if waiting and all(t.next > 1 for t in started):
                    task = waiting.popleft()
                    if task.event is not None:
                        torch.accelerator.current_stream(task.part.device).wait_event(task.event)
                    self._advance(task, started)
                    del task  # hold no finished call (its works) while idle
                elif started:
                    task = started.popleft()
                    task.work.wait()
                    self._advance(task, started)
                    del task
            except BaseException as exc:  # out of step with the peers from here on: fail all
                with self._lock:  # no call is queued after this (submit sees `failed`)
                    self.failed = exc
                    queued, stopped = self._drain()
                for failed in [*started, *waiting, *queued]:
                    failed.job._error = exc
                    failed.job._issued.set()
                started.clear()
                waiting.clear()
                del queued, failed
                accepting = accepting and not stopped

    def _next_call(self, block: bool) -> list[_Task] | None:
        if block:
            return self.calls.get()
        try:
            return self.calls.get_nowait()
        except queue.Empty:
            return []

    def _drain(self) -> tuple[list[_Task], bool]:
        """Everything queued, and whether a stop request was among it."""
        tasks: list[_Task] = []
        stopped = False
        while True:
            try:
                call = self.calls.get_nowait()
            except queue.Empty:
                return tasks, stopped
            if call is None:
                stopped = True
            else:
                tasks += call

    @staticmethod
    def _advance(task: _Task, started: deque[_Task]) -> None:
        work = task.issue()
        if task.next < task.stages:
            task.work = work
            started.append(task)
            return
        job = task.job
        job._final.append(work)
        job._tasks_left -= 1
        if job._tasks_left == 0:
            job._issued.set()


class _Engines:
    """The engine of each live topology, held weakly by topology.

    A `Topology` is a frozen description of a layout and its subgroups; the engine (a
    thread and its queue) is how this module uses those subgroups. It lives here, beside
    the code that needs it, rather than in a mutable slot of the topology: a topology stays
    a plain value that other algorithms can use without knowing this one. One engine per
    topology is what keeps the ranks in step (every call on a topology goes through the
    same queue, in call order), so the first use creates it under a lock. Its thread is
    stopped and joined when the topology is collected or, through the same finalizer, at
    interpreter exit while the interpreter still runs normally.
    """

    def __init__(self) -> None:
        self._by_topology: weakref.WeakKeyDictionary[Topology, _Engine] = \
            weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def __call__(self, topology: Topology) -> _Engine:
        with self._lock:
            engine = self._by_topology.get(topology)
            if engine is None:
                engine = self._by_topology[topology] = _Engine(topology)
                weakref.finalize(topology, engine.close, _EXIT_TIMEOUT)
        return engine

    def close(self, topology: Topology | None, timeout: float | None) -> bool:
        """Stop and join the thread of ``topology``'s engine (of every engine for ``None``)."""
        with self._lock:
            if topology is None:
                engines = list(self._by_topology.values())
            else:
                engine = self._by_topology.get(topology)
                engines = [engine] if engine is not None else []
        stopped = [engine.close(timeout) for engine in engines]
        return all(stopped)


_engine = _Engines()
