"""The expert readers' queues: demand reads before reads ahead (jmoe.checkpoint.read_order)."""

import gc
import threading

import pytest

from jmoe.checkpoint.read_order import DEMAND, PriorityPool, ReadPriority

pytestmark = pytest.mark.quick  # the quick tier: all of this module


WAIT_S = 10  # a bound on every wait: a broken pool fails the test instead of hanging it


def pool_threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(name)]


def blocked(pool: PriorityPool, priority: ReadPriority | None = None):
    """Occupy one of the pool's threads until the returned event is set."""
    started, release = threading.Event(), threading.Event()

    def hold():
        started.set()
        assert release.wait(WAIT_S)

    future = pool.submit(hold, priority=priority)
    assert started.wait(WAIT_S)
    return release, future


def test_queued_tasks_run_lowest_rank_first_ties_in_submission_order():
    pool = PriorityPool(1, "test-order")
    release, _ = blocked(pool)
    ran = []
    ranks = [(2, 0), (1, 5), DEMAND, (1, 3), DEMAND, (1, 5)]
    futures = [pool.submit(ran.append, i, priority=ReadPriority(rank)) for i, rank in enumerate(ranks)]
    release.set()
    for future in futures:
        future.result(WAIT_S)
    assert ran == [2, 4, 3, 1, 5, 0]
    pool.shutdown()


def test_a_raised_read_moves_up_with_its_queued_pieces_and_pieces_take_their_reads_rank():
    pool = PriorityPool(1, "test-raise")
    release, _ = blocked(pool)
    ran = []
    late, early = ReadPriority((1, 9)), ReadPriority((1, 1))
    pool.submit(ran.append, "early", priority=early)
    pool.submit(ran.append, "late", priority=late)
    late.rank = DEMAND  # a step now waits for it
    pool.wake()
    release.set()
    pool.shutdown()
    assert ran == ["late", "early"]

    pool = PriorityPool(1, "test-inherit")
    started, release = threading.Event(), threading.Event()
    order = []

    def read():  # a piece submitted from inside a read is queued with the read's rank
        started.set()
        assert release.wait(WAIT_S)
        pool.submit(order.append, "piece")

    reading = pool.submit(read, priority=ReadPriority((1, 4)))
    assert started.wait(WAIT_S)
    pool.submit(order.append, "after", priority=ReadPriority((1, 6)))
    pool.submit(order.append, "before", priority=ReadPriority((1, 2)))
    release.set()
    reading.result(WAIT_S)
    pool.shutdown()
    assert order == ["before", "piece", "after"]

    pool = PriorityPool(1, "test-default")
    release, _ = blocked(pool)
    pool.submit(order.append, "ahead", priority=ReadPriority((1, 0)))
    pool.submit(order.append, "demand")  # submitted from no task: a demand read
    release.set()
    pool.shutdown()
    assert order[3:] == ["demand", "ahead"]


def test_reserved_threads_run_only_demand_reads():
    pool = PriorityPool(2, "test-reserved", reserved=1)
    release, _ = blocked(pool, ReadPriority((1, 0)))  # read ahead on the one thread it may use
    second_ahead = threading.Event()
    queued = pool.submit(second_ahead.set, priority=ReadPriority((1, 1)))
    assert not second_ahead.wait(0.3)  # waits: the other thread is kept for demand reads
    assert pool.submit(lambda: "demand").result(WAIT_S) == "demand"
    assert not queued.done()
    release.set()
    queued.result(WAIT_S)  # runs once the read-ahead thread is free
    pool.shutdown()
    with pytest.raises(ValueError, match="reserved=2: expected 0 <= reserved < threads=2"):
        PriorityPool(2, "test-bad", reserved=2)


def test_a_raised_read_ahead_runs_on_a_reserved_thread():
    pool = PriorityPool(2, "test-raise-reserved", reserved=1)
    release, _ = blocked(pool, ReadPriority((1, 0)))
    priority = ReadPriority((1, 1))
    ran = threading.Event()
    pool.submit(ran.set, priority=priority)
    assert not ran.wait(0.3)
    priority.rank = DEMAND
    pool.wake()
    assert ran.wait(WAIT_S)
    release.set()
    pool.shutdown()


def test_shutdown_cancels_queued_tasks_and_stops_the_threads():
    pool = PriorityPool(1, "test-shutdown")
    release, running = blocked(pool)
    queued = pool.submit(lambda: None)
    closing = threading.Thread(target=pool.shutdown, kwargs={"cancel_futures": True})
    closing.start()
    release.set()
    closing.join(WAIT_S)
    assert queued.cancelled() and running.done() and not pool_threads("test-shutdown")
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(lambda: None)

    pool = PriorityPool(1, "test-drain")
    release, _ = blocked(pool)
    queued = pool.submit(lambda: "ran")
    release.set()
    pool.shutdown()  # queued tasks run first
    assert queued.result(0) == "ran" and not pool_threads("test-drain")


def test_an_error_reaches_the_future_and_the_thread_goes_on():
    pool = PriorityPool(1, "test-error")

    def fail():
        raise OSError("disk")

    with pytest.raises(OSError, match="disk"):
        pool.submit(fail).result(WAIT_S)
    assert pool.submit(lambda: 7).result(WAIT_S) == 7
    pool.shutdown()


def test_a_pool_nobody_shut_stops_its_threads_when_collected():
    pool = PriorityPool(2, "test-collected")
    assert pool.submit(lambda: 1).result(WAIT_S) == 1
    threads = pool_threads("test-collected")
    assert len(threads) == 2
    del pool
    gc.collect()
    for thread in threads:
        thread.join(WAIT_S)
    assert not pool_threads("test-collected")
