"""Who may call which endpoint of the local engine: SGLang 0.5.23's levels (`srt/utils/auth.py`
`decide_request_auth`, the levels as `srt/entrypoints/http_server.py` marks its endpoints), for the
endpoints the local engine serves.

- Paths starting with `/health`, `/ready` or `/metrics`, and every OPTIONS request: open, whatever the
  keys (probes, like sglang-router's health check, carry no key).
- The control endpoints SGLang marks `AuthLevel.ADMIN_OPTIONAL` (`ADMIN_PATHS`: weight updates and
  their groups and session, LoRA adapters, pause/continue, abort, memory, flush, the weight version,
  `/get_weights_by_name`): the admin key when the engine has one (`--admin-api-key`; the API key is then
  refused there), else the API key, else open.
- Every other endpoint (`/generate`, model and server info): the API key when the engine has one (the
  admin key does not open them), else open.

SGLang's admin-only endpoints (`ADMIN_FORCE`, its HiCache storage controls) are not served here.
A key travels as `Authorization: Bearer KEY` (the scheme in any case), compared in constant time.
"""

from __future__ import annotations

import hmac

from megatron_rl.rollout.sglang import ADMIN_PATHS

OPEN_PREFIXES = ("/health", "/ready", "/metrics")

__all__ = ["ADMIN_PATHS", "OPEN_PREFIXES", "allowed"]


def _bearer_is(header: str | None, key: str) -> bool:
    scheme, space, token = (header or "").partition(" ")
    if not space or scheme.lower() != "bearer":
        return False
    # aiohttp keeps undecodable header bytes as surrogates: compared as the bytes they were
    return hmac.compare_digest(token.encode("utf-8", "surrogateescape"), key.encode())


def allowed(method: str, path: str, authorization: str | None, api_key: str | None, admin_api_key: str | None) -> bool:
    """Whether a request may reach the endpoint at `path` (a refusal answers 401)."""
    if method == "OPTIONS" or path.startswith(OPEN_PREFIXES):
        return True
    if path in ADMIN_PATHS and admin_api_key:
        return _bearer_is(authorization, admin_api_key)
    return api_key is None or _bearer_is(authorization, api_key)
