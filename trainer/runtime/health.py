"""The health gate: stop a run that is collapsing, instead of finding out after it ends.

Distillation fails in ways the loss does not show: the critic diverges, the student
over-saturates, the samples get worse while every number logged looks fine. With
`health_gate: true` the loop hands this gate each step's numbers and each validation's scores;
it answers with a reason to stop when
- the validation mean score (EMA weights where validated, else live) stays more than
  `health_score_margin` below its best for `health_score_patience` validations in a row, or
- (the stages whose declaration asks for it, `health_watches_samples`: Stage1, Stage2) the
  validation samples stop moving or flood with one colour: their `motion` or `contrast`
  (trainer.evaluation.sample_stats: from the pixels, on any data) stays below
  `health_sample_min_ratio` of the highest seen in the run for `health_score_patience`
  validations in a row. Only stages that start from a trained model are watched: a
  pretrain's first samples are noise, which moves more than any video;
- the critic's FM loss relative to its value when Stage2 started (`critic_loss_rel`, logged
  by Stage2) stays above `health_critic_max_ratio` (diverging) or below
  `health_critic_min_ratio` (it predicts the student's samples almost exactly: they have
  collapsed to something trivial, and the critic has nothing left to learn or to teach) for
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
    """Why the gate stopped a run: gate is "validation", "samples" or "critic"."""

    step: int
    gate: str
    message: str
    onset: int | None = None  # the first step of the unhealthy streak that stopped the run

    def to_json(self) -> dict:
        return {"step": self.step, "gate": self.gate, "message": self.message,
                "onset": self.onset}


def watched_score(record: dict, name: str = "mean_score") -> tuple[str, float] | None:
    """(key, value) of the validation number `name` the gate watches in a metrics record: the
    EMA's where the record has one, else the live weights'; None without validation."""
    for weights in ("ema", "live"):
        key = f"val/{weights}/{name}"
        if isinstance(record.get(key), (int, float)):
            return key, float(record[key])
    return None


# What a collapse of each sample statistic looks like, in the stop message.
SAMPLE_COLLAPSES = {
    "motion": ("have stopped moving", "the mean change of a pixel between frames",
               "a static video"),
    "contrast": ("are flooding with one colour", "the spread of pixel values within a frame",
                 "a colour flood"),
}


@dataclass
class Trend:
    """A watched validation number: its highest value so far, the step of it, and how many
    observations in a row have been degraded."""

    best: float | None = None
    best_step: int | None = None
    below: int = 0
    since: int | None = None  # the step of the first degraded observation in the row

    def update(self, step: int, value: float, limit_from_best) -> int:
        """Take `value`; it is degraded below limit_from_best(best). Returns the count in a row."""
        if self.best is None or value > self.best:
            self.best, self.best_step = value, step
        self.below = self.below + 1 if value < limit_from_best(self.best) else 0
        self.since = (self.since or step) if self.below else None
        return self.below


@dataclass(frozen=True)
class HealthSettings:
    """The health_* keys of a run, typed; `sample_min_ratio` is 0 (samples unwatched) unless
    the run's stage watches its samples (StageDeclaration.health_watches_samples)."""

    enabled: bool
    margin: float
    score_patience: int
    critic_max_ratio: float
    critic_min_ratio: float
    critic_patience: int
    sample_min_ratio: float

    @classmethod
    def of(cls, args, *, watches_samples: bool) -> "HealthSettings":
        return cls(enabled=bool(args.health_gate), margin=float(args.health_score_margin),
                   score_patience=int(args.health_score_patience),
                   critic_max_ratio=float(args.health_critic_max_ratio),
                   critic_min_ratio=float(args.health_critic_min_ratio),
                   critic_patience=int(args.health_critic_patience),
                   sample_min_ratio=(float(args.health_sample_min_ratio) if watches_samples
                                     else 0.0))


class HealthGate:
    """Decides, step by step, whether a run has degraded past its configured limits."""

    def __init__(self, settings: HealthSettings):
        self.enabled = settings.enabled
        self.margin = settings.margin
        self.score_patience = settings.score_patience
        self.critic_max_ratio = settings.critic_max_ratio
        self.critic_min_ratio = settings.critic_min_ratio
        self.critic_patience = settings.critic_patience
        self.sample_min_ratio = settings.sample_min_ratio
        self.score = Trend()
        self.critic_over = 0
        self.critic_under = 0
        self.critic_since: int | None = None  # the first step of the critic's streak
        self.samples = {name: Trend() for name in SAMPLE_COLLAPSES}

    def unhealthy_since(self) -> int | None:
        """The first step of the earliest unhealthy streak still running (a reading past a
        limit, not yet for its patience), or None while every reading is healthy. The loop
        keeps the newest checkpoint saved before it from being pruned."""
        if not self.enabled:
            return None
        starts = [self.critic_since, self.score.since,
                  *(trend.since for trend in self.samples.values())]
        return min((s for s in starts if s is not None), default=None)

    def observe(self, step: int, numbers: dict) -> StopReason | None:
        """Feed one step's numbers (with its validation scores when it validated); returns the
        reason to stop, or None. Does nothing when the gate is off."""
        if not self.enabled:
            return None
        return (self._check_critic(step, numbers) or self._check_samples(step, numbers)
                or self._check_score(step, numbers))

    def _check_critic(self, step: int, numbers: dict) -> StopReason | None:
        ratio = numbers.get("critic_loss_rel")
        if not isinstance(ratio, (int, float)):
            return None
        over = self.critic_max_ratio > 0 and ratio > self.critic_max_ratio
        under = self.critic_min_ratio > 0 and ratio < self.critic_min_ratio
        self.critic_over = self.critic_over + 1 if over else 0
        self.critic_under = self.critic_under + 1 if under else 0
        self.critic_since = (self.critic_since or step) if over or under else None
        if self.critic_over >= self.critic_patience:
            return StopReason(step, "critic", onset=self.critic_since, message=(
                f"health gate: the critic's FM loss has been more than "
                f"{self.critic_max_ratio:g}x its value at the start of Stage2 for "
                f"{self.critic_over} steps in a row (now {ratio:.3g}x at step {step}): the "
                f"critic is diverging. Lower critic_learning_rate (or learning_rate), or raise "
                f"health_critic_max_ratio."))
        if self.critic_under >= self.critic_patience:
            return StopReason(step, "critic", onset=self.critic_since, message=(
                f"health gate: the critic's FM loss has been below {self.critic_min_ratio:g}x "
                f"its value at the start of Stage2 for {self.critic_under} steps in a row (now "
                f"{ratio:.3g}x at step {step}): the critic predicts the student's samples "
                f"almost exactly, so they have collapsed to something trivial (a static or flat "
                f"video) and the critic has stopped learning anything it could teach. Look at "
                f"the latest samples; lower learning_rate (the student's), or lower "
                f"health_critic_min_ratio (0 turns this check off)."))
        return None

    def _check_samples(self, step: int, numbers: dict) -> StopReason | None:
        if self.sample_min_ratio <= 0:
            return None
        for name, (what, meaning, collapse) in SAMPLE_COLLAPSES.items():
            watched = watched_score(numbers, name)
            if watched is None:
                continue
            key, value = watched
            trend = self.samples[name]
            if trend.update(step, value, lambda best: self.sample_min_ratio * best) \
                    >= self.score_patience:
                return StopReason(step, "samples", onset=trend.since, message=(
                    f"health gate: the validation samples {what}: {key} ({meaning}) has been "
                    f"below {self.sample_min_ratio:g} of its highest ({trend.best:.4f} at step "
                    f"{trend.best_step}) for {trend.below} validations in a row (now "
                    f"{value:.4f} at step {step}), which is {collapse}. The weights before it "
                    f"are in the checkpoint nearest step {trend.best_step}; lower "
                    f"learning_rate, or lower health_sample_min_ratio (0 turns this check off)."))
        return None

    def _check_score(self, step: int, numbers: dict) -> StopReason | None:
        watched = watched_score(numbers)
        if watched is None:
            return None
        key, score = watched
        trend = self.score
        if trend.update(step, score, lambda best: best - self.margin) < self.score_patience:
            return None
        return StopReason(step, "validation", onset=trend.since, message=(
            f"health gate: validation {key} has been more than {self.margin:g} below its best "
            f"({trend.best:.3f} at step {trend.best_step}) for {trend.below} validations in a "
            f"row (now {score:.3f} at step {step}): the samples are getting worse. The best "
            f"weights are in the checkpoint nearest step {trend.best_step}; lower the learning "
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
                self._check_samples(record["step"], record)
                self._check_score(record["step"], record)
