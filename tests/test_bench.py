"""bench/bench_step.py runs end to end on a tiny UNet (its main() in this process) and writes
well-formed JSON; the diffusers reference runner reads tqdm progress live and stops the whole process
group (real processes). No timing is asserted: the figures are measurements, only their presence
and sanity are checked."""
import json
import math
import os
import sys
import textwrap
import time

import pytest
from helpers import load_bench_module, run_main

diffusers_reference = load_bench_module("diffusers_reference")


def run_bench(*args, check=True):
    """`python bench/bench_step.py ARGS` through its main() in this process: a CompletedProcess."""
    return run_main(load_bench_module("bench_step").main, args, check=check)


def positive_finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One run of the bench on the tiny UNet: (its stdout, its JSON report)."""
    tmp_path = tmp_path_factory.mktemp("bench")
    out = tmp_path / "bench.json"
    result = run_bench("--tiny", "--steps", "2", "--warmup", "1", "--data_seconds", "0.2",
                       "--json", str(out))
    return result.stdout, json.loads(out.read_text())


def test_the_dit_latent_recipe_times_a_dit_on_latents_of_labelled_images(tmp_path):
    """The GPU recipe DiT's figures come from, cut for a CPU: DiT-S/8 on the latents (8x8x4) of
    64 px labelled synthetic images through a narrowed VAE of sd-vae-ft-mse's shape, learned sigma;
    both steps and the FLOP count call the DiT as the trainer does."""
    out = tmp_path / "dit.json"
    run_bench("--recipe", "dit-latent", "--tiny", "--steps", "2", "--warmup", "1", "--data_seconds", "0.2",
              "--snr_gamma", "0", "--json", str(out), "--", "--dit_size", "S/8", "--resolution", "64",
              "--train_batch_size", "4", "--mixed_precision", "no")
    report = json.loads(out.read_text())
    config = report["config"]
    assert (config["model_type"], config["dit_size"], config["latents"]) == ("dit", "S/8", True)
    assert config["unet_parameters"] > 30e6  # DiT-S: 33M (the label table of 1000 classes in each block)
    assert all(positive_finite(report["step"][variant]["images_per_s"]) for variant in ("full", "bare"))
    assert positive_finite(report["flops"]["gflop_per_image_fwd_bwd"]) and report["sanity"]["weights_finite_after"]


@pytest.mark.xdist_group("test_bench.tiny_run")
def test_tiny_bench_writes_complete_json(tiny_run):
    stdout, report = tiny_run
    assert "full optimizer_step" in stdout and "extras cost" in stdout

    assert {"command", "date", "machine", "config", "step", "data", "flops", "gpu", "diffusers", "notes",
            "sanity"} <= set(report)
    assert "bench_step.py" in report["command"] and "--tiny" in report["command"]
    machine = report["machine"]
    assert machine["device"] == "cpu" and machine["cpu_cores"] >= 1 and machine["torch"]
    assert len(machine["load_average_start"]) == 3

    config = report["config"]
    assert config["recipe"] == "tiny" and config["resolution"] == 8 and config["train_batch_size"] == 8
    assert config["extras"]["ema"] is True and config["extras"]["snr_gamma"] == 5.0
    assert config["extras"]["diagnostics"] is True  # the trainer always keeps per-timestep diagnostics
    assert config["rounds"] == 2  # --steps 2 caps the rounds at 2 of one step each

    for variant in ("full", "bare"):
        timing = report["step"][variant]
        assert len(timing["rounds_s"]) == 2 and all(positive_finite(t) for t in timing["rounds_s"])
        assert timing["min_s"] <= timing["median_s"] <= timing["max_s"]
        assert positive_finite(timing["images_per_s"])
        assert timing["images_per_s"] == pytest.approx(8 / timing["median_s"])
    extras = report["step"]["extras"]
    assert len(extras["paired_ratios"]) == 2 and all(positive_finite(r) for r in extras["paired_ratios"])
    assert extras["percent"] == pytest.approx(100 * (extras["median_ratio"] - 1))

    data = report["data"]
    assert positive_finite(data["images_per_s"]) and positive_finite(data["ratio"])
    assert data["consumed_images_per_s"] == pytest.approx(report["step"]["full"]["images_per_s"])
    flops = report["flops"]
    assert positive_finite(flops["gflop_per_image_fwd_bwd"]) and positive_finite(flops["achieved_tflops_full"])
    assert flops["mfu_full"] is None and flops["peak_tflops"] is None  # no peak known for a CPU
    assert report["gpu"] is None and report["diffusers"]["status"] == "skipped"
    assert report["sanity"]["weights_finite_after"] is True


@pytest.mark.xdist_group("test_bench.tiny_run")
def test_table_renders_the_gpu_rows(tiny_run):
    """The GPU-only rows (MFU, memory, diffusers reference, profile) cannot run here: render them
    from a CPU report with those sections filled in, so a format slip shows before a GPU run."""
    bench_report = load_bench_module("bench_report")

    report = json.loads(json.dumps(tiny_run[1]))
    report["flops"].update(peak_tflops=989.4, mfu_full=0.2, mfu_bare=0.25)
    report["gpu"] = {"peak_allocated_bytes_full": 3 * 2 ** 30, "peak_reserved_bytes_full": 4 * 2 ** 30,
                     "peak_allocated_bytes_bare": 2 * 2 ** 30, "peak_reserved_bytes_bare": 3 * 2 ** 30,
                     "process_memory_mib_nvidia_smi": 5000, "matmul_tflops_measured": 790.0}
    report["diffusers"] = {"status": "ok", "images_per_s": 4000.0, "step_s": 0.032, "steps_timed": 200,
                           "seconds_timed": 6.4, "peak_process_memory_mib_nvidia_smi": 7000,
                           "ours_full_over_diffusers_images_per_s": 1.5}
    report["profile"] = {"clock": "self_device_time_total", "steps": 5, "total_full_ms": 30.0, "total_bare_ms": 29.0,
                         "ops": [{"op": "aten::_foreach_lerp_", "full_ms": 0.2, "bare_ms": 0.0, "extra_ms": 0.2}],
                         "device_ms_full": 26.2, "device_ms_bare": 25.1,
                         "top_device_full": [{"kernel": "triton_red_fused_native_group_norm_0", "ms": 0.48}]}
    text = bench_report.table(report)
    assert "MFU" in text and "20.0%" in text and "790" in text
    assert "3.00 GiB allocated" in text and "5000 MiB" in text
    assert "ours/diffusers = 1.50x" in text and "aten::_foreach_lerp_" in text
    assert "full 26.2 ms, bare 25.1 ms" in text and "triton_red_fused_native_group_norm_0" in text


def test_cifar10_recipe_gets_its_synthetic_images_before_the_config_is_checked(tmp_path):
    """The config parser refuses a --dataset_name folder that does not exist: the images are
    written first, as many as the diffusers reference's steps read when it runs."""
    import datasets
    bench_step = load_bench_module("bench_step")

    args, trainer_flags = bench_step.parse_args(["--recipe", "cifar10", "--batch_size", "4",
                                                  "--diffusers_warmup", "1", "--diffusers_steps", "2"])
    for compare, count in ((False, 512), (True, 4 * (1 + 2 + 2))):
        workdir = tmp_path / str(compare)
        config = bench_step.make_config(args, trainer_flags, str(workdir), compare)
        assert config.dataset_name == str(workdir / "images") and config.resolution == 32
        images = datasets.load_dataset(config.dataset_name, split="train")
        assert len(images) == count and images[0]["image"].size == (32, 32) and images[0]["image"].mode == "RGB"


def test_flop_count_leaves_a_compiled_unet_compiled(tmp_path, fresh_accelerate):
    """count_flops runs before the timed steps; a compiled module first called inside
    FlopCounterMode would stay uncompiled, and --torch_compile's figures would be eager ones. The
    eager backend captures the same frames as inductor without generating code."""
    import torch
    from faults import dynamo_counts
    from helpers import tiny_run as setup_tiny_run

    from diffusion_extras.training import loop, step
    device_figures = load_bench_module("device_figures")

    torch.compiler.reset()  # what an earlier test compiled (or refused to) in this process is forgotten
    run = setup_tiny_run(tmp_path, "--torch_compile", "--torch_compile_backend", "eager", "--max_train_steps", 4)
    before = dynamo_counts()
    assert positive_finite(device_figures.count_flops(run)["gflop_per_image_fwd_bwd"])
    step.optimizer_step(run, loop.make_batches(run))
    after = dynamo_counts()
    assert after["graphs"] > before["graphs"], "the step after the FLOP count ran uncompiled"
    assert after["breaks"] == before["breaks"]


@pytest.mark.parametrize("args, needle", [(["--steps", "0"], "--steps"),
                                          (["--diffusers_script", "/nonexistent/train_unconditional.py"],
                                           "--diffusers_script")])
def test_bad_input_is_one_line_error(args, needle):
    result = run_bench(*args, check=False)
    assert result.returncode == 2
    assert result.stderr.startswith("error:") and needle in result.stderr
    assert "Traceback" not in result.stderr


FAKE_LAUNCHER = """
import subprocess, sys
subprocess.run([sys.executable, sys.argv[1], sys.argv[2]])  # like accelerate launch: a child does the work
"""
FAKE_TRAINER = """
import os, sys, time
from tqdm.auto import tqdm
open(sys.argv[1], "w").write(str(os.getpid()))
bar = tqdm(total=100, mininterval=0)  # every update printed: step 40 is surely seen before the pause
bar.set_description("Epoch 0")
for step in range(40):
    time.sleep(0.01)
    bar.update(1)
    bar.set_postfix(loss=0.5, lr=1e-4, step=step + 1)
time.sleep(60)  # silent, like end-of-epoch sampling: the bench must stop it, not wait for it
open(sys.argv[1] + ".finished", "w").close()
"""


def test_follow_progress_reads_tqdm_and_stops_the_process_group(tmp_path):
    launcher, trainer, pid_file = tmp_path / "launch.py", tmp_path / "train.py", tmp_path / "pid"
    launcher.write_text(textwrap.dedent(FAKE_LAUNCHER))
    trainer.write_text(textwrap.dedent(FAKE_TRAINER))
    points, code, tail = diffusers_reference.follow_progress(
        [sys.executable, str(launcher), str(trainer), str(pid_file)], stop_at=40, timeout=300,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert code is None  # stopped by us, not finished
    assert not os.path.exists(f"{pid_file}.finished"), "it waited for the trainer instead of stopping it"
    counts = [n for n, _ in points]
    assert counts == sorted(set(counts)) and counts[-1] >= 40
    assert "Epoch 0" in tail
    rate = diffusers_reference.steps_per_second(points, warmup=5)
    assert rate is not None and positive_finite(rate[0]) and rate[1] == counts[-1] - min(n for n in counts if n >= 5)
    child = int(pid_file.read_text())
    time.sleep(0.5)
    try:
        with open(f"/proc/{child}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
        assert state in ("Z", "X"), f"the trainer child {child} still runs (state {state})"
    except FileNotFoundError:
        pass  # gone entirely


def test_reference_refuses_what_train_unconditional_cannot_train():
    from types import SimpleNamespace
    grey = SimpleNamespace(prediction_type="epsilon", model={"in_channels": 1}, model_config_name_or_path=None)
    velocity = SimpleNamespace(prediction_type="v_prediction", model={"in_channels": 3}, model_config_name_or_path=None)
    rgb = SimpleNamespace(prediction_type="epsilon", model={"in_channels": 3}, model_config_name_or_path=None)
    assert "RGB" in diffusers_reference.unsupported(grey)
    assert "v_prediction" in diffusers_reference.unsupported(velocity)
    assert diffusers_reference.unsupported(rgb) is None
