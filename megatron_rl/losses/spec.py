"""The loss spec: what the policy loss computes, built and validated once per run (imports nothing).

The tuples below are the one list of each choice. `megatron_rl.config` types the `algorithm`
section's fields with them (so OmegaConf, `megatron-rl config --reference` and the
config reference in docs/configuration.md show them) and takes its bounds from `BOUNDS`; the loss modules dispatch on the
same names. Adding a choice means adding its name here and its code in the module that computes it.
This module imports neither torch nor the rest of the package, so the config stays cheap to import.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass

RATIO_LEVELS = ("token", "sequence", "sequence_token")
GATES = ("clip", "soft")
AGGREGATION_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3")
IS_MODES = ("none", "truncate", "mask", "reject")
# sequence = the product of the token weights (verl's "sequence"), geometric = their geometric mean
IS_LEVELS = ("token", "sequence", "geometric")

CHOICES: dict[str, tuple[str, ...]] = {
    "ratio_level": RATIO_LEVELS,
    "gate": GATES,
    "loss_agg_mode": AGGREGATION_MODES,
    "kl_estimator": KL_ESTIMATORS,
    "is_correction": IS_MODES,
    "is_level": IS_LEVELS,
}

# Numeric bounds of each field, keyed as megatron_rl.config's field metadata (ge, gt, le, lt).
BOUNDS: dict[str, dict[str, float]] = {
    "clip_eps_low": {"ge": 0, "lt": 1},
    "clip_eps_high": {"ge": 0},
    "dual_clip_c": {"gt": 1},
    "sapo_tau_pos": {"gt": 0},
    "sapo_tau_neg": {"gt": 0},
    "max_log_ratio": {"gt": 0},
    "kl_coef": {"ge": 0},
    "entropy_coef": {"ge": 0},
    "is_threshold": {"gt": 0},
    "is_mask_min": {"ge": 0},
    "is_mask_max": {"gt": 0},
}

# Aggregations that keep a ratio level's meaning where not all do: a sequence ratio is one number
# per response, so only the per-sequence mean weights every response equally (as GSPO defines it).
RESTRICTED_AGGREGATIONS: dict[str, tuple[str, ...]] = {"sequence": ("seq-mean-token-mean",)}

_COMPARISONS = {
    "ge": (operator.ge, ">="),
    "gt": (operator.gt, ">"),
    "le": (operator.le, "<="),
    "lt": (operator.lt, "<"),
}


@dataclass(frozen=True)
class LossSpec:
    """Every setting `megatron_rl.losses.policy_loss` reads; the fields are those of the config's
    `algorithm` section with the same names (see docs/configuration.md).

    Construction validates the choices (`CHOICES`), the bounds (`BOUNDS`) and the combinations that
    cannot run, raising ValueError that names the key as `algorithm.<field>` and what is allowed.
    """

    ratio_level: str
    gate: str
    clip_eps_low: float
    clip_eps_high: float
    dual_clip_c: float | None
    sapo_tau_pos: float
    sapo_tau_neg: float
    loss_agg_mode: str
    max_log_ratio: float
    kl_coef: float
    kl_estimator: str
    entropy_coef: float
    is_correction: str
    is_level: str
    is_threshold: float
    is_mask_min: float
    is_mask_max: float

    @classmethod
    def from_section(cls, section: object) -> LossSpec:
        """The spec of an `algorithm` section (any object with these fields as attributes)."""
        names = [fld.name for fld in dataclasses.fields(cls)]
        missing = [name for name in names if not hasattr(section, name)]
        if missing:
            raise TypeError(f"LossSpec.from_section: {type(section).__name__} has no attribute(s) {missing}")
        return cls(**{name: getattr(section, name) for name in names})

    def __post_init__(self) -> None:
        for name, choices in CHOICES.items():
            value = getattr(self, name)
            if value not in choices:
                raise ValueError(f"algorithm.{name} = {value!r} is not allowed; allowed: {list(choices)}")
        for name, bounds in BOUNDS.items():
            value = getattr(self, name)
            if value is None and name == "dual_clip_c":  # null = dual clip off
                continue
            allowed = "float " + ", ".join(f"{_COMPARISONS[k][1]} {bound}" for k, bound in bounds.items())
            numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not numeric or not all(_COMPARISONS[k][0](value, bound) for k, bound in bounds.items()):
                raise ValueError(f"algorithm.{name} = {value!r} is out of range; allowed: {allowed}")
        aggregations = RESTRICTED_AGGREGATIONS.get(self.ratio_level, AGGREGATION_MODES)
        if self.loss_agg_mode not in aggregations:
            raise ValueError(
                f"algorithm.loss_agg_mode = {self.loss_agg_mode!r} is not supported with "
                f"algorithm.ratio_level = {self.ratio_level!r}; allowed: {list(aggregations)}"
            )
        if self.gate == "soft" and self.ratio_level != "token":
            raise ValueError(
                f"algorithm.gate = 'soft' (SAPO) needs algorithm.ratio_level = 'token', not {self.ratio_level!r}"
            )
        if not self.is_mask_min < self.is_mask_max:
            raise ValueError(
                f"algorithm.is_mask_min ({self.is_mask_min}) must be below algorithm.is_mask_max ({self.is_mask_max})"
            )
