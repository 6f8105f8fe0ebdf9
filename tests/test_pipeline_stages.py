"""Uneven pipeline stages (`parallel.num_layers_in_first_pipeline_stage` / `..._last_...`), no processes started:
the global layers of each stage equal Megatron-Core's own split (`get_num_layers_to_build`,
`get_transformer_layer_offset` on the TransformerConfig the builder makes), the Hugging Face tensors of each
stage cover the checkpoint once, and a split that cannot be made is refused in one line naming the keys and
numbers. Equality of an uneven PP = 2 run with world size 1 (log-probs, loss, grad norm, parameters,
checkpoints), of its conversion and of its weight sync: tests/mrl_multiproc (the launches of
tests/test_actor_distributed.py, tests/test_convert_distributed.py, tests/test_weight_sync.py)."""

from __future__ import annotations

import re

import pytest

from megatron_rl.config import Config, ConfigError, ModelConfig, pipeline_stage_layers, validate
from megatron_rl.models.hf_mapping import HFMapping

from mrl_configs import layout, tiny_model

SPLITS = [  # (layers, PP, first, last, the layers of each stage)
    (4, 2, 3, None, (3, 1)),
    (4, 2, None, 3, (1, 3)),
    (4, 2, 1, 3, (1, 3)),
    (4, 2, None, None, (2, 2)),
    (7, 3, 1, None, (1, 3, 3)),  # the middle and the last stage share the rest
    (61, 8, 5, None, (5, 8, 8, 8, 8, 8, 8, 8)),  # DeepSeek-V3: 61 layers on PP 8
    (61, 16, 3, 2, (3, *[4] * 14, 2)),  # DeepSeek-V3 on PP 16
    (92, 4, 22, 24, (22, 23, 23, 24)),  # GLM-4.5
]


@pytest.mark.parametrize(("layers", "pp", "first", "last", "sizes"), SPLITS)
def test_stage_layers_are_megatrons(layers: int, pp: int, first: int | None, last: int | None, sizes: tuple) -> None:
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from megatron_rl.models.builder import transformer_config

    model = ModelConfig(family="qwen3", num_layers=layers, num_experts=None)
    parallel = layout(pp=pp, first=first, last=last)
    stages = pipeline_stage_layers(model, parallel)
    assert tuple(len(s) for s in stages) == sizes
    assert [s.start for s in stages] == [sum(sizes[:i]) for i in range(pp)] and stages[-1].stop == layers
    config = transformer_config(model, parallel)
    for rank, stage in enumerate(stages):
        offset = get_transformer_layer_offset(config, None, rank)
        assert range(offset, offset + get_num_layers_to_build(config, None, rank)) == stage, (rank, stage)


@pytest.mark.parametrize(("first", "last"), [(3, None), (None, 3), (None, None)])
def test_each_stage_maps_its_own_hf_tensors(first: int | None, last: int | None) -> None:
    """Each stage's Megatron parameters (its global layers; the embedding on the first, the final norm on the
    last) name Hugging Face tensors of those layers only, and the stages together name every tensor once."""
    model = tiny_model("qwen3_moe", tie_word_embeddings=False)
    mapping = HFMapping(model)
    stages = pipeline_stage_layers(model, layout(pp=2, first=first, last=last))
    seen: list[str] = []
    for index, layers in enumerate(stages):
        names = ["embedding.word_embeddings.weight"] if index == 0 else []
        names += ["decoder.final_layernorm.weight", "output_layer.weight"] if index == len(stages) - 1 else []
        for rule in mapping.rules:
            for layer in layers if "{layer}" in rule.megatron else ():
                if rule.layers != "all" and bool(mapping.moe_layers[layer]) != (rule.layers == "moe"):
                    continue
                experts = range(model.num_experts) if "{expert}" in rule.megatron else [None]
                names += [rule.megatron.format(layer=layer, expert=e) for e in experts]
        hf = [n for name in names for n in mapping.hf_names(name)]
        held = {int(m.group(1)) for n in hf if (m := re.match(r"model\.layers\.(\d+)\.", n))}
        assert held == set(layers), (index, sorted(held), layers)
        seen += hf
    assert sorted(seen) == sorted(mapping.expected_hf_shapes())


@pytest.mark.parametrize(
    ("layers", "pp", "first", "last", "message"),
    [
        (
            4,
            2,
            3,
            2,
            "parallel.num_layers_in_first_pipeline_stage (3) + parallel.num_layers_in_last_pipeline_stage (2) must "
            "equal model.num_layers (4) with parallel.pipeline_model_parallel_size = 2",
        ),
        (
            4,
            2,
            4,
            None,
            "model.num_layers (4) - parallel.num_layers_in_first_pipeline_stage (4) leaves 0 layer(s) for the other 1 "
            "of parallel.pipeline_model_parallel_size = 2 stages: they must split evenly, at least 1 each",
        ),
        (
            4,
            3,
            2,
            2,
            "model.num_layers (4) - parallel.num_layers_in_first_pipeline_stage (2) + "
            "parallel.num_layers_in_last_pipeline_stage (2) leaves 0 layer(s) for the other 1 of "
            "parallel.pipeline_model_parallel_size = 3 stages",
        ),
        (10, 4, 3, None, "leaves 7 layer(s) for the other 3 of parallel.pipeline_model_parallel_size = 4 stages"),
        (
            4,
            1,
            None,
            2,
            "parallel.num_layers_in_last_pipeline_stage (2) splits pipeline stages, but "
            "parallel.pipeline_model_parallel_size = 1",
        ),
        (4, 2, 0, None, "parallel.num_layers_in_first_pipeline_stage = 0 is out of range; allowed: int >= 1"),
        (
            5,
            2,
            None,
            None,
            "parallel.pipeline_model_parallel_size (2) must divide model.num_layers (5), or set "
            "parallel.num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage",
        ),
    ],
)
def test_splits_that_cannot_be_made_are_refused(
    layers: int, pp: int, first: int | None, last: int | None, message: str
) -> None:
    cfg = Config(model=ModelConfig(num_layers=layers), parallel=layout(pp=pp, first=first, last=last))
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert message in str(err.value) and "\n" not in str(err.value)
