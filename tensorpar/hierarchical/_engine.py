"""The engine of the hierarchical all-reduce: the pipeline, and one thread per topology.

`tensorpar.hierarchical` checks a call and hands it here: the call is cut into tasks (slices,
a tail) whose stages one thread per topology issues, in call order, on the topology's
subgroups. The thread's lifecycle (started on demand, stopped and joined when its topology
is collected, at interpreter exit or by `shutdown_hierarchical`) is described there.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections import deque
from typing import Any

import torch
import torch.distributed as dist

from tensorpar.comm import _comm
from tensorpar.comm._group import Group, resolve_group
from tensorpar.hierarchical._work import HierarchicalWork
from tensorpar.hierarchical.topology import Topology

__all__ = ["THREAD_NAME", "engines"]

_SUM: Any = dist.ReduceOp.SUM if dist.is_available() else None

_EXIT_TIMEOUT = 30.0
"""Seconds the interpreter's exit waits for each engine thread (its queued calls included)."""
THREAD_NAME = "tensorpar-hierarchical"


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
                                               name=THREAD_NAME, daemon=True)
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
        if thread is None or threading.current_thread().name == THREAD_NAME:
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


engines = _Engines()
"""The engine of every live topology: ``engines(topology)`` gets (or starts) one."""
