"""What every command line shares below the commands themselves (they live in cli/ and report/)."""
from __future__ import annotations

import gc
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn


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
    Where torch is imported already (a program that calls a command's main(), a notebook) it does
    nothing: freezing would keep that program's own objects from the collector for good."""
    if "torch" in sys.modules:
        yield
        return
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


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
