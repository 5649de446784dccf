"""The run's data, set up before the first step: the batch fitted to a small data set, the data
source (decode-once cache or a stream's shard), a latent run's posteriors and VAE record, an
image-conditioned run's condition, sigma_data, and the clean input the monitors measure."""
from __future__ import annotations

import dataclasses
import functools

import torch

from diffusion_extras.data import batch_order, images, latents, sources
from diffusion_extras.data.conditioning import stored_channels
from diffusion_extras.monitoring import diagnostics
from diffusion_extras.training import autoencoder, conditioning
from diffusion_extras.training.config import TrainConfig
from diffusion_extras.training.run_state import Data


def fit_batch_to_data(config: TrainConfig, accelerator, dataset, validation_split: float) -> TrainConfig:
    """The config with the batch following the data, as the model does: with no --train_batch_size
    given (by flag or recipe), a data set smaller than the global batch trains with the largest
    batch it fills, said in one line. A batch the user gave is kept (the data source refuses it
    then); a stream's length is unknown, so its batch is kept too."""
    if "train_batch_size" in config.given or config.streaming:
        return config
    count = len(dataset) - batch_order.held_out_count(len(dataset), validation_split)
    batch = batch_order.fitted_batch_size(count, config.train_batch_size, accelerator.num_processes)
    if batch == config.train_batch_size:
        return config
    accelerator.print(f"data: {count} training images, fewer than the recipe's batch of {config.train_batch_size}"
                      + (f" x {accelerator.num_processes} processes" if accelerator.num_processes > 1 else "")
                      + f": training with --train_batch_size {batch} (give one to choose)")
    fitted = dataclasses.replace(config, train_batch_size=batch)
    fitted._given = config.given  # the fitted batch is not the user's
    return fitted


def build_data(config: TrainConfig, accelerator, channels: int, dataset, validation_split: float, classes,
               data_source=sources.build_source, latent: autoencoder.LatentSpace | None = None,
               recorded: dict | None = None) -> tuple:
    """(the training data, the held-out images or None): the data source (decode-once cache or
    this rank's shard of a stream, with the `classes` open_training_data read; with a `latent`
    space, the images' posteriors, encoded once on this device, or a stream's pixels, encoded as
    they come; with --conditioning, pixels with a stored condition beside them, which the step
    encodes) and sigma_data. `recorded`: the config of the checkpoint a resume starts from."""
    conditional = config.conditioning != "none"
    earlier = None
    if latent is None:
        source = data_source(config.data_spec(), accelerator, channels, dataset, validation_split, classes)
        encoder = posterior = normalisation = None
    else:  # cached: the source holds posteriors; streamed (or conditional): pixels, which the step encodes
        earlier = autoencoder.earlier_fingerprint(recorded, latent.vae, dict(latent.vae.config))
        encoder = latents.Encoder.of(latent.vae.to(accelerator.device), config.random_flip, latent.factor,
                                     (earlier.fingerprint,) if earlier else ())
        source = data_source(config.data_spec(), accelerator, channels, dataset, validation_split, classes,
                             encoder=None if conditional else encoder)
        fine_tuning = config.pretrained_model_name_or_path is not None
        measured = autoencoder.measures_statistics(latent.vae, fine_tuning)
        encoded_each_step = config.streaming or conditional
        posterior, normalisation = autoencoder.posterior(latent, source, encoder, encoded_each_step, accelerator,
                                                         fine_tuning)
        accelerator.print(f"latents: {normalisation}")
        if not encoded_each_step:  # the latents are cached: the encoder's work is done
            autoencoder.offload_encoder(latent.vae)
    condition = conditioning.for_run(config.conditioning, channels, stored_channels(config.data_spec(), channels),
                                     config.sr_factor, config.seed, latent.vae if latent else None,
                                     config.conditioning_dropout_prob, config.max_noise_level,
                                     images.parse_background(config.background))
    sample = torch.from_numpy(source.reference_sample(2048))
    if condition is not None:  # pixels: a stored condition's channels off
        sample = sample[:, :channels]
    # sigma_data of the model input per dimension (pixels in [-1, 1], or the latent means):
    # the scale of the Bayes-optimal reference curve
    if posterior is None:
        clean = latents.model_input(sample, "cpu")
    else:  # the normalised latents' std, checked where the config's scale normalises them
        clean, spread = posterior.normalised(sample, "cpu")
        note = None if measured or fine_tuning else autoencoder.scale_note(latent, clean, spread)
        if note:
            accelerator.print(note)
    sigma_data = diagnostics.per_dimension_variance(clean, bounded=posterior is None) ** 0.5
    training_data = Data(source=source, sigma_data=sigma_data, class_names=getattr(source, "class_names", None),
                         global_micro_batch_size=config.train_batch_size * accelerator.num_processes,
                         gradient_accumulation_steps=config.gradient_accumulation_steps, posterior=posterior,
                         vae=latent.vae if latent else None, vae_fingerprint=encoder.fingerprint if encoder else None,
                         vae_earlier=earlier, latent_normalization=normalisation, condition=condition)
    return training_data, source.held_out_images


def clean_input(data: Data):
    """(a source's stored batch, device) -> the UNet's clean input, for the held-out loss and the
    gradient probe: pixels in [-1, 1], or in a latent run the normalised posterior means (no draw:
    the same input at every measurement); with --conditioning (clean input, condition), the
    condition made with fixed masks (ImageCondition.fixed_inputs)."""
    if data.condition is not None:
        return functools.partial(data.condition.fixed_inputs, posterior=data.posterior)
    return functools.partial(latents.model_input, posterior=data.posterior)


def latent_record(training_data: Data) -> dict | None:
    """A latent run's VAE as checkpoints record it: its weights' fingerprint and the latents'
    normalisation (shift and scale per channel); None for a pixel run."""
    posterior = training_data.posterior
    if posterior is None:
        return None
    return {"fingerprint": training_data.vae_fingerprint, "fingerprint_format": latents.FINGERPRINT_FORMAT,
            "shift": [float(v) for v in posterior.shift],
            "scale": [float(v) for v in posterior.scale]}
