"""The session's hooks (every test as in a clean shell) and the fixtures tests share. What tests
share that is not a fixture (the tiny recipe, the runners of the commands in this process, files a
test makes) is in tests/helpers.py; commands in processes of their own in tests/processes.py."""
import os
import shutil
import signal
import sys
import tempfile

import pytest

# torch on one intra-op thread in every test process and command: pytest -n 3 on 2 cores runs three
# tests at once, and a thread per core each would have them wait on each other. Also the summation
# order that tests which recompute a command's numbers rely on. Set before helpers imports torch,
# which reads it as it loads (a plain `pytest`, without xdist's workers, has no later chance).
os.environ["OMP_NUM_THREADS"] = "1"

from helpers import run_training, write_tiny_recipe  # noqa: E402 - after the thread count torch reads

# Variables of the caller's shell that change what the libraries do (offline mode, endpoint, cache
# folders, the tracker's mode, an accelerate config): no test may depend on them.
CALLER_VARIABLES = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_OFFLINE", "WANDB_", "ACCELERATE_")
READ_AT_IMPORT = ("huggingface_hub", "datasets", "diffusers", "transformers", "accelerate", "wandb")


def pytest_configure(config):
    """Every test runs as in a clean shell, whatever the caller exported (HF_HUB_OFFLINE, a custom
    HF_HOME or HF_ENDPOINT, WANDB_MODE, ...): those variables are removed before any library reads
    them (huggingface_hub and datasets read them once, at import); then the suite sets its own,
    which the processes the tests start inherit (processes.cli_env)."""
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped without one); run them with `pytest -m cuda`")
    # pytest-xdist's own mark, declared here too for a run without it (-p no:xdist)
    config.addinivalue_line("markers", "xdist_group(name): tests that run on one worker under --dist loadgroup")
    imported = sorted(name for name in sys.modules if name.split(".")[0] in READ_AT_IMPORT)
    if imported:
        raise pytest.UsageError(f"{imported[0]} was imported before the tests cleared the caller's HF_*/WANDB_* "
                                "variables (by a pytest plugin?); run pytest with -p no:<that plugin>")
    for name in list(os.environ):
        if name.startswith(CALLER_VARIABLES):
            del os.environ[name]
    # Offline, in this process and in every process a test starts: no test reaches the Hub (with a
    # network a download would be slow and not the subject; without one, a request waits on
    # huggingface_hub's retries). A test of Hub code talks to tests/hub_server.py and goes online
    # itself: in this process through hub_server.serve_in_process, in a process of its own with
    # HF_ENDPOINT, HF_HUB_OFFLINE=0 and an HF_HOME of its own. wandb likewise logs locally.
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["WANDB_MODE"] = "offline"
    config.hf_home = os.environ["HF_HOME"] = tempfile.mkdtemp(prefix="ddpm-tests-hf-home-")


def pytest_unconfigure(config):
    if getattr(config, "hf_home", None):
        shutil.rmtree(config.hf_home, ignore_errors=True)


def signal_state() -> dict:
    """The stop signals' Python handlers, this thread's blocked signals, and the pending ones."""
    from diffusion_extras.core.stop_flag import STOP_SIGNALS
    return {"handlers": {signal.Signals(number).name: signal.getsignal(number) for number in sorted(STOP_SIGNALS)},
            "blocked": sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])), "pending": sorted(signal.sigpending())}


@pytest.fixture(autouse=True)
def signals_left_as_found():
    """Every test leaves the stop signals (SIGINT, SIGTERM, SIGUSR1) as it found them: their handlers,
    this thread's mask, none pending. A handler or a mask left behind changes what a later test on the
    same worker sees, far from its cause (seen once: Ctrl-C not raising KeyboardInterrupt after a
    run); this fails the test that left it, and restores the state for the next."""
    before = signal_state()
    yield
    after = signal_state()
    for name, handler in before["handlers"].items():
        signal.signal(signal.Signals[name], handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, before["blocked"])
    assert after == before, f"the test left the signal state changed: {before} -> {after}"


@pytest.fixture
def tiny_recipe(tmp_path):
    """tiny_recipe(**overrides): write_tiny_recipe in this test's folder."""
    return lambda **overrides: write_tiny_recipe(tmp_path, **overrides)


@pytest.fixture(scope="session")
def tiny_reference_run(tmp_path_factory):
    """The output folder of the tiny recipe trained 3 steps (seed 0, no other flag), trained once per
    session (per xdist worker) for the tests that compare a run with it. Read it, never write it."""
    folder = tmp_path_factory.mktemp("tiny_reference_run")
    run_training(write_tiny_recipe(folder), folder / "run", "--max_train_steps", 3)
    return folder / "run"


@pytest.fixture
def parquet_images(tmp_path):
    """40 grey images of 10x12 whose pixel value is their row index, in 4 parquet shards."""
    import datasets
    import numpy as np
    from PIL import Image
    folder = tmp_path / "pq"
    folder.mkdir()
    images = [Image.fromarray(np.full((10, 12), i * 5, np.uint8)) for i in range(40)]
    features = datasets.Features({"img": datasets.Image(), "n": datasets.Value("int64")})
    dataset = datasets.Dataset.from_dict({"img": images, "n": list(range(40))}, features=features)
    for k in range(4):
        dataset.shard(4, k).to_parquet(str(folder / f"part-{k}.parquet"))
    return str(folder)


@pytest.fixture
def fresh_accelerate():
    """Each in-process run gets its own accelerate state (it is a process-wide singleton)."""
    from accelerate.state import AcceleratorState, GradientState
    AcceleratorState._reset_state(True), GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True), GradientState._reset_state()
