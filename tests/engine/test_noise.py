"""The counter-based noise: pure integer functions, the same on every device."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from metrale.engine.noise import (
    MASK32,
    SALT_TOKEN,
    exponentials,
    mix,
    mix32,
    request_key,
    row_keys,
    uniform_bits,
)
from metrale.engine.runtime.syncs import count_syncs

words = st.integers(0, MASK32)


@settings(max_examples=100, deadline=None)
@given(st.lists(words, min_size=1, max_size=64))
def test_the_tensor_mixer_equals_its_host_twin_without_overflow(values: list[int]) -> None:
    # The extremes too: every product must stay below 2^63 for any input.
    values = [*values, 0, 1, MASK32, MASK32 - 1, 1 << 31]
    mixed = mix(torch.tensor(values, dtype=torch.int64)).tolist()
    assert mixed == [mix32(v) for v in values]
    assert all(0 <= m <= MASK32 for m in mixed)


def test_the_mixer_is_a_bijection_on_a_range_of_inputs() -> None:
    values = torch.arange(1 << 16, dtype=torch.int64) * 65_537
    assert torch.unique(mix(values)).numel() == values.numel()


def test_a_request_key_takes_both_seed_words_and_the_stream() -> None:
    keys = {
        request_key(0),
        request_key(1),
        request_key(1 << 32),
        request_key(0, stream=1),
        request_key(1, stream=1),
    }
    assert len(keys) == 5
    assert request_key(7) == request_key(7 + (1 << 64)), "a seed is taken modulo 2^64"
    assert request_key(-1) == request_key((1 << 64) - 1)
    assert all(0 <= k <= MASK32 for k in keys)


def test_uniform_bits_are_balanced_and_differ_by_row_and_index() -> None:
    keys = row_keys(torch.full((512,), request_key(3)), torch.arange(512))  # [512]
    bits = uniform_bits(keys, torch.arange(256), SALT_TOKEN)  # [512, 256]
    assert bits.shape == (512, 256)
    assert int(bits.min()) >= 0 and int(bits.max()) <= MASK32
    # Each of the 32 bits is set about half the time (131,072 values: the
    # standard deviation of a frequency is about 0.0014).
    frequencies = torch.stack([((bits >> b) & 1).double().mean() for b in range(32)])
    assert float((frequencies - 0.5).abs().max()) < 0.01
    # Neighbouring positions and indices share nothing visible.
    assert torch.unique(bits).numel() > 0.999 * bits.numel()
    rows = bits.double() / 2**32
    assert float(torch.corrcoef(torch.stack([rows[0], rows[1]]))[0, 1].abs()) < 0.25


def test_exponentials_are_finite_positive_with_mean_one() -> None:
    bits = torch.tensor([0, MASK32, 1 << 31], dtype=torch.int64)
    edge = exponentials(bits)
    assert bool(torch.isfinite(edge).all()) and bool((edge > 0).all())
    keys = row_keys(torch.full((64,), request_key(9)), torch.arange(64))
    many = exponentials(uniform_bits(keys, torch.arange(1024), SALT_TOKEN))
    assert abs(float(many.mean()) - 1.0) < 0.02


def test_the_noise_reads_nothing_back_to_the_host() -> None:
    keys = torch.full((4,), request_key(1))
    with count_syncs() as counts, torch.inference_mode():
        exponentials(uniform_bits(row_keys(keys, torch.arange(4)), torch.arange(300), 1))
    assert counts.readbacks == counts.uploads == 0, counts.by_kind


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_noise_on_cuda_equals_the_cpu_bit_for_bit() -> None:
    keys = row_keys(torch.full((64,), request_key(11)), torch.arange(64))
    bits = uniform_bits(keys, torch.arange(4096), SALT_TOKEN)
    on_cuda = uniform_bits(keys.cuda(), torch.arange(4096, device="cuda"), SALT_TOKEN)
    assert torch.equal(on_cuda.cpu(), bits)
