"""Latent diffusion's data (data/latents.py): posteriors encoded once (both flips), each step's
latent drawn from (seed, micro-step), normalised by the VAE config or measured statistics; a
resumed latent run is bit-exact with a straight one."""
import json

import faults
import numpy as np
import pytest
import torch
from helpers import LATENT_MODEL, load_unet_weights, read_history, run_training, save_random_images, save_tiny_vae
from processes import launch_training
from safetensors.torch import load_file

from diffusion_extras.data import latents
from diffusion_extras.data.decode_cache import DecodedImages
from diffusion_extras.training import autoencoder


def tiny_vae(tmp_path, **overrides):
    from diffusers import AutoencoderKL
    return AutoencoderKL.from_pretrained(save_tiny_vae(tmp_path / "vae", **overrides)).eval()


def random_images(count: int = 5, size: int = 8) -> DecodedImages:
    pixels = np.random.default_rng(0).integers(0, 256, (count, size, size, 3), dtype=np.uint8)
    return DecodedImages.from_arrays(list(pixels), 3)


def test_both_views_are_the_posteriors_of_the_image_and_its_mirror(tmp_path):
    vae, images = tiny_vae(tmp_path), random_images()
    stored = DecodedImages.from_arrays(list(latents.iter_encoded(images, latents.Encoder.of(vae, True))), 8)
    assert stored.image(0).shape == (4, 4, 2 * 2 * 2)  # [h, w, views x (mean, std) x C]
    pixels = torch.from_numpy(np.stack([images.image(i) for i in range(5)])).permute(0, 3, 1, 2).float() / 127.5 - 1
    with torch.no_grad():
        plain, mirrored = vae.encode(pixels).latent_dist, vae.encode(pixels.flip(-1)).latent_dist
    batch = torch.from_numpy(np.stack([stored.image(i) for i in range(5)])).permute(0, 3, 1, 2)
    posterior = latents.Posterior(2, 2, torch.zeros(2), torch.ones(2))
    flip = torch.tensor([True, False, True, False, False])
    noise = torch.randn(5, 2, 4, 4, generator=torch.Generator().manual_seed(0))
    drawn = posterior.model_input(batch, "cpu", flip, noise)
    expected = torch.where(flip.view(-1, 1, 1, 1), mirrored.mean + mirrored.std * noise, plain.mean + plain.std * noise)
    torch.testing.assert_close(drawn, expected, rtol=1e-5, atol=1e-6)
    scaled = latents.Posterior(2, 2, torch.tensor([0.5, -1.0]), torch.tensor([2.0, 3.0])).model_input(batch, "cpu")
    torch.testing.assert_close(scaled, (plain.mean - torch.tensor([0.5, -1.0]).view(1, -1, 1, 1))
                               * torch.tensor([2.0, 3.0]).view(1, -1, 1, 1), rtol=1e-5, atol=1e-6)


def test_the_vae_configs_normalisation_is_used_where_it_has_one(tmp_path):
    from diffusion_extras.evaluation.pipeline_latent import latent_normalization
    config = {"scaling_factor": 0.5, "shift_factor": 0.1, "latents_mean": None, "latents_std": None}
    shift, scale = latent_normalization(config, 2)
    assert shift.tolist() == pytest.approx([0.1, 0.1]) and scale.tolist() == [0.5, 0.5]
    shift, scale = latent_normalization(config | {"latents_mean": [1.0, 2.0], "latents_std": [4.0, 2.0]}, 2)
    assert shift.tolist() == [1.0, 2.0] and scale.tolist() == [0.125, 0.25]


def test_a_vae_without_a_scale_gets_the_measured_statistics_saved_in_its_config(tmp_path):
    vae_folder = save_tiny_vae(tmp_path / "vae")
    path = tmp_path / "vae" / "config.json"
    path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k != "scaling_factor"}))
    from diffusers import AutoencoderKL
    vae = AutoencoderKL.from_pretrained(vae_folder).eval()
    assert autoencoder.measures_statistics(vae)
    stored = DecodedImages.from_arrays(list(latents.iter_encoded(random_images(40), latents.Encoder.of(vae, False))), 4)

    class Source:  # what posterior() reads of a source: its stored posteriors
        images = stored
    space = autoencoder.LatentSpace(vae, vae_folder, 3, 2, 2, 4)
    posterior, normalisation = autoencoder.posterior(space, Source, latents.Encoder.of(vae, False, 2), streamed=False)
    assert normalisation.startswith("normalised by their per-channel mean and std, measured on the training")
    assert vae.config.scaling_factor == 1.0 and len(vae.config.latents_mean) == 2
    batch = torch.from_numpy(np.stack([stored.image(i) for i in range(40)])).permute(0, 3, 1, 2)
    # the normalised latents' moments, exactly: E[z] = E[mean], E[z^2] = E[mean^2 + std^2]
    mean = posterior.model_input(batch, "cpu").double()
    std = posterior.model_input(batch, "cpu", noise=torch.ones(40, 2, 4, 4)).double() - mean
    first, second = mean.mean((0, 2, 3)), (mean ** 2 + std ** 2).mean((0, 2, 3))
    torch.testing.assert_close(first, torch.zeros(2, dtype=torch.float64), atol=1e-5, rtol=0)
    torch.testing.assert_close(second - first ** 2, torch.ones(2, dtype=torch.float64), atol=1e-5, rtol=0)
    assert not autoencoder.measures_statistics(AutoencoderKL.from_pretrained(save_tiny_vae(tmp_path / "kept")))


def test_a_resumed_latent_run_is_bit_exact_and_encodes_once(tiny_recipe, tmp_path):
    """16 RGB images (2 micro-batches an epoch) on an image folder: the cache holds the latents;
    stopped by a signal after step 3, resumed to 6, against a straight run to 6 (epochs crossed)."""
    folder = save_random_images(tmp_path / "images", 16, 8, 8)
    vae = save_tiny_vae(tmp_path / "vae")
    recipe = tiny_recipe(model=LATENT_MODEL, checkpointing_steps=3, train_batch_size=8)
    flags = ("--train_data_dir", folder, "--pretrained_vae_model_name_or_path", vae, "--random_flip",
             "--max_train_steps", 6)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    first = run_training(recipe, straight, *flags, "--cache_dir", tmp_path / "cache")
    assert "encoded 16 images once (2 view(s), 2 latent channels)" in first.stdout
    assert "latents: normalised by the VAE config's scaling_factor 0.18215\n" in first.stdout
    stopped = run_training(recipe, resumed, *flags, "--cache_dir", tmp_path / "cache",
                           hooks=faults.hooks(signal_at_step=3), check=False)
    assert stopped.returncode == 4, stopped.stderr[-3000:]
    again = run_training(recipe, resumed, *flags, "--cache_dir", tmp_path / "cache", "--resume_from_checkpoint",
                         "latest")
    assert "encoded" not in stopped.stdout + again.stdout  # the cache's latents, read back
    # (test_resume.assert_same_state says the same of every state file; that module waits on the harness rewrite)
    assert [h["loss"] for h in read_history(straight)] == [h["loss"] for h in read_history(resumed)]
    assert len(read_history(straight)) == 6
    for weights in (load_unet_weights, lambda run: load_file(run / "checkpoint-6" / "model.safetensors")):
        a, b = weights(straight), weights(resumed)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    a, b = (torch.load(run / "checkpoint-6" / "optimizer.bin", weights_only=True) for run in (straight, resumed))
    assert all(torch.equal(x["exp_avg_sq"], y["exp_avg_sq"]) for x, y in zip(a["state"].values(), b["state"].values()))


def test_fid_in_training_scores_decoded_samples_against_the_pixel_images(tiny_recipe, tmp_path):
    """--eval_steps on a latent run (the digits, RGB VAE): the reference is the pixel images the
    posteriors were encoded from, the samples are decoded; FID is logged at steps 2 and 4."""
    vae = save_tiny_vae(tmp_path / "vae")
    run_training(tiny_recipe(model=LATENT_MODEL), tmp_path / "run", "--pretrained_vae_model_name_or_path", vae,
                 "--max_train_steps", 4, "--eval_steps", 2, "--eval_num_samples", 8, "--feature_extractor", "tiny")
    fids = {h["step"]: h["eval/fid"] for h in read_history(tmp_path / "run") if "eval/fid" in h}
    assert sorted(fids) == [2, 4] and all(value > 0 for value in fids.values())
    with np.load(tmp_path / "run" / "logs" / "fid_reference_tiny.npz") as reference:
        assert "64-8-8-" in str(reference["fingerprint"])  # 64 digits at 8 px, the pixel resolution


def test_latents_of_unit_scale_are_not_held_to_the_pixel_range(tiny_recipe, tmp_path):
    """A VAE config whose scale puts the latents outside [-1, 1] (unit-variance latents do): the run
    trains (sigma_data, the reference curve's scale, is measured on them without the pixel-range check)."""
    vae = save_tiny_vae(tmp_path / "vae", scaling_factor=40.0)
    result = run_training(tiny_recipe(model=LATENT_MODEL), tmp_path / "run", "--pretrained_vae_model_name_or_path", vae,
                          "--max_train_steps", 1)
    assert "latents: normalised by the VAE config's scaling_factor 40" in result.stdout


def test_a_vae_changed_under_the_same_path_is_refused_on_resume(tiny_recipe, tmp_path):
    """The checkpoint records the VAE's fingerprint and normalisation: other weights saved to the
    same folder make a resume one line naming them, not a run on other latents."""
    vae = save_tiny_vae(tmp_path / "vae")
    recipe = tiny_recipe(model=LATENT_MODEL, checkpointing_steps=2)
    flags = ("--pretrained_vae_model_name_or_path", vae)
    run_training(recipe, tmp_path / "run", *flags, "--max_train_steps", 2)
    save_tiny_vae(tmp_path / "vae", seed=1)  # retrained, same folder
    result = run_training(recipe, tmp_path / "run", *flags, "--max_train_steps", 4, "--resume_from_checkpoint",
                          "latest", check=False)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "vae.fingerprint:" in result.stderr.strip().splitlines()[-1]


# ----------------------------------------------------------------------------- streamed latents
def test_a_latent_run_killed_while_saving_resumes_from_the_checkpoint_before_bit_exact(tiny_recipe, tmp_path):
    """SIGKILL in its own process while checkpoint-6 is written: the resume starts from checkpoint-3
    and ends as a straight run does (weights, optimizer state)."""
    folder = save_random_images(tmp_path / "images", 16, 8, 8)
    recipe = tiny_recipe(model=LATENT_MODEL, checkpointing_steps=3, train_batch_size=8)
    flags = ("--train_data_dir", folder, "--pretrained_vae_model_name_or_path", save_tiny_vae(tmp_path / "vae"),
             "--random_flip", "--max_train_steps", 6, "--cache_dir", tmp_path / "cache")
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    run_training(recipe, straight, *flags)
    assert launch_training(recipe, killed, *flags, faults=("--sigkill_in_save", 6), check=False).returncode == -9
    assert not (killed / "checkpoint-6").exists() and (killed / "checkpoint-3").is_dir()
    assert "at optimizer step 3" in run_training(recipe, killed, *flags, "--resume_from_checkpoint", "latest").stdout
    a, b = (load_file(run / "checkpoint-6" / "model.safetensors") for run in (straight, killed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    a, b = (torch.load(run / "checkpoint-6" / "optimizer.bin", weights_only=True) for run in (straight, killed))
    assert all(torch.equal(x["exp_avg_sq"], y["exp_avg_sq"]) for x, y in zip(a["state"].values(), b["state"].values()))


def write_parquet_images(path, images: np.ndarray) -> str:
    """[N, H, W, 3] uint8 images as one parquet file, in this order; returns its path."""
    import datasets
    from PIL import Image
    features = datasets.Features({"image": datasets.Image()})
    datasets.Dataset.from_dict({"image": [Image.fromarray(image) for image in images]}, features=features) \
        .to_parquet(str(path))
    return str(path)


def test_a_streamed_batch_is_encoded_as_the_cache_encodes_it(tmp_path):
    """The streamed posterior (pixels encoded in the step, each image flipped before it is encoded)
    gives the cached path's latents for the same images, flips and noise, bit for bit at the same
    batch size, and in batches of any size to the VAE's float rounding."""
    vae, images = tiny_vae(tmp_path), random_images(5)
    cached = latents.Posterior(2, 2, torch.tensor([0.5, -1.0]), torch.tensor([2.0, 3.0]))
    streamed = latents.Posterior(2, 2, cached.shift, cached.scale, latents.Encoder.of(vae, True, factor=2))
    stored = torch.from_numpy(np.stack(list(latents.iter_encoded(images, streamed.encoder)))).permute(0, 3, 1, 2)
    pixels = torch.from_numpy(np.stack([images.image(i) for i in range(5)])).permute(0, 3, 1, 2)  # uint8, as streamed
    assert streamed.latent_shape(pixels.shape) == cached.latent_shape(stored.shape) == (2, 4, 4)
    flip = torch.tensor([True, False, True, False, True])
    noise = torch.randn(5, 2, 4, 4, generator=torch.Generator().manual_seed(0))
    expected = cached.model_input(stored, "cpu", flip, noise)
    assert torch.equal(streamed.model_input(pixels, "cpu", flip, noise), expected)
    one_at_a_time = torch.cat([streamed.model_input(pixels[i:i + 1], "cpu", flip[i:i + 1], noise[i:i + 1])
                               for i in range(5)])
    torch.testing.assert_close(one_at_a_time, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(streamed.model_input(pixels, "cpu", ~flip, noise), expected, atol=1e-3)


def test_streamed_and_cached_runs_train_on_the_same_latents(tiny_recipe, tmp_path):
    """24 RGB images, cached from one parquet file, and streamed from another holding them in the
    order the cached run draws its first epoch (3 micro-batches of 8): each step trains on the same
    images, so the latents the UNet sees (flips and the posterior's draw from (seed, micro-step))
    and the losses are those of the cached run, to the VAE's float rounding across batch sizes.
    The streamed run's FID compares decoded samples with the stream's pixel images."""
    from diffusion_extras.data.batch_order import GlobalBatchOrder
    from diffusion_extras.training.hooks import Hooks
    pixels = np.random.default_rng(1).integers(0, 256, (24, 8, 8, 3), dtype=np.uint8)
    epoch = np.concatenate([GlobalBatchOrder(24, 8, 0).indices(k) for k in range(3)])
    files = {"cached": write_parquet_images(tmp_path / "cached.parquet", pixels),
             "streamed": write_parquet_images(tmp_path / "streamed.parquet", pixels[epoch])}
    vae = save_tiny_vae(tmp_path / "vae")
    seen = {}
    streamed = ("--streaming", "--shuffle_buffer_size", 0,  # and FID after the last step: the stream's pixels
                "--eval_steps", 3, "--eval_num_samples", 8, "--feature_extractor", "tiny")
    for name, extra in (("cached", ()), ("streamed", streamed)):
        inputs = seen[name] = []
        hooks = Hooks(model_input=lambda run, clean, micro_step, inputs=inputs: inputs.append(clean.clone()) or clean)
        run_training(tiny_recipe(model=LATENT_MODEL, max_train_samples=None), tmp_path / name, "--train_data_files",
                     files[name], "--pretrained_vae_model_name_or_path", vae, "--random_flip", "--max_train_steps", 3,
                     *extra, hooks=hooks)
    assert len(seen["cached"]) == len(seen["streamed"]) == 3
    for cached, streamed in zip(seen["cached"], seen["streamed"]):
        torch.testing.assert_close(streamed, cached, rtol=1e-5, atol=1e-5)
    losses = [[h["loss"] for h in read_history(tmp_path / name) if "loss" in h] for name in ("cached", "streamed")]
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    assert [h["eval/fid"] > 0 for h in read_history(tmp_path / "streamed") if "eval/fid" in h] == [True]


def test_a_streamed_latent_run_resumes_bit_exact_with_statistics_measured_on_the_stream(tiny_recipe, tmp_path):
    """40 RGB images in 4 parquet shards, streamed by 2 loader workers, 8 a step, with a VAE config
    that names no scale: the statistics are measured on the stream's first images (all 40, both
    views) before training, saved in the exported vae/, measured again on resume; stopped by a
    signal after step 3 and resumed to 6 (past the stream's epoch), it ends where a straight run does."""
    pixels = np.random.default_rng(2).integers(0, 256, (40, 8, 8, 3), dtype=np.uint8)
    (tmp_path / "pq").mkdir()
    for shard in range(4):
        write_parquet_images(tmp_path / "pq" / f"part-{shard}.parquet", pixels[shard::4])
    vae_folder = save_tiny_vae(tmp_path / "vae")
    path = tmp_path / "vae" / "config.json"
    path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k != "scaling_factor"}))
    recipe = tiny_recipe(model=LATENT_MODEL, checkpointing_steps=3, max_train_samples=None)
    flags = ("--dataset_name", tmp_path / "pq", "--streaming", "--shuffle_buffer_size", 0, "--dataloader_num_workers",
             2, "--pretrained_vae_model_name_or_path", vae_folder, "--random_flip", "--max_train_steps", 6,
             "--grad_diagnostics_steps", 3)  # the probe encodes its batch too, off the training step
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    first = run_training(recipe, straight, *flags)
    assert [h["step"] for h in read_history(straight) if "grad_probe/total_norm" in h] == [3, 6]
    assert ("latents: normalised by their per-channel mean and std, measured on the latents of the stream's first "
            "40 images (the VAE config names no scale)") in first.stdout
    stopped = run_training(recipe, resumed, *flags, hooks=faults.hooks(signal_at_step=3), check=False)
    assert stopped.returncode == 4, stopped.stderr[-3000:]
    run_training(recipe, resumed, *flags, "--resume_from_checkpoint", "latest")
    losses = [[h["loss"] for h in read_history(run) if "loss" in h] for run in (straight, resumed)]
    assert losses[0] == losses[1] and len(losses[0]) == 6
    for weights in (load_unet_weights, lambda run: load_file(run / "checkpoint-6" / "model.safetensors")):
        a, b = weights(straight), weights(resumed)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    from diffusers import AutoencoderKL
    stored = latents.iter_encoded(DecodedImages.from_arrays(list(pixels), 3),
                                  latents.Encoder.of(AutoencoderKL.from_pretrained(vae_folder).eval(), True))
    mean, std = latents.channel_statistics(DecodedImages.from_arrays(list(stored), 8), 2)
    exported = json.loads((straight / "vae" / "config.json").read_text())
    assert exported["scaling_factor"] == 1.0
    assert exported["latents_mean"] == pytest.approx(mean.tolist(), rel=1e-5)
    assert exported["latents_std"] == pytest.approx(std.tolist(), rel=1e-5)


def test_two_ranks_of_a_latent_run_equal_one_rank_of_the_same_global_batch(tiny_recipe, tmp_path):
    """16 RGB images with a cache folder, flips on: 2 gloo ranks x 4 images (the first rank encodes,
    the other reads its latents) train as 1 rank x 8 (same posteriors, flips, draws, noise and
    timesteps, each rank its slice), and the 2-rank export decodes."""
    from diffusion_extras.evaluation.pipeline_latent import LatentDiffusionPipeline
    folder = save_random_images(tmp_path / "images", 16, 8, 8)
    flags = ("--train_data_dir", folder, "--pretrained_vae_model_name_or_path", save_tiny_vae(tmp_path / "vae"),
             "--random_flip", "--max_train_steps", 4, "--cache_dir", tmp_path / "cache")
    two = launch_training(tiny_recipe(model=LATENT_MODEL, train_batch_size=4), tmp_path / "two", *flags, ranks=2,
                          env={"ACCELERATE_USE_CPU": "1"})
    assert two.stdout.count("encoded 16 images once") == 1 and "replicas identical on 2 processes" in two.stdout
    run_training(tiny_recipe(model=LATENT_MODEL, train_batch_size=8), tmp_path / "one", *flags)
    w2, w1 = load_unet_weights(tmp_path / "two"), load_unet_weights(tmp_path / "one")
    assert max((w2[k] - w1[k]).abs().max().item() for k in w1) < 1e-5
    l2, l1 = read_history(tmp_path / "two"), read_history(tmp_path / "one")
    assert [h["loss"] for h in l2] == pytest.approx([h["loss"] for h in l1], rel=1e-5)
    pipe = LatentDiffusionPipeline.from_pretrained(tmp_path / "two")
    images = pipe(batch_size=2, num_inference_steps=2, output_type="np").images
    assert np.asarray(images).shape == (2, 8, 8, 3) and np.isfinite(images).all()


@pytest.mark.usefixtures("fresh_accelerate")
def test_the_held_out_loss_and_the_gradient_probe_score_normalised_latent_means(tmp_path):
    """On the digits with a VAE, the held-out images are split off the encoded latents, and the
    held-out loss and the gradient probe feed the UNet the normalised posterior means of their
    images: the VAE's encoding of those pixel images, times the config's scaling_factor."""
    from diffusers import AutoencoderKL
    from helpers import tiny_run

    from diffusion_extras.data.batch_order import to_model_input
    vae_folder = save_tiny_vae(tmp_path / "vae")
    run = tiny_run(tmp_path, "--pretrained_vae_model_name_or_path", vae_folder, "--validation_split", 0.25,
                   "--grad_diagnostics_steps", 2, model=LATENT_MODEL)
    source, held_out, probe = run.data.source, run.extras.held_out, run.extras.grad_monitor
    vae = AutoencoderKL.from_pretrained(vae_folder).eval()

    def expected(pixels: np.ndarray) -> torch.Tensor:
        with torch.no_grad():
            return vae.encode(to_model_input(torch.from_numpy(pixels), "cpu")).latent_dist.mean * 0.18215

    rows = source.held_out_images.rows
    assert len(rows) == 16 and held_out.images.shape == (16, 4, 4, 4)  # [N, mean and std x 2 channels, 4, 4]
    pixels = np.stack([source.pixels.images.image(int(row)) for row in rows]).transpose(0, 3, 1, 2)  # all decoded
    torch.testing.assert_close(held_out.clean_input(held_out.images, "cpu"), expected(pixels), rtol=1e-5, atol=1e-6)
    assert probe.noise.shape == (run.config.diagnostics_bins, 8, 2, 4, 4)  # the latents' shape, not the stored one
    torch.testing.assert_close(probe.clean_input(probe.images, "cpu"), expected(source.reference_images(8)),
                               rtol=1e-5, atol=1e-6)
    run.accelerator.end_training()


def test_a_latent_run_logs_the_held_out_loss_and_the_gradient_probe(tiny_recipe, tmp_path):
    vae = save_tiny_vae(tmp_path / "vae")
    run_training(tiny_recipe(model=LATENT_MODEL), tmp_path / "run", "--pretrained_vae_model_name_or_path", vae,
                 "--max_train_steps", 4, "--validation_split", 0.25, "--validation_steps", 2,
                 "--grad_diagnostics_steps", 2)
    logged = {}
    for row in read_history(tmp_path / "run"):  # a step's rows: the training window's, the probes'
        logged.setdefault(row["step"], {}).update(row)
    for step in (2, 4):
        assert np.isfinite(logged[step]["validation/raw_loss"]) and np.isfinite(logged[step]["grad_probe/total_norm"])
    assert (tmp_path / "run" / "images" / "held_out_loss.png").is_file()
    assert (tmp_path / "run" / "images" / "grad_per_timestep.png").is_file()


def test_two_streaming_ranks_equal_one_with_the_statistics_of_the_streams_first_images(tiny_recipe, tmp_path):
    """4 parquet shards of 4 RGB images, unshuffled, with a VAE config that names no scale. Rank r of
    2 reads shards r and r + 2, so 2 ranks x 4 images hold, step by step, what 1 rank x 8 reads from
    the shards in turn: the same global batches, flips and draws. They train alike only if every
    rank normalises as one rank does: with the statistics of the stream's first images, measured
    alike on each rank, not on its own shard."""
    pixels = np.random.default_rng(3).integers(0, 256, (16, 8, 8, 3), dtype=np.uint8)
    (tmp_path / "pq").mkdir()
    for shard in range(4):
        write_parquet_images(tmp_path / "pq" / f"part-{shard}.parquet", pixels[4 * shard:4 * shard + 4])
    save_tiny_vae(tmp_path / "vae")
    path = tmp_path / "vae" / "config.json"
    path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k != "scaling_factor"}))
    flags = ("--dataset_name", tmp_path / "pq", "--streaming", "--shuffle_buffer_size", 0, "--random_flip",
             "--pretrained_vae_model_name_or_path", tmp_path / "vae", "--max_train_steps", 4)
    two = launch_training(tiny_recipe(model=LATENT_MODEL, train_batch_size=4, max_train_samples=None), tmp_path / "two",
                          *flags, ranks=2, env={"ACCELERATE_USE_CPU": "1"})
    assert "measured on the latents of the stream's first 16 images" in two.stdout
    assert "replicas identical on 2 processes" in two.stdout
    run_training(tiny_recipe(model=LATENT_MODEL, train_batch_size=8, max_train_samples=None), tmp_path / "one", *flags)
    w2, w1 = load_unet_weights(tmp_path / "two"), load_unet_weights(tmp_path / "one")
    assert max((w2[k] - w1[k]).abs().max().item() for k in w1) < 1e-5
    l2, l1 = read_history(tmp_path / "two"), read_history(tmp_path / "one")
    assert [h["loss"] for h in l2] == pytest.approx([h["loss"] for h in l1], rel=1e-5)


def test_the_model_card_says_how_the_latents_were_normalised(tmp_path, fresh_accelerate):
    """The start-up line's normalisation reaches the Hub model card (the VAE config's scaling_factor here)."""
    from helpers import tiny_run

    from diffusion_extras.hub.push import write_model_card
    from diffusion_extras.training.periodic import model_card
    run = tiny_run(tmp_path, "--pretrained_vae_model_name_or_path", save_tiny_vae(tmp_path / "vae"), model=LATENT_MODEL)
    (tmp_path / "card").mkdir()
    text = open(write_model_card(str(tmp_path / "card"), {**model_card(run), "repo_id": "user/latent"})).read()
    run.accelerator.end_training()
    assert "decodes its samples. Its latents were normalised by the VAE config's scaling_factor 0.18215." in text
