"""The layout is a contract: sub-packages import only the ones below them (pyproject.toml's
import-linter layers, which read every import statement, those inside functions included), and
the package is the installed one, found without sys.path edits."""
import ast
import importlib.metadata
import os
import subprocess
import sys

from helpers import ROOT

import diffusion_extras


def test_the_layer_contract_holds():
    result = subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports_command; "
                             "lint_imports_command()"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "1 kept, 0 broken" in result.stdout


def test_the_package_is_installed_and_is_this_project():
    """requirements.txt installs the project (editable): the tests import it like a user would."""
    distribution = importlib.metadata.distribution("diffusion-extras")
    assert {"ddpm-train", "ddpm-sample", "ddpm-evaluate", "ddpm-report", "ddpm-posthoc-ema"} <= {
        entry.name for entry in distribution.entry_points if entry.group == "console_scripts"}
    assert os.path.dirname(os.path.dirname(os.path.abspath(diffusion_extras.__file__))) == ROOT


def test_the_entry_script_is_thin():
    """train_ddpm.py: a docstring, imports and the __main__ guard; the trainer lives in the package."""
    with open(os.path.join(ROOT, "train_ddpm.py")) as fh:
        tree = ast.parse(fh.read())
    kinds = [type(node).__name__ for node in tree.body]
    assert set(kinds) <= {"Expr", "Import", "ImportFrom", "If"} and kinds.count("If") == 1, kinds


def test_usage_lines_name_the_command_as_the_user_typed_it():
    """`ddpm-sample --help` says `usage: ddpm-sample`, `python -m diffusion_extras.sample --help` says
    that (argparse alone would print `__main__.py` for the second; a fixed prog, the module form for
    the first)."""
    scripts = os.path.dirname(sys.executable)
    for command in (["ddpm-sample"], ["ddpm-report"], [sys.executable, "-m", "diffusion_extras.sample"]):
        if len(command) == 1:
            command = [os.path.join(scripts, command[0])]
        typed = os.path.basename(command[0]) if len(command) == 1 else "python -m diffusion_extras.sample"
        result = subprocess.run([*command, "--help"], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0 and result.stdout.startswith(f"usage: {typed} "), result.stdout[:200]
