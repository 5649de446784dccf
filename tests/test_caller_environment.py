"""The suite's promise to whoever runs it: the caller's HF_*/WANDB_* variables change no test
(conftest.pytest_configure removes them before any library reads them, then sets the suite's own:
offline, an HF_HOME of the session, wandb offline), and the test processes run torch on one
thread whatever the caller's OMP_NUM_THREADS."""
import os

from helpers import ROOT
from processes import run_command

PROBE_TEST = '''
import os
import huggingface_hub.constants
import datasets.config


def test_the_libraries_read_the_suites_environment():
    assert os.environ["HF_HUB_OFFLINE"] == "1" and "HF_ENDPOINT" not in os.environ
    assert os.environ["WANDB_MODE"] == "offline"  # the suite's own, not the caller's online
    assert huggingface_hub.constants.HF_HUB_OFFLINE is True and datasets.config.HF_HUB_OFFLINE is True
    assert huggingface_hub.constants.ENDPOINT == "https://huggingface.co"
    assert huggingface_hub.constants.HF_HOME == os.environ["HF_HOME"] != "/nonexistent/hf"
'''


def run_pytest(tmp_path, *args, env):
    """pytest in a process of its own on a probe test in `tmp_path`, with the suite's conftest.py
    loaded as a plugin (-p conftest), so that its hooks apply as to the suite's own tests."""
    (tmp_path / "test_probe.py").write_text(PROBE_TEST)
    return run_command(["-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest", *args,
                        str(tmp_path / "test_probe.py")], check=False,
                       env={"PYTHONPATH": os.pathsep.join([str(tmp_path), os.path.join(ROOT, "tests"), ROOT]), **env})


def test_a_callers_online_endpoint_home_and_wandb_variables_change_nothing(tmp_path):
    result = run_pytest(tmp_path, env={"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9",
                                       "HF_HOME": "/nonexistent/hf", "WANDB_MODE": "online"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def test_a_plugin_that_imports_a_library_first_is_named_in_a_usage_error(tmp_path):
    """Had a pytest plugin imported huggingface_hub before the variables were removed, its
    constants would hold the caller's values: the suite refuses to run and names the module."""
    (tmp_path / "early_import_plugin.py").write_text("import huggingface_hub\n")
    result = run_pytest(tmp_path, "-p", "early_import_plugin", env={})
    assert result.returncode == 4, result.stdout[-3000:] + result.stderr[-3000:]  # pytest's usage error
    assert "huggingface_hub was imported before the tests cleared" in result.stderr


def test_torch_runs_on_one_thread_in_the_test_processes():
    """Two test processes share two cores, as the commands do (conftest.pytest_configure sets
    OMP_NUM_THREADS=1 whatever the caller's shell says, before torch is imported)."""
    import torch
    assert torch.get_num_threads() == 1
