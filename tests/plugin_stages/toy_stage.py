"""A stage defined entirely outside relay's package, the torch-free half: flow matching whose
loss is taken on the clean sample the predicted velocity implies, x0 = x_t - sigma v, with
sigma uniform on [0, 1]. It exists to prove that a stage plugs in through its declaration alone
(no product file names it): a run names it as

    stage: plugin_stages.toy_stage:TOY      (tests/ on PYTHONPATH)

and relay checks it on the login side through this module (which imports no torch), builds it
and warms it up through the import strings below (tests/plugin_stages/toy_x0.py).
"""

from __future__ import annotations

from trainer.config.schema import ConfigError
from trainer.stages.declaration import StageDeclaration


class ToyX0(StageDeclaration):
    name = "toy_x0"
    builder = "plugin_stages.toy_x0:build"
    warmup_loss = "plugin_stages.toy_x0:warmup_loss"
    lora_refusal = "the toy trains every weight"

    def check(self, args, family, config) -> None:
        if args.loss_weighting != "none":
            raise ConfigError(f"stage {args.stage} weighs every noise level alike: set "
                              f"loss_weighting: none (got {args.loss_weighting}).")


TOY = ToyX0()
