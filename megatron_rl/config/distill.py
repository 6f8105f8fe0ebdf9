"""The `distill` section: on-policy distillation's teacher and the weight of its per-token advantage, and the
section's own rules (`check_distill`, run by `rules.check_rules`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from megatron_rl.config.errors import ConfigError
from megatron_rl.config.fields import described as _f

if TYPE_CHECKING:
    from megatron_rl.config.schema import Config


@dataclass
class DistillConfig:
    """On-policy distillation (docs/training.md): the teacher scores every sampled token; its per-token
    advantage -(log pi_student - log pi_teacher) is added, times `kl_coef`, to the objective's."""

    teacher: str | None = _f(
        None,
        "the teacher: a Hugging Face folder, served by a second local engine the run starts (at the folder's "
        "dtype); null, with teacher_urls empty = no distillation",
    )
    teacher_urls: list = _f([], "instead of teacher: SGLang servers or a router serving the teacher (http://host:port)")
    api_key: str | None = _f(
        None, "the key of the teacher's engine; null = rollout.api_key (else a random one for a local teacher)"
    )
    tokenizer: str | None = _f(
        None,
        "the teacher's tokenizer folder, refused unless it equals the student's (vocabulary and special tokens); "
        "null = teacher (teacher_urls need it)",
    )
    kl_coef: float = _f(
        1.0,
        "weight of the distillation advantage -(log pi - log pi_teacher) of each generated token, added to the "
        "objective's reward advantage (algorithm.name = opd: the only advantage)",
        gt=0,
    )
    mode: Literal["reverse_kl"] = _f(
        "reverse_kl", "reverse_kl = the per-token reverse KL of the sampled tokens (its k1 estimate) as the reward"
    )

    @property
    def enabled(self) -> bool:
        """A teacher is configured: the run distils."""
        return bool(self.teacher or self.teacher_urls)


def check_distill(cfg: Config) -> None:
    """The `distill` section against itself and the objective; ConfigError naming the keys."""
    distill, alg = cfg.distill, cfg.algorithm
    if alg.name == "opd" and not distill.enabled:
        raise ConfigError("algorithm.name = 'opd' distils from a teacher: set distill.teacher or distill.teacher_urls")
    if not distill.enabled:
        for key in ("api_key", "tokenizer"):
            if getattr(distill, key):
                raise ConfigError(
                    f"distill.{key} is set but there is no teacher (distill.teacher, distill.teacher_urls)"
                )
        return
    if distill.teacher and distill.teacher_urls:
        raise ConfigError("distill.teacher (a folder the run serves) and distill.teacher_urls: give one of them")
    for i, url in enumerate(distill.teacher_urls):
        if not (isinstance(url, str) and url.startswith(("http://", "https://")) and url.split("://", 1)[1]):
            raise ConfigError(f"distill.teacher_urls[{i}] = {url!r} is not an http:// or https:// address")
    if distill.teacher_urls and not distill.tokenizer:
        raise ConfigError(
            "distill.teacher_urls need distill.tokenizer (the teacher's tokenizer folder), which is checked equal "
            "to the student's"
        )
    if alg.kl_in_reward:
        raise ConfigError(
            "distill (a teacher) gives per-token advantages, which algorithm.kl_in_reward = true (one penalised "
            "reward per trajectory) does not take; use the KL in the loss (kl_in_reward = false)"
        )
    if alg.advantage_estimator == "gae":
        raise ConfigError(
            "distill (a teacher) with algorithm.advantage_estimator = 'gae': GAE's advantages are computed after the "
            "critic's values, on every trainer rank, where the teacher's scores are not; not built: use another "
            "estimator with distill, or no teacher with gae"
        )
    if alg.ratio_level == "sequence":
        raise ConfigError(
            "distill (a teacher) gives each token its own advantage, but algorithm.ratio_level = 'sequence' (GSPO) "
            "has one advantage per sequence; use algorithm.name = gspo_token (ratio_level = 'sequence_token')"
        )
