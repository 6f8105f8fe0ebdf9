"""config.json <-> `model` for DeepSeek sparse attention: DeepSeek-V3.2 (`deepseek_v32`) and GLM-5 (`glm_moe_dsa`).

Both are DeepSeek-V3's MLA and sigmoid-routed MoE (`hf_config_sigmoid` reads those keys) plus a lightning indexer in
every layer (`models.dsa_attention`): `index_n_heads` heads of `index_head_dim` channels score each query against
every earlier key, and the query attends only the `index_topk` best. What else the two configs say is checked here:
- `layer_types`: every layer `indexed_attention`; `mlp_layer_types`: `dense` for the first `first_k_dense_replace`
  layers, `sparse` after; `mlp_bias`: false.
- GLM-5's `indexer_types` (or the `index_topk_pattern` / `index_topk_freq` / `index_skip_topk_offset` it is derived
  from, as transformers derives it): every layer `full`. A `shared` layer reuses an earlier layer's top-k, a
  dependency across layers (and pipeline stages) this stack does not build: refused by name.
- `indexer_rope_interleave` (GLM-5's Hub files): the indexer's RoPE layout is the family's (GLM-5 interleaved,
  DeepSeek-V3.2 half-split), as transformers computes it.
"""

from __future__ import annotations

from typing import Any

from megatron_rl.models.hf_config import hf_bool, hf_int, refuse

DSA_FAMILIES = ("deepseek_v32", "glm_moe_dsa")
# The keys this module reads (beyond DeepSeek-V3's).
DSA_KEYS = frozenset(
    {"index_n_heads", "index_head_dim", "index_topk", "layer_types", "mlp_layer_types", "mlp_bias",
     "indexer_rope_interleave"}
)  # fmt: skip
GLM_DSA_KEYS = frozenset({"indexer_types", "index_topk_pattern", "index_topk_freq", "index_skip_topk_offset"})


def indexer_rope_interleaved(family: str) -> bool:
    """Whether the family's indexer rotates interleaved pairs (GLM-5) rather than the two halves (DeepSeek-V3.2)."""
    return family == "glm_moe_dsa"


def _indexer_types(hf: dict[str, Any], source: str, layers: int) -> list[Any]:
    """GLM-5's per-layer indexer modes, derived as transformers' GlmMoeDsaConfig derives them when unset."""
    if hf.get("indexer_types") is not None:
        return hf["indexer_types"]
    pattern = hf.get("index_topk_pattern")
    if pattern is not None:
        refuse(isinstance(pattern, (str, list)), source, f"index_topk_pattern = {pattern!r} is not a string or list")
        return [{"F": "full", "S": "shared"}.get(c, c) for c in pattern] if isinstance(pattern, str) else pattern
    freq = hf_int(hf, source, "index_topk_freq", default=1)
    offset = hf_int(hf, source, "index_skip_topk_offset", default=2, minimum=0)
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]


def dsa_fields(hf: dict[str, Any], family: str, source: str, layers: int, dense: int) -> dict[str, Any]:
    """The indexer's `model` fields of a deepseek_v32 / glm_moe_dsa config.json with `layers` layers, the first
    `dense` of them with a dense MLP; every other DSA key checked."""
    kinds = hf.get("layer_types")
    refuse(
        kinds is None or kinds == ["indexed_attention"] * layers,
        source,
        f"layer_types = {kinds!r}: needs 'indexed_attention' in each of the {layers} layers",
    )
    mlp = hf.get("mlp_layer_types")
    want = ["dense"] * dense + ["sparse"] * (layers - dense)
    refuse(mlp is None or mlp == want, source, f"mlp_layer_types = {mlp!r} contradicts first_k_dense_replace = {dense}")
    refuse(not hf_bool(hf, source, "mlp_bias", default=False), source, "mlp_bias = true is not supported")
    interleaved = indexer_rope_interleaved(family)
    refuse(
        hf.get("indexer_rope_interleave", interleaved) is interleaved,
        source,
        f"indexer_rope_interleave = {hf.get('indexer_rope_interleave')!r}: {family}'s indexer rotates "
        f"{'interleaved pairs' if interleaved else 'the two halves'}",
    )
    if family == "glm_moe_dsa":
        types = _indexer_types(hf, source, layers)
        refuse(
            isinstance(types, list) and len(types) == layers and all(t in ("full", "shared") for t in types),
            source,
            f"indexer_types = {types!r} is not a list of {layers} of ['full', 'shared']",
        )
        shared = [i for i, t in enumerate(types) if t == "shared"]
        refuse(
            not shared,
            source,
            f"indexer_types: layer {shared[0] if shared else ''} is 'shared' (reuses an earlier layer's top-k), which "
            "is not supported: every layer 'full'",
        )
    return dict(
        dsa_index_n_heads=hf_int(hf, source, "index_n_heads"),
        dsa_index_head_dim=hf_int(hf, source, "index_head_dim"),
        dsa_index_topk=hf_int(hf, source, "index_topk"),
    )


def dsa_hf_config(model: Any) -> dict[str, Any]:
    """The indexer's config.json keys of `model`."""
    hf: dict[str, Any] = dict(
        index_n_heads=model.dsa_index_n_heads,
        index_head_dim=model.dsa_index_head_dim,
        index_topk=model.dsa_index_topk,
        mlp_bias=False,
    )
    if model.family == "glm_moe_dsa":
        hf["indexer_types"] = ["full"] * model.num_layers
    return hf
