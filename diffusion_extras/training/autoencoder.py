"""Latent diffusion's autoencoder: --pretrained_vae_model_name_or_path loaded with diffusers'
from_pretrained, frozen, and checked against the run before training (one line each: not an
autoencoder, a resolution it cannot encode, images it cannot read, a UNet of other channels). The
UNet then follows its latents (models.follow_data): latent_channels, and sample_size = --resolution
/ the downsampling factor, side by side.

An AutoencoderKL (Stable Diffusion's, SDXL's, SD3's, FLUX.1's VAEs) gives a posterior; a VQModel
(the LDM papers' autoencoders, diffusers' LDMPipeline) and an AutoencoderTiny (TAESD) give one
latent per image (std 0), which their decoders take as LDMPipeline and diffusers' pipelines give
them: a VQModel quantises while decoding."""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from diffusion_extras.data import latents
from diffusion_extras.data.spec import Resolution, as_resolution, image_size, resolution_text
from diffusion_extras.evaluation.pipeline_latent import latent_normalization, vae_scale_factor
from diffusion_extras.hub.download import is_offline_error, offline_reason
from diffusion_extras.training.config import ConfigError, TrainConfig
from diffusion_extras.training.validation import unfitting_side

VAE_SUBFOLDER = "vae"  # where a diffusers pipeline folder keeps its VAE
VAE_SUBFOLDERS = (VAE_SUBFOLDER, "vqvae")  # ... and where LDMPipeline keeps its VQModel
AUTOENCODERS = ("AutoencoderKL", "VQModel", "AutoencoderTiny")  # the diffusers classes a latent run encodes with
ENCODER_PARTS = ("encoder", "quant_conv")  # their modules that only encode (the rest decodes)
COLOUR_CHANNELS = (1, 3, 4)  # images a VAE may take: grayscale, RGB, RGBA
SCALE_TOLERANCE = 2.0  # a normalised latents' std beyond [1/2, 2] is far from the 1 the noise levels assume


@dataclass(frozen=True)
class LatentSpace:
    """The frozen VAE and the shape of what the UNet trains on."""
    vae: object            # a diffusers AUTOENCODERS class, eval mode, no gradients
    source: str            # where it came from (the model line, the model card)
    image_channels: int    # the VAE's in_channels: the images are converted to them
    channels: int          # latent_channels: the UNet's in_channels
    factor: int            # pixels per latent along each side (diffusers' vae_scale_factor)
    size: Resolution       # latent size: --resolution / factor, N or (h, w) (the UNet's sample_size)

    def describe(self, resolution: Resolution) -> str:
        height, width = image_size(self.size)
        return (f"latents of the VAE {self.source} ({height}x{width} from {resolution_text(resolution)} px, factor "
                f"{self.factor})")


def vae_subfolder(path: str, subfolder: str | None) -> str | None:
    """--vae_subfolder, else vae/ (or an LDM pipeline's vqvae/) where the folder (a pipeline's) has
    one, else the folder itself."""
    if subfolder is None:
        return next((name for name in VAE_SUBFOLDERS if os.path.isdir(os.path.join(os.path.expanduser(path), name))),
                    None)
    return subfolder


def read_vae_config(path: str, subfolder: str | None) -> tuple[dict, str | None]:
    """(the VAE's config, the subfolder it was found in): the folder or Hub id itself, or its vae/
    (vqvae/)."""
    from diffusers import AutoencoderKL

    flag = f"--pretrained_vae_model_name_or_path {path}"
    tries = [subfolder] if subfolder is not None or os.path.isdir(os.path.expanduser(path)) else [None, *VAE_SUBFOLDERS]
    error = None
    for candidate in tries:
        try:
            return AutoencoderKL.load_config(os.path.expanduser(path), subfolder=candidate), candidate
        except (OSError, ValueError) as raised:  # diffusers raises EnvironmentError for a missing config
            error = raised
            if not os.path.isdir(os.path.expanduser(path)) and is_offline_error(error):  # a Hub id, no network
                raise ConfigError(f"{flag}: cannot download it: {offline_reason(path)}") from None
    first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
    where = f" (subfolder {subfolder})" if subfolder else ""
    raise ConfigError(f"{flag}{where}: no VAE config found ({first_line}); give an AutoencoderKL folder, a pipeline "
                      "folder with vae/, or --vae_subfolder") from None


def load_latent_space(config: TrainConfig) -> LatentSpace:
    """The frozen VAE of --pretrained_vae_model_name_or_path, checked against the run."""
    import diffusers

    path = config.pretrained_vae_model_name_or_path
    flag = f"--pretrained_vae_model_name_or_path {path}"
    values, subfolder = read_vae_config(path, vae_subfolder(path, config.vae_subfolder))
    kind = values.get("_class_name")
    if kind not in AUTOENCODERS:
        raise ConfigError(f"{flag}: its config is a {kind or 'model without a class name'}, not an autoencoder "
                          f"({', '.join(AUTOENCODERS)}); give the VAE's folder or a pipeline folder with vae/")
    factor = vae_scale_factor(values)
    unfitting = unfitting_side(config.resolution, factor)
    if unfitting:
        named, side = unfitting
        raise ConfigError(f"{named} is not a multiple of the VAE's downsampling factor {factor}: use a "
                          f"multiple of {factor} (e.g. {side - side % factor or factor})")
    image_channels = values["in_channels"]
    if image_channels not in COLOUR_CHANNELS or values["out_channels"] != image_channels:
        raise ConfigError(f"{flag}: its images have {image_channels} -> {values['out_channels']} channels; a VAE "
                          "for training images reads and writes 1 (grayscale), 3 (RGB) or 4 (RGBA)")
    if config.keep_alpha and image_channels != 4:
        raise ConfigError(f"--keep_alpha keeps RGBA but the VAE reads {image_channels}-channel images: "
                          "drop --keep_alpha (transparency is composited on --background)")
    vae = getattr(diffusers, kind).from_pretrained(os.path.expanduser(path), subfolder=subfolder)
    vae.requires_grad_(False).eval()  # frozen: encodes the data once and decodes samples
    source = path if subfolder is None else f"{path} ({subfolder}/)"
    return LatentSpace(vae=vae, source=source, image_channels=image_channels, channels=values["latent_channels"],
                       factor=factor, size=latent_size(config.resolution, factor))


def latent_size(resolution: Resolution, factor: int) -> Resolution:
    """The latents' size for images of `resolution`: N / factor, or (H / factor, W / factor)."""
    return as_resolution([side // factor for side in image_size(resolution)])


def measures_statistics(vae, fine_tuning: bool = False) -> bool:
    """Whether the run measures the latents' per-channel statistics: the VAE's config.json names no
    scaling_factor (diffusers filled in its default) and no latents_mean / latents_std, and the run
    is not `fine_tuning` a latent pipeline, whose denoiser learned the latents as its pipeline scales
    them: by the config's values, diffusers' defaults filled in (DiTPipeline's VAE, from diffusers 0.12,
    names no scale, and it trained on latents x 0.18215, today's default)."""
    config = vae.config
    unset = "scaling_factor" in (config.get("_use_default_values") or ())
    return not fine_tuning and unset and (config.get("latents_mean") is None or config.get("latents_std") is None)


def posterior(latent: LatentSpace, source, encoder: latents.Encoder, streamed: bool,
              processes=None, fine_tuning: bool = False) -> tuple[latents.Posterior, str]:
    """How the UNet's latents are drawn from the source's posteriors (`streamed`: from its pixel
    batches, encoded by `encoder` as they come: a stream's, or a conditional run's) and normalised: by the VAE config
    (pipeline_latent.latent_normalization), or, where it has none, by the per-channel mean and std
    of the training latents (of a stream's first STATISTICS_IMAGES images), measured once here (by
    the main one of the `processes`, the accelerator) and written into the VAE's config as
    latents_mean / latents_std (scaling_factor 1), so the exported vae/ decodes with them. Returns
    it with what says which ("normalised by ...": the start-up line and the model card say it).
    `fine_tuning` a latent pipeline: as its VAE config says, defaults included (measures_statistics)."""
    vae = latent.vae
    config = vae.config
    if measures_statistics(vae, fine_tuning):
        mean, std, measured = measure_statistics(latent, source, encoder, streamed, processes)
        vae.register_to_config(latents_mean=[float(v) for v in mean], latents_std=[float(v) for v in std],
                               scaling_factor=1.0)
        normalisation = (f"normalised by their per-channel mean and std, measured on {measured} (the VAE "
                         "config names no scale) and saved as latents_mean / latents_std in the exported vae/")
    elif config.get("latents_mean") is not None and config.get("latents_std") is not None:
        normalisation = ("normalised by the VAE config's latents_mean / latents_std x scaling_factor "
                         f"{config.scaling_factor:g}")
    else:
        default = "scaling_factor" in (config.get("_use_default_values") or ())
        normalisation = (f"normalised by the VAE config's scaling_factor {config.scaling_factor:g}"
                         + (f" and shift_factor {config.shift_factor:g}" if config.get("shift_factor") else "")
                         + (" (diffusers' default, which the base's pipeline scales its latents by)"
                            if default else ""))
    shift, scale = latent_normalization(vae.config, latent.channels)
    drawn = latents.Posterior(latent.channels, encoder.views, shift, scale, encoder if streamed else None)
    return drawn, normalisation


def measure_statistics(latent: LatentSpace, source, encoder: latents.Encoder, streamed: bool, processes=None) -> tuple:
    """(mean, std per latent channel, what they were measured on): on the cached latents, or on a
    stream's first images encoded here. With several `processes` the main process measures and
    sends them to every rank: each rank's own encoding could round differently on its GPU, and P
    ranks must normalise as one does."""
    main = processes is None or processes.is_main_process
    if not main:
        mean = std = np.zeros(latent.channels)
        measured = "the main process's"
    elif streamed:  # pixels (a stored condition's channels after the images': off)
        pixels = source.reference_sample(latents.STATISTICS_IMAGES)[:, :latent.image_channels]
        stored = latents.encoded_sample(pixels, encoder)
        measured = (f"the latents of the stream's first {len(stored)} images" if source.batches_per_epoch is None
                    else f"the latents of {len(stored)} training images")
        mean, std = latents.channel_statistics(stored, latent.channels)
    else:
        measured = "the training latents"
        mean, std = latents.channel_statistics(source.images, latent.channels)
    if processes is not None and processes.num_processes > 1:
        from accelerate.utils import broadcast
        both = broadcast(torch.from_numpy(np.stack([mean, std])).to(processes.device), from_process=0)
        mean, std = both.cpu().numpy()
    return mean, std, measured


@dataclass(frozen=True)
class EarlierFingerprint:
    """The VAE fingerprint a checkpoint recorded in an earlier release's form (latents.earlier_fingerprints:
    it changed with the interpreter's hash seed), and how this VAE was recognised as the one it names."""
    fingerprint: str
    exact: bool  # recognised by recomputing it (latents.earlier_fingerprints), not only by what it shaped


def earlier_fingerprint(recorded: dict | None, vae, config: dict) -> EarlierFingerprint | None:
    """A resumed checkpoint's VAE fingerprint where an earlier release wrote it (None otherwise),
    recognised exactly where its recomputation is affordable (`config`: the VAE's as loaded)."""
    record = (recorded or {}).get("vae")
    if not record or record.get("fingerprint_format") is not None:
        return None
    candidates = latents.earlier_fingerprints(vae, config)
    exact = candidates is not None and record["fingerprint"] in candidates
    return EarlierFingerprint(record["fingerprint"], exact)


def reconcile_vae_record(saved: dict, current: dict, earlier: EarlierFingerprint | None) -> tuple[dict, str | None]:
    """(the checkpoint's recorded config, with its VAE fingerprint in today's form where this VAE is
    the one an earlier release fingerprinted; the line that says so, or None). Recognised by the
    fingerprint recomputed, or else by what did not depend on the hash seed: the latent
    normalisation (per-channel statistics measured on this VAE's latents of the data, the earlier
    cache's where cached_latents took it over, or the config's scale) and the VAE's path, which the
    resume check compares as usual. Anything else is left as recorded: the check names the difference."""
    record, now = saved.get("vae"), current.get("vae")
    if not record or not now or earlier is None or record.get("fingerprint") != earlier.fingerprint:
        return saved, None
    how = "its fingerprint recomputed"
    if not earlier.exact:
        if (record.get("shift"), record.get("scale")) != (now["shift"], now["scale"]):
            return saved, None
        how = "its latent normalisation and path (the weights could not be compared)"
    upgraded = {**record, "fingerprint": now["fingerprint"], "fingerprint_format": now["fingerprint_format"]}
    return ({**saved, "vae": upgraded},
            f"the checkpoint's VAE fingerprint is an earlier release's, which depended on the interpreter's hash "
            f"seed: the VAE is recognised by {how}; checkpoints from now on record the new fingerprint")


def offload_encoder(vae) -> None:
    """Cached latents: the run encodes nothing more, so the encoder's weights go to the CPU (they stay
    in the model, which the export saves); only the decoder stays on the accelerator, for the sample
    grids and evaluation."""
    for name in ENCODER_PARTS:
        part = getattr(vae, name, None)
        if isinstance(part, torch.nn.Module):
            part.to("cpu")


def scale_note(latent: LatentSpace, clean: torch.Tensor, spread: torch.Tensor) -> str | None:
    """One line where the latents normalised by the VAE config's scale (`clean`: the normalised
    posterior means of a sample of the training images, `spread`: their stds) have a std far from 1
    (SCALE_TOLERANCE), with the value and how to normalise by measured statistics instead: diffusers'
    save_pretrained writes its default scaling_factor 0.18215 (Stable Diffusion's) into any VAE
    config that names none, so a VAE of one's own carries a scale measured for another model."""
    std = float(((clean.double() ** 2 + spread.double() ** 2).mean() - clean.double().mean() ** 2) ** 0.5)
    if 1 / SCALE_TOLERANCE <= std <= SCALE_TOLERANCE:
        return None
    config = latent.vae.config
    scale = f"scaling_factor {config.get('scaling_factor'):g}" + (
        " with its latents_mean / latents_std" if config.get("latents_mean") is not None else "")
    return (f"latents: their std normalised by the VAE config's {scale} is {std:.3g}, far from 1 (diffusers writes "
            "scaling_factor 0.18215, Stable Diffusion's, into a VAE config that names none): to normalise by "
            "statistics measured on your data instead, remove scaling_factor, shift_factor, latents_mean and "
            f"latents_std from the config.json of the VAE {latent.source}")
