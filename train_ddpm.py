#!/usr/bin/env python
"""Train a DDPM (diffusers UNet2DModel + DDPMScheduler) with Accelerate.

    python train_ddpm.py                                   # embedded digits, CPU minutes
    accelerate launch train_ddpm.py --config configs/cifar10-ddpm.yaml --dataset_name cifar10

Progress is counted in optimizer steps. Everything random in a step (data order, crops, flips,
noise, timesteps) is a function of (seed, micro-step), so a resumed run continues bit for bit
and P ranks with batch B train like one rank with batch P*B (up to float summation order).

The trainer lives in the package (diffusion_extras/training/): build.py builds the typed run,
step.py is one optimizer step, loop.py the loop, periodic.py the grids, probes and export,
resume.py the resume, lr_range.py the LR range test, main.py the exit codes, and hooks.py the
extension points. `python train_ddpm.py --help` lists the flags by group.

Exit codes: 0 done; 2 bad input (one line, before training); 3 stopped on non-finite steps;
4 preempted (SIGTERM/SIGUSR1/SIGINT: checkpoint saved, resume latest); 5 disk full (free space, resume latest).
"""
from diffusion_extras.core import stop_flag

stop_flag.record_early_signals()  # before torch is imported (seconds): a preemption signal then is kept
from diffusion_extras.training.main import cli  # noqa: E402

if __name__ == "__main__":
    cli()
