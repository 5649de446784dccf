"""core/stop_flag.py across ranks, in one process: two `Shared` on one in-memory c10d store, driven
from two threads as two ranks would be. The command-line tests of a stop on 2 ranks are in
tests/test_preemption.py."""
import threading

import pytest
import torch.distributed as dist

from diffusion_extras.core import stop_flag


@pytest.fixture
def two_ranks():
    store = dist.PrefixStore("watch", dist.HashStore())  # what each rank's keys are under
    yield [stop_flag.Shared(store, rank, 2) for rank in range(2)], store
    stop_flag.clear()


def agree_on_both(ranks, gave_up) -> list:
    """Each rank's agreement on its own thread (the first waits for the second); their answers."""
    answers = [None, None]

    def agree(rank):
        answers[rank] = ranks[rank].agree(gave_up[rank])
    threads = [threading.Thread(target=agree, args=(rank,), daemon=True) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    return answers


def test_the_ranks_agree_that_one_gave_up_and_only_then(two_ranks):
    ranks, store = two_ranks
    assert agree_on_both(ranks, [False, False]) == [False, False]
    assert agree_on_both(ranks, [False, True]) == [True, True]
    assert agree_on_both(ranks, [False, False]) == [False, False]  # each section counts afresh
    assert store.check(["section3/arrived"]) and not store.check(["section1/arrived"])  # rank 0 removed old keys
    assert store.check(["stop"])  # the rank that gave up published the stop


def test_a_published_stop_is_seen_at_the_next_poll_and_raised_by_check(two_ranks, monkeypatch):
    ranks, _ = two_ranks
    assert not ranks[0].poll()
    ranks[1].publish()
    assert not ranks[0].poll()  # asked the store less than POLL_SECONDS ago: no round trip
    monkeypatch.setattr(stop_flag, "POLL_SECONDS", 0.0)
    assert ranks[0].poll()
    stop_flag.share(ranks[0])
    with pytest.raises(stop_flag.StopRequested):
        stop_flag.check()


def test_an_interruptible_section_gives_up_on_this_rank_when_another_did(two_ranks):
    """Rank 1 gave up (its agreement on a thread); rank 0 finished its block: it raises too."""
    ranks, _ = two_ranks
    other = threading.Thread(target=ranks[1].agree, args=(True,), daemon=True)
    other.start()
    stop_flag.share(ranks[0])
    with pytest.raises(stop_flag.StopRequested):
        with stop_flag.interruptible():
            pass  # finished its share
    other.join(timeout=10)
