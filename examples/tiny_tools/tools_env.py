"""The tiny_tools environment: the built-in calculator tool plus a turn reward for a well-formed call.

`env.type: examples.tiny_tools.tools_env:TinyToolsEnv` (the repository root is on the path when
`megatron-rl` runs from it, as run.sh does). The episode is the calculator's (`megatron_rl.envs`):
a turn with `<tool_call>` gets one tool message with the result (or an error the model can read),
a turn without a call ends it. The first turn earns `TOOL_CALL_REWARD` when it holds calls and the
calculator answered every one (no malformed call, unknown tool, error or timeout); that turn reward
is what `algorithm.turn_credit=per_turn` adds to the outcome (the rule reward of the final answer).
"""

from __future__ import annotations

from megatron_rl.envs import Observation, Turn
from megatron_rl.envs.calculator import CalculatorEnv

TOOL_CALL_REWARD = 0.1


class TinyToolsEnv(CalculatorEnv):
    """`calculator`, with `TOOL_CALL_REWARD` for a first turn of well-formed, answered calls."""

    def step(self, turn: Turn) -> Observation:
        obs = super().step(turn)
        if turn.index == 0 and obs.events and all(event == "tool_call" for event in obs.events):
            obs.reward = TOOL_CALL_REWARD
        return obs
