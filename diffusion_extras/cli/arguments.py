"""The flags the command lines share (`python -m diffusion_extras.sample`, `.evaluate`, `.posthoc_ema`)
and bad input reported as one `error: ...` line with exit status 2 instead of a traceback. Nothing
here imports torch: a command parses its flags (`--help`, a bad flag) before it loads its work."""
from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager

from diffusion_extras.core.commands import prog_name
from diffusion_extras.evaluation.choices import ALL_SCHEDULERS, DEFAULT_GUIDANCE_SCALE, TIMESTEP_SPACINGS


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text}")
    return value


def pipeline_parser(command: str, description: str) -> argparse.ArgumentParser:
    """The parser of `python -m diffusion_extras.COMMAND PIPELINE ...`; `description`: the module docstring."""
    parser = argparse.ArgumentParser(prog=prog_name(command), description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pipeline", help="folder saved by train_ddpm.py (save_pretrained) or a Hub id")
    return parser


def add_sampler_arguments(parser: argparse.ArgumentParser) -> None:
    """--scheduler, --timestep_spacing, --num_inference_steps and --seed of the sample and evaluate commands."""
    parser.add_argument("--scheduler", choices=ALL_SCHEDULERS, default=None,
                        help="the sampler, on the pipeline's noise schedule: ddpm (ancestral), ddim (eta=0) or dpm "
                             "(DPM-Solver++ (2M)); a flow-matching model's: euler or dpm (on the flow sigmas). "
                             "(default: ddim, euler for a flow-matching model)")
    parser.add_argument("--timestep_spacing", choices=TIMESTEP_SPACINGS, default=None,
                        help="where the steps fall on the training schedule (diffusers' scheduler setting): trailing "
                             "starts at its last step, as a zero-terminal-SNR schedule needs. Default: the pipeline's "
                             "scheduler config's (trailing for a zero-terminal-SNR schedule)")
    parser.add_argument("--num_inference_steps", type=positive_int, default=50,
                        help="denoising steps per image (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0,
                        help="image i starts from noise seeded by (seed, i), whatever the batch size "
                             "(default: %(default)s)")


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: %(default)s)")


def add_guidance_arguments(parser: argparse.ArgumentParser) -> None:
    """--guidance_scale, --guidance_interval and --guide of the sample and evaluate commands."""
    parser.add_argument("--guidance_scale", type=float, default=None,
                        help=f"guidance scale of a class-conditional pipeline, or of any with --guide "
                             f"(default {DEFAULT_GUIDANCE_SCALE}; 1: none)")
    parser.add_argument("--guidance_interval", type=noise_interval, default=None, metavar="LOW,HIGH",
                        help="guide only at noise levels sigma = sqrt((1 - alpha_bar) / alpha_bar) in (LOW, HIGH], "
                             "one unguided UNet call elsewhere (Kynkaanniemi et al. 2024); default: every step")
    parser.add_argument("--guide", default=None,
                        help="autoguidance (Karras et al. 2024): a weaker model of the same resolution, channels "
                             "and classes (a UNet or DiT folder, a pipeline folder with unet/ or transformer/, or a "
                             "training checkpoint run/checkpoint-N: its EMA weights) "
                             "replaces the 'no class' branch; works for unconditional pipelines too. Default: the "
                             "pipeline's saved guide/ if it has one; 'none': never")


MASK_KINDS = ("random", "top", "bottom", "left", "right")  # --mask: data/conditioning.py's random masks, or a half


def add_condition_arguments(parser: argparse.ArgumentParser, images_help: str) -> None:
    """--conditioning_images, --masks, --back_projection_steps, --noise_level and --mask of the sample and
    evaluate commands (image-conditioned pipelines)."""
    parser.add_argument("--conditioning_images", default=None, metavar="DIR", help=images_help)
    parser.add_argument("--masks", default=None, metavar="DIR",
                        help="inpainting: the masks (white = to fill), the files at the same relative paths as the "
                             "images'")
    parser.add_argument("--back_projection_steps", type=non_negative_int, default=0, metavar="N",
                        help="super-resolution: N steps of iterative back-projection of each output onto its input, "
                             "so that the output, downsampled again, gives the input back (docs/conditioning.md; "
                             "default: %(default)s, none)")
    parser.add_argument("--noise_level", type=non_negative_int, default=None, metavar="N",
                        help="super-resolution trained with --max_noise_level: the noise level its inputs are given "
                             "at (0 to that maximum; higher for noisier or otherwise degraded inputs; default: the "
                             "pipeline's, 20)")
    parser.add_argument("--mask", choices=MASK_KINDS, default=None,
                        help="inpainting without --masks: random masks as training draws them (from --seed), or one "
                             "half of each image (default: random)")


def noise_interval(text: str) -> tuple[float, float]:
    """LOW,HIGH -> (low, high) with 0 <= low < high ('inf' allowed)."""
    try:
        low, high = (float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give two noise levels LOW,HIGH, e.g. 0.3,5") from None
    if not 0 <= low < high:
        raise argparse.ArgumentTypeError(f"{text!r}: need 0 <= LOW < HIGH")
    return low, high


@contextmanager
def one_line_errors():
    """Bad input and missing or unreadable files (ValueError, OSError) end the command with
    `error: ...` on stderr and exit status 2, as argparse does for a bad flag."""
    try:
        yield
    except (ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
