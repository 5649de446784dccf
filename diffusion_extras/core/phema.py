"""Post-hoc EMA (Karras et al. 2024, "Analyzing and Improving the Training Dynamics of Diffusion
Models", Sec. 3 and App. C); named after EDM2's `training/phema.py`.

During training, `PowerFunctionEMA` tracks a few power-function EMA profiles and writes them as
fp16 snapshots; afterwards `reconstruct` forms the EMA of any other relative width `sigma_rel` at a
snapshot step as a least-squares combination of the snapshots, so the EMA length is chosen by
evaluation instead of guessed before training. The command line that does this for a training
output directory, scoring each width and exporting the best, lives in `diffusion_extras/cli/posthoc_ema.py`.
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from scipy.optimize import brentq

# gamma = 0 (a flat profile) is the widest power function that still weights recent steps at
# least as much as old ones; EDM2's reconstruct_phema.py accepts sigma_rel in (0, 0.289) likewise.
SIGMA_REL_MAX = 12 ** -0.5
SNAPSHOT_PATTERN = re.compile(r"phema-(\d{9})\.safetensors")


def gamma_to_sigma_rel(gamma: float) -> float:
    """Relative std of the power-function profile p(t) ~ t**gamma (EDM2 Eq. 123)."""
    if not gamma > -1:
        raise ValueError(f"power-function exponent gamma must be > -1, got {gamma}")
    gamma = float(gamma)
    return float(np.sqrt((gamma + 1) / ((gamma + 2) ** 2 * (gamma + 3))))


def sigma_rel_to_gamma(sigma_rel: float) -> float:
    """Exponent gamma >= 0 whose profile has relative std `sigma_rel` (inverse of Eq. 123)."""
    if not 0 < sigma_rel < SIGMA_REL_MAX:
        raise ValueError(f"sigma_rel must be in (0, {SIGMA_REL_MAX:.4f}), got {sigma_rel}; "
                         "EDM2 uses 0.05 and 0.10 during training and ~0.01-0.25 post hoc")
    # gamma_to_sigma_rel decreases on gamma >= 0 and is below 1/(gamma+2), so the root lies in
    # [0, 1/sigma_rel]; bisection avoids picking among the cubic's roots (EDM2 Eq. 126).
    return float(brentq(lambda g: gamma_to_sigma_rel(g) - sigma_rel, 0.0, 1.0 / sigma_rel,
                        xtol=1e-13, rtol=4 * np.finfo(float).eps))


class PowerFunctionEMA:
    """Power-function EMA profiles tracked during training (default sigma_rels=(0.05, 0.10)),
    with snapshots written every `snapshot_every` optimizer steps, compactly, as fp16.

    The average for exponent gamma after step t is theta_hat_t = beta_t theta_hat_{t-1} +
    (1 - beta_t) theta_t with beta_t = (1 - 1/t)**(gamma + 1) (EDM2 Eq. 127). Unrolled, step s gets
    weight (s**(gamma+1) - (s-1)**(gamma+1)) / t**(gamma+1): exactly the integral of the continuous
    profile (gamma+1) tau**gamma / t**(gamma+1) over (s-1, s], which is why the continuous inner
    products in `solve_weights` describe these discrete averages without approximation. Time is
    counted in optimizer steps; EDM2 counts images, which is the same at a constant batch size
    because the profiles depend only on ratios of times.
    """

    def __init__(self, parameters: Iterable[torch.nn.Parameter], sigma_rels=(0.05, 0.10)):
        parameters = list(parameters)
        if not parameters or not sigma_rels:
            raise ValueError("PowerFunctionEMA needs at least one parameter and one sigma_rel")
        self.sigma_rels = tuple(float(s) for s in sigma_rels)
        self.gammas = tuple(sigma_rel_to_gamma(s) for s in self.sigma_rels)
        # fp32 averages whatever the training dtype: fp16/bf16 would swallow (1 - beta) * theta.
        self.averages = [[p.detach().to(torch.float32, copy=True) for p in parameters]
                         for _ in self.gammas]
        self.step = 0

    @torch.no_grad()
    def update(self, parameters, step: int, finite: torch.Tensor | None = None) -> None:
        """Fold in the parameters after `step` optimizer steps (1 after the first step). `finite`
        (0-dim bool on the device) false leaves the averages untouched, like a skipped optimizer
        step leaves the weights, without a host read; the step count still advances."""
        step = int(step)
        if step <= self.step:
            raise ValueError(f"EMA step must increase: got {step} after {self.step}")
        sources = [p.detach().to(torch.float32) for p in parameters]
        if len(sources) != len(self.averages[0]):
            raise ValueError(f"expected {len(self.averages[0])} parameters, got {len(sources)}")
        for gamma, averages in zip(self.gammas, self.averages):
            # (previous/step)**(gamma+1) is (1 - 1/t)**(gamma+1) for consecutive steps and stays
            # right if updates skip steps (EDM2's t_delta); beta = 0 at step 1 drops the init.
            beta = (self.step / step) ** (gamma + 1)
            if finite is None:
                torch._foreach_lerp_(averages, sources, 1.0 - beta)
            else:  # a list of 0-dim weights: one tensor weight would be read with .item() (see ema.py)
                torch._foreach_lerp_(averages, sources, [finite.to(torch.float32) * (1.0 - beta)] * len(sources))
        self.step = step

    def state_dict(self) -> dict:
        return {"sigma_rels": list(self.sigma_rels), "step": self.step,
                "averages": [list(averages) for averages in self.averages]}

    def load_state_dict(self, state) -> None:
        saved = state["sigma_rels"]
        if len(saved) != len(self.sigma_rels) or not np.allclose(saved, self.sigma_rels, rtol=0,
                                                                 atol=1e-12):
            raise ValueError(f"checkpoint tracks sigma_rels {state['sigma_rels']}, this run "
                             f"{list(self.sigma_rels)}; resume with the same sigma_rels")
        for averages, saved in zip(self.averages, state["averages"], strict=True):
            for average, value in zip(averages, saved, strict=True):
                average.copy_(value)
        self.step = int(state["step"])

    def save_snapshot(self, directory: str, step: int, parameter_names: list[str]) -> str:
        """Write DIRECTORY/phema-<step:09d>.safetensors (fp16, written to a temp file and renamed
        so a crash never leaves a truncated snapshot under the final name); returns its path."""
        if step != self.step:
            raise ValueError(f"snapshot step {step} differs from the last EMA update step "
                             f"{self.step}; call update(parameters, {step}) first")
        if len(parameter_names) != len(self.averages[0]) or len(set(parameter_names)) != len(
                parameter_names):
            raise ValueError(f"need {len(self.averages[0])} distinct parameter names, "
                             f"got {len(parameter_names)}")
        tensors = {f"profile{i}/{name}": average.to("cpu", torch.float16).contiguous()
                   for i, averages in enumerate(self.averages)
                   for name, average in zip(parameter_names, averages)}
        metadata = {"format": "phema-v1", "step": str(step),
                    "sigma_rels": json.dumps(self.sigma_rels), "gammas": json.dumps(self.gammas)}
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"phema-{step:09d}.safetensors")
        tmp_path = os.path.join(directory, f".phema-{step:09d}.safetensors.tmp")
        save_file(tensors, tmp_path, metadata=metadata)
        with open(tmp_path, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp_path, path)
        return path


@dataclass(frozen=True)
class Snapshot:
    """One EMA profile in one snapshot file; `tensors` reads the file on each access because a
    run's snapshots together rarely fit in memory."""
    path: str
    step: int
    gamma: float
    sigma_rel: float
    profile: int

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        prefix = f"profile{self.profile}/"
        with safe_open(self.path, framework="pt") as f:
            return {key[len(prefix):]: f.get_tensor(key) for key in f.keys()
                    if key.startswith(prefix)}


def load_snapshots(directory: str) -> list[Snapshot]:
    """Every profile of every phema-*.safetensors in `directory`, sorted by (step, sigma_rel)."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"post-hoc EMA snapshot directory {directory} does not exist")
    snapshots = []
    for name in os.listdir(directory):
        match = SNAPSHOT_PATTERN.fullmatch(name)
        if match is None:
            continue
        path = os.path.join(directory, name)
        with safe_open(path, framework="pt") as f:
            metadata = f.metadata() or {}
        if metadata.get("format") != "phema-v1" or int(metadata["step"]) != int(match.group(1)):
            raise ValueError(f"{path} is not a post-hoc EMA snapshot written by PowerFunctionEMA")
        for i, (sigma_rel, gamma) in enumerate(zip(json.loads(metadata["sigma_rels"]),
                                                   json.loads(metadata["gammas"]))):
            snapshots.append(Snapshot(path, int(metadata["step"]), gamma, sigma_rel, i))
    return sorted(snapshots, key=lambda s: (s.step, s.sigma_rel))


def _profile_dot(step_a, gamma_a, step_b, gamma_b):
    """Integral of the product of two power-function profiles ending at step_a, step_b
    (EDM2 Eq. 151), written with the ratio earlier/later so large gammas cannot overflow."""
    step_a, gamma_a, step_b, gamma_b = np.broadcast_arrays(step_a, gamma_a, step_b, gamma_b)
    later = np.maximum(step_a, step_b)
    gamma_later = np.where(step_a >= step_b, gamma_a, gamma_b)
    ratio = np.minimum(step_a, step_b) / later
    return ((gamma_a + 1) * (gamma_b + 1) / (gamma_a + gamma_b + 1)
            * ratio ** gamma_later / later)


def solve_weights(snapshot_steps, snapshot_gammas, target_step: int,
                  target_sigma_rel: float) -> np.ndarray:
    """Least-squares weights w (one per snapshot, float64) such that sum_i w_i * profile_i is
    closest in L2 to the target profile (EDM2 Alg. 3). Snapshots after `target_step` get weight 0:
    they hold later parameters the target never saw."""
    steps = np.asarray(snapshot_steps, dtype=np.float64)
    gammas = np.asarray(snapshot_gammas, dtype=np.float64)
    if steps.ndim != 1 or steps.shape != gammas.shape or steps.size == 0:
        raise ValueError("need one step and one gamma per snapshot, and at least one snapshot")
    if target_step not in steps:
        known = sorted({int(s) for s in steps})
        listed = known if len(known) <= 6 else [*known[:3], "...", *known[-3:]]
        raise ValueError(f"step {target_step} has no snapshot; choose one of "
                         f"{', '.join(map(str, listed))}")
    target_gamma = sigma_rel_to_gamma(target_sigma_rel)
    used = steps <= target_step
    s, g = steps[used], gammas[used]
    gram = _profile_dot(s[:, None], g[:, None], s[None, :], g[None, :])
    rhs = _profile_dot(s, g, float(target_step), target_gamma)
    # lstsq instead of solve: the Gram matrix of many similar profiles is badly conditioned, and a
    # repeated (step, gamma) pair would make it singular; lstsq returns the minimum-norm solution.
    solution = np.linalg.lstsq(gram, rhs, rcond=None)[0]
    # Every profile integrates to 1, so the weights should sum to 1; renormalizing (as EDM2 does)
    # keeps a constant parameter exactly constant.
    weights = np.zeros_like(steps)
    weights[used] = solution / solution.sum()
    return weights


def require_snapshots(directory: str) -> list[Snapshot]:
    """`load_snapshots`, refusing a directory that holds none (a run trained without post-hoc EMA)."""
    snapshots = load_snapshots(directory)
    if not snapshots:
        raise ValueError(f"no phema-*.safetensors snapshots in {directory}; train with "
                         "post-hoc EMA enabled to write them")
    return snapshots


def reconstruct(directory: str, sigma_rel: float, step: int | None = None
                ) -> dict[str, torch.Tensor]:
    """fp32 state dict (parameter name -> tensor) of the EMA with relative width `sigma_rel` at
    `step` (default: the last snapshot step), as the weighted sum of the snapshots."""
    snapshots = require_snapshots(directory)
    step = max(s.step for s in snapshots) if step is None else step
    weights = solve_weights([s.step for s in snapshots], [s.gamma for s in snapshots],
                            step, sigma_rel)
    state: dict[str, torch.Tensor] = {}
    for snapshot, weight in zip(snapshots, weights):
        if weight == 0:
            continue
        tensors = snapshot.tensors
        if state and tensors.keys() != state.keys():
            raise ValueError(f"{snapshot.path} holds different parameters than earlier snapshots")
        for name, tensor in tensors.items():
            total = state.setdefault(name, torch.zeros(tensor.shape, dtype=torch.float32))
            total.add_(tensor.to(torch.float32), alpha=float(weight))
    return state
