"""Preemption on a real (one-node) Slurm cluster (issue 33): examples/slurm/local_cluster.sh brings
it up when this machine allows (root, the slurm-wlm and munge packages; .ci/run installs them),
else the tests are skipped with the reason. A job under --time=1 (Slurm's smallest limit: one
minute) with --signal=USR1@40 stops with a checkpoint, requeues itself (exit 4 ->
`scontrol requeue`, examples/slurm/train_one_node.sbatch) and continues until done; its weights
equal an uninterrupted run's, bit for bit. Slurm checks time limits about once a minute and holds
a requeued job ~2 minutes before it is eligible again, so each test takes several minutes."""
import os
import shutil
import subprocess
import time

import pytest
from conftest import ROOT, cli_env, load_unet_weights, read_history, write_tiny_recipe


def _cluster_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root to start slurmctld/slurmd"
    missing = [tool for tool in ("sbatch", "slurmctld", "slurmd", "munged") if shutil.which(tool) is None]
    if missing:
        return f"Slurm not installed ({', '.join(missing)}): apt-get install -y slurm-wlm munge"
    return None


@pytest.fixture(scope="module")
def slurm():
    reason = _cluster_unavailable()
    if reason:
        pytest.skip(reason)
    result = subprocess.run(["bash", os.path.join(ROOT, "examples", "slurm", "local_cluster.sh")],
                            capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        pytest.skip(f"the local Slurm cluster did not come up: {result.stderr.strip()[-300:]}")


def wait_for_job(job_id: str, timeout: float) -> str:
    """The job's final state once it has left the queue (requeues included)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        queued = subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True).stdout.strip()
        if not queued:
            state = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout
            return state.split("JobState=")[1].split()[0] if "JobState=" in state else "GONE"
        time.sleep(5)
    subprocess.run(["scancel", job_id])
    raise AssertionError(f"job {job_id} still queued after {timeout:.0f} s")


def test_a_time_limited_job_requeues_itself_until_done_bit_identical(slurm, tmp_path, train):
    recipe = write_tiny_recipe(tmp_path, train_batch_size=4, max_train_steps=300, checkpointing_steps=50,
                               lr_scheduler="constant", dataloader_num_workers=2)
    out, log = tmp_path / "run", tmp_path / "slurm.out"
    env = {**cli_env(tmp_path), "ACCELERATE_USE_CPU": "1", "PYTHONPATH": ROOT}
    submitted = subprocess.run(["sbatch", "--parsable", "--time=1", "--signal=USR1@40", f"--output={log}",
                                "examples/slurm/train_one_node.sbatch", "--config", recipe, "--output_dir", str(out)],
                               cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    job_id = submitted.stdout.strip().split(";")[0]
    state = wait_for_job(job_id, timeout=1500)
    text = log.read_text(errors="replace")  # tqdm bars cut mid-character by a stop
    assert state == "COMPLETED" and "done: 300 optimizer steps" in text, text[-3000:]
    assert text.count("preempted: SIGUSR1 received") >= 1 and "Traceback" not in text, text[-3000:]
    train(recipe, tmp_path / "straight", env={"ACCELERATE_USE_CPU": "1"})
    assert [h["loss"] for h in read_history(out)] == [h["loss"] for h in read_history(tmp_path / "straight")]
    exported, straight = load_unet_weights(out), load_unet_weights(tmp_path / "straight")
    import torch
    assert all(torch.equal(exported[k], straight[k]) for k in straight)
