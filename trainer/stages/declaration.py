"""What a stage declares about itself, torch-free (`StageDeclaration`), so the login node checks
a run of any stage before anything is queued, and the rest of relay asks the declaration
instead of naming a stage.

A declaration says what the stage needs of the model family (`capabilities`), which arguments
name the weights it starts from (`weight_keys`), how its model samples (`sampling`), which
roles it holds in memory (`memory_roles`), what it requires of its arguments (`check`), what
reads the empty caption (`null_caption_uses`), and where its torch half is: `builder`,
`warmup_loss` (import strings, "package.module:attribute", imported only when called).
relay's own are in trainer.stages.declarations; trainer.stages.registry finds a run's.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Mapping


@dataclass(frozen=True)
class WeightKey:
    """An argument naming weights the stage warm-starts a role from (`path`), the argument
    picking which of them (`weights`: live | ema), and the boolean argument without which the
    stage reads nothing from it (`read_if`; None: always read when set)."""

    path: str
    weights: str
    read_if: str | None = None

    def read(self, args: Mapping[str, Any]) -> bool:
        return self.read_if is None or bool(args.get(self.read_if))


@dataclass(frozen=True)
class SamplingPlan:
    """How a stage's model turns noise into latents, as validation, `relay sample`, `relay eval`
    and `relay export` use it: the sampler (an import string of a function with the signature
    of trainer.diffusion.sampling.sample_fm), its steps and guidance, the shift of its grid."""

    sampler: str
    steps: int
    guidance: float
    shift: float

    def load_sampler(self):
        return load_object(self.sampler)


@dataclass(frozen=True)
class MemoryRole:
    """A model a stage holds in memory (trainer.checks.memory): trained (with an
    optimizer and gradients) or frozen, with an EMA or not."""

    name: str
    trained: bool
    ema: bool = False


def load_object(reference: str):
    """The object "package.module:attribute" names (the attribute may be dotted), imported now.
    Raises ImportError or AttributeError."""
    module_name, _, attribute = reference.partition(":")
    target: Any = importlib.import_module(module_name)
    for part in attribute.split("."):
        target = getattr(target, part)
    return target


class StageDeclaration:
    """The torch-free half of a stage. Subclass it, set the attributes and override the methods
    that differ; the defaults are those of a stage that trains one model by flow matching's
    draws, warm-started from pretrained_transformer_path, sampled with the Euler sampler."""

    # The name `stage:` gives relay's own stages; a stage outside relay is named by its
    # declaration's import string instead, and `name` is only what messages call it.
    name: str = ""
    # What the stage calls on the model (trainer.models.family.CAPABILITIES): preflight refuses
    # a model family that lacks one.
    capabilities: tuple[str, ...] = ()
    # The warm-start weights; the first names the run's own model (its student's, for a stage
    # with several roles): trainer.source_model inherits that run's architecture.
    weight_keys: tuple[WeightKey, ...] = (
        WeightKey("pretrained_transformer_path", "pretrained_weights", "load_transformer_weights"),)
    # Import strings of the torch half: builder(args, topo) -> trainer.stages.base.Stage, with
    # its models, optimizers and data (weights random: the run then resumes or warm-starts);
    # warmup_loss(model, batch, args, shapes) -> the loss of one step at the real shapes for
    # the kernel warm-up (trainer.warmup), or None when the stage has none.
    builder: str = ""
    warmup_loss: str | None = None
    # The checkpoint member `relay sample` / `relay eval` / `relay export` read the live
    # weights of, for a stage with several roles (None: the one model's).
    inference_member: str | None = None
    # Video streams the trained forward runs per sample (teacher forcing: clean | noisy).
    video_copies: int = 1
    # None when the stage draws its noise levels as flow matching does, so
    # train_timestep_range applies; else what it draws instead (preflight refuses the key).
    timestep_range_refusal: str | None = None
    # None when a LoRA run (lora_rank > 0) may train the stage; else why not.
    lora_refusal: str | None = "it is not built for one"
    # Arguments (null by default) that only this stage reads: another stage warns when set.
    own_keys: tuple[str, ...] = ()
    # The health gate (trainer.runtime.health): whether it watches the validation samples for a
    # collapse (a stage that starts from a trained model), and the critic's loss the stage
    # logs as critic_loss_rel.
    health_watches_samples: bool = False
    health_watches_critic: bool = False

    def memory_roles(self, use_ema: bool, args=None) -> tuple[MemoryRole, ...]:
        """The models one GPU holds for a step (trainer.checks.memory); `args`, the run's
        arguments where known (None: the stage's default roles)."""
        return (MemoryRole("transformer", True, use_ema),)

    def sampling(self, args) -> SamplingPlan:
        """The sampler of the stage's model and its settings for these arguments."""
        return SamplingPlan("trainer.diffusion.sampling:sample_fm", args.validation_steps,
                            args.validation_guidance, args.train_timestep_shift)

    def check(self, args, family, config: dict[str, Any]) -> None:
        """Raise trainer.config.schema.ConfigError when the stage cannot run with these
        arguments (warn where harmless); `family` and its `config` are the run's model's."""

    def null_caption_uses(self, args) -> list[str]:
        """What in the stage reads the empty caption's embedding beyond caption dropout, each
        with the setting that removes the need."""
        return []

    def frozen_roles(self, args) -> dict[str, tuple[str, str, str]]:
        """role -> (source path, weights, the key naming the path) of the roles the run keeps
        out of its checkpoints (trainer.checkpoint.frozen_roles)."""
        return {}

    def read_weight_keys(self, args) -> tuple[WeightKey, ...]:
        """The weight keys a warm start of this run reads."""
        return tuple(key for key in self.weight_keys if key.read(args))

    # --- the torch half ----------------------------------------------------------------
    def build(self, args, topo):
        """The stage object (trainer.stages.base.Stage) for args on this rank."""
        return load_object(self.builder)(args, topo)

    def load_warmup_loss(self):
        """The warm-up loss function, or None when the stage has none."""
        return load_object(self.warmup_loss) if self.warmup_loss else None
