"""The pieces of the RL loop (`megatron_rl.trainer`): model source, rollout collection, metrics, loop state."""
