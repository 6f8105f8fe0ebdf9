"""Next-token sampling with SGLang's log-prob convention.

The log-prob returned for a sampled token is `log_softmax(logits / T)` taken before top-p/top-k
filtering; for greedy rows (T == 0) it is the raw `log_softmax(logits)`. Top-k keeps the k most
likely tokens (k <= 0 keeps all); top-p keeps the smallest prefix of the sorted distribution whose
mass reaches p (a token is dropped when the mass before it already exceeds p), as SGLang does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

GREEDY_EPS = 1e-6  # SGLang treats temperatures below this as greedy


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of `logits` ([rows, vocab]); returns (token ids, their log-probs).

    `temperature`, `top_p` (float) and `top_k` (long) hold one value per row, on the logits' device.
    `generator`: one for all rows, or one per row (a request's own seeded stream, `sampling_seed`).
    """
    logits = logits.float()
    greedy = temperature < GREEDY_EPS
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature).unsqueeze(1)
    logprobs = torch.log_softmax(scaled, dim=-1)
    n_greedy = int(greedy.sum())
    if n_greedy == len(greedy):
        tokens = torch.argmax(logits, dim=-1)
    else:
        rows = (~greedy).nonzero().squeeze(1)
        if isinstance(generator, Sequence):
            generator = [generator[i] for i in rows.tolist()]
        probs = logprobs[rows].exp()
        k, p = top_k[rows], top_p[rows]
        vocab = probs.shape[1]
        if bool(((k > 0) & (k < vocab)).any()) or bool((p < 1.0).any()):
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            rank = torch.arange(vocab, device=probs.device).unsqueeze(0)
            k_eff = torch.where(k > 0, k, torch.full_like(k, vocab)).unsqueeze(1)
            drop = rank >= k_eff
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            drop |= mass_before > p.unsqueeze(1)
            picked = order.gather(1, _inverse_cdf(sorted_probs.masked_fill(drop, 0.0), generator)).squeeze(1)
        else:
            picked = _inverse_cdf(probs, generator).squeeze(1)
        if n_greedy:
            tokens = torch.argmax(logits, dim=-1).index_copy(0, rows, picked)
        else:
            tokens = picked
    token_logprobs = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    return tokens, token_logprobs


def _inverse_cdf(weights: torch.Tensor, generator: torch.Generator | Sequence[torch.Generator] | None) -> torch.Tensor:
    """One index per row drawn with probability proportional to `weights` ([rows, n] >= 0): [rows, 1].

    Inverse-transform sampling needs one uniform number per row, where `torch.multinomial` draws one
    per vocabulary entry; a zero weight is never picked. A list of generators draws row i's number
    from generator i.
    """
    cdf = weights.double().cumsum(dim=-1)
    if isinstance(generator, Sequence):
        draws = [torch.rand(1, generator=g, device=weights.device, dtype=torch.float64) for g in generator]
        u = torch.cat(draws).view(-1, 1)
    else:
        u = torch.rand(weights.shape[0], 1, generator=generator, device=weights.device, dtype=torch.float64)
    index = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)
    return index.clamp_(max=weights.shape[1] - 1)
