"""The benchmarks' one timing loop: warm-up calls, then samples of back-to-back calls.

A sample is `reps` calls queued back to back and waited for once, divided by `reps`
(`msa_pallas.timing.batched_times_ms`, the autotuner's loop too): the host's dispatch
latency stays out of the number. Every benchmark quotes the median of the samples.
"""

from __future__ import annotations

import statistics
from typing import Callable

import jax

from msa_pallas.timing import batched_times_ms


def times_ms(launch: Callable[[int], object], *, samples: int, reps: int,
             warmup: int = 1) -> list[float]:
    """Per-call milliseconds of `samples` samples of `reps` calls, after `warmup` calls.

    `launch(i)` starts the i-th call (i counts from 0, warm-up and samples each, e.g. to
    rotate input sets) and returns its output.
    """
    for i in range(warmup):
        jax.block_until_ready(launch(i))
    return batched_times_ms(launch, samples=samples, reps=reps)


def median_ms(launch: Callable[[int], object], *, samples: int, reps: int,
              warmup: int = 1) -> float:
    """The median of `times_ms(...)`."""
    return statistics.median(times_ms(launch, samples=samples, reps=reps, warmup=warmup))
