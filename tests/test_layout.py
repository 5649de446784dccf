"""The package is the installed one, found without sys.path edits, and its commands are the same
command whichever way they are started. (The layer contract between sub-packages is lint-imports',
run by CI with ruff: .ci/run.)"""
import importlib.metadata
import os
import sys

from helpers import ROOT
from processes import run_command

import diffusion_extras

SCRIPTS = os.path.dirname(sys.executable)  # where pip installed the console scripts


def test_the_package_is_installed_and_is_this_project():
    """requirements.txt installs the project (editable): the tests import it like a user would."""
    distribution = importlib.metadata.distribution("diffusion-extras")
    assert {"ddpm-train", "ddpm-sample", "ddpm-evaluate", "ddpm-report", "ddpm-posthoc-ema"} <= {
        entry.name for entry in distribution.entry_points if entry.group == "console_scripts"}
    assert os.path.dirname(os.path.dirname(os.path.abspath(diffusion_extras.__file__))) == ROOT


def test_train_ddpm_py_and_ddpm_train_are_one_command():
    """train_ddpm.py, the checkout's entry, is the installed trainer command: the same help, and the
    same one-line answer to a bad flag, but for the name it was started by."""
    for args, code in ((["--help"], 0), (["--learning_rate", "fast"], 2)):
        entry = run_command(["train_ddpm.py", *args], check=False)
        installed = run_command(args, launcher=[os.path.join(SCRIPTS, "ddpm-train")], check=False)
        assert entry.returncode == installed.returncode == code, entry.stderr[-2000:] + installed.stderr[-2000:]
        assert entry.stdout.replace("train_ddpm.py", "ddpm-train") == installed.stdout
        assert entry.stderr.replace("train_ddpm.py", "ddpm-train") == installed.stderr


def test_usage_lines_name_the_command_as_the_user_typed_it():
    """`ddpm-sample --help` says `usage: ddpm-sample`, `python -m diffusion_extras.sample --help` says
    that (argparse alone would print `__main__.py` for the second; a fixed prog, the module form for
    the first)."""
    for launcher, typed in (([os.path.join(SCRIPTS, "ddpm-sample")], "ddpm-sample"),
                            ([os.path.join(SCRIPTS, "ddpm-report")], "ddpm-report"),
                            ([sys.executable, "-m", "diffusion_extras.sample"], "python -m diffusion_extras.sample")):
        result = run_command(["--help"], launcher=launcher, timeout=120)
        assert result.stdout.startswith(f"usage: {typed} "), result.stdout[:200]
