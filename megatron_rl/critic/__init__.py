"""The critic of PPO: the value model (the policy's backbone with a scalar head), its initialisation, and
`MegatronCritic`, the value model with its optimizer as the trainer runs it."""
