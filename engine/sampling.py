"""Turning logits into tokens: temperature, top-k, top-p and seeded draws.

Contract: every random draw of a request comes from that request's own
``torch.Generator`` (CPU), seeded from ``SamplingParams.seed``, so a request's
sampled output depends only on its seed, its logits and the order of its own
draws, never on which other requests share the batch. Greedy requests
(``temperature == 0``) never draw and never need a generator.

The target distribution of a sampled request is ``target_probs(logits)``:
softmax of ``logits / temperature`` restricted to the top-k tokens and then to
the smallest top-p nucleus, renormalised. Speculative sampling (verify.py) and
MTP drafting (mtp_drafter.py) both use this one function, so a draft's
distribution and the target are shaped the same way.
"""

from __future__ import annotations

import torch

from metrale.engine.api import SamplingParams


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for one request, on the CPU (or on ``device``, where the
    device step draws); an unseeded request gets a fresh non-deterministic
    seed."""
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def target_probs(
    logits: torch.Tensor,  # [num_rows, vocab]
    params: SamplingParams,
) -> torch.Tensor:  # [num_rows, vocab] float32 on the CPU, rows sum to 1
    """The distribution a sampled request draws from, one row per logits row."""
    assert not params.greedy, "greedy requests take the argmax, not a distribution"
    scaled = logits.detach().to(device="cpu", dtype=torch.float32) / params.temperature
    vocab = scaled.shape[-1]
    if 0 < params.top_k < vocab:
        # Everything below the k-th largest logit is cut (ties at the k-th stay).
        kth = torch.topk(scaled, params.top_k, dim=-1).values[:, -1:]  # [num_rows, 1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)  # [num_rows, vocab]
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # Keep a token while the mass strictly before it is below top_p: the
        # nucleus is the smallest prefix reaching top_p, and never empty.
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def draw(
    probs: torch.Tensor,  # [vocab] CPU, sums to 1
    generator: torch.Generator,
) -> int:
    """One token from ``probs`` with the request's generator."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


def uniform(generator: torch.Generator) -> float:
    """One draw from U[0, 1) with the request's generator."""
    return float(torch.rand((), generator=generator).item())
