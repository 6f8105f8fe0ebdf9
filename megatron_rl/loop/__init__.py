"""The rollout side of an RL step, on rank 0 (`megatron_rl.trainer`): collection, evaluation, the rollout driver."""
