"""Where a step's compute and time go: model FLOPs, the GPU's peak, peak memory, and a per-op profile."""
from __future__ import annotations

import os
import time

import diffusers_reference
import torch


def timed(fn, steps: int, synchronize) -> float:
    """Seconds per call, the device drained before and after."""
    synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    synchronize()
    return (time.perf_counter() - start) / steps


def count_flops(run) -> dict:
    """Model FLOPs of one forward+backward per image. Attention runs on PyTorch's math SDPA here
    so that its two matmuls are counted on every device (FlopCounterMode does not see the fused
    CPU kernel); they are reported apart, as the issue's 36.3 GFLOP/img leaves them out."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from diffusion_extras.evaluation.pipeline_backbone import predict, sample_shape

    device, unet = run.accelerator.device, run.learner.unet
    # the model's input (latents in a latent run), UNet or DiT, called as the trainer calls it
    sample = torch.randn(2, *sample_shape(run.accelerator.unwrap_model(unet)), device=device)
    timesteps = torch.randint(0, run.objective.num_train_timesteps, (2,), device=device)
    counter = FlopCounterMode(display=False)
    # Eager, even under --torch_compile: a compiled module first called inside a dispatch mode is
    # left uncompiled for every later call (seen on torch 2.11 and 2.13), and the steps timed after
    # this would be eager ones.
    with counter, sdpa_kernel([SDPBackend.MATH]), torch.compiler.set_stance("force_eager"):
        predict(unet, sample, timesteps).float().square().mean().backward()
    unet.zero_grad(set_to_none=True)
    by_op = {str(op): flops / 2 for op, flops in counter.get_flop_counts()["Global"].items()}
    attention = by_op.get("aten.bmm", 0.0)  # the UNet's only batched matmuls are attention's (a DiT's too)
    total = counter.get_total_flops() / 2
    return {"gflop_per_image_fwd_bwd": total / 1e9, "gflop_per_image_attention_matmuls": attention / 1e9,
            "gflop_per_image_without_attention_matmuls": (total - attention) / 1e9,
            "gflop_per_image_by_op": {op: v / 1e9 for op, v in by_op.items()}}


PEAK_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.4), ("H200", 989.4), ("GH200", 989.4),
               ("A100", 312.0), ("L40S", 362.1), ("L4", 121.0))  # dense bf16 = fp16, spec sheets


def peak_tflops(name: str | None, given: float | None) -> float | None:
    if given is not None or not name:
        return given
    return next((value for key, value in PEAK_TFLOPS if key in name), None)


def matmul_tflops(device, dtype) -> float:
    """What an 8192^3 matmul reaches in this dtype: the achievable ceiling, beside the spec peak."""
    a, b = (torch.randn(8192, 8192, device=device, dtype=dtype) for _ in range(2))
    for _ in range(3):
        a @ b
    seconds = timed(lambda: a @ b, 10, torch.cuda.synchronize)
    return 2 * 8192 ** 3 / seconds / 1e12


def cuda_memory(full, bare, device) -> dict:
    out = {}
    for name, fn in (("full", full), ("bare", bare)):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        out[f"peak_allocated_bytes_{name}"] = torch.cuda.max_memory_allocated(device)
        out[f"peak_reserved_bytes_{name}"] = torch.cuda.max_memory_reserved(device)
    out["process_memory_mib_nvidia_smi"] = diffusers_reference.compute_apps_memory_mib().get(os.getpid())
    return out


def profile_extras(full, bare, steps: int, device, synchronize) -> dict:
    """Self time per op and step in each variant; the ops that differ most are where extras go."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    field = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    per_op, kernels = {}, {}
    for name, fn in (("full", full), ("bare", bare)):
        with profile(activities=activities) as prof:
            for _ in range(steps):
                fn()
            synchronize()
        events = prof.key_averages()
        per_op[name] = {e.key: getattr(e, field, 0.0) / steps / 1e3 for e in events}
        # The device's own entries (kernels, copies, memsets), without the CPU-side ops that launch them
        # and without the device-side ranges of record_function annotations (Optimizer.step#AdamW.step
        # spans kernels counted already): their sum is the time the device computes per step, which read
        # against the step's wall time says whether the step is bound by the device or by launching work.
        kernels[name] = {e.key: e.self_device_time_total / steps / 1e3 for e in events
                         if device.type == "cuda" and e.device_type == torch.autograd.DeviceType.CUDA
                         and not getattr(e, "is_user_annotation", False)}
    ops = set(per_op["full"]) | set(per_op["bare"])
    rows = [{"op": op, "full_ms": per_op["full"].get(op, 0.0), "bare_ms": per_op["bare"].get(op, 0.0)} for op in ops]
    for row in rows:
        row["extra_ms"] = row["full_ms"] - row["bare_ms"]
    rows.sort(key=lambda row: -abs(row["extra_ms"]))
    top = sorted(kernels["full"].items(), key=lambda item: -item[1])[:20]
    return {"clock": field, "steps": steps, "total_full_ms": sum(per_op["full"].values()),
            "total_bare_ms": sum(per_op["bare"].values()), "ops": rows[:20],
            "device_ms_full": sum(kernels["full"].values()), "device_ms_bare": sum(kernels["bare"].values()),
            "top_device_full": [{"kernel": key, "ms": ms} for key, ms in top]}
