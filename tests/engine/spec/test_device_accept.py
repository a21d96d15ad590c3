"""The batched acceptance rule equals the scalar one row by row, and sampled
rows choose exactly the host's tokens.

Each device function is checked against its scalar reference on random
batches (widths 0 and 1 included): ``accept_drafts``, ``target_probs`` and
``sample_at``. The chi-square test of ``test_sampling_parity`` then runs
through ``accept_rows`` and ``choose_rows`` themselves: 2,000 seeded requests
as the rows of one batch, drafting from a ``q`` unlike ``p`` and from copies,
must match the exact distribution of 4-token continuations.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from metrale.engine.api import SamplingParams
from metrale.engine.noise import request_key
from metrale.engine.runtime.syncs import count_syncs
from metrale.engine.sampling import sample_at, target_probs
from metrale.engine.spec.acceptance import accept_drafts
from metrale.engine.spec.device_accept import (
    DeviceAccepted,
    accept_rows,
    choose_rows,
    target_probs_rows,
)
from tests.support.exact_distribution import (
    LENGTH,
    PARAMS,
    PROMPT,
    TRIALS,
    VOCAB,
    chi_square,
    critical_value,
    exact_distribution,
    model,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def emitted_prefix(out: DeviceAccepted, b: int) -> list[int]:
    return out.emitted[b, : int(out.accepted[b]) + 1].tolist()


@st.composite
def greedy_batches(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = draw(st.integers(1, 5))
    rows = draw(st.lists(st.integers(0, width), min_size=1, max_size=6))
    # A three-token vocabulary makes drafts right often enough to keep runs.
    ids = st.lists(st.integers(0, 2), min_size=width, max_size=width)
    tokens = [draw(ids) for _ in rows]
    argmax = [draw(ids) for _ in rows]
    return torch.tensor(tokens), torch.tensor(rows), torch.tensor(argmax)


@settings(max_examples=200, deadline=None)
@given(greedy_batches())
def test_accept_rows_equal_accept_drafts(batch: tuple[torch.Tensor, ...]) -> None:
    tokens, widths, chosen = batch
    out = accept_rows(tokens, widths, chosen)
    assert torch.equal(out.emitted, chosen)
    for b, width in enumerate(widths.tolist()):
        if width == 0:
            assert int(out.accepted[b]) == 0
            continue
        accepted, bonus = accept_drafts(tokens[b, 1:width].tolist(), chosen[b, :width].tolist())
        assert int(out.accepted[b]) == accepted
        assert emitted_prefix(out, b) == [*tokens[b, 1 : accepted + 1].tolist(), bonus]


row_params = st.tuples(
    st.one_of(st.just(0.0), st.floats(0.05, 3.0)),  # temperature
    st.integers(0, 14),  # top_k: 0 is off, above the vocabulary cuts nothing
    st.one_of(st.just(1.0), st.floats(0.05, 1.0)),  # top_p
)


def assert_rows_equal_target_probs(
    logits: torch.Tensor, params: list[tuple[float, int, float]]
) -> None:
    temperatures, top_ks, top_ps = zip(*params, strict=True)
    # Float64, so a top_p within float32 rounding of 1 still counts as a cut.
    temperature = torch.tensor(temperatures, dtype=torch.float64)
    top_k, top_p = torch.tensor(top_ks), torch.tensor(top_ps, dtype=torch.float64)
    probs = target_probs_rows(logits, temperature, top_k, top_p)  # [N, V]
    assert probs.dtype == torch.float32
    for i, (t, k, p) in enumerate(params):
        if t == 0.0:
            expected = torch.zeros(logits.shape[1])
            expected[int(logits[i].argmax())] = 1.0
        else:
            sampling = SamplingParams(temperature=t, top_k=k, top_p=p)
            expected = target_probs(logits[i : i + 1], sampling)[0]
        assert torch.equal(probs[i], expected), (i, t, k, p)


@settings(max_examples=150, deadline=None)
@given(st.lists(row_params, min_size=1, max_size=8), st.integers(0, 2**31))
def test_target_probs_rows_equal_target_probs_row_by_row(
    params: list[tuple[float, int, float]], seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    # Continuous logits: no two tokens tie, so the nucleus is unambiguous.
    logits = torch.randn(len(params), 12, generator=gen) * 3.0
    assert_rows_equal_target_probs(logits, params)


@settings(max_examples=100, deadline=None)
@given(st.lists(row_params, min_size=1, max_size=8), st.integers(0, 2**31))
def test_target_probs_rows_keep_ties_at_the_kth_like_target_probs(
    params: list[tuple[float, int, float]], seed: int
) -> None:
    # Integer logits tie often; top-p is off, since which of two tokens tied
    # at the nucleus boundary stays is up to the reference's unstable sort.
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, 4, (len(params), 12), generator=gen).float()
    assert_rows_equal_target_probs(logits, [(t, k, 1.0) for t, k, _ in params])


def test_target_probs_rows_keep_the_lower_id_of_a_tie_at_the_nucleus_boundary() -> None:
    logits = torch.tensor([[0.0, 1.0, 1.0, 0.0]])
    # p = [a, b, b, a] with b > 0.3: the first b alone reaches top_p.
    probs = target_probs_rows(logits, torch.tensor([1.0]), torch.tensor([0]), torch.tensor([0.3]))
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0]]


@settings(max_examples=60, deadline=None)
@given(st.lists(row_params, min_size=1, max_size=6), st.integers(0, 2**31))
def test_choose_rows_equal_sample_at_row_by_row(
    params: list[tuple[float, int, float]], seed: int
) -> None:
    # A verify's rows: each slot's own key and positions, greedy slots
    # (one-hot targets) among them; the vocabulary spans several blocks.
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(params), 700, generator=gen) * 3.0  # [N, V]
    temperature, top_k, top_p = (torch.tensor(c) for c in zip(*params, strict=True))
    target = target_probs_rows(logits, temperature.double(), top_k, top_p.double())
    keys = [request_key(seed + i) for i in range(len(params))]
    positions = torch.randint(0, 4000, (len(params),), generator=gen)
    with torch.inference_mode():
        chosen = choose_rows(target, torch.tensor(keys), positions)
    for i, (t, _, _) in enumerate(params):
        expected = sample_at(target[i : i + 1], [keys[i]], [int(positions[i])])[0]
        assert int(chosen[i]) == expected, i
        if t == 0.0:
            assert expected == int(logits[i].argmax()), "a greedy row takes the argmax"


def test_the_device_rules_read_nothing_back_to_the_host() -> None:
    # count_syncs counts on the CPU what would make a GPU's host wait.
    tokens = torch.randint(0, 5, (4, 3))
    widths = torch.tensor([0, 1, 2, 3])
    logits = torch.randn(4, 5)
    params = (torch.tensor([0.0, 0.7, 1.0, 2.0]), torch.tensor([0, 2, 9, 1]), torch.full((4,), 0.8))
    keys = torch.tensor([0, request_key(1), request_key(2), request_key(3)])
    with count_syncs() as counts, torch.inference_mode():
        chosen = choose_rows(target_probs_rows(logits, *params), keys, torch.arange(4))
        accept_rows(tokens, widths, chosen[:, None].expand(4, 3))
    assert counts.readbacks == counts.uploads == 0, counts.by_kind


def test_speculative_sampling_through_the_device_rule_passes_the_chi_square_test() -> None:
    # One row per seeded request, decoded together to LENGTH tokens: each step
    # drafts up to 3 tokens (odd rows copy, even rows draw from a q unlike p
    # with their own keys, which never drafts token 1 in some contexts),
    # verifies them in one call, and a finished row rides along inactive.
    fake, width = model(), 4
    context = torch.cartesian_prod(torch.arange(VOCAB), torch.arange(VOCAB)).tolist()
    p_table = torch.stack(
        [target_probs(fake.next_logits(pair)[None, :], PARAMS)[0] for pair in context]
    ).reshape(VOCAB, VOCAB, VOCAB)  # [last but one, last, next]
    gen = torch.Generator().manual_seed(1)
    q_table = torch.softmax(torch.randn(VOCAB, VOCAB, VOCAB, generator=gen) * 1.5, dim=-1)
    q_table[::2, :, 1] = 0.0
    q_table /= q_table.sum(dim=-1, keepdim=True)
    keys = torch.tensor([request_key(seed) for seed in range(TRIALS)])  # [B]
    copies = torch.arange(TRIALS) % 2 == 1  # [B]
    outputs: list[list[int]] = [[] for _ in range(TRIALS)]
    proposed, accepted = Counter[bool](), Counter[bool]()
    while any(len(out) < LENGTH for out in outputs):
        left = torch.tensor([LENGTH - len(out) for out in outputs])  # [B]
        widths = torch.where(left > 0, torch.randint(1, width + 1, (TRIALS,), generator=gen), 0)
        seq = torch.zeros(TRIALS, width + 1, dtype=torch.long)  # [B, W+1]: one more context
        seq[:, :2] = torch.tensor([[*PROMPT, *out][-2:] for out in outputs])
        start = torch.tensor([len(PROMPT) + len(out) for out in outputs])  # [B]
        for i in range(width - 1):
            q = q_table[seq[:, i], seq[:, i + 1]]  # [B, V]
            drawn = choose_rows(q, keys, start + i)  # the draft's own position
            seq[:, i + 2] = torch.where(copies, (seq[:, i + 1] + 1) % VOCAB, drawn)
        target = p_table[seq[:, :-1], seq[:, 1:]]  # [B, W, V]
        positions = start[:, None] + torch.arange(width)  # [B, W]
        chosen = choose_rows(
            target.reshape(-1, VOCAB),
            keys.repeat_interleave(width),
            positions.reshape(-1),
        ).view(TRIALS, width)
        out = accept_rows(seq[:, 1:], widths, chosen)
        for b in range(TRIALS):
            if widths[b] > 0:
                outputs[b].extend(emitted_prefix(out, b))
                proposed[bool(copies[b])] += int(widths[b]) - 1
                accepted[bool(copies[b])] += int(out.accepted[b])
    counts = Counter(tuple(out[:LENGTH]) for out in outputs)
    exact = exact_distribution()
    assert chi_square(counts, exact) < critical_value(exact)
    # Both draft kinds were verified, and rejected often enough to matter.
    for copy in (False, True):
        assert 0 < accepted[copy] < proposed[copy]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_rules_on_cuda_never_sync_and_equal_the_cpu() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 1000, generator=gen)
    rows = torch.arange(64)  # [N]
    temperature = torch.rand(64, generator=gen) * (rows % 3 > 0)  # every third row greedy
    top_p = torch.full((64,), 0.9)
    keys = torch.tensor([request_key(i) for i in range(64)])
    positions = torch.randint(0, 9000, (64,), generator=gen)
    tokens = torch.randint(0, 1000, (16, 4), generator=gen)
    widths = torch.randint(0, 5, (16,), generator=gen)
    on = [t.cuda() for t in (logits, temperature, rows, top_p, keys, positions, tokens, widths)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.inference_mode():
            probs = target_probs_rows(on[0], on[1], on[2], on[3])
            chosen = choose_rows(probs, on[4], on[5])
            out = accept_rows(on[6], on[7], chosen.view(16, 4))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(probs.sum(dim=1).cpu(), torch.ones(64))
    # The same distribution gives the same token on either device: the noise
    # is integer arithmetic (a draw next to a tie may differ where the two
    # devices' sums round apart, which random rows make vanishingly rare).
    on_cpu = choose_rows(probs.cpu(), keys, positions)
    assert torch.equal(chosen.cpu(), on_cpu)
    expected = accept_rows(tokens, widths, on_cpu.view(16, 4))
    assert torch.equal(out.accepted.cpu(), expected.accepted)


def test_without_cuts_the_sort_is_skipped_and_nothing_changes() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 50, generator=gen) * 3
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.3, 0.0, 2.0], dtype=torch.float64)
    top_k = torch.zeros(6, dtype=torch.int64)
    top_p = torch.ones(6, dtype=torch.float64)
    sorted_once = target_probs_rows(logits, temperature, top_k, top_p)
    torch.testing.assert_close(
        target_probs_rows(logits, temperature, top_k, top_p, cuts=False), sorted_once
    )
