"""Preemption on a real (one-node) Slurm cluster: examples/slurm/local_cluster.sh brings
it up when this machine allows (root, the slurm-wlm and munge packages; .ci/run installs them),
else the tests are skipped with the reason. A job under --time=1 (Slurm's smallest limit: one
minute) with --signal=USR1@15 stops with a checkpoint, requeues itself (exit 4 ->
`scontrol requeue`, examples/slurm/train_one_node.sbatch) and continues until done; its weights
equal an uninterrupted run's, bit for bit. A 2-rank job (examples/slurm/train_multi_node.sbatch,
ranks started by srun) cancelled with `scancel --signal=TERM` does the same. The jobs run the
examples with tests/faults.py --step_seconds S for train_ddpm.py, whose steps sleep until the first
stop: the first segment lasts as long as the scheduler needs, at little CPU, and the requeued one
finishes in seconds. The jobs' interpreter is this one (the examples' PYTHON variable), whichever
python is first on PATH. The uninterrupted runs compared with: one rank in this process, two as
processes."""
import os
import shutil
import subprocess
import sys
import time

import pytest
from helpers import ROOT, load_unet_weights, read_history, run_training, write_tiny_recipe
from processes import cli_env, launch_training

# Every test here reads `slurm` (module-scoped): on one xdist worker (--dist loadgroup) the cluster is started once.
pytestmark = pytest.mark.xdist_group("test_slurm.slurm")


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
    """The job's final state once it has left the queue (requeues included). Slurm holds a requeued
    job 2 minutes before it may start again (Reason=BeginTime); the test releases the hold as an
    admin would (`scontrol update StartTime=now`), so each requeue costs seconds, not minutes. Not at
    once: slurmd revokes the ended run's job credential with one-second resolution, and a restart in
    that same second is refused ("Job credential revoked": the job fails; seen once in a CI-like run)."""
    deadline, held_since = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        queued = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T %r"], capture_output=True,
                                text=True).stdout.strip()
        held_since = (held_since or time.monotonic()) if queued == "PENDING BeginTime" else None
        if held_since is not None and time.monotonic() - held_since >= 3:
            subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], capture_output=True)
        if not queued:
            state = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout
            return state.split("JobState=")[1].split()[0] if "JobState=" in state else "GONE"
        time.sleep(2)
    subprocess.run(["scancel", job_id])
    raise AssertionError(f"job {job_id} still queued after {timeout:.0f} s")


TRAINER = '"${PYTHON:-python}" train_ddpm.py'  # how the examples start the trainer


def slurm_script(tmp_path, example: str, step_seconds: float) -> str:
    """examples/slurm/EXAMPLE with tests/faults.py --step_seconds S (the trainer whose steps sleep S
    seconds until its first stop) in place of train_ddpm.py, in tmp_path; the rest is the example's."""
    with open(os.path.join(ROOT, "examples", "slurm", example)) as fh:
        text = fh.read()
    assert text.count(TRAINER) == 1, example
    path = tmp_path / example
    path.write_text(text.replace(TRAINER, f'"${{PYTHON:-python}}" tests/faults.py --step_seconds {step_seconds} --'))
    return str(path)


def job_environment() -> dict:
    """The environment sbatch passes on to the job: the test commands' (processes.cli_env), on the CPU,
    with this interpreter as the examples' PYTHON (not whichever python is first on PATH: a venv's
    python run without activating the venv is not) and this checkout importable."""
    return {**cli_env(), "ACCELERATE_USE_CPU": "1", "PYTHONPATH": ROOT, "PYTHON": sys.executable}


def test_a_time_limited_job_requeues_itself_until_done_bit_identical(slurm, tmp_path):
    # The job must not fit in one segment. slurmctld sends --signal=SIG@W at a periodic check (every 30 s)
    # once now + W + 30 s >= the end (send_job_warn_signal in its job_mgr.c): with --time=1, W=15 puts it
    # 15 to ~45 s into the job, before the limit at 60 s. (W=40 allowed it at once: a job started just
    # before a check got USR1 0.2 s in, before the interpreter had a handler, and died of it.) Until
    # the stop each step sleeps 0.6 s (--step_seconds), so the 100 steps would last over 60 s on
    # any machine (plus the start-up) at little CPU, as a slow job does; the requeued job resumes
    # unslowed and finishes in seconds (a tiny step is ~40 ms of CPU). The reference run takes the same
    # steps unslowed (the sleep changes no number).
    recipe = write_tiny_recipe(tmp_path, train_batch_size=4, max_train_steps=100, checkpointing_steps=25,
                               lr_scheduler="constant", dataloader_num_workers=2)
    out, log = tmp_path / "run", tmp_path / "slurm.out"
    job_id = subprocess.check_output(["sbatch", "--parsable", "--time=1", "--signal=USR1@15", f"--output={log}",
                                      slurm_script(tmp_path, "train_one_node.sbatch", 0.6), "--config", recipe,
                                      "--output_dir", str(out)], cwd=ROOT, env=job_environment(),
                                     text=True).strip().split(";")[0]
    state = wait_for_job(job_id, timeout=900)
    text = log.read_text(errors="replace")  # tqdm bars cut mid-character by a stop
    assert state == "COMPLETED" and "done: 100 optimizer steps" in text, text[-3000:]
    assert text.count("preempted: SIGUSR1 received") >= 1 and "Traceback" not in text, text[-3000:]
    run_training(recipe, tmp_path / "straight", env={"ACCELERATE_USE_CPU": "1"})
    assert [h["loss"] for h in read_history(out)] == [h["loss"] for h in read_history(tmp_path / "straight")]
    exported, straight = load_unet_weights(out), load_unet_weights(tmp_path / "straight")
    import torch
    assert all(torch.equal(exported[k], straight[k]) for k in straight)


def test_a_two_rank_job_cancelled_with_sigterm_requeues_and_ends_bit_identical(slurm, tmp_path):
    """`scancel --signal=TERM JOB` signals every process of the job's steps at once: both ranks and
    their loader workers. The ranks agree on a stop step, write checkpoint-N, exit 4, srun exits 4,
    the script requeues the job, and the requeued job finishes the run."""
    recipe = write_tiny_recipe(tmp_path, train_batch_size=4, max_train_steps=100, checkpointing_steps=25,
                               lr_scheduler="constant", dataloader_num_workers=2)
    out, log = tmp_path / "run", tmp_path / "slurm.out"
    # 0.1 s of sleep per step until the stop (--step_seconds): the signal, sent once checkpoint-25
    # is written, reaches the ranks mid-run (75 steps, 7.5 s, before the end)
    job_id = subprocess.check_output(["sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1",
                                      "--gpus-per-node=0", "--time=30", f"--output={log}",
                                      slurm_script(tmp_path, "train_multi_node.sbatch", 0.1), "--config", recipe,
                                      "--output_dir", str(out)], cwd=ROOT, env=job_environment(),
                                     text=True).strip().split(";")[0]
    deadline = time.monotonic() + 300
    while not (out / "checkpoint-25").is_dir():  # training, past start-up, before the end
        assert time.monotonic() < deadline, log.read_text(errors="replace")[-3000:] if log.exists() else "no log"
        time.sleep(0.5)
    subprocess.run(["scancel", "--signal=TERM", job_id])
    state = wait_for_job(job_id, timeout=900)
    text = log.read_text(errors="replace")
    assert state == "COMPLETED" and "done: 100 optimizer steps" in text, text[-3000:]
    assert text.count("preempted: SIGTERM received") == 1 and "Traceback" not in text, text[-3000:]
    stopped_at = int(text.split("stopped after optimizer step ")[1].split()[0])
    assert 25 <= stopped_at < 100 and (out / f"checkpoint-{stopped_at}").is_dir()
    launch_training(recipe, tmp_path / "straight", ranks=2, env={"ACCELERATE_USE_CPU": "1"})
    assert [h["loss"] for h in read_history(out)] == [h["loss"] for h in read_history(tmp_path / "straight")]
    exported, straight = load_unet_weights(out), load_unet_weights(tmp_path / "straight")
    import torch
    assert exported.keys() == straight.keys() and all(torch.equal(exported[k], straight[k]) for k in straight)
