#!/usr/bin/env python
"""Train a small diffusers AutoencoderKL on the embedded digits and save it with save_pretrained: a
stand-in for a Hub VAE, so latent diffusion (--pretrained_vae_model_name_or_path) can be measured on
a fresh machine with no network.

    python bench/train_digits_vae.py --output_dir digits-vae            # ~1M parameters, 16 px -> 4x4x4
    python train_ddpm.py --pretrained_vae_model_name_or_path digits-vae --output_dir latent-digits

The loss is the LDM autoencoder's without its discriminator and LPIPS (Rombach et al. 2022):
L1 reconstruction of the posterior's sample + kl_weight x KL(posterior || N(0, I)). At the end the
latents' std over the digits (posterior means and their spread) sets `scaling_factor` = 1 / std,
as Stable Diffusion's 0.18215 was measured, so the UNet sees latents of about unit variance.
Ctrl-C, SIGTERM or SIGUSR1 stop it after the current step and save the VAE trained so far (exit 4,
as the trainer's).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the package, from bench/

from diffusion_extras.core import commands, cpu_threads, stop_flag  # noqa: E402

with commands.importing_the_stack():  # torch's idle threads sleep: a shared CPU keeps its speed (cpu_threads)
    import torch
    from tqdm.auto import tqdm

    from diffusion_extras.data import batch_order, decode_cache, images

# Three encoder blocks: factor 4 (16 px -> 4x4 latents); 4 latent channels as Stable Diffusion's.
DIGITS_VAE = dict(in_channels=1, out_channels=1, latent_channels=4, block_out_channels=[32, 64, 64],
                  layers_per_block=1, norm_num_groups=8,
                  down_block_types=["DownEncoderBlock2D"] * 3, up_block_types=["UpDecoderBlock2D"] * 3)
# Minutes on 2 cores (docs/BENCHMARKS.md, "Latent against pixel diffusion"): a cosine decay from a
# higher peak reaches in 600 steps the reconstruction a constant 1e-3 reached in 1000.
STEPS, LEARNING_RATE, LR_WARMUP_STEPS = 600, 2e-3, 30
STOPPED = 4  # the exit code of a run stopped by a signal with its VAE saved (the trainer's "preempted")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", required=True, help="where the AutoencoderKL is saved (save_pretrained)")
    parser.add_argument("--resolution", type=int, default=16, help="image side in pixels (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=STEPS, help="optimizer steps (default: %(default)s)")
    parser.add_argument("--batch_size", type=int, default=64, help="images per step (default: %(default)s)")
    parser.add_argument("--learning_rate", type=float, default=LEARNING_RATE,
                        help="AdamW's peak learning rate, reached after --lr_warmup_steps, then cosine decay to 0 "
                             "(default: %(default)s)")
    parser.add_argument("--lr_warmup_steps", type=int, default=LR_WARMUP_STEPS,
                        help="linear warm-up steps (default: %(default)s)")
    parser.add_argument("--kl_weight", type=float, default=1e-4,
                        help="weight of the KL term (LDM's f-scaling) (default: %(default)s)")
    parser.add_argument("--latent_channels", type=int, default=DIGITS_VAE["latent_channels"],
                        help="latent channels (default: %(default)s)")
    parser.add_argument("--block_out_channels", default=",".join(map(str, DIGITS_VAE["block_out_channels"])),
                        help="comma-separated; the encoder halves the image once per block but the last "
                             "(default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the weights and the batches (default: %(default)s)")
    return parser.parse_args(argv)


def digits(resolution: int) -> torch.Tensor:
    """The 1,797 digits in [-1, 1], [N, 1, resolution, resolution], decoded as the trainer decodes them."""
    decoded = decode_cache.decode_dataset(images.digits_dataset(), "image", resolution, True, 1)
    return batch_order.to_model_input(torch.from_numpy(decoded.as_array()).permute(0, 3, 1, 2), "cpu")


def build_vae(args):
    from diffusers import AutoencoderKL

    blocks = [int(v) for v in args.block_out_channels.split(",")]
    return AutoencoderKL(**{**DIGITS_VAE, "latent_channels": args.latent_channels, "block_out_channels": blocks,
                            "down_block_types": ["DownEncoderBlock2D"] * len(blocks),
                            "up_block_types": ["UpDecoderBlock2D"] * len(blocks), "sample_size": args.resolution})


def train(vae, data: torch.Tensor, args) -> int:
    """The reconstruction + KL steps, with a progress bar (its time estimate and the reconstruction
    L1 of every 10th step), until args.steps or a stop signal (stop_flag); returns the steps done."""
    from diffusers.optimization import get_cosine_schedule_with_warmup

    generator = torch.Generator().manual_seed(args.seed)
    optimizer = torch.optim.AdamW(vae.parameters(), lr=args.learning_rate)
    schedule = get_cosine_schedule_with_warmup(optimizer, args.lr_warmup_steps, args.steps)
    vae.train()
    done = 0
    with tqdm(range(args.steps), desc="VAE steps", unit="step", file=sys.stdout) as progress_bar:
        for step in progress_bar:
            if stop_flag.early_signal() is not None:
                break
            batch = data[torch.randint(len(data), (args.batch_size,), generator=generator)]
            posterior = vae.encode(batch).latent_dist
            reconstruction = vae.decode(posterior.sample(generator)).sample
            l1 = (reconstruction - batch).abs().mean()
            loss = l1 + args.kl_weight * posterior.kl().mean() / batch[0].numel()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            done = step + 1
            if step % 10 == 0 or done == args.steps:
                progress_bar.set_postfix(l1=f"{l1.item():.4f}")
    return done


@torch.no_grad()
def latent_std(vae, data: torch.Tensor) -> float:
    """The std of the latents a UNet would be trained on: sqrt(Var[mean] + E[std^2]) over all."""
    vae.eval()
    means, variances = [], []
    for first in range(0, len(data), 256):
        posterior = vae.encode(data[first:first + 256]).latent_dist
        means.append(posterior.mean)
        variances.append(posterior.var)
    mean, variance = torch.cat(means), torch.cat(variances)
    return float((mean.var() + variance.mean()).sqrt())


def main(argv=None) -> int:
    """Train and save; 0 when done, STOPPED when a signal stopped it (the VAE so far saved). The
    process is left as found (its signal handlers back), for a caller that runs it in-process."""
    args = parse_args(argv)
    with commands.leaving_the_process_as_found():  # from here a stop signal is recorded, not fatal
        torch.manual_seed(args.seed)
        data = digits(args.resolution)
        vae = build_vae(args)
        print(f"AutoencoderKL: {sum(p.numel() for p in vae.parameters()) / 1e6:.2f}M parameters, "
              f"{len(data)} digits at {args.resolution} px; {cpu_threads.describe()}", flush=True)
        done = train(vae, data, args)
        stopped = stop_flag.early_signal()
        if stopped is not None:
            print(f"{stopped[0]}: stopped after step {done} of {args.steps}; saving the VAE trained so far",
                  flush=True)
        scale = 1.0 / latent_std(vae, data)
        vae.register_to_config(scaling_factor=scale)
        vae.save_pretrained(args.output_dir)
        print(f"saved to {args.output_dir} (scaling_factor {scale:.4g}); reconstruction L1 on all digits: "
              f"{evaluation_l1(vae, data):.4f}")
    return 0 if stopped is None else STOPPED


@torch.no_grad()
def evaluation_l1(vae, data: torch.Tensor) -> float:
    """Reconstruction L1 of the posterior means over every digit, in [-1, 1] units."""
    vae.eval()
    total = sum(float((vae.decode(vae.encode(data[i:i + 256]).latent_dist.mean).sample - data[i:i + 256]).abs().sum())
                for i in range(0, len(data), 256))
    return total / data.numel()


if __name__ == "__main__":
    sys.exit(main())
