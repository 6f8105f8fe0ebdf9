"""The three weight-sync modes behind `megatron_rl.rollout.weight_sync.make_weight_sync`."""
