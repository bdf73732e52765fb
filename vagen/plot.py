"""Training curves from run directories.

    python -m vagen.plot runs/sokoban_visual [runs/other ...] [--out DIR] [--metrics m1,m2]

Reads ``RUN_DIR/metrics.jsonl`` (one JSON object per line, written by the trainer:
``{"iteration": 3, "time": 41.2, "rollout/success": 0.25, ..., "warnings": ["..."]}``) and
writes one PNG per metric plus ``summary.png``, a grid of all of them. Several runs are
overlaid, labelled by their directory names. ``eval/<name>`` is drawn dashed with markers in
the same axes as ``rollout/<name>`` when a run has it. Collapse-monitor warnings are dashed
vertical lines at their iteration, in the subplot of the metric they mention ("grad_norm",
"entropy", "in_group", ...) or in every subplot when they mention none.

Lines may lack metrics (eval only every k iterations), hold NaN, or be cut short (a run still
writing): missing and non-finite values are skipped, a truncated last line is ignored.

Uses matplotlib's object API with the Agg canvas (no pyplot), so it never touches a global
backend and runs headless.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_METRICS = (
    "rollout/success",
    "rollout/reward_mean",
    "rollout/in_group_reward_std",
    "actor/entropy",
    "actor/grad_norm",
    "rollout/response_length",
)
"""Metrics plotted when ``--metrics`` is not given."""

TITLES = {
    "rollout/success": "success rate",
    "rollout/reward_mean": "mean episode reward",
    "rollout/in_group_reward_std": "in-group reward std",
    "actor/entropy": "policy entropy",
    "actor/grad_norm": "gradient norm",
    "rollout/response_length": "response length (tokens)",
}

# Words that tie a collapse warning to a metric, beyond the metric's own leaf name.
_WARNING_ALIASES = {
    "rollout/in_group_reward_std": ("in_group", "in-group", "reward_std", "reward std"),
    "actor/grad_norm": ("grad_norm", "gradient norm", "grad norm"),
    "actor/entropy": ("entropy",),
    "rollout/response_length": ("response_length", "response length"),
    "rollout/reward_mean": ("reward_mean", "mean reward"),
    "rollout/success": ("success",),
}

METRICS_FILE = "metrics.jsonl"


@dataclass
class RunMetrics:
    """The parsed metrics of one run directory."""

    name: str
    """Legend label: the run directory's name."""
    series: dict[str, tuple[list[float], list[float]]] = field(default_factory=dict)
    """metric name -> (iterations, values), finite values only, in file order."""
    warnings: list[tuple[float, str]] = field(default_factory=list)
    """(iteration, warning text) for every collapse-monitor warning."""


def metrics_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / METRICS_FILE


def load_run(run_dir: str | Path, name: str | None = None) -> RunMetrics:
    """Parse ``run_dir/metrics.jsonl``.

    Raises FileNotFoundError naming the expected path when the file is missing. A line that
    does not parse is skipped (silently when it is the last one: a run still being written).
    """
    path = metrics_path(run_dir)
    if not path.is_file():
        where = "the directory does not exist" if not Path(run_dir).is_dir() else "it has no metrics file"
        raise FileNotFoundError(
            f"no metrics for run {str(run_dir)!r}: expected {path} ({where}). The trainer writes "
            f"{METRICS_FILE} into its run directory once per iteration; run training first "
            f"(e.g. `deepspeed vagen/train.py --config sokoban_visual`) and pass that run directory."
        )
    run = RunMetrics(name=name or Path(run_dir).resolve().name)
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    last_nonblank = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    for line_number, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if line_number != last_nonblank:
                print(f"warning: {path}:{line_number + 1} is not valid JSON; skipped", file=sys.stderr)
            continue
        if not isinstance(record, dict):
            continue
        iteration = record.get("iteration", line_number)
        if not _is_number(iteration):
            continue
        for key, value in record.items():
            if key in ("iteration", "time", "warnings") or not _is_number(value):
                continue
            if not math.isfinite(value):
                continue
            xs, ys = run.series.setdefault(key, ([], []))
            xs.append(float(iteration))
            ys.append(float(value))
        warnings = record.get("warnings") or []
        if isinstance(warnings, str):
            warnings = [warnings]
        run.warnings.extend((float(iteration), str(text)) for text in warnings)
    return run


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def warning_targets(text: str, metrics: Sequence[str]) -> list[str]:
    """The metrics among ``metrics`` a warning mentions; all of them when it mentions none."""
    lowered = text.lower()
    hits = []
    for metric in metrics:
        leaf = metric.rsplit("/", 1)[-1]
        words = {leaf, leaf.replace("_", " "), *_WARNING_ALIASES.get(metric, ())}
        if any(word in lowered for word in words):
            hits.append(metric)
    return hits or list(metrics)


def _companion(metric: str) -> str | None:
    """``eval/x`` for ``rollout/x``: evaluation is drawn in the same axes as the rollout metric."""
    if metric.startswith("rollout/"):
        return "eval/" + metric.removeprefix("rollout/")
    return None


def _resolve_metrics(requested: Sequence[str] | None, runs: Sequence[RunMetrics]) -> list[str]:
    available = sorted({name for run in runs for name in run.series})
    if requested is None:
        present = [m for m in DEFAULT_METRICS if any(m in run.series for run in runs)]
        if not present:
            raise ValueError(
                f"none of the default metrics {list(DEFAULT_METRICS)} appear in these runs; "
                f"pass --metrics with some of: {available}"
            )
        return present
    resolved = []
    for name in requested:
        if name in available:
            resolved.append(name)
            continue
        # A leaf name ("grad_norm") is accepted when it names one logged metric; rollout/ wins
        # over eval/ because eval/<leaf> is drawn in the same axes anyway.
        matches = [m for m in available if m.rsplit("/", 1)[-1] == name]
        if f"rollout/{name}" in matches:
            matches = [f"rollout/{name}"]
        if len(matches) == 1:
            resolved.append(matches[0])
            continue
        if matches:
            raise ValueError(f"metric {name!r} is ambiguous: it matches {matches}; pass the full name")
        raise ValueError(f"metric {name!r} is not in these runs; choices: {available}")
    return resolved


def _draw_metric(
    ax,
    metric: str,
    plotted: Sequence[str],
    runs: Sequence[RunMetrics],
    colours: Sequence[str],
    label_warnings: bool,
) -> None:
    companion = _companion(metric)
    for run, colour in zip(runs, colours, strict=True):
        if metric in run.series:
            xs, ys = run.series[metric]
            ax.plot(xs, ys, color=colour, linewidth=1.6, label=run.name)
        if companion and companion in run.series:
            xs, ys = run.series[companion]
            label = f"{run.name} ({companion})"
            ax.plot(xs, ys, color=colour, linestyle="--", marker="o", markersize=4, label=label)
        for iteration, text in run.warnings:
            if metric not in warning_targets(text, plotted):
                continue
            ax.axvline(iteration, color=colour, linestyle=":", linewidth=1.2, alpha=0.8)
            if label_warnings:
                ax.annotate(
                    text[:60],
                    xy=(iteration, 1.0),
                    xycoords=("data", "axes fraction"),
                    rotation=90,
                    fontsize=7,
                    color=colour,
                    ha="right",
                    va="top",
                )
    ax.set_title(TITLES.get(metric, metric) + (f"  [{metric}]" if metric in TITLES else ""), fontsize=10)
    ax.set_xlabel("iteration")
    ax.grid(True, alpha=0.3)


def plot_runs(
    run_dirs: Sequence[str | Path], out_dir: str | Path | None = None, metrics: Sequence[str] | None = None
) -> list[Path]:
    """Write ``<metric>.png`` per metric and ``summary.png`` into ``out_dir``; return the paths.

    ``out_dir`` defaults to ``<first run dir>/plots``. ``metrics`` defaults to those of
    ``DEFAULT_METRICS`` that some run logged; names may be full (``actor/grad_norm``) or a
    unique leaf (``grad_norm``).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not run_dirs:
        raise ValueError("plot_runs needs at least one run directory")
    runs = [load_run(run_dir) for run_dir in run_dirs]
    _disambiguate_names(runs, run_dirs)
    chosen = _resolve_metrics(metrics, runs)
    out_dir = Path(out_dir) if out_dir is not None else Path(run_dirs[0]) / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    colours = [f"C{i % 10}" for i in range(len(runs))]

    paths = []
    for metric in chosen:
        figure = Figure(figsize=(7, 4), dpi=100, layout="constrained")
        FigureCanvasAgg(figure)
        ax = figure.add_subplot()
        _draw_metric(ax, metric, chosen, runs, colours, label_warnings=True)
        ax.legend(fontsize=8)
        path = out_dir / (metric.replace("/", "_") + ".png")
        figure.savefig(path)
        paths.append(path)

    columns = min(3, len(chosen))
    rows = math.ceil(len(chosen) / columns)
    figure = Figure(figsize=(5 * columns, 3.4 * rows + 0.6), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(rows, columns, squeeze=False).ravel()
    for ax, metric in zip(axes, chosen, strict=False):
        _draw_metric(ax, metric, chosen, runs, colours, label_warnings=False)
    for ax in axes[len(chosen) :]:
        ax.set_visible(False)
    handles = [axes[0].plot([], [], color=c, label=run.name)[0] for run, c in zip(runs, colours, strict=True)]
    companions = {_companion(m) for m in chosen} - {None}
    if any(name in run.series for run in runs for name in companions):
        handles.append(axes[0].plot([], [], color="grey", linestyle="--", marker="o", label="eval")[0])
    if any(run.warnings for run in runs):
        handles.append(axes[0].plot([], [], color="grey", linestyle=":", label="collapse warning")[0])
    figure.legend(handles=handles, loc="outside upper center", ncols=min(len(handles), 4), fontsize=9)
    path = out_dir / "summary.png"
    figure.savefig(path)
    paths.append(path)
    return paths


def _disambiguate_names(runs: Sequence[RunMetrics], run_dirs: Sequence[str | Path]) -> None:
    names = [run.name for run in runs]
    for run, run_dir in zip(runs, run_dirs, strict=True):
        if names.count(run.name) > 1:
            resolved = Path(run_dir).resolve()
            run.name = f"{resolved.parent.name}/{resolved.name}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vagen.plot",
        description="Plot training curves (success, reward, in-group reward std, entropy, grad norm, "
        "response length) of one or more run directories.",
    )
    parser.add_argument("run_dirs", nargs="+", help="run directories, each holding metrics.jsonl")
    parser.add_argument("--out", default=None, help="output directory (default: FIRST_RUN_DIR/plots)")
    parser.add_argument(
        "--metrics",
        default=None,
        help=f"comma-separated metric names (default: {','.join(DEFAULT_METRICS)})",
    )
    args = parser.parse_args(argv)
    metrics = [m.strip() for m in args.metrics.split(",") if m.strip()] if args.metrics else None
    try:
        paths = plot_runs(args.run_dirs, args.out, metrics)
    except (FileNotFoundError, ValueError) as error:
        parser.error(str(error))
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
