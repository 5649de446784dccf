"""Health check on the loss per class of a class-conditional run: which classes lag.
The diagnostics log `loss_class/<id>`, each class's loss over what all classes reach at the same
timesteps (monitoring/diagnostics.py), so 1 is average whatever timesteps a class drew."""
from __future__ import annotations

import math

import numpy as np

from diffusion_extras.report.checks import Finding, RunLog

CLASS_LAG_RATIO = 1.2      # a class 20 % above all classes' loss at the same timesteps lags ...
CLASS_MIN_WINDOWS = 3      # ... judged over at least 3 logged windows of the last half, and by
                           # more than 4 standard errors of its window-to-window scatter


def class_losses(run: RunLog) -> dict[int, np.ndarray]:
    """Each class's logged relative loss over the last half of the windows, by class id."""
    later = run.records[len(run.records) // 2:]
    keys = sorted({key for record in later for key in record if key.startswith("loss_class/")})
    return {int(key.split("/")[1]): np.array([float(r[key]) for r in later if isinstance(r.get(key), (int, float))
                                              and math.isfinite(r[key])]) for key in keys}


def check_class_lag(run: RunLog, class_names: dict | None = None) -> list[Finding]:
    """class_lag (warning): the classes whose loss stays above the others' at the same timesteps.
    `class_names`: id -> name (the exported pipeline's id2label), for the message."""
    series = {c: v for c, v in class_losses(run).items() if len(v) >= CLASS_MIN_WINDOWS}
    means = {c: float(v.mean()) for c, v in series.items()}
    lagging = {c: means[c] for c in sorted(means, key=means.get, reverse=True)
               if means[c] > CLASS_LAG_RATIO and means[c] - 1.0 > 4 * float(series[c].std(ddof=1)) / math.sqrt(
                   len(series[c]))}
    if not lagging:
        return []
    named = {c: _named(c, class_names) for c in means}
    return [Finding(
        "class_lag", "warning",
        f"Class{'es' if len(lagging) > 1 else ''} {', '.join(named[c] for c in lagging)} "
        f"lag{'' if len(lagging) > 1 else 's'}: "
        f"{', '.join(f'{r:.2f}x' for r in lagging.values())} the loss all classes reach at the same timesteps "
        f"(mean over the last half of the logged windows, {len(means)} classes).",
        "Look at those classes' images first (few images, mislabelled or mixed ones); then give them more "
        "updates (repeat their images in the data) or train longer. A larger --guidance_scale sharpens a class "
        "the model knows; it cannot teach one it has not learned.",
        {"lagging": {named[c]: r for c, r in lagging.items()},
         "class_loss_ratios": {named[c]: m for c, m in sorted(means.items())}})]


def _named(class_id: int, class_names: dict | None) -> str:
    """'3 (cat)', or '3' when the name is the id or unknown."""
    name = (class_names or {}).get(class_id)
    return str(class_id) if name in (None, str(class_id)) else f"{class_id} ({name})"
