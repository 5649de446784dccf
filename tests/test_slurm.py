"""Preemption, several nodes and a lost node on a real Slurm cluster on this machine:
`examples/slurm/local_cluster.sh --nodes 2` brings up a controller and two nodes, node1 and node2,
each slurmd in network and UTS namespaces of its own (its own address and hostname), when this
machine allows (root, the slurm-wlm and munge packages, network namespaces; .ci/run brings it up),
else the tests are skipped with the reason (where only the namespaces are refused, the one-node
cluster serves the one-node tests).

- A job under --time=1 (Slurm's smallest limit: one minute) with --signal=USR1@15 stops with a
  checkpoint, requeues itself (exit 4 -> `scontrol requeue`, examples/slurm/train_one_node.sbatch)
  and continues until done; its weights equal an uninterrupted run's, bit for bit.
- examples/slurm/train_multi_node.sbatch (ranks started by srun): on one node with 2 ranks, cancelled
  with `scancel --signal=TERM`, it does the same; on two nodes with one rank each it trains as one
  node with two processes, its checkpoint's files byte for byte; in one-minute slots on two nodes
  every rank stops at the same step and the requeued job finishes the run; a signal to one node's
  rank alone stops both at one step; when one node's rank is killed, the other fails by itself on
  the closed connection, Slurm's line names the lost task and node, and the same command resumes
  from the newest complete checkpoint; when one node's link is cut, Slurm declares the node down
  and requeues the job, which resumes once the node is back, while a cut shorter than Slurm's
  timeout only holds a step up. Each 2-rank job ends as the uninterrupted run.
The slowed jobs run the examples with tests/faults.py --step_seconds S for train_ddpm.py, whose
steps sleep until the first stop: the first segment lasts as long as the scheduler needs, at little
CPU, and the requeued one finishes in seconds. The jobs' interpreter is this one (the examples'
PYTHON variable), whichever python is first on PATH. The uninterrupted runs compared with: one rank
in this process, two as processes on this machine (one straight 2-rank run serves every 2-rank job)."""
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
from helpers import ROOT, load_bench_module, load_unet_weights, read_history, run_training, write_tiny_recipe
from processes import cli_env, launch_training

from diffusion_extras.training.checkpointing import resume_candidates

CLUSTER = os.path.join(ROOT, "examples", "slurm", "local_cluster.sh")
# The 2-rank jobs' recipe: 100 steps of global batch 8, checkpoints every 25, two loader workers per rank
TWO_RANK_RECIPE = {"train_batch_size": 4, "max_train_steps": 100, "checkpointing_steps": 25,
                   "lr_scheduler": "constant", "dataloader_num_workers": 2}
# Two nodes, one rank each, as a CPU cluster's user submits the multi-node example: its GPU and CPU
# counts overridden on the command line (a node here has this machine's 2 CPUs)
TWO_NODES = ("--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=0", "--cpus-per-task=1")
# Every test reads the module-scoped cluster (`slurm`), the 2-rank ones also `two_rank_straight`: on one
# xdist worker (--dist loadgroup), so each is made once.
pytestmark = pytest.mark.xdist_group("test_slurm")


def _cluster_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root to start slurmctld/slurmd"
    missing = [tool for tool in ("sbatch", "slurmctld", "slurmd", "munged") if shutil.which(tool) is None]
    if missing:
        return f"Slurm not installed ({', '.join(missing)}): apt-get install -y slurm-wlm munge"
    return None


def bring_up(*flags) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", CLUSTER, *flags], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def slurm():
    """The number of nodes up (2; 1 where this machine refuses the namespaces) and, with 1, why."""
    reason = _cluster_unavailable()
    if reason:
        pytest.skip(reason)
    two = bring_up("--nodes", "2")
    if two.returncode == 0:
        return 2, None
    one = bring_up()
    if one.returncode != 0:
        pytest.skip(f"the local Slurm cluster did not come up: {one.stderr.strip()[-300:]}")
    return 1, f"the two-node cluster did not come up: {two.stderr.strip()[-300:]}"


@pytest.fixture
def two_nodes(slurm):
    nodes, reason = slurm
    if nodes < 2:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def two_rank_straight(tmp_path_factory):
    """(recipe, output folder) of TWO_RANK_RECIPE run uninterrupted by 2 ranks on this machine
    (torch.distributed's variables, gloo): what every 2-rank job must end equal to."""
    folder = tmp_path_factory.mktemp("two_rank_straight")
    recipe = write_tiny_recipe(folder, **TWO_RANK_RECIPE)
    launch_training(recipe, folder / "run", ranks=2, env={"ACCELERATE_USE_CPU": "1"})
    return recipe, folder / "run"


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


def trainer_process(job_id: str, rank: int) -> int:
    """The pid of rank `rank`'s trainer in the job (bench/two_nodes.py finds it for its lost node too)."""
    return load_bench_module("two_nodes").trainer_process(job_id, rank)


def slurm_script(tmp_path, example: str, step_seconds: float | None) -> str:
    """examples/slurm/EXAMPLE, or with step_seconds S a copy in tmp_path with tests/faults.py
    --step_seconds S (the trainer whose steps sleep S seconds until its first stop) in place of
    train_ddpm.py; the rest is the example's."""
    path = os.path.join(ROOT, "examples", "slurm", example)
    if step_seconds is None:
        return path
    with open(path) as fh:
        text = fh.read()
    assert text.count(TRAINER) == 1, example
    copy = tmp_path / example
    copy.write_text(text.replace(TRAINER, f'"${{PYTHON:-python}}" tests/faults.py --step_seconds {step_seconds} --'))
    return str(copy)


def job_environment() -> dict:
    """The environment sbatch passes on to the job: the test commands' (processes.cli_env), on the CPU,
    with this interpreter as the examples' PYTHON (not whichever python is first on PATH: a venv's
    python run without activating the venv is not) and this checkout importable."""
    return {**cli_env(), "ACCELERATE_USE_CPU": "1", "PYTHONPATH": ROOT, "PYTHON": sys.executable}


def submit(script: str, log, recipe, output_dir, *sbatch_flags) -> str:
    """`sbatch SBATCH_FLAGS SCRIPT --config RECIPE --output_dir OUTPUT_DIR` from the project root, as a
    user submits it, with its output to `log`; the job id."""
    return subprocess.check_output(["sbatch", "--parsable", *sbatch_flags, f"--output={log}", script,
                                    "--config", recipe, "--output_dir", str(output_dir)],
                                   cwd=ROOT, env=job_environment(), text=True).strip().split(";")[0]


def read_log(log) -> str:
    """The job's output, each tqdm redraw (a carriage return) on a line of its own; decoded with
    replacement (a bar cut mid-character by a stop)."""
    return log.read_text(errors="replace").replace("\r", "\n")


def assert_same_run(run, straight, step: int = 100) -> None:
    """The same loss at every step, the same exported weights, and checkpoint-STEP's state byte for
    byte: training weights, optimizer, LR schedule, EMA, diagnostics and every rank's RNG states
    (train_state.json records the output folder, and its marker that file's checksum)."""
    import torch
    assert [h["loss"] for h in read_history(run)] == [h["loss"] for h in read_history(straight)]
    exported, reference = load_unet_weights(run), load_unet_weights(straight)
    assert exported.keys() == reference.keys() and all(torch.equal(exported[k], reference[k]) for k in reference)
    ours, theirs = run / f"checkpoint-{step}", straight / f"checkpoint-{step}"
    assert {"optimizer.bin", "random_states_1.pkl"} <= set(os.listdir(theirs))
    differing = load_bench_module("two_nodes").state_differences(ours, theirs)
    assert not differing, f"checkpoint-{step}: {differing} differ from one node's"


def rank_lines(text: str) -> dict:
    """{rank: (node, local rank, local world size, rendezvous)} from the multi-node example's line per rank."""
    found = re.findall(r"^(\d+): rank (\d+) of 2 on (\S+) \(local rank (\d+) of (\d+)\), rendezvous at (\S+)$",
                       text, re.MULTILINE)
    assert all(label == rank for label, rank, *_ in found), found  # srun's label is the rank
    return {int(rank): (node, int(local), int(local_size), rendezvous) for _, rank, node, local, local_size, rendezvous
            in found}


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
    job_id = submit(slurm_script(tmp_path, "train_one_node.sbatch", 0.6), log, recipe, out,
                    "--time=1", "--signal=USR1@15")
    state = wait_for_job(job_id, timeout=900)
    text = read_log(log)
    assert state == "COMPLETED" and "done: 100 optimizer steps" in text, text[-3000:]
    assert text.count("preempted: SIGUSR1 received") >= 1 and "Traceback" not in text, text[-3000:]
    run_training(recipe, tmp_path / "straight", env={"ACCELERATE_USE_CPU": "1"})
    assert [h["loss"] for h in read_history(out)] == [h["loss"] for h in read_history(tmp_path / "straight")]
    exported, straight = load_unet_weights(out), load_unet_weights(tmp_path / "straight")
    import torch
    assert all(torch.equal(exported[k], straight[k]) for k in straight)


def test_a_two_rank_job_cancelled_with_sigterm_requeues_and_ends_bit_identical(slurm, tmp_path, two_rank_straight):
    """`scancel --signal=TERM JOB` signals every process of the job's steps at once: both ranks and
    their loader workers. The ranks agree on a stop step, write checkpoint-N, exit 4, srun exits 4,
    the script requeues the job, and the requeued job finishes the run."""
    recipe, straight = two_rank_straight
    out, log = tmp_path / "run", tmp_path / "slurm.out"
    # 0.1 s of sleep per step until the stop (--step_seconds): the signal, sent once checkpoint-25
    # is written, reaches the ranks mid-run (75 steps, 7.5 s, before the end)
    job_id = submit(slurm_script(tmp_path, "train_multi_node.sbatch", 0.1), log, recipe, out,
                    "--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1", "--gpus-per-node=0", "--time=30")
    wait_for_checkpoint(out / "checkpoint-25", log)  # training, past start-up, before the end
    subprocess.run(["scancel", "--signal=TERM", job_id], check=True)
    state = wait_for_job(job_id, timeout=900)
    text = read_log(log)
    assert state == "COMPLETED" and "done: 100 optimizer steps" in text, text[-3000:]
    assert text.count("preempted: SIGTERM received") == 1 and "Traceback" not in text, text[-3000:]
    stopped_at = int(text.split("stopped after optimizer step ")[1].split()[0])
    assert 25 <= stopped_at < 100 and (out / f"checkpoint-{stopped_at}").is_dir()
    assert_same_run(out, straight)


def test_two_nodes_with_one_rank_each_train_as_one_node_with_two(two_nodes, tmp_path, two_rank_straight):
    """The multi-node example as users submit it, on node1 and node2 (one rank each, gloo): every
    rank's line names its own node and the first node as the rendezvous; the run's losses, weights and
    checkpoint state equal, byte for byte, two processes on one machine with the same global batch."""
    recipe, straight = two_rank_straight
    out, log = tmp_path / "run", tmp_path / "slurm.out"
    job_id = submit(slurm_script(tmp_path, "train_multi_node.sbatch", None), log, recipe, out, *TWO_NODES,
                    "--time=30")
    state = wait_for_job(job_id, timeout=900)
    text = read_log(log)
    assert state == "COMPLETED" and "done: 100 optimizer steps" in text, text[-3000:]
    ranks = rank_lines(text)
    port = ranks[0][3].split(":")[1]
    assert ranks == {0: ("node1", 0, 1, f"node1:{port}"), 1: ("node2", 0, 1, f"node1:{port}")}, text[:3000]
    assert_same_run(out, straight)


def test_two_nodes_in_one_minute_slots_stop_at_one_step_requeue_and_end_bit_identical(two_nodes, tmp_path,
                                                                                       two_rank_straight):
    """--time=1 --signal=USR1@15 on two nodes (the timing as in the one-node test above): Slurm
    signals the rank on each node; they agree on one stop step, write one checkpoint there together
    (each node's line names it), both exit 4, the job requeues itself and the requeued job finishes."""
    recipe, straight = two_rank_straight
    out, log = tmp_path / "run", tmp_path / "slurm.out"
    job_id = submit(slurm_script(tmp_path, "train_multi_node.sbatch", 0.6), log, recipe, out, *TWO_NODES,
                    "--time=1", "--signal=USR1@15")
    state = wait_for_job(job_id, timeout=900)
    text = read_log(log)
    assert state == "COMPLETED" and "done: 100 optimizer steps" in text, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    # (the stop line is the main process's, on stderr with its progress bar: not always after a label)
    stops = re.findall(r"preempted: SIGUSR1 received; stopped after optimizer step (\d+) ", text)
    assert stops, text[-3000:]
    for step in stops:  # each slot's stop: both nodes saved that one checkpoint, and both ranks exited 4
        assert sorted(re.findall(rf"^([01]): saved \S+/checkpoint-{step}$", text, re.MULTILINE)) == ["0", "1"], text
    assert text.count("srun: error: node1: task 0: Exited with exit code 4") == len(stops), text[-3000:]
    assert text.count("srun: error: node2: task 1: Exited with exit code 4") == len(stops), text[-3000:]
    assert_same_run(out, straight)


def test_a_signal_to_one_nodes_rank_stops_both_nodes_at_one_step(two_nodes, tmp_path, two_rank_straight):
    """SIGUSR1 to node2's rank alone (not through Slurm, which signals every node of the job): the
    ranks agree on the stop across the nodes (preemption.py: an all-reduce of the flag each step),
    both save one checkpoint at that step and exit 4, and the requeued job finishes the run."""
    recipe, straight = two_rank_straight
    out, log = tmp_path / "run", tmp_path / "slurm.out"
    job_id = submit(slurm_script(tmp_path, "train_multi_node.sbatch", 0.1), log, recipe, out, *TWO_NODES,
                    "--time=30")
    wait_for_checkpoint(out / "checkpoint-25", log)
    os.kill(trainer_process(job_id, 1), signal.SIGUSR1)
    state = wait_for_job(job_id, timeout=900)
    text = read_log(log)
    assert state == "COMPLETED" and "done: 100 optimizer steps" in text and "Traceback" not in text, text[-3000:]
    # the main process, on node1, names the signal it did not receive itself
    stops = re.findall(r"preempted: a stop signal \(on another rank\) received; stopped after optimizer step (\d+) ",
                       text)
    assert len(stops) == 1 and 25 <= int(stops[0]) < 100, text[-3000:]
    assert sorted(re.findall(rf"^([01]): saved \S+/checkpoint-{stops[0]}$", text, re.MULTILINE)) == ["0", "1"], text
    assert "srun: error: node1: task 0: Exited with exit code 4" in text, text[-3000:]
    assert "srun: error: node2: task 1: Exited with exit code 4" in text, text[-3000:]
    assert_same_run(out, straight)


def wait_for_checkpoint(path, log, timeout: float = 300) -> None:
    """Until checkpoint `path` is written: the job is training, past its start-up."""
    deadline = time.monotonic() + timeout
    while not path.is_dir():
        assert time.monotonic() < deadline, read_log(log)[-3000:] if log.exists() else "no log"
        time.sleep(0.5)


def test_a_lost_node_ends_the_job_in_bounded_time_and_the_same_command_resumes_bit_identical(two_nodes, tmp_path,
                                                                                             two_rank_straight):
    """Node2's rank killed (SIGKILL) mid-run: node1's rank does not wait in its collective for the
    group's timeout (30 minutes) but fails at once on the closed connection, by itself (srun's
    --wait=120 would end it after two minutes); srun's line names the lost task and node; the job
    fails. Submitted again, the same command resumes from the newest complete checkpoint and ends
    as the uninterrupted run."""
    recipe, straight = two_rank_straight
    out, log = tmp_path / "run", tmp_path / "slurm.out"
    script = slurm_script(tmp_path, "train_multi_node.sbatch", 0.3)  # slowed until it is resumed
    job_id = submit(script, log, recipe, out, *TWO_NODES, "--time=30")
    wait_for_checkpoint(out / "checkpoint-25", log)
    os.kill(trainer_process(job_id, 1), signal.SIGKILL)
    state = wait_for_job(job_id, timeout=300)  # srun's --wait=120 and Slurm's KillWait=30 bound it
    text = read_log(log)
    assert state == "FAILED", text[-3000:]
    lost = text.index("srun: error: node2: task 1: Killed")
    assert text.index("srun: error: node1: task 0: Exited with exit code 1") > lost, text[-3000:]
    assert "done:" not in text and not (out / "unet").exists()
    newest = resume_candidates(str(out), "latest")[0]  # what --resume_from_checkpoint latest picks
    again = tmp_path / "again.out"
    assert wait_for_job(submit(script, again, recipe, out, *TWO_NODES, "--time=30"), timeout=900) == "COMPLETED"
    text = read_log(again)
    assert f"0: resumed from {newest} at optimizer step" in text and "done: 100 optimizer steps" in text, text[-3000:]
    assert_same_run(out, straight)


def set_node_link(node: int, state: str) -> None:
    """Node `node`'s link up or down (bench/two_nodes.py cuts it for its figures too)."""
    load_bench_module("two_nodes").set_node_link(node, state)


def job_restarts(job_id: str) -> int:
    """How many times Slurm has requeued the job (bench/two_nodes.py reads it for its figures too)."""
    return load_bench_module("two_nodes").job_restarts(job_id)


# local_cluster.sh's SlurmdTimeout (30 s), slurmctld's ping interval within it, and KillWait (30 s)
NODE_DOWN_BOUND = 30 + 30 + 30 + 30


def test_a_node_cut_off_the_network_is_declared_down_and_the_requeued_job_resumes_bit_identical(two_nodes, tmp_path,
                                                                                                two_rank_straight):
    """Node2's link cut mid-run and kept down (a vanished node: nothing is closed, node1's rank waits at
    its collective): Slurm declares node2 down after SlurmdTimeout, ends node1's rank (SIGTERM, which
    cannot finish a stop without its peer, then SIGKILL), and requeues the job by itself (--requeue),
    minutes before the process group's 30-minute timeout would. With the link back, node2 returns to
    service, its stranded rank ends, and the same job resumes from the newest complete checkpoint and
    ends as the uninterrupted run."""
    recipe, straight = two_rank_straight
    out, log = tmp_path / "run", tmp_path / "slurm.out"
    script = slurm_script(tmp_path, "train_multi_node.sbatch", 0.3)  # slowed until it is resumed
    job_id = submit(script, log, recipe, out, *TWO_NODES, "--time=30")
    wait_for_checkpoint(out / "checkpoint-25", log)
    first, stranded = trainer_process(job_id, 0), trainer_process(job_id, 1)
    set_node_link(2, "down")
    try:
        deadline = time.monotonic() + NODE_DOWN_BOUND
        while os.path.exists(f"/proc/{first}"):  # node1's rank: ended by Slurm, not by the group's timeout
            assert time.monotonic() < deadline, read_log(log)[-3000:]
            time.sleep(1)
        node = subprocess.run(["scontrol", "show", "node", "node2"], capture_output=True, text=True).stdout
        assert "DOWN" in node.split("State=")[1].split()[0] and "Reason=Not responding" in node, node
        assert job_restarts(job_id) == 1 and os.path.exists(f"/proc/{stranded}")
        # what the requeued job will find: it cannot start before node2 is back
        newest = resume_candidates(str(out), "latest")[0]  # what --resume_from_checkpoint latest picks
    finally:
        set_node_link(2, "up")
    assert wait_for_job(job_id, timeout=900) == "COMPLETED", read_log(log)[-3000:]
    text = read_log(log)
    assert "srun: error: Node failure on node2" in text and "DUE TO NODE FAILURE" in text, text[-3000:]
    assert f"0: resumed from {newest} at optimizer step" in text and "done: 100 optimizer steps" in text, text[-3000:]
    assert not os.path.exists(f"/proc/{stranded}")
    assert_same_run(out, straight)


def test_a_network_cut_shorter_than_slurmd_timeout_costs_only_the_wait(two_nodes, tmp_path, two_rank_straight):
    """Node2's link down for 15 s mid-run (under local_cluster.sh's SlurmdTimeout of 30 s): the ranks
    wait at their collective, TCP resends what it held once the link is back, and the job goes on:
    no requeue, no node failure, the uninterrupted run's result. A collective timeout shorter than
    the cut would fail it (seen with build.py's COLLECTIVE_TIMEOUT_MINUTES at 5 s, which both the
    process group and the stop agreement's group take: which of them waits depends on where the cut falls)."""
    recipe, straight = two_rank_straight
    out, log = tmp_path / "run", tmp_path / "slurm.out"
    script = slurm_script(tmp_path, "train_multi_node.sbatch", 0.3)
    job_id = submit(script, log, recipe, out, *TWO_NODES, "--time=30")
    wait_for_checkpoint(out / "checkpoint-25", log)
    set_node_link(2, "down")
    try:
        time.sleep(15)
    finally:
        set_node_link(2, "up")
    assert wait_for_job(job_id, timeout=900) == "COMPLETED", read_log(log)[-3000:]
    text = read_log(log)
    assert job_restarts(job_id) == 0 and "Node failure" not in text, text[-3000:]
    assert "resumed from" not in text and "done: 100 optimizer steps" in text, text[-3000:]
    # the cut held a step up (a global batch of 8 over 15 s: about 0.5 images/s; the others ~20)
    assert min(h["images_per_second"] for h in read_history(out)) < 1
    assert_same_run(out, straight)
