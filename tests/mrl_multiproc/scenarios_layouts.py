"""The layouts that the other scenarios leave out, against world size 1, in tests/test_actor_distributed.py's
launches: data parallelism alone (DP 2); expert-TP other than TP with EP 1, both ways (ETP 2 with TP 1: the
dense part data-parallel, every expert split over both ranks; TP 2 with ETP 1: every expert whole on both
ranks, which route their own halves of the tokens); PP 2 split unevenly, 3 + 1 layers
(`parallel.num_layers_in_first_pipeline_stage`), which also loads the world-size-1 checkpoint (model and
optimizer state by global layer) and repeats its next two updates; PP 2 x EP 2 and TP 2 x EP 2 x ETP 1 on 4 ranks.

Each runs `check_layout_briefly` (scenarios_cp.py) against `w1_reference`: log-probs, entropy, recorded
routing and R3 log-probs, padded and packed, then two GRPO updates with R2 replay (loss, grad norm, tokens;
the parameters after them). TP (with SP, which Megatron requires for MoE training under TP), EP, PP, CP,
TP x EP and TP x CP are the other scenarios' (`w2_tp2_sp`, `w2_ep2_alltoall`, `w2_pp2`, `w2_cp2`,
`w4_tp2_ep2`, `w4_tp2_cp2`). With EP 1 and expert-TP != TP, Megatron-Core 0.16 reduced the experts'
gradients over the dense data-parallel group (`models.builder.reduce_experts_over_expert_data_parallel`):
the grad norm and the parameters were off.
"""

from __future__ import annotations

from megatron.core import parallel_state as ps
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_rl.actor.actor import MegatronActor
from megatron_rl.actor.batch import ActorBatch

from mrl_configs import layout
from mrl_multiproc.scenarios_actor import check_w1_checkpoint_resumes
from mrl_multiproc.scenarios_cp import check_layout_briefly


def w2_dp2(ctx) -> None:  # noqa: ANN001
    check_layout_briefly(ctx, layout())


def w2_etp2(ctx) -> None:  # noqa: ANN001
    check_layout_briefly(ctx, layout(etp=2))


def w2_tp2_etp1(ctx) -> None:  # noqa: ANN001
    check_layout_briefly(ctx, layout(tp=2, sp=True, etp=1))


def w2_pp2_uneven(ctx) -> None:  # noqa: ANN001
    parallel = layout(pp=2, first=3)

    def resumes_from_w1(actor: MegatronActor, batch: ActorBatch) -> None:
        layers = [m.layer_number - 1 for c in actor.chunks for m in c.modules() if isinstance(m, TransformerLayer)]
        assert layers == ([0, 1, 2] if ps.is_pipeline_first_stage() else [3]), layers
        check_w1_checkpoint_resumes(ctx, actor, batch, f"layout {parallel}")

    check_layout_briefly(ctx, parallel, then=resumes_from_w1)


def w4_pp2_ep2(ctx) -> None:  # noqa: ANN001
    check_layout_briefly(ctx, layout(pp=2, ep=2))


def w4_tp2_ep2_etp1(ctx) -> None:  # noqa: ANN001
    check_layout_briefly(ctx, layout(tp=2, sp=True, ep=2, etp=1))
