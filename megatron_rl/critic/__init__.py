"""The critic of PPO: the value model (the policy's backbone with a scalar head) and its initialisation."""
