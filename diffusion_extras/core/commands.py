"""What every command line shares below the commands themselves (they live in cli/ and report/)."""
from __future__ import annotations

import functools
import gc
import logging
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NoReturn

from diffusion_extras.core import cpu_threads, stop_flag


def prog_name(command: str) -> str:
    """How the user started COMMAND, for usage lines: the console script as typed (`ddpm-sample`),
    else `python -m diffusion_extras.COMMAND` (argparse's own default would say `__main__.py`)."""
    typed = os.path.basename(sys.argv[0])
    return typed if typed.startswith("ddpm-") else f"python -m diffusion_extras.{command}"


@contextmanager
def importing_the_stack() -> Iterator[None]:
    """Around a command's first import of torch, diffusers and the rest: the cyclic collector off
    while they import, then their objects frozen (gc.freeze). Importing them makes ~560,000 objects
    the collector tracks, and with it on CPython walks them again and again as they grow (~7 full
    collections): 8.8 -> 6.3-7.5 CPU-s for the trainer's imports, measured on 2 cores. Frozen,
    they are also left out of the collections while the command runs and at its exit (exit_with).
    What is lost: collecting cyclic garbage made while importing (6 objects, measured).
    Also torch's CPU threads: they sleep when idle instead of spinning, and they are as many as
    the CPUs the process may use (cpu_threads), unless the user chose either.
    Where torch is imported already (a program that calls a command's main(), a notebook) it does
    nothing: freezing would keep that program's own objects from the collector for good, and its
    threads are that program's."""
    if "torch" in sys.modules:
        yield
        return
    cpu_threads.set_wait_policy()  # read once, as torch loads its OpenMP runtime
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()
    if "torch" in sys.modules:
        cpu_threads.set_thread_count()


def exit_with(code: int | None) -> NoReturn:
    """sys.exit(code) once a command's work is done, without the collections CPython runs while it
    finalizes walking every object of the libraries' modules (torch, diffusers, transformers...):
    ~1.5 s of a 2-core machine's time per command, measured with those imported. The command's own
    garbage is collected first (its __del__ methods and weakref finalizers run: files, loader
    workers), then what is left, the modules, is frozen (gc.freeze), which finalization's
    collections skip. atexit handlers and module teardown run as usual."""
    gc.collect()
    gc.freeze()
    sys.exit(code)


@contextmanager
def leaving_the_process_as_found(record_stop_signals: bool = True) -> Iterator[None]:
    """Around a command's main(): from its first line, stop signals are recorded (stop_flag; the
    trainer's, which saves and stops on them), and warnings are logged to stderr. On every way out
    (an exit code, an error, an exception) the process is left as the caller had it, so that a
    program that calls main() (a notebook, a test) keeps its own Ctrl-C and can call it again: its
    signal handlers back, no signal or stop on record, the log handler removed, accelerate's
    process-wide state reset (the next Accelerator starts anew, as in a fresh process), torch's
    TF32 switches and OMP_WAIT_POLICY as they were."""
    previous_handlers = stop_flag.record_early_signals() if record_stop_signals else {}
    wait_policy = os.environ.get(cpu_threads.WAIT_POLICY)  # importing_the_stack may set it
    log_handler = None
    if not logging.root.handlers:  # logging.basicConfig's condition; this handler leaves with the command
        log_handler = logging.StreamHandler(sys.stderr)
        log_handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logging.root.addHandler(log_handler)
    log_level = logging.root.level
    logging.root.setLevel(logging.WARNING)
    tf32 = _tf32_switches()
    try:
        yield
    finally:
        stop_flag.reset(previous_handlers)
        if wait_policy is None:
            os.environ.pop(cpu_threads.WAIT_POLICY, None)
        if log_handler is not None:
            logging.root.removeHandler(log_handler)
        logging.root.setLevel(log_level)
        _set_tf32_switches(tf32)
        if "accelerate.state" in sys.modules:
            from accelerate.state import AcceleratorState, GradientState
            AcceleratorState._reset_state(reset_partial_state=True)
            GradientState._reset_state()


def _tf32_switches() -> tuple[bool, bool]:
    """torch's (matmul, cuDNN) TF32 switches now: torch's defaults where torch is not imported yet."""
    if "torch" not in sys.modules:
        return False, True
    import torch
    return torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32


def _set_tf32_switches(switches: tuple[bool, bool]) -> None:
    if "torch" in sys.modules:
        import torch
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = switches


def leaves_the_process_as_found(main: Callable) -> Callable:
    """A command's main() (sample, evaluate, post-hoc EMA) run in leaving_the_process_as_found,
    without recording stop signals: those commands stop at Ctrl-C as any program does."""
    @functools.wraps(main)
    def wrapped(*args, **kwargs):
        with leaving_the_process_as_found(record_stop_signals=False):
            return main(*args, **kwargs)
    return wrapped
