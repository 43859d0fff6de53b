"""`relay plot`: one picture of a run, from its metrics.jsonl.

One column per stage (a stage's output_dir, or every stage of a pipeline root, in pipeline
order), one panel per row: every loss term the stage logs, its learning rates, gradient
norms, step time, and validation scores, each against the step. Written as PNG with
matplotlib's Agg backend (no display needed); nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from launcher.record import RECORD_FILE, RecordError, read_record

COLUMN_INCHES, ROW_INCHES, DPI = 4.2, 2.3, 100


@dataclasses.dataclass(frozen=True)
class Panel:
    """One row of the figure: the metrics.jsonl keys it draws (those `match` accepts)."""

    title: str
    ylabel: str
    match: Callable[[str], bool]
    log_y: bool = False

    def keys(self, records: list[dict[str, Any]]) -> list[str]:
        """The keys of this panel that `records` hold, in first-seen order."""
        found: dict[str, None] = {}
        for record in records:
            for key, value in record.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) \
                        and self.match(key):
                    found.setdefault(key)
        return list(found)


PANELS = (
    Panel("loss", "loss", lambda k: k == "loss" or k.startswith("loss_") or k.endswith("_loss"),
          log_y=True),
    Panel("learning rate", "lr", lambda k: k == "lr" or k.endswith("_lr")),
    Panel("gradient norm", "norm", lambda k: k.endswith("grad_norm"), log_y=True),
    Panel("step time", "seconds", lambda k: k == "step_time_s"),
    Panel("validation", "accuracy", lambda k: k.startswith("val/") and k.endswith("_accuracy")),
)


class PlotError(Exception):
    """Nothing to plot at the given path; the message says what was expected."""


def find_runs(path: str | os.PathLike) -> list[tuple[str, Path]]:
    """(name, output_dir) of what `path` names: a pipeline root (every stage in order) or one
    run's output_dir. Raises PlotError when it is neither."""
    path = Path(path)
    if (path / RECORD_FILE).is_file():
        try:
            record = read_record(path)
        except RecordError as exc:
            raise PlotError(str(exc)) from None
        return [(name, Path(entry["output_dir"])) for name, entry in record["stages"].items()]
    if (path / "metrics.jsonl").is_file():
        return [(path.name, path)]
    raise PlotError(f"{path} is neither a pipeline root (with {RECORD_FILE}) nor a run's "
                    f"output_dir (with metrics.jsonl). Pass one of those.")


def read_metrics(output_dir: Path) -> list[dict[str, Any]]:
    """Every complete record of output_dir/metrics.jsonl ([] when there is none yet)."""
    try:
        lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return []
    records = []
    for line in lines:
        try:
            value = json.loads(line)
        except json.JSONDecodeError:
            continue  # the line being written
        if isinstance(value, dict) and isinstance(value.get("step"), int):
            records.append(value)
    return records


def build_figure(runs: list[tuple[str, list[dict[str, Any]]]]):
    """The matplotlib Figure: a column per (name, records), a row per panel."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    columns = max(1, len(runs))
    figure = Figure(figsize=(COLUMN_INCHES * columns, ROW_INCHES * len(PANELS)), dpi=DPI,
                    layout="constrained")
    # One step axis per column: a stage validated once still shows where in its run.
    axes = figure.subplots(len(PANELS), columns, squeeze=False, sharex="col")
    for col, (name, records) in enumerate(runs):
        for row, panel in enumerate(PANELS):
            draw_panel(axes[row][col], panel, records)
            axes[row][col].set_title(f"{name}: {panel.title}", fontsize=9)
        axes[-1][col].set_xlabel("step")
    return figure


def draw_panel(ax, panel: Panel, records: list[dict[str, Any]]) -> None:
    """One panel: a line per key (markers where a key is logged rarely, like validation)."""
    keys = panel.keys(records)
    if not keys:
        ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes,
                color="grey")
        ax.set_yticks([])
        return
    for key in keys:
        points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
        steps, values = zip(*points)
        ax.plot(steps, values, marker="o" if len(points) < 20 else None, markersize=3,
                linewidth=1, label=key)
    if panel.log_y and all(v > 0 for k in keys for r in records
                           if isinstance(v := r.get(k), (int, float))):
        ax.set_yscale("log")
    if panel.title == "validation":
        ax.set_ylim(-0.05, 1.05)
    ax.set_ylabel(panel.ylabel, fontsize=8)
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=6, loc="best")


def plot(path: str | os.PathLike, out: str | os.PathLike | None = None) -> Path:
    """Write the plot of a run or pipeline root; returns the PNG's path (default
    <path>/plot.png). Raises PlotError when there is nothing to plot."""
    runs = [(name, read_metrics(directory)) for name, directory in find_runs(path)]
    if not any(records for _, records in runs):
        raise PlotError(f"no metrics.jsonl records under {path} yet: nothing to plot.")
    target = Path(out) if out else Path(path) / "plot.png"
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    build_figure(runs).savefig(tmp, format="png")
    os.replace(tmp, target)
    return target
