"""The quality benchmark's goals, checked against one or more results.json of `quality.py run`.

Every gap is a run's mean score against its own teacher at its most steps (the `sft` stage,
dense), in points. A goal over several runs (seeds) is reported per run and as their mean,
and the mean is what meets or misses it:

- the teacher at 4 steps at least 10 points below itself (else the benchmark is too easy to
  show what distillation is for);
- Stage1 at 4 steps within 3 points, at 1 step within 8;
- Stage2 at 4 steps within 3 points, at 1 step within 5;
- each student at 4 steps with at least 10x fewer function evaluations than the teacher.

`--stage1` / `--stage2` name the stage directories that play those roles (default `stage1`,
`stage2`; several names, comma-separated, when one root holds several seeds of a stage).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Goal:
    role: str            # "teacher", "stage1" or "stage2"
    steps: int
    bound: float         # points (gap goals) or a ratio (nfe goals)
    kind: str = "within"  # "within": gap >= -bound; "below": gap <= -bound; "nfe": ratio >= bound

    @property
    def text(self) -> str:
        name = "teacher" if self.role == "teacher" else self.role.capitalize()
        if self.kind == "nfe":
            return f"{name} @{self.steps}: function evaluations, teacher@max / student"
        return f"{name} @{self.steps} vs teacher@max"

    @property
    def target(self) -> str:
        return {"within": f"within {self.bound:g} pt", "below": f"at least {self.bound:g} pt below",
                "nfe": f"at least {self.bound:g}x"}[self.kind]

    def verdict(self, value: float) -> str:
        if self.kind == "nfe":
            short = self.bound - value
            return "met" if short <= 0 else f"missed by {short:.1f}x"
        short = -self.bound - value if self.kind == "within" else value + self.bound
        return "met" if short <= 1e-9 else f"missed by {short:.2f} pt"


GOALS = (Goal("teacher", 4, 10.0, "below"),
         Goal("stage1", 4, 3.0), Goal("stage1", 1, 8.0), Goal("stage1", 4, 10.0, "nfe"),
         Goal("stage2", 4, 3.0), Goal("stage2", 1, 5.0), Goal("stage2", 4, 10.0, "nfe"))


def _dense(row: dict) -> bool:
    return row.get("attention", "dense") == "dense"  # results before sparse attention: dense


def _teacher_rows(rows: list[dict]) -> dict[int, dict]:
    return {r["steps"]: r for r in rows if r["stage"] == "sft" and _dense(r)}


def measure(goal: Goal, rows: list[dict], stage: str) -> float | None:
    """The goal's value for one student stage (or the teacher) of one results file; None when
    the file did not score what it needs."""
    teacher = _teacher_rows(rows)
    if not teacher:
        return None
    reference = teacher[max(teacher)]
    if goal.role == "teacher":
        row = teacher.get(goal.steps)
    else:
        row = next((r for r in rows if r["stage"] == stage and r["steps"] == goal.steps
                    and _dense(r)), None)
    if row is None:
        return None
    if goal.kind == "nfe":
        return reference["nfe"] / row["nfe"]
    return (row["mean_score"] - reference["mean_score"]) * 100


def check(results: list[tuple[str, dict]], stage_names: dict[str, list[str]]) -> list[dict]:
    """One entry per goal: its runs (label, value) over every file and named stage that was
    scored, their mean and the verdict on the mean (None where nothing was scored)."""
    checked = []
    for goal in GOALS:
        names = ["sft"] if goal.role == "teacher" else stage_names[goal.role]
        runs = [(f"{label}: {name}", value) for label, result in results for name in names
                if (value := measure(goal, result["rows"], name)) is not None]
        mean = sum(v for _, v in runs) / len(runs) if runs else None
        checked.append({"goal": goal, "runs": runs, "mean": mean,
                        "verdict": goal.verdict(mean) if runs else "not scored"})
    return checked


def unknown_stages(results: list[tuple[str, dict]], names: list[str]) -> list[str]:
    """The names no results file scored a row of: a misspelt --stage1 / --stage2."""
    scored = {r["stage"] for _, result in results for r in result["rows"]}
    return [name for name in names if name not in scored]


def goals_markdown(checked: list[dict]) -> str:
    lines = ["| goal | target | run | value | verdict |", "| --- | --- | --- | --- | --- |"]
    for entry in checked:
        goal = entry["goal"]
        fmt = (lambda v: f"{v:.1f}x") if goal.kind == "nfe" else (lambda v: f"{v:+.2f} pt")
        first = f"| {goal.text} | {goal.target} |"
        if not entry["runs"]:
            lines.append(f"{first} | | not scored |")
            continue
        for i, (label, value) in enumerate(entry["runs"]):
            lead = first if i == 0 else "| | |"
            single = len(entry["runs"]) == 1
            lines.append(f"{lead} {label} | {fmt(value)} | {entry['verdict'] if single else ''} |")
        if len(entry["runs"]) > 1:
            lines.append(f"| | | mean of {len(entry['runs'])} | {fmt(entry['mean'])} | "
                         f"{entry['verdict']} |")
    return "\n".join(lines) + "\n"


def load(paths: list[str]) -> list[tuple[str, dict]]:
    """(label, results) per file; the label is the path as given, less /quality/results.json."""
    found = []
    for path in paths:
        file = Path(path)
        if file.is_dir():
            file = file / "quality" / "results.json" if (file / "quality").is_dir() else file / "results.json"
        if not file.is_file():
            raise SystemExit(f"quality goals: {file} is not a results file (give the "
                             f"results.json `quality.py run` wrote, or the root it scored, "
                             f"which holds quality/results.json)")
        label = path.removesuffix("/").removesuffix("/results.json").removesuffix("/quality")
        found.append((label, json.loads(file.read_text())))
    return found
