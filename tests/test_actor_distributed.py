"""The Megatron actor across layouts: one gloo launch per world size, shared with the other two layout modules (tests/mrl_multiproc/scenarios_actor.py).

Every layout first checks the actor's log-prob path (hidden states, no logits) against the logits
path on the same weights: log-probs, entropy and every parameter's gradient within 1e-5 (also with
tied embeddings at TP=1, TP=2 and PP=2). The world-size-1 launch computes the references (log-probs
and entropy against a plain full-vocab log_softmax, recorded routing, parameters after optimizer
steps, a checkpoint); TP=2 with SP,
EP=2 (alltoall), PP=2 and TP=2 x EP=2 must reproduce them: log-probs/entropy within 1e-5,
parameters after two Adam steps within 1e-6, routing replay exact, checkpoints loadable across layouts
(also across vocabulary paddings: TP1 <-> TP2, model and optimizer tensors bit for bit) and
`checkpoint.load` taking both a full and a weights-only checkpoint. Every layout (and PP = 2 with the
allgather dispatcher, and activation recompute) repeats this with packed micro-batches
(`train.micro_batch_tokens`, THD): log-probs, entropy, R2 routing and R3 log-probs against the same
references, and two packed updates from the world-size-1 checkpoint against its padded parameters.
Context parallelism on the CPU (tests/mrl_multiproc/scenarios_cp.py): CP=2 does all of the above,
and GSPO with R3, SFT and DeepSeek-V3's multi-latent attention, padded and packed; TP=2 x CP=2 the
log-probs, routing and two updates. The remaining layouts (tests/mrl_multiproc/scenarios_layouts.py):
DP 2, expert-TP 2 with TP 1, TP 2 with expert-TP 1 (EP 1 both), PP 2 split 3 + 1 layers (which also resumes
from the world-size-1 checkpoint), PP 2 x EP 2 and TP 2 x EP 2 x expert-TP 1 reproduce the log-probs, routing
and two updates the same way. PPO's critic (tests/mrl_multiproc/scenarios_critic.py): its values and two
updates of the value loss under TP 2 with SP, PP 2 and EP 2, packed, against world size 1's. The run folder's checkpoints
(manifest checksums computed while writing, on one rank and on two; resume past damage that keeps
a file's size) are tests/test_checkpoint_integrity.py's subject, run here to share the launches.
"""

from __future__ import annotations

import pytest

from mrl_multiproc.launcher import ModuleLaunches, ScenarioLaunches, scenario_test

pytestmark = pytest.mark.e2e  # every test here launches (or uses a launch of) an engine or ranks

WORLDS = {
    1: [
        "w1_reference",
        "w1_cp_references",
        "w1_hidden_path_tied",
        "w1_recompute_replay",
        "w1_sigmoid_replay",
        "w1_checkpoint_load_both_kinds",
        "w1_reference_policy_kl",
        "w1_kl_gradient_by_hand",
        "w1_reject_reference",
        "w1_shards_hashed_while_written_and_damage_falls_back",
        "w1_lora_reference",
        "w1_grouped_experts",
        "w1_critic_reference",
    ],
    2: [
        "w2_reject_dp2",
        "w2_tp2_sp",
        "w2_ep2_alltoall",
        "w2_sigmoid_replay_ep2",
        "w2_pp2",
        "w2_pp2_allgather",
        "w2_pp2_hidden_path_tied",
        "w2_tp2_hidden_path_tied",
        "w2_pp2_recompute_replay",
        "w2_bad_layout",
        "w2_vocab_padding_tp1_tp2_tp1",
        "w2_every_ranks_shard_is_in_the_manifest",
        "w2_scattered_batch",
        "w2_lora_tp2_sp",
        "w2_lora_ep2",
        "w2_lora_pp2",
        "w2_grouped_experts_ep2",
        "w2_grouped_experts_etp2",
        "w2_cp_reductions",
        "w2_cp2",
        "w2_cp2_gspo_sft_mla",
        "w2_dp2",
        "w2_etp2",
        "w2_tp2_etp1",
        "w2_pp2_uneven",
        "w2_critic_tp2_sp",
        "w2_critic_pp2",
        "w2_critic_ep2",
    ],
    4: [
        "w4_tp2_ep2",
        "w4_tp2_cp2",
        "w4_pp2_ep2",
        "w4_tp2_ep2_etp1",
        "w4_load_pp2_checkpoint",
        "w4_scattered_batch",
    ],
}


@pytest.fixture(scope="module")
def launches(layout_launches: ScenarioLaunches) -> ModuleLaunches:
    """This module's part of the layout launches it shares with two others (tests/conftest.py)."""
    return layout_launches.view("scenarios_actor")


test_scenario = scenario_test(WORLDS)
