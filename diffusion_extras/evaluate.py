"""Command line: FID / KID / FD-DINOv2 / CMMD of a saved DDPMPipeline against a folder of images or
saved statistics (an .npz serves one extractor; a folder serves any).

    python -m diffusion_extras.evaluate PIPELINE --reference DIR_OR_STATS.npz --num_samples 10000 \\
        --eval_metrics fid,kid,fd_dinov2,cmmd
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

import numpy as np
from PIL import Image

from diffusion_extras.evaluation import (ReferenceStatistics, build_feature_extractor, evaluate_unet_metrics,
                                         extractors_for, parse_metrics, reference_statistics)
from diffusion_extras.backbones import CLIP_DEFAULT, DINOV2_DEFAULT
from diffusion_extras.sample import positive_int
from diffusion_extras.data import preprocess_image
from diffusion_extras.sampling import SCHEDULERS, load_pipeline, make_scheduler, resolve_device

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".webp")


def list_images(folder: str) -> list[str]:
    paths = sorted(os.path.join(root, name) for root, _, names in os.walk(folder)
                   for name in names if name.lower().endswith(IMAGE_EXTENSIONS))
    if not paths:
        raise ValueError(f"no images ({', '.join(IMAGE_EXTENSIONS)}) found under {folder}")
    return paths


def load_image(path: str, resolution: int) -> np.ndarray:
    """RGB uint8 [H, W, 3], preprocessed exactly as training images are (shorter side to
    `resolution`, centre crop)."""
    with Image.open(path) as image:
        return preprocess_image(image, resolution, center_crop=True, channels=3)


def iter_image_batches(paths: list[str], resolution: int, batch_size: int):
    for first in range(0, len(paths), batch_size):
        yield np.stack([load_image(path, resolution) for path in paths[first:first + batch_size]])


def folder_fingerprint(paths: list[str], resolution: int) -> str:
    """Changes when a file is added, removed, rewritten or the resolution changes."""
    digest = hashlib.sha256(f"resolution={resolution}".encode())
    for path in paths:
        stat = os.stat(path)
        digest.update(f"\n{os.path.abspath(path)}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    return digest.hexdigest()


def load_reference(reference: str, extractor, resolution: int, cache_dir: str | None, batch_size: int):
    if os.path.isfile(reference):
        statistics = ReferenceStatistics.load(reference)
        if statistics.extractor_name != extractor.name:
            raise ValueError(f"{reference} was made with {statistics.extractor_name!r}, not {extractor.name!r}; "
                             "pass the matching --feature_extractor / --inception_weights or a folder of images")
        return statistics
    if not os.path.isdir(reference):
        raise FileNotFoundError(f"--reference {reference} is neither a folder of images nor a .npz statistics file")
    paths = list_images(reference)
    fingerprint = folder_fingerprint(paths, resolution)
    extractor_key = hashlib.sha256(extractor.name.encode()).hexdigest()[:8]
    cache_path = (os.path.join(cache_dir, f"reference-{fingerprint[:16]}-{extractor_key}.npz")
                  if cache_dir else None)
    return reference_statistics(iter_image_batches(paths, resolution, batch_size), extractor,
                                cache_path=cache_path, fingerprint=fingerprint)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m diffusion_extras.evaluate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pipeline", help="folder saved by train_ddpm.py (save_pretrained) or a Hub id")
    parser.add_argument("--reference", required=True,
                        help="folder of reference images (resized to the model resolution) or a stats .npz")
    parser.add_argument("--num_samples", type=positive_int, default=10000, help="generated images")
    parser.add_argument("--eval_metrics", default="fid,kid", help="comma list of fid, kid, fd_dinov2, cmmd")
    parser.add_argument("--feature_extractor", choices=("inception", "tiny"), default="inception",
                        help="features of fid/kid; tiny: random conv net for smoke tests, NOT comparable "
                             "with published numbers")
    parser.add_argument("--inception_weights", default=None,
                        help="TorchScript inception-2015-12-05.pt (StyleGAN2-ADA / clean-fid detector); "
                             "default: downloaded once into the Hugging Face cache folder")
    parser.add_argument("--dinov2_model", default=DINOV2_DEFAULT, help="Hub id or local folder for fd_dinov2")
    parser.add_argument("--clip_model", default=CLIP_DEFAULT, help="Hub id or local folder for cmmd")
    parser.add_argument("--scheduler", choices=SCHEDULERS, default="ddim")
    parser.add_argument("--num_inference_steps", type=positive_int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch_size", type=positive_int, default=64, help="images per UNet call")
    parser.add_argument("--cache_dir", default=None, help="where reference statistics are cached")
    parser.add_argument("--output", default=None, help="metrics JSON file")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        device = resolve_device(args.device)
        groups = extractors_for(parse_metrics(args.eval_metrics), args.feature_extractor)
        pipeline = load_pipeline(args.pipeline, device=device)
        size = pipeline.unet.config.sample_size
        resolution = size if isinstance(size, int) else size[0]
        suites = []
        for kind, metrics in groups.items():
            extractor = build_feature_extractor(kind, args.inception_weights, device,
                                                model={"dinov2": args.dinov2_model, "clip": args.clip_model}.get(kind))
            reference = load_reference(args.reference, extractor, resolution, args.cache_dir, args.batch_size)
            suites.append((extractor, reference, metrics))
        scheduler = make_scheduler(args.scheduler, pipeline.scheduler.config)
        metrics = evaluate_unet_metrics(pipeline.unet, scheduler, suites, args.num_samples,
                                        args.num_inference_steps, args.seed, args.batch_size, device)
        report = {**metrics, "feature_extractors": {m: e.name for e, _, group in suites for m in group},
                  "reference": args.reference, "reference_images": reference.num_images, "pipeline": args.pipeline,
                  "scheduler": args.scheduler, "num_inference_steps": args.num_inference_steps, "seed": args.seed}
        if args.output:
            os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
            with open(args.output, "w") as f:
                json.dump(report, f, indent=2)
    except (ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
