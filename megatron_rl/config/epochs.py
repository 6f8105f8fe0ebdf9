"""`train.epochs`: a run's steps from the size of its data (verl's `trainer.total_epochs`).

The rule: `train.epochs = E` (which implies `train.steps = null`; both given is refused, naming both keys)
over P usable training prompts, D of them drawn per step, is ceil(E x P / D) steps: the fewest that draw
every prompt E times. D is `train.prompts_per_step` (SFT), or what an RL step's generation round draws
(`derived.prompts_per_round`: times `algorithm.oversample_factor` with dynamic sampling; a step that needs
more rounds draws more). With several train files P counts them all; a weighted mixture draws each file by
its weight, so a file goes through more or fewer than E passes.

A stage derives the count once its data is read, on every rank before torch.distributed starts (the run
folder's resume and the learning-rate schedule need it), and runs on the resolved configuration: train.steps
the count, train.epochs 0, so that RUN_DIR/config.yaml runs again as it ran. The learning-rate schedule, the
progress line and its ETA, the checkpoint of the last step and a resume all read train.steps from there. The
sampler (`megatron_rl.data.sampler`) draws epoch by epoch, each in a fresh seeded order, a step crossing an
epoch's end without dropping a prompt; its position is in every checkpoint.
"""

from __future__ import annotations

import dataclasses

from megatron_rl.config.errors import ConfigError
from megatron_rl.config.rules import check_step_rules
from megatron_rl.config.schema import Config


def epoch_steps(epochs: int, prompts: int, per_step: int) -> int:
    """ceil(epochs x prompts / per_step): the fewest steps of `per_step` prompts that draw each prompt `epochs` times."""
    if epochs < 1 or prompts < 1 or per_step < 1:
        raise ValueError(f"epoch_steps: epochs {epochs}, prompts {prompts} and per_step {per_step} must be >= 1")
    return -(-epochs * prompts // per_step)


def with_epoch_steps(cfg: Config, prompts: int, per_step: int) -> tuple[Config, str]:
    """`cfg` with train.steps derived from train.epochs and train.epochs 0, its step-count rules checked
    (ConfigError naming the derived count), and the line the stage prints at start-up; `cfg` and "" without
    train.epochs. `prompts`: the usable training prompts; `per_step`: those one step draws."""
    train = cfg.train
    if not train.epochs:
        return cfg, ""
    steps = epoch_steps(train.epochs, prompts, per_step)
    resolved = dataclasses.replace(cfg, train=dataclasses.replace(train, steps=steps, epochs=0))
    try:
        check_step_rules(resolved)
    except ConfigError as err:
        raise ConfigError(f"{err} (train.steps = {steps} from train.epochs = {train.epochs})") from None
    line = (
        f"train.epochs = {train.epochs}: {steps} steps (ceil({train.epochs} x {prompts} usable prompts / "
        f"{per_step} per step))"
    )
    return resolved, line
