"""data/workers.py: a loader worker ignores a stop signal that another process (a scheduler) sends,
even when it has a thread that was started before its worker_init_fn ran."""
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
from helpers import tiny_run, write_tar_shards

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
    subprocess.run(["kill", "-TERM", str(worker)])  # a scheduler's signal, not the parent's
    time.sleep(0.5)
    assert list(batches) == [worker] * 3


@pytest.mark.parametrize("streamed", [False, True], ids=["cached", "streamed"])
def test_the_loop_ends_its_loader_workers_when_it_ends(tmp_path, fresh_accelerate, streamed):
    """The workers end with the training loop, not whenever the garbage collector frees their
    iterator: a reference cycle through a kept frame (matplotlib's layout code) held it, and a
    collection at exit waited 5 s per worker (10 s after "done" with 2 workers)."""
    import gc
    import multiprocessing

    from diffusion_extras.training import loop
    flags = []
    if streamed:
        flags = ["--train_data_files", f"{write_tar_shards(tmp_path / 'shards', shards=4, per_shard=4)}/train-*.tar",
                 "--streaming"]
    run = tiny_run(tmp_path, *flags, max_train_steps=3, dataloader_num_workers=2, save_images_steps=3)
    gc.disable()  # only reference counts free objects: what is left to a collection stays
    try:
        loop.train(run)
        assert multiprocessing.active_children() == []
    finally:
        gc.enable()
