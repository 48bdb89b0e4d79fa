"""Lossless verification: the greedy rule and the standard speculative-sampling rejection rule.

Given ``k`` drafted tokens per batch row with the drafter's distributions ``q [B, k, V]`` and the
verifier's distributions ``p [B, k + 1, V]`` at the same positions (``p[:, i]`` predicts draft ``i``;
``p[:, k]`` the token after the last draft), each row independently:

* greedy: accept the longest prefix where the draft equals ``argmax p``; the next token is
  ``argmax p`` at the first mismatch (or at row ``k``, the bonus token);
* sampling (Leviathan et al. 2211.17192, Chen et al. 2302.01318): accept draft ``i`` with
  probability ``min(1, p_i(d_i) / q_i(d_i))``; at the first rejection sample from
  ``norm(max(p_i - q_i, 0))``; when all are accepted sample the bonus token from ``p_k``.
  The emitted tokens are then distributed exactly as sampling from ``p`` one token at a time.

Logits processors (temperature, top-k/top-p, penalties) are applied to both ``p`` and ``q`` with the
same prefix a plain decoding step would give them, so the rule targets the processed distribution.
"""

from __future__ import annotations

import torch


def process(logits_processor, prefix: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Processed logits ``[T, V]`` for rows ``logits [T, V]`` whose row ``j`` follows ``prefix [n + j]``.

    ``prefix`` is 1-D and holds at least ``len(prefix) - T + 1`` tokens before row 0; row ``j`` is
    processed with ``prefix[: len(prefix) - T + 1 + j]`` (what plain decoding would pass).
    """
    logits = logits.float()
    if not logits_processor:
        return logits
    T, n = logits.shape[0], prefix.shape[0] - logits.shape[0] + 1
    rows = [logits_processor(prefix[None, : n + j], logits[j : j + 1].clone())[0] for j in range(T)]
    return torch.stack(rows)


def accept_greedy(drafts: torch.Tensor, p_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """drafts ``[B, k]``, verifier logits ``[B, k + 1, V]`` -> (accepted counts ``[B]``, next tokens ``[B]``)."""
    target = p_logits.argmax(dim=-1)  # [B, k + 1]
    k = drafts.shape[1]
    n = (drafts == target[:, :k]).long().cumprod(dim=1).sum(dim=1)  # length of the agreeing prefix
    return n, target.gather(1, n[:, None])[:, 0]


def accept_sample(drafts: torch.Tensor, q: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """drafts ``[B, k]``, drafter probs ``q [B, k, V]``, verifier probs ``p [B, k + 1, V]`` -> (accepted ``[B]``, next ``[B]``).

    Each row draws its own uniforms and residual sample, in row order."""
    if drafts.shape[1] == 0:  # nothing drafted: a plain sampling step
        return drafts.new_zeros(drafts.shape[0]), torch.multinomial(p[:, 0], 1)[:, 0]
    out = [accept_sample_row(drafts[b], q[b], p[b]) for b in range(drafts.shape[0])]
    return (torch.tensor([o[0] for o in out], dtype=torch.long, device=drafts.device),
            torch.tensor([o[1] for o in out], dtype=torch.long, device=drafts.device))


def accept_sample_row(drafts: torch.Tensor, q: torch.Tensor, p: torch.Tensor) -> tuple[int, int]:
    """drafts ``[k]``, drafter probs ``q [k, V]``, verifier probs ``p [k + 1, V]`` -> (accepted, next token)."""
    k = drafts.shape[0]
    rows = torch.arange(k, device=drafts.device)
    ratio = p[rows, drafts] / q[rows, drafts]  # q > 0: the drafts were sampled from q
    rejected = (torch.rand(k, device=p.device) >= ratio).nonzero()
    if not rejected.numel():
        return k, int(torch.multinomial(p[k], 1))
    n = int(rejected[0, 0])
    residual = (p[n] - q[n]).clamp(min=0)
    if float(residual.sum()) <= 0:  # p == q up to rounding: the residual is empty, p itself is exact
        residual = p[n]
    return n, int(torch.multinomial(residual / residual.sum(), 1))


def pick(probs_or_logits: torch.Tensor, do_sample: bool) -> torch.Tensor:
    """One token per row from ``[B, V]``: argmax of logits (greedy) or a sample from probabilities -> ``[B]``."""
    if do_sample:
        return torch.multinomial(probs_or_logits, 1)[:, 0]
    return probs_or_logits.argmax(dim=-1)
