"""The timing loop of the autotuner and the benchmark scripts.

A sample is `reps` back-to-back calls, waited for once, divided by `reps`:
the launches queue up on the GPU, so the host's per-call dispatch latency
(tens of microseconds, a sizeable part of a 0.1-0.5 ms step) stays out of
the number, for every implementation alike.
"""

from __future__ import annotations

import time
from typing import Callable

import jax


def batched_times_ms(launch: Callable[[int], object], *, samples: int, reps: int,
                     queued_ms: list[float] | None = None) -> list[float]:
    """Per-call milliseconds of `samples` samples of `reps` calls each.

    Args:
      launch: `launch(i)` starts the i-th call (i counts from 0 over all
        samples, e.g. to rotate input sets) and returns its output.
      samples: how many samples.
      reps: calls per sample.
      queued_ms: a list that gets, for each sample, the per-call
        milliseconds the host took to queue its calls (until the last one
        returned, before the wait). Where that is about the whole sample's
        time, the host bounded the sample, not the GPU: the GPU waited for
        calls (unless so many launches were queued that the queue, full,
        held the host back).
    """
    times = []
    calls = 0
    for _ in range(samples):
        start = time.perf_counter()
        for _ in range(reps):
            out = launch(calls)
            calls += 1
        queued = time.perf_counter()
        jax.block_until_ready(out)
        end = time.perf_counter()
        times.append((end - start) * 1e3 / reps)
        if queued_ms is not None:
            queued_ms.append((queued - start) * 1e3 / reps)
        del out
    return times
