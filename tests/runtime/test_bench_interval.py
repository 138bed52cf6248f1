"""bench_runtime's interval for a median per-round ratio: order statistics, whatever the distribution."""

import math

import pytest

from megatron_zb.testing.scripts import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_runtime")


@pytest.mark.parametrize("rounds, low, high", [(16, 4, 13), (48, 17, 32), (5, 1, 5)])
def test_the_interval_is_the_binomial_order_statistics(bench, rounds, low, high):
    times = {"ours": [float(r) for r in range(1, rounds + 1)], "theirs": [1.0] * rounds}
    assert bench.median_interval(times, "ours", "theirs") == (float(low), float(high))
    # P(Binomial(n, 1/2) < low): at most 2.5% (too few rounds for that: the extremes), one further in more
    below = sum(math.comb(rounds, k) for k in range(low)) / 2**rounds
    assert below <= 0.025 < below + math.comb(rounds, low) / 2**rounds or (low, high) == (1, rounds)
