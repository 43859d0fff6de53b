"""The health gate: stop a run that is collapsing, instead of finding out after it ends.

Distillation fails in ways the loss does not show: the critic diverges, the student
over-saturates, the samples get worse while every number logged looks fine. With
`health_gate: true` the loop hands this gate each step's numbers and each validation's scores;
it answers with a reason to stop when
- the validation mean score (EMA weights where validated, else live) stays more than
  `health_score_margin` below its best for `health_score_patience` validations in a row, or
- the critic's FM loss relative to its value when Stage2 started (`critic_loss_rel`, logged
  by trainer.stages.dmd_sgf) stays above `health_critic_max_ratio` for
  `health_critic_patience` steps in a row.
The loop then saves, writes the reason into run-result.json (`stop_reason`) and exits 1, so
`relay status` and a chained pipeline see a failed stage with its reason. Torch-free. On
resume the validation counts are rebuilt from the metrics.jsonl records the resumed run keeps;
the critic's count of steps in a row starts again (metrics.jsonl holds logged steps only).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass
class StopReason:
    """Why the gate stopped a run: gate is "validation" or "critic"."""

    step: int
    gate: str
    message: str

    def to_json(self) -> dict:
        return {"step": self.step, "gate": self.gate, "message": self.message}


def watched_score(record: dict) -> tuple[str, float] | None:
    """(key, value) of the validation score the gate watches in a metrics record: the EMA's
    mean_score where the record has one, else the live weights'; None without validation."""
    for weights in ("ema", "live"):
        key = f"val/{weights}/mean_score"
        if isinstance(record.get(key), (int, float)):
            return key, float(record[key])
    return None


class HealthGate:
    """Decides, step by step, whether a run has degraded past its configured limits."""

    def __init__(self, args):
        self.enabled = bool(args.health_gate)
        self.margin = float(args.health_score_margin)
        self.score_patience = int(args.health_score_patience)
        self.critic_max_ratio = float(args.health_critic_max_ratio)
        self.critic_patience = int(args.health_critic_patience)
        self.best: float | None = None
        self.best_step: int | None = None
        self.below = 0
        self.critic_over = 0

    def observe(self, step: int, numbers: dict) -> StopReason | None:
        """Feed one step's numbers (with its validation scores when it validated); returns the
        reason to stop, or None. Does nothing when the gate is off."""
        if not self.enabled:
            return None
        return self._check_critic(step, numbers) or self._check_score(step, numbers)

    def _check_critic(self, step: int, numbers: dict) -> StopReason | None:
        ratio = numbers.get("critic_loss_rel")
        if self.critic_max_ratio <= 0 or not isinstance(ratio, (int, float)):
            return None
        self.critic_over = self.critic_over + 1 if ratio > self.critic_max_ratio else 0
        if self.critic_over < self.critic_patience:
            return None
        return StopReason(step, "critic", (
            f"health gate: the critic's FM loss has been more than {self.critic_max_ratio:g}x "
            f"its value at the start of Stage2 for {self.critic_over} steps in a row (now "
            f"{ratio:.3g}x at step {step}): the critic is diverging. Lower "
            f"critic_learning_rate (or learning_rate), or raise health_critic_max_ratio."))

    def _check_score(self, step: int, numbers: dict) -> StopReason | None:
        watched = watched_score(numbers)
        if watched is None:
            return None
        key, score = watched
        if self.best is None or score > self.best:
            self.best, self.best_step = score, step
        self.below = self.below + 1 if score < self.best - self.margin else 0
        if self.below < self.score_patience:
            return None
        return StopReason(step, "validation", (
            f"health gate: validation {key} has been more than {self.margin:g} below its best "
            f"({self.best:.3f} at step {self.best_step}) for {self.below} validations in a row "
            f"(now {score:.3f} at step {step}): the samples are getting worse. The best "
            f"weights are in the checkpoint nearest step {self.best_step}; lower the learning "
            f"rates, or widen health_score_margin / health_score_patience."))

    def replay(self, metrics_path: Path, through_step: int) -> None:
        """Rebuild the gate's state from the metrics.jsonl records of steps <= through_step
        (a resumed run continues the counts of the run it resumes)."""
        if not self.enabled or not metrics_path.is_file():
            return
        for line in metrics_path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a kill mid-write
            if record.get("step", 0) <= through_step:
                self._check_score(record["step"], record)
