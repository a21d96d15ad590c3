"""The batched acceptance rules equal the scalar ones row by row, and keep
sampling exact.

Each device function is checked against its scalar reference on random
batches (widths 0 and 1 included): ``accept_greedy``, ``target_probs``, and
``accept_sampled_with`` given the same uniforms. The chi-square test of
``test_sampling_parity`` then runs through ``accept_sampled_rows`` itself:
2,000 seeded requests as the rows of one batch, drafting from a ``q`` unlike
``p`` and from copies, must match the exact distribution of 4-token
continuations.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from metrale.engine.api import SamplingParams
from metrale.engine.runtime.syncs import count_syncs
from metrale.engine.sampling import target_probs
from metrale.engine.spec.acceptance import accept_greedy, accept_sampled_with, draw_inverse_cdf
from metrale.engine.spec.device_accept import (
    DeviceAccepted,
    accept_greedy_rows,
    accept_sampled_rows,
    draw_rows,
    request_uniforms,
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

# The largest float32 below 1: a uniform as close to 1 as torch.rand gets.
U_MAX = 1.0 - 2.0**-24


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
def test_greedy_rows_equal_accept_greedy(batch: tuple[torch.Tensor, ...]) -> None:
    tokens, widths, argmax = batch
    out = accept_greedy_rows(tokens, widths, argmax)
    assert torch.equal(out.emitted, argmax)
    for b, width in enumerate(widths.tolist()):
        if width == 0:
            assert int(out.accepted[b]) == 0
            continue
        accepted, bonus = accept_greedy(tokens[b, 1:width].tolist(), argmax[b, :width].tolist())
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


probability_rows = st.lists(
    st.one_of(st.just(0.0), st.floats(2.0**-20, 1.0, width=32)), min_size=1, max_size=10
).filter(lambda row: any(p > 0 for p in row))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(probability_rows, st.floats(0.0, U_MAX, width=32)), min_size=1))
def test_draw_rows_equal_the_scalar_inverse_cdf_and_never_draw_probability_zero(
    rows: list[tuple[list[float], float]],
) -> None:
    vocab = max(len(row) for row, _ in rows)
    probs = torch.tensor([row + [0.0] * (vocab - len(row)) for row, _ in rows])  # [N, V]
    u = torch.tensor([u for _, u in rows])  # [N]
    drawn = draw_rows(probs, u)  # [N]
    for i in range(len(rows)):
        assert int(drawn[i]) == draw_inverse_cdf(probs[i], float(u[i]))
        assert float(probs[i, int(drawn[i])]) > 0.0


def test_draw_rows_clamp_to_the_last_positive_token_at_the_float_edge() -> None:
    # u = 1 puts the threshold at the total, which no cumulative sum exceeds
    # (as a scan whose rounding overshoots would): the draw must not walk off
    # into the trailing zeros. A row without mass gives token 0.
    probs = torch.tensor([[0.1, 0.7, 0.2, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    drawn = draw_rows(probs, torch.tensor([1.0, 0.5]))
    assert drawn.tolist() == [2, 0]
    assert draw_inverse_cdf(probs[0], 1.0) == 2


def random_batch(
    gen: torch.Generator, batch: int, width: int, vocab: int, kinds: list[str]
) -> dict[str, torch.Tensor]:
    """A verify's inputs: targets with zeros (a nucleus cut), drafts from q
    (zeros too: a draft vocabulary), and per-slot kinds: ``mtp`` drafts drawn
    from q, ``copy`` one-hot drafts, ``any`` drafts q may give no mass (the
    ``q(d) > 0`` guard), ``above`` q over p everywhere (a residual with no
    mass, so a rejection falls back to p)."""
    target = torch.softmax(torch.randn(batch, width, vocab, generator=gen) * 2, dim=-1)
    target = target * (torch.rand(batch, width, vocab, generator=gen) > 0.2)
    target = target + (target.sum(-1, keepdim=True) == 0) * 1.0  # no all-zero row
    target = target / target.sum(-1, keepdim=True)  # [B, W, V]
    q = torch.softmax(torch.randn(batch, width - 1, vocab, generator=gen) * 2, dim=-1)
    q = q * (torch.rand(batch, width - 1, vocab, generator=gen) > 0.3)
    q = q + (q.sum(-1, keepdim=True) == 0) * 1.0
    q = q / q.sum(-1, keepdim=True)  # [B, W-1, V]
    mtp = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).reshape(batch, width - 1)
    any_ids = torch.randint(0, vocab, (batch, width - 1), generator=gen)
    for b, kind in enumerate(kinds):
        if kind == "above":
            q[b] = 2 * target[b, :-1]
        if kind in ("copy", "any"):
            mtp[b] = any_ids[b]
    last = torch.randint(0, vocab, (batch, 1), generator=gen)
    return {
        "tokens": torch.cat([last, mtp], dim=1),  # [B, W]
        "widths": torch.randint(0, width + 1, (batch,), generator=gen),
        "draft_probs": q,
        "one_hot": torch.tensor([kind == "copy" for kind in kinds]),
        "target": target,
        "accept_u": torch.rand(batch, width - 1, generator=gen),
        "draw_u": torch.rand(batch, generator=gen),
    }


def assert_rows_equal_the_scalar_rule(inputs: dict[str, torch.Tensor], out: DeviceAccepted) -> None:
    tokens, widths, q = inputs["tokens"], inputs["widths"], inputs["draft_probs"]
    for b, width in enumerate(widths.tolist()):
        if width == 0:
            assert int(out.accepted[b]) == 0
            continue
        drafts = tokens[b, 1:width].tolist()
        probs = None if bool(inputs["one_hot"][b]) else q[b, : width - 1]
        accepted, bonus = accept_sampled_with(
            drafts,
            probs,
            inputs["target"][b, :width],
            inputs["accept_u"][b].tolist(),
            float(inputs["draw_u"][b]),
        )
        assert int(out.accepted[b]) == accepted, b
        assert emitted_prefix(out, b) == [*drafts[:accepted], bonus], b
        # Beyond the bonus: the later drafts (padding too), then the bonus.
        tail = out.emitted[b, accepted + 1 :].tolist()
        assert tail == [*tokens[b, accepted + 2 :].tolist(), bonus][: len(tail)], b


kinds_of_slots = st.lists(st.sampled_from(["mtp", "copy", "any", "above"]), min_size=1, max_size=8)


@settings(max_examples=150, deadline=None)
@given(kinds_of_slots, st.integers(1, 5), st.integers(0, 2**31))
def test_sampled_rows_equal_the_scalar_rule_given_the_same_uniforms(
    kinds: list[str], width: int, seed: int
) -> None:
    inputs = random_batch(torch.Generator().manual_seed(seed), len(kinds), width, 5, kinds)
    with torch.inference_mode():
        out = accept_sampled_rows(**inputs)
    assert_rows_equal_the_scalar_rule(inputs, out)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 8), st.integers(1, 5), st.integers(0, 2**31))
def test_sampled_rows_without_draft_probs_treat_every_draft_as_a_copy(
    batch: int, width: int, seed: int
) -> None:
    inputs = random_batch(torch.Generator().manual_seed(seed), batch, width, 5, ["copy"] * batch)
    tokens, widths, one_hot = inputs["tokens"], inputs["widths"], inputs["one_hot"]
    target, accept_u, draw_u = inputs["target"], inputs["accept_u"], inputs["draw_u"]
    out = accept_sampled_rows(tokens, widths, None, one_hot, target, accept_u, draw_u)
    assert_rows_equal_the_scalar_rule(inputs, out)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.sampled_from(["greedy-copy", "greedy-mtp", "sampled"]), min_size=1, max_size=8),
    st.integers(0, 2**31),
)
def test_temperature_zero_slots_accept_exactly_as_greedy_in_a_mixed_batch(
    kinds: list[str], seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    batch, width, vocab = len(kinds), 4, 6
    logits = torch.randn(batch, width, vocab, generator=gen) * 2  # [B, W, V]
    argmax = logits.argmax(dim=-1)  # [B, W]
    # Drafts that are the argmax half the time, so greedy runs get long.
    guess = torch.randint(0, vocab, (batch, width), generator=gen)
    right = torch.rand(batch, width, generator=gen) < 0.5
    drafts = torch.where(right, argmax, guess)[:, :-1]  # [B, W-1]
    greedy = [kind.startswith("greedy") for kind in kinds]
    temperature = torch.tensor([0.0 if g else 0.9 for g in greedy]).repeat_interleave(width)
    top_k, top_p = torch.zeros(batch * width, dtype=torch.long), torch.full((batch * width,), 0.9)
    with torch.inference_mode():
        target = target_probs_rows(logits.reshape(-1, vocab), temperature, top_k, top_p)
    inputs = {
        "tokens": torch.cat([torch.zeros(batch, 1, dtype=torch.long), drafts], dim=1),  # [B, W]
        "widths": torch.randint(0, width + 1, (batch,), generator=gen),
        # Positive everywhere: q(d) > 0, as for any drawn draft.
        "draft_probs": torch.softmax(torch.randn(batch, width - 1, vocab, generator=gen), dim=-1),
        "one_hot": torch.tensor([kind == "greedy-copy" for kind in kinds]),
        "target": target.reshape(batch, width, vocab),
        "accept_u": torch.rand(batch, width - 1, generator=gen),
        "draw_u": torch.rand(batch, generator=gen),
    }
    with torch.inference_mode():
        out = accept_sampled_rows(**inputs)
    expected = accept_greedy_rows(inputs["tokens"], inputs["widths"], argmax)
    for b in range(batch):
        if greedy[b]:
            assert int(out.accepted[b]) == int(expected.accepted[b])
            assert emitted_prefix(out, b) == emitted_prefix(expected, b)
    assert_rows_equal_the_scalar_rule(inputs, out)  # the sampled slots too


def test_the_device_rules_read_nothing_back_to_the_host() -> None:
    # count_syncs counts on the CPU what would make a GPU's host wait.
    kinds = ["mtp", "copy", "any", "above"]
    inputs = random_batch(torch.Generator().manual_seed(0), 4, 3, 5, kinds)
    logits = torch.randn(4, 5)
    params = (torch.tensor([0.0, 0.7, 1.0, 2.0]), torch.tensor([0, 2, 9, 1]), torch.full((4,), 0.8))
    generators = [torch.Generator().manual_seed(0), None, None, None]
    with count_syncs() as counts, torch.inference_mode():
        accept_sampled_rows(**inputs)
        accept_greedy_rows(inputs["tokens"], inputs["widths"], inputs["tokens"])
        draw_rows(target_probs_rows(logits, *params), inputs["draw_u"])
        request_uniforms(generators, 3, "cpu")
    assert counts.readbacks == counts.uploads == 0, counts.by_kind


def test_request_uniforms_come_from_each_request_generator_alone() -> None:
    def gen(seed: int) -> torch.Generator:
        return torch.Generator().manual_seed(seed)

    alone = request_uniforms([gen(7)], 5, "cpu")  # [1, 5]
    crowded = request_uniforms([None, gen(3), gen(7), None], 5, "cpu")  # [4, 5]
    assert crowded.shape == (4, 5) and crowded.dtype == torch.float32
    assert torch.equal(crowded[2], alone[0])
    assert torch.equal(crowded[1], request_uniforms([gen(3)], 5, "cpu")[0])
    assert not crowded[[0, 3]].any()
    assert ((crowded >= 0) & (crowded < 1)).all()
    assert request_uniforms([], 3, "cpu").shape == (0, 3)


def test_speculative_sampling_through_the_device_rule_passes_the_chi_square_test() -> None:
    # One row per seeded request, decoded together to LENGTH tokens: each step
    # drafts up to 3 tokens (odd rows copy, even rows draw from a q unlike p,
    # which never drafts token 1 in some contexts), verifies them in one call,
    # and a finished row rides along inactive (width 0).
    fake, width = model(), 4
    context = torch.cartesian_prod(torch.arange(VOCAB), torch.arange(VOCAB)).tolist()
    p_table = torch.stack(
        [target_probs(fake.next_logits(pair)[None, :], PARAMS)[0] for pair in context]
    ).reshape(VOCAB, VOCAB, VOCAB)  # [last but one, last, next]
    gen = torch.Generator().manual_seed(1)
    q_table = torch.softmax(torch.randn(VOCAB, VOCAB, VOCAB, generator=gen) * 1.5, dim=-1)
    q_table[::2, :, 1] = 0.0
    q_table /= q_table.sum(dim=-1, keepdim=True)
    generators = [torch.Generator().manual_seed(seed) for seed in range(TRIALS)]
    copies = torch.arange(TRIALS) % 2 == 1  # [B]
    outputs: list[list[int]] = [[] for _ in range(TRIALS)]
    proposed, accepted = Counter[bool](), Counter[bool]()
    while any(len(out) < LENGTH for out in outputs):
        left = torch.tensor([LENGTH - len(out) for out in outputs])  # [B]
        widths = torch.where(left > 0, torch.randint(1, width + 1, (TRIALS,), generator=gen), 0)
        seq = torch.zeros(TRIALS, width + 1, dtype=torch.long)  # [B, W+1]: one more context
        seq[:, :2] = torch.tensor([[*PROMPT, *out][-2:] for out in outputs])
        for i in range(width - 1):
            q = q_table[seq[:, i], seq[:, i + 1]]  # [B, V]
            drawn = torch.multinomial(q, 1, generator=gen)[:, 0]  # [B]
            seq[:, i + 2] = torch.where(copies, (seq[:, i + 1] + 1) % VOCAB, drawn)
        active = [g if n > 0 else None for g, n in zip(generators, left.tolist(), strict=True)]
        uniforms = request_uniforms(active, width, "cpu")  # [B, W]
        out = accept_sampled_rows(
            seq[:, 1:],
            widths,
            q_table[seq[:, :-2], seq[:, 1:-1]],  # [B, W-1, V]
            copies,
            p_table[seq[:, :-1], seq[:, 1:]],  # [B, W, V]
            uniforms[:, :-1],
            uniforms[:, -1],
        )
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
    kinds = ["mtp", "copy", "any", "above"] * 16
    inputs = random_batch(torch.Generator().manual_seed(0), len(kinds), 5, 1000, kinds)
    cuda = {name: value.cuda() for name, value in inputs.items()}
    logits = torch.randn(64, 1000, generator=torch.Generator().manual_seed(1)).cuda()
    rows = torch.arange(64, device="cuda")  # [N]
    temperature = torch.rand(64, device="cuda") * (rows % 3 > 0)  # every third row greedy
    top_p = torch.full((64,), 0.9, device="cuda")
    generators = [torch.Generator("cuda").manual_seed(0), None]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.inference_mode():
            out = accept_sampled_rows(**cuda)
            greedy = accept_greedy_rows(cuda["tokens"], cuda["widths"], cuda["tokens"])
            probs = target_probs_rows(logits, temperature, rows, top_p)
            uniforms = request_uniforms(generators, 3, "cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    # A draw next to a boundary may differ between two scans; accepting may not.
    assert torch.equal(out.accepted.cpu(), accept_sampled_rows(**inputs).accepted)
    tokens, widths = inputs["tokens"], inputs["widths"]
    assert torch.equal(greedy.accepted.cpu(), accept_greedy_rows(tokens, widths, tokens).accepted)
    torch.testing.assert_close(probs.sum(dim=1).cpu(), torch.ones(64))
    assert uniforms.shape == (2, 3) and not uniforms[1].any()


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
