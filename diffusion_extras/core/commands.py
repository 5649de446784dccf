"""What every command line shares below the commands themselves (they live in cli/ and report/)."""
from __future__ import annotations

import os
import sys


def prog_name(command: str) -> str:
    """How the user started COMMAND, for usage lines: the console script as typed (`ddpm-sample`),
    else `python -m diffusion_extras.COMMAND` (argparse's own default would say `__main__.py`)."""
    typed = os.path.basename(sys.argv[0])
    return typed if typed.startswith("ddpm-") else f"python -m diffusion_extras.{command}"
