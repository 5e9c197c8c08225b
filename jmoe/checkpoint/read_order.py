"""The order an expert reader's queued work runs in (issue #31): reads a step waits for before reads ahead of need.

A reader's reads and their 4 MiB pieces queue on pools of threads. With first-come order, the read-ahead the disk
tier then submitted between steps (one expert for each of 24 layers: 0.9 GB on the bench checkpoint) sat in front
of the first layer's demand reads, and read-ahead made the wait longer than demand reads alone
(bench/results/disk_tier_orbax.md: -21% of the wait hidden in a 6 GB cgroup). Here every queued task carries a
`ReadPriority` and a free thread takes the lowest rank (ties: first submitted). The rank is read when a thread
takes a task, so raising a read (a step comes to wait for a read it had read ahead) moves its queued pieces up
too; a piece submitted from inside a task takes that task's priority (`PriorityPool.submit`'s default). A pool may
keep threads for demand reads (`reserved`): a read-ahead holds its thread while its pieces are read, and without
them a demand read waited for a whole read ahead to finish before its own pieces could be queued.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import itertools
import threading
import weakref


DEMAND = (0,)  # the rank of a read a step waits for now; read-ahead ranks are tuples that sort after it


class ReadPriority:
    """Where a read stands in its reader's queues: lower `rank` (a tuple) runs first."""

    __slots__ = ("rank",)

    def __init__(self, rank: tuple = DEMAND):
        self.rank = rank

    def __repr__(self) -> str:
        return f"ReadPriority({self.rank})"


_running = contextvars.ContextVar("jmoe_read_priority", default=None)  # the task on this thread's priority


class _Queue:
    """The tasks and their threads' shared state (no reference to the pool: an unclosed pool can be collected)."""

    def __init__(self, ahead_threads: int):
        self.tasks: list[tuple[ReadPriority, int, concurrent.futures.Future, object, tuple]] = []
        self.order = itertools.count()
        self.ready = threading.Condition()
        self.shut = False
        self.ahead_threads, self.ahead_running = ahead_threads, 0  # threads that may run tasks ranked after DEMAND

    def _next(self):
        """The index of the task to run now, or None (no task, or only read-ahead with its threads all busy)."""
        if not self.tasks:
            return None
        best = min(range(len(self.tasks)), key=lambda i: (self.tasks[i][0].rank, self.tasks[i][1]))
        if self.tasks[best][0].rank > DEMAND and self.ahead_running >= self.ahead_threads:
            return None
        return best

    def take(self):
        """(task, whether it runs on a read-ahead thread), waiting for one; None once shut and empty."""
        with self.ready:
            while (best := self._next()) is None:
                if self.shut and not self.tasks:
                    return None
                self.ready.wait()
            task = self.tasks.pop(best)
            ahead = task[0].rank > DEMAND
            self.ahead_running += ahead
            return task, ahead

    def work(self) -> None:
        while (taken := self.take()) is not None:
            (priority, _, future, fn, args), ahead = taken
            if future.set_running_or_notify_cancel():
                token = _running.set(priority)
                try:
                    future.set_result(fn(*args))
                except BaseException as e:  # the future carries it to whoever waits
                    future.set_exception(e)
                finally:
                    _running.reset(token)
            del taken, future, fn, args  # a finished task's arguments (read buffers) are let go now
            if ahead:
                with self.ready:
                    self.ahead_running -= 1
                    self.ready.notify_all()

    def close(self, cancel: bool) -> None:
        with self.ready:
            self.shut = True
            dropped, self.tasks = (self.tasks, []) if cancel else ([], self.tasks)
            self.ready.notify_all()
        for _, _, future, _, _ in dropped:
            future.cancel()


class PriorityPool:
    """`threads` threads running submitted calls lowest `ReadPriority.rank` first (see the module docstring), of
    which `reserved` run only DEMAND tasks; the threads are named `name`-N and stop at `shutdown` (or when the pool
    is collected)."""

    def __init__(self, threads: int, name: str, reserved: int = 0):
        if not 0 <= reserved < threads:
            raise ValueError(f"reserved={reserved}: expected 0 <= reserved < threads={threads}")
        self._queue = _Queue(threads - reserved)
        self._threads = [threading.Thread(target=self._queue.work, name=f"{name}-{i}", daemon=True)
                         for i in range(threads)]
        for thread in self._threads:
            thread.start()
        self._stop = weakref.finalize(self, self._queue.close, True)

    def submit(self, fn, *args, priority: ReadPriority | None = None) -> concurrent.futures.Future:
        """A future of fn(*args). `priority`: by default that of the task running on the calling thread (a piece
        of a read ranks with its read), else DEMAND."""
        priority = priority or _running.get() or ReadPriority()
        future = concurrent.futures.Future()
        with self._queue.ready:
            if self._queue.shut:
                raise RuntimeError("cannot submit to a PriorityPool after shutdown")
            self._queue.tasks.append((priority, next(self._queue.order), future, fn, args))
            self._queue.ready.notify()
        return future

    def wake(self) -> None:
        """Look again at the queued tasks' ranks (call after raising one: a thread may be waiting for a rank that
        its read-ahead threads allow)."""
        with self._queue.ready:
            self._queue.ready.notify_all()

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        """No more submissions; queued tasks are cancelled (`cancel_futures`) or run first; `wait`: until the
        threads have stopped."""
        self._queue.close(cancel_futures)
        self._stop.detach()
        if wait:
            for thread in self._threads:
                thread.join()
