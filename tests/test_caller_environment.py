"""The suite's promise to whoever runs it: the caller's HF_*/WANDB_* variables change no test
(conftest.pytest_configure removes them before any library reads them), and the test processes run
torch on one thread whatever the caller's OMP_NUM_THREADS."""
import os
import subprocess
import sys

from helpers import ROOT

PROBE_TEST = '''
import os
import huggingface_hub.constants
import datasets.config


def test_the_libraries_read_a_clean_environment():
    assert not any(name.startswith(("HF_HUB_OFFLINE", "HF_ENDPOINT")) for name in os.environ)
    assert os.environ["WANDB_MODE"] == "offline"  # the suite's own, not the caller's online
    assert huggingface_hub.constants.HF_HUB_OFFLINE is False and datasets.config.HF_HUB_OFFLINE is False
    assert huggingface_hub.constants.ENDPOINT == "https://huggingface.co"
    assert huggingface_hub.constants.HF_HOME == os.environ["HF_HOME"] != "/nonexistent/hf"
'''


def run_pytest(tmp_path, *args, env=None):
    """pytest on a test file placed beside the suite's (so conftest.py applies), in a subprocess."""
    probe = os.path.join(ROOT, "tests", f"test_zz_probe_{os.getpid()}_{tmp_path.name}.py")
    with open(probe, "w") as fh:
        fh.write(PROBE_TEST)
    try:
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               *args, probe], cwd=ROOT, capture_output=True, text=True,
                              env={**os.environ, **(env or {})}, timeout=300)
    finally:
        os.remove(probe)


def test_a_callers_offline_endpoint_home_and_wandb_variables_change_nothing(tmp_path):
    result = run_pytest(tmp_path, env={"HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9",
                                       "HF_HOME": "/nonexistent/hf", "WANDB_MODE": "online"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def test_a_plugin_that_imports_a_library_first_is_named_in_a_usage_error(tmp_path):
    """Had a pytest plugin imported huggingface_hub before the variables were removed, its
    constants would hold the caller's values: the suite refuses to run and names the module."""
    (tmp_path / "early_import_plugin.py").write_text("import huggingface_hub\n")
    result = run_pytest(tmp_path, "-p", "early_import_plugin", env={"PYTHONPATH": str(tmp_path)})
    assert result.returncode == 4, result.stdout[-3000:] + result.stderr[-3000:]  # pytest's usage error
    assert "huggingface_hub was imported before the tests cleared" in result.stderr


def test_torch_runs_on_one_thread_in_the_test_processes():
    """Two test processes share two cores, as the commands do (conftest.pytest_configure sets
    OMP_NUM_THREADS=1 whatever the caller's shell says, before torch is imported)."""
    import torch
    assert torch.get_num_threads() == 1
