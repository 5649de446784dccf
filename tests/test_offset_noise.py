"""--offset_noise (lucidrains' offset_noise_strength) in training/step.py's micro_step_randomness:
eps + s x a per-image, per-channel constant, drawn from (seed, micro-step) like every other draw."""
from types import SimpleNamespace

import torch

from diffusion_extras.core.timesteps import make_timestep_sampler
from diffusion_extras.training.step import micro_step_randomness

SHAPE = (3, 4, 4)


def fake_run(offset_noise: float, rank: int = 0, num_processes: int = 1, batch: int = 4, seed: int = 7):
    """What micro_step_randomness reads of a Run, for `num_processes` ranks of `batch` images each."""
    return SimpleNamespace(
        accelerator=SimpleNamespace(device=torch.device("cpu"), process_index=rank),
        data=SimpleNamespace(global_micro_batch_size=batch * num_processes, class_names=None, posterior=None,
                           condition=None),
        config=SimpleNamespace(seed=seed, offset_noise=offset_noise, condition_dropout=0.1, train_batch_size=batch,
                               random_flip=True),
        objective=SimpleNamespace(timestep_sampler=make_timestep_sampler("uniform", 1000)))


def test_offset_is_a_per_channel_constant_and_leaves_the_other_draws_unchanged():
    plain = micro_step_randomness(fake_run(0.0), 5, SHAPE)
    offset = micro_step_randomness(fake_run(0.1), 5, SHAPE)
    difference = offset[0] - plain[0]
    constant = difference[:, :, :1, :1]
    assert torch.allclose(difference, constant.expand_as(difference))  # constant over the pixels
    assert constant.abs().min() > 0 and len(constant.flatten().unique()) == 12  # one per image and channel
    assert 0.02 < constant.std() < 0.3  # s x N(0, 1), s = 0.1
    for plain_draw, offset_draw in zip(plain[1:], offset[1:]):  # timesteps, flips, ...: as without it
        assert plain_draw is offset_draw is None or torch.equal(plain_draw, offset_draw)


def test_offsets_are_a_function_of_seed_and_micro_step_and_rank_independent():
    first = micro_step_randomness(fake_run(0.1), 5, SHAPE)[0]
    assert torch.equal(micro_step_randomness(fake_run(0.1), 5, SHAPE)[0], first)  # a resume redraws them bitwise
    assert not torch.equal(micro_step_randomness(fake_run(0.1), 6, SHAPE)[0], first)
    assert not torch.equal(micro_step_randomness(fake_run(0.1, seed=8), 5, SHAPE)[0], first)
    # two ranks of 2 images draw exactly the one-rank batch of 4, each its half
    halves = [micro_step_randomness(fake_run(0.1, rank, 2, batch=2), 5, SHAPE)[0] for rank in (0, 1)]
    assert torch.equal(torch.cat(halves), first)
