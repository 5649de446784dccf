"""data/workers.py: a loader worker ignores a stop signal that another process (a scheduler) sends,
even when it has a thread that was started before its worker_init_fn ran."""
import os
import subprocess
import sys
import threading
import time

import torch

from diffusion_extras.data import workers

_early_thread_in_workers = False  # the fork hook below starts a thread only while a test sets it


def _start_a_thread_in_the_child():
    if _early_thread_in_workers:  # as a library does that starts a thread at fork (before worker_init_fn)
        threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()


os.register_at_fork(after_in_child=_start_a_thread_in_the_child)


class Pids(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, index):
        time.sleep(0.2)  # the test signals the worker between items
        return os.getpid()


def test_a_worker_with_a_thread_from_before_its_init_ignores_a_schedulers_sigterm(monkeypatch):
    """SIGTERM from `kill` (not the worker's parent) to a worker that has a thread of its own from
    before worker_init_fn: the worker lives and the loader yields every item. Before
    workers.start_workers (signals blocked only in worker_init_fn) that thread took the signal and
    the worker died: "DataLoader worker (pid ...) is killed by signal: Terminated"."""
    monkeypatch.setattr(sys.modules[__name__], "_early_thread_in_workers", True)
    loader = torch.utils.data.DataLoader(Pids(), batch_size=None, num_workers=1,
                                         worker_init_fn=workers.ignore_stop_signals)
    batches = workers.start_workers(loader)
    worker = next(batches)
    subprocess.run(["kill", "-TERM", str(worker)], check=True)  # a scheduler's signal, not the parent's
    time.sleep(0.5)
    assert list(batches) == [worker] * 3
