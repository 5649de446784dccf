"""Training health report: reads OUTPUT_DIR/logs/history.jsonl and training_config.yaml, runs the
checks of checks.py, dynamics.py, timestep_balance.py and class_balance.py, and writes
training_report.json and training_report.md, each finding with its recommendation.
    python -m diffusion_extras.report OUTPUT_DIR_OR_CHECKPOINT_DIR
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict

import numpy as np
import yaml

from diffusion_extras.core import commands
from diffusion_extras.core.commands import prog_name
from diffusion_extras.report import checks, class_balance, timestep_balance
from diffusion_extras.report import dynamics as report_dynamics
from diffusion_extras.report.checks import SEVERITY_ORDER, Finding, RunLog, median

__all__ = ["Finding", "analyze", "summarize", "write_report", "main"]


def analyze(history: list[dict], config: dict, bayes_optimal_bins: dict[str, float] | None = None,
            class_names: dict[int, str] | None = None) -> list[Finding]:
    """All findings for a run, most severe first; ValueError when nothing was logged yet.
    `class_names` (id -> name) names the classes of a class-conditional run."""
    run = RunLog(history, config or {})
    findings = [finding for check in checks.RUN_CHECKS + report_dynamics.CHECKS for finding in check(run)]
    findings += timestep_balance.check_timestep_balance(run, bayes_optimal_bins)
    findings += class_balance.check_class_lag(run, class_names)
    findings += learned_variance_note(run)
    return sorted(findings, key=lambda finding: SEVERITY_ORDER[finding.severity])


def learned_variance_note(run: RunLog) -> list[Finding]:
    """With --variance_type learned_range: what the per-timestep loss and its reference measure."""
    if run.config.get("variance_type") != "learned_range":
        return []
    _, estimate = run.series("vlb_bits_per_dim", last_fraction=0.25)
    return [Finding(
        "learned_variance_reference", "info",
        "This run learns its variance (--variance_type learned_range). The per-timestep loss (loss_bin/*) and "
        "its Bayes-optimal reference are the simple loss's: the unweighted MSE of the prediction, the first C "
        "of the UNet's 2C output channels, which alone trains the mean (the bound's term is stop-gradiented "
        "there), so the reference and the imbalance check read as in a fixed-variance run. The bound's terms, "
        "vlb_bin/* in bits/dim, train only the variance and have no such reference"
        + (f"; their training-time sum over t is {float(np.median(estimate)):.3f} bits/dim "
           "(vlb_bits_per_dim, without the prior term)." if len(estimate) else "."),
        "Nothing to change; for the model's likelihood run `python -m diffusion_extras.evaluate OUTPUT_DIR "
        "--reference IMAGES --eval_metrics nll`.",
        {"vlb_bits_per_dim": float(np.median(estimate)) if len(estimate) else None})]


def summarize(history: list[dict], config: dict) -> dict:
    run = RunLog(history, config or {})
    last_value = lambda key: (run.series(key)[1][-1:].tolist() or [None])[0]  # noqa: E731
    _, norms = run.series("grad_norm", last_fraction=0.5)
    _, clip_rate = run.series("clip_rate", last_fraction=0.5)
    tail = run.loss[-max(1, len(run.loss) // 10):]
    return {"steps_run": run.steps_run, "max_train_steps": run.planned,
            "final_loss": median(tail) if len(tail) else None,
            "best_smoothed_loss": float(run.smooth.min()) if len(run.smooth) else None,
            "final_learning_rate": last_value("lr"),
            "median_grad_norm_last_half": median(norms) if len(norms) else None,
            "clip_rate_last_half": float(clip_rate.mean()) if len(clip_rate) else None,
            "nonfinite_steps": int(run.series("nonfinite_steps")[1].sum()),
            "max_consecutive_nonfinite": int(max(run.series("max_consecutive_nonfinite")[1], default=0)),
            "final_ema_decay": last_value("ema_decay"), "final_loss_scale": last_value("loss_scale"),
            "prediction_type": config.get("prediction_type"),
            "mixed_precision": config.get("mixed_precision")}


def render_markdown(summary: dict, findings: list[Finding], output_dir: str) -> str:
    counts = {s: sum(f.severity == s for f in findings) for s in SEVERITY_ORDER}
    lines = [f"# Training health report: `{output_dir}`", "",
             f"**{counts['critical']} critical, {counts['warning']} warning"
             f"{'' if counts['warning'] == 1 else 's'}, {counts['info']} info.**",
             "", "| | |", "|---|---|"]
    for key, value in summary.items():
        shown = "-" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)
        lines.append(f"| {key.replace('_', ' ')} | {shown} |")
    lines += ["", "## Findings", ""]
    if not findings:
        lines.append("No problems found.")
    for finding in findings:
        lines += [f"### {finding.severity.upper()}: {finding.code}", "", finding.message, "",
                  f"**Recommendation:** {finding.recommendation}", "",
                  f"<sub>evidence: `{json.dumps(_jsonable(finding.evidence))}`</sub>", ""]
    return "\n".join(lines).rstrip() + "\n"


def _jsonable(value):
    """Plain JSON: numpy scalars to Python, NaN/inf to None (strict parsers reject NaN)."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (np.floating, float)):
        return float(value) if math.isfinite(value) else None
    return value.item() if isinstance(value, np.generic) else value


def resolve_output_dir(path: str) -> str:
    """The run's output_dir: `path` itself or, for a checkpoint folder, its parent."""
    if not os.path.isdir(path):
        raise ValueError(f"{path}: no such directory; pass a training output_dir or a checkpoint in it")
    for candidate in (path, os.path.dirname(os.path.abspath(path))):
        if os.path.isfile(os.path.join(candidate, "logs", "history.jsonl")):
            return candidate
    raise ValueError(f"{path}: no logs/history.jsonl here or in the parent folder; pass the output_dir "
                     "of a run that has logged at least once")


def load_history(output_dir: str) -> list[dict]:
    path = os.path.join(output_dir, "logs", "history.jsonl")
    history = []
    with open(path) as fh:
        for number, line in enumerate(fh, 1):
            if line.strip():
                try:
                    history.append(json.loads(line))
                except json.JSONDecodeError as error:
                    raise ValueError(f"{path}:{number}: not valid JSON ({error.msg}); fix or delete "
                                     "that line") from None
    return history


REFERENCE_FILE = "reference_loss_bins.json"  # written by the trainer beside history.jsonl


def load_config(output_dir: str) -> dict:
    """The run's training_config.yaml as a mapping ({} without one: the checks that need a
    setting are skipped). An unreadable file is a ValueError the CLI prints as one line."""
    path = os.path.join(output_dir, "training_config.yaml")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as fh:
            values = yaml.safe_load(fh)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
        first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ValueError(f"{path}: cannot read the run's config ({first_line}); "
                         "restore it from the run or delete it to report without it") from None
    if values is not None and not isinstance(values, dict):
        raise ValueError(f"{path}: expected a mapping of setting: value, got a {type(values).__name__}")
    return values or {}


def _write_atomically(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as fh:
        fh.write(text)
    os.replace(path + ".tmp", path)  # a reader never sees half a report


def load_reference_bins(output_dir: str) -> dict | None:
    """The Bayes-optimal per-bin reference the trainer stored, for reports made on demand."""
    path = os.path.join(output_dir, "logs", REFERENCE_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as fh:
        return json.load(fh).get("bayes_optimal_bins")


def load_class_names(output_dir: str) -> dict[int, str] | None:
    """id -> class name from the exported pipeline's model_index.json (a class-conditional run that
    has exported at least once), else None."""
    path = os.path.join(output_dir, "model_index.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as fh:
            id2label = json.load(fh).get("id2label")
    except (OSError, ValueError):  # a folder being written: the report goes on with class ids
        return None
    return {int(k): str(v) for k, v in id2label.items()} if isinstance(id2label, dict) else None


def write_report(output_dir: str, history=None, config=None, bayes_optimal_bins=None) -> tuple[str, str]:
    """Write training_report.json and .md into output_dir; returns (json_path, md_path)."""
    if history is None or config is None:
        output_dir = resolve_output_dir(output_dir) if history is None else output_dir
        history = load_history(output_dir) if history is None else history
        config = load_config(output_dir) if config is None else config
    if bayes_optimal_bins is None:
        bayes_optimal_bins = load_reference_bins(output_dir)
    findings = analyze(history, config, bayes_optimal_bins, load_class_names(output_dir))
    summary = summarize(history, config)
    thresholds = {k: v for k, v in vars(checks).items() if k.isupper() and isinstance(v, (int, float))}
    payload = {"output_dir": output_dir, "summary": summary, "findings": [asdict(f) for f in findings],
               "bayes_optimal_bins": bayes_optimal_bins, "thresholds": thresholds}
    os.makedirs(output_dir, exist_ok=True)
    json_path = os.path.join(output_dir, "training_report.json")
    md_path = os.path.join(output_dir, "training_report.md")
    _write_atomically(json_path, json.dumps(_jsonable(payload), indent=2, allow_nan=False) + "\n")
    _write_atomically(md_path, render_markdown(summary, findings, output_dir))
    return json_path, md_path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog_name("report"),
                                     description="Write and print the health report of a training run.")
    parser.add_argument("run_dir", help="the training output_dir, or a checkpoint folder inside it")
    return parser


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    try:
        _, md_path = write_report(resolve_output_dir(args.run_dir))
    except (ValueError, OSError, yaml.YAMLError) as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    with open(md_path) as fh:
        print(fh.read(), end="")


def cli():
    """The process entry (`python -m diffusion_extras.report`, `ddpm-report`)."""
    commands.exit_with(main())


if __name__ == "__main__":
    cli()
