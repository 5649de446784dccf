"""What bench_step.py records beside its figures (machine, command, config) and how it prints them."""
from __future__ import annotations

import os
import platform
import shlex
import subprocess

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def command_line(script: str, argv: list[str]) -> str:
    """`python SCRIPT ARGV...`: the command line that made a report (argv: what the script's main got)."""
    return " ".join(shlex.quote(a) for a in ["python", os.path.relpath(script, ROOT), *argv])


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            return next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), "")
    except OSError:
        return platform.processor()


def _git_commit() -> str | None:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (head + ("+uncommitted" if dirty else "")) or None


def machine_info(device, load_start) -> dict:
    import accelerate
    import diffusers

    cuda = device.type == "cuda"
    return {"device": device.type, "cpu": _cpu_model(), "cpu_cores": os.cpu_count(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS"), "python": platform.python_version(),
            "diffusers": diffusers.__version__, "accelerate": accelerate.__version__,
            "gpu": torch.cuda.get_device_name(device) if cuda else None, "cuda": torch.version.cuda if cuda else None,
            "load_average_start": list(load_start), "load_average_end": list(os.getloadavg()),
            "git_commit": _git_commit()}


def config_summary(args, config, run) -> dict:
    from diffusion_extras.training import models

    return {"recipe": "tiny" if args.tiny else args.recipe, "mixed_precision": config.mixed_precision,
            "train_batch_size": config.train_batch_size,
            "gradient_accumulation_steps": config.gradient_accumulation_steps, "resolution": config.resolution,
            "unet_parameters": models.count_parameters(run.learner.unet),  # (the model's: a UNet's or a DiT's)
            "model_type": config.model_type, "dit_size": config.dit_size,
            "latents": run.data.posterior is not None,
            "dataloader_num_workers": config.dataloader_num_workers,
            "data": "synthetic random images (parquet)" if config.dataset_name else "embedded digits",
            # what the full step did, read off the run rather than assumed from flags
            "extras": {"ema": run.extras.ema is not None, "snr_gamma": config.snr_gamma,
                       "diagnostics": run.extras.diagnostics is not None,
                       "max_grad_norm": config.max_grad_norm, "prediction_type": config.prediction_type},
            "steps_per_variant": args.steps, "warmup": args.warmup, "rounds": min(args.rounds, args.steps)}


def notes(results: dict, device) -> list[str]:
    machine, config, step, data, flops = (results.get(k) for k in ("machine", "config", "step", "data", "flops"))
    out = []
    if device.type == "cpu":
        out.append(f"CPU shared with other jobs: load average {os.getloadavg()[0]:.2f} at the end on "
                   f"{os.cpu_count()} cores; torch used {torch.get_num_threads()} thread(s)")
    if not config["extras"]["diagnostics"]:
        out.append("the run has no `diagnostics`: the full step ran without per-timestep diagnostics")
    out.append("bare step: one noisy batch made beforehand on the device; forward, fp32 MSE, backward, the same "
               "fused AdamW; no GradScaler, clipping, EMA, weighting, randomness or H2D copy")
    extras = step["extras"]
    out.append(f"extras cost {extras['percent']:+.1f}% (median of paired round ratios; "
               f"target <= {extras['target_percent']:g}%: {'met' if extras['meets_target'] else 'MISSED'})")
    q1, q3 = extras["paired_ratio_quartiles"]
    if 100 * (q3 - q1) > extras["target_percent"]:
        out.append(f"the paired ratios' interquartile range ({100 * (q3 - q1):.1f} points) is wider than the "
                   f"target: this machine is too noisy to resolve it; see --profile for the extras' own ops")
    out.append(f"data pipeline delivers {data['ratio']:.1f}x what the step consumes (target >= "
               f"{data['target_ratio']:g}x: {'met' if data['meets_target'] else 'MISSED'})"
               + ("; with 0 workers loading runs in the training process and adds 1/ratio of a step"
                  if data["num_workers"] == 0 else ""))
    out.append(f"FLOPs (FlopCounterMode, math attention): {flops['gflop_per_image_fwd_bwd']:.3f} GFLOP/img fwd+bwd, "
               f"of which attention's two matmuls {flops['gflop_per_image_attention_matmuls']:.3f}; without them "
               f"{flops['gflop_per_image_without_attention_matmuls']:.3f} (what a fused-attention count shows)")
    if not results["sanity"]["weights_finite_after"]:
        out.append("WARNING: weights were not finite after the bench (timings of NaN steps may mislead)")
    return out


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:9.1f} ms"


def table(results: dict) -> str:
    lines = _header(results) + _step_lines(results) + _device_lines(results) + _profile_lines(results["profile"])
    return "\n".join(lines + ["", *("note: " + n for n in results["notes"])])


def _header(results: dict) -> list[str]:
    machine, config = results["machine"], results["config"]
    extras = config["extras"]
    where = machine["gpu"] or f"{machine['cpu']} ({machine['cpu_cores']} cores, {machine['torch_threads']} threads)"
    return [f"train_ddpm step benchmark: recipe {config['recipe']}, {config['unet_parameters'] / 1e6:.2f}M params, "
            f"batch {config['train_batch_size']} x {config['gradient_accumulation_steps']}, "
            f"precision {config['mixed_precision']}, {where}, torch {machine['torch']}",
            f"full step extras: EMA {'on' if extras['ema'] else 'off'}, min-SNR gamma {extras['snr_gamma']}, "
            f"diagnostics {'on' if extras['diagnostics'] else 'off'}; load average "
            f"{machine['load_average_start'][0]:.2f} -> {machine['load_average_end'][0]:.2f}",
            "", f"{'':24}{'median':>12}{'min':>12}{'max':>12}{'images/s':>12}{'TFLOP/s':>10}"]


def _step_lines(results: dict) -> list[str]:
    step, data, flops = results["step"], results["data"], results["flops"]
    lines = []
    for name, label in (("full", "full optimizer_step"), ("bare", "bare step")):
        s = step[name]
        lines.append(f"{label:24}{_ms(s['median_s']):>12}{_ms(s['min_s']):>12}{_ms(s['max_s']):>12}"
                     f"{s['images_per_s']:12.1f}{flops[f'achieved_tflops_{name}']:10.3f}")
    e = step["extras"]
    q1, q3 = e["paired_ratio_quartiles"]
    return lines + [
        f"{'extras cost':24}{e['percent']:+.1f}% (median of {len(e['paired_ratios'])} paired round ratios, "
        f"quartiles {100 * (q1 - 1):+.1f}% .. {100 * (q3 - 1):+.1f}%; fastest rounds "
        f"{100 * (e['ratio_of_minima'] - 1):+.1f}%; target <= {e['target_percent']:g}%)",
        f"{'data pipeline':24}{data['images_per_s']:.0f} img/s delivered vs {data['consumed_images_per_s']:.1f} "
        f"consumed = {data['ratio']:.1f}x (target >= {data['target_ratio']:g}x, {data['num_workers']} workers)",
        f"{'model FLOPs':24}{flops['gflop_per_image_fwd_bwd']:.3f} GFLOP/img fwd+bwd "
        f"({flops['gflop_per_image_without_attention_matmuls']:.3f} without attention matmuls)"]


def _device_lines(results: dict) -> list[str]:
    flops, gpu, reference = results["flops"], results["gpu"], results["diffusers"]
    lines = []
    if flops["peak_tflops"]:
        ceiling = gpu.get("matmul_tflops_measured") if gpu else None
        lines.append(f"{'MFU':24}full {flops['mfu_full']:.1%}, bare {flops['mfu_bare']:.1%} of "
                     f"{flops['peak_tflops']:g} TFLOP/s dense peak"
                     + (f" (an 8192^3 matmul reaches {ceiling:.0f})" if ceiling else ""))
    if gpu:
        gib = {k: v / 2 ** 30 for k, v in gpu.items() if k.startswith("peak_")}
        lines.append(f"{'peak memory':24}full {gib['peak_allocated_bytes_full']:.2f} GiB allocated "
                     f"({gib['peak_reserved_bytes_full']:.2f} reserved), bare {gib['peak_allocated_bytes_bare']:.2f}"
                     f" GiB; process {gpu['process_memory_mib_nvidia_smi']} MiB (nvidia-smi)")
    if reference["status"] == "ok":
        lines.append(f"{'diffusers reference':24}{reference['images_per_s']:.1f} img/s "
                     f"({_ms(reference['step_s']).strip()}/step over {reference['steps_timed']} steps), peak "
                     f"{reference['peak_process_memory_mib_nvidia_smi']} MiB (nvidia-smi); ours/diffusers = "
                     f"{reference['ours_full_over_diffusers_images_per_s']:.2f}x")
    else:
        lines.append(f"{'diffusers reference':24}{reference['status']}: {reference['note'][:300]}")
    return lines


def _profile_lines(profile: dict | None) -> list[str]:
    if not profile:
        return []
    lines = ["", f"profile ({profile['clock']}, ms per step): full {profile['total_full_ms']:.1f}, "
             f"bare {profile['total_bare_ms']:.1f}; ops that differ most:  full     bare    extra"]
    lines += [f"  {row['op'][:48]:48}{row['full_ms']:9.2f}{row['bare_ms']:9.2f}{row['extra_ms']:+9.2f}"
              for row in profile["ops"][:15]]
    if profile.get("top_device_full"):
        lines += ["", f"device time per step (kernels and copies): full {profile['device_ms_full']:.1f} ms, "
                      f"bare {profile['device_ms_bare']:.1f} ms; the full step's largest:"]
        lines += [f"  {row['kernel'][:70]:70}{row['ms']:9.2f}" for row in profile["top_device_full"][:15]]
    return lines
