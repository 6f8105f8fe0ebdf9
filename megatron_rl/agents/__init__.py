"""Black-box agents trained through an OpenAI-compatible gateway (`env.type=agent`)."""

from megatron_rl.agents.gateway import MODEL, Gateway
from megatron_rl.agents.openai_chat import ChatRequest, RequestError, parse_request
from megatron_rl.agents.runner import AgentEpisode, AgentError, row_json, run_agent_episodes
from megatron_rl.agents.segments import EpisodeRecord

__all__ = [
    "MODEL",
    "AgentEpisode",
    "AgentError",
    "ChatRequest",
    "EpisodeRecord",
    "Gateway",
    "RequestError",
    "parse_request",
    "row_json",
    "run_agent_episodes",
]
