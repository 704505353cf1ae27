"""Property-based tests (hypothesis): random small shapes, dtypes, masks and
gates; the Pallas kernels (interpret mode on CPU) against the plain-jnp path
and against the float64 NumPy reference, forward and every gradient.

Drawn: N in 1..40, S in 1..4, H in 1..3, d in {8, 16, 32}, 0-2 leading batch
dims (each 1 or 2), float32 / bfloat16 / float16, no mask / a random mask /
a mask with fully masked rows, gate or none, default or custom scale.

Every example is a new shape, hence a new interpret-mode compile (~3-4 s on
two cores), so `max_examples` is small: 6 drawn examples (they cover N from
1 to 19 with tile tails, 0, 1 and 2 batch dims, all three dtypes, no mask and
random masks, gate or none, both scales) and one explicit example that always
runs (`@example`: bfloat16, a fully masked row, N = 37, two batch dims).
MSA_PALLAS_PROPERTY_EXAMPLES=N draws N examples instead of 6 (a deeper run).
`derandomize=True` makes the drawn examples the same on every run (CI is
reproducible: a failure reproduces with the same command), and the database
is off (no state between runs).
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, example, given, settings, strategies as st  # noqa: E402

import edge_checks  # noqa: E402
import helpers  # noqa: E402
from helpers import fwd_bwd, numpy_results, random_inputs  # noqa: E402

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}
# assert_close's measure (relative, with an absolute floor of tol per element).
TOL = {"f32": 1e-5, "bf16": 2e-2, "f16": 2e-2}

PROFILE = settings(
    max_examples=int(os.environ.get("MSA_PALLAS_PROPERTY_EXAMPLES", "6")),
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@st.composite
def cases(draw):
    batch = tuple(draw(st.lists(st.integers(1, 2), min_size=0, max_size=2)))
    S = draw(st.integers(1, 4))
    N = draw(st.integers(1, 40))
    H = draw(st.integers(1, 3))
    d = draw(st.sampled_from([8, 16, 32]))
    dtype = draw(st.sampled_from(list(DTYPES)))
    mask = draw(st.sampled_from(["none", "random", "fully-masked-row"]))
    gate = draw(st.booleans())
    scale = draw(st.sampled_from([None, 0.5]))
    seed = draw(st.integers(0, 2**31 - 1))
    return dict(batch=batch, S=S, N=N, H=H, d=d, dtype=dtype, mask=mask, gate=gate,
                scale=scale, seed=seed)


def _inputs(case):
    kw = dict(gate=case["gate"])
    if case["mask"] == "none":
        kw["mask_rate"] = None
    elif case["mask"] == "fully-masked-row":
        kw["mask_rate"] = 0.3
        # The last MSA row of the last batch element.
        kw["fully_masked_row"] = tuple(b - 1 for b in case["batch"]) + (case["S"] - 1,)
    return random_inputs(
        case["seed"], case["batch"], case["S"], case["N"], case["H"], case["d"],
        DTYPES[case["dtype"]], **kw,
    )


@PROFILE
@given(case=cases())
# Always run: bfloat16, a fully masked row, a gate, two batch dims, N = 37 (a tail
# past two 16-wide tiles).
@example(case=dict(batch=(2, 1), S=2, N=37, H=3, d=32, dtype="bf16", mask="fully-masked-row",
                   gate=True, scale=None, seed=20261201))
def test_pallas_matches_xla_and_float64(case):
    inputs = _inputs(case)
    label = " ".join(f"{k}={v}" for k, v in case.items())
    pallas = fwd_bwd("pallas", case["scale"])(*inputs.args)
    xla = fwd_bwd("xla", case["scale"])(*inputs.args)
    helpers.assert_shapes_dtypes_finite(pallas, inputs)
    helpers.assert_shapes_dtypes_finite(xla, inputs)
    tol = TOL[case["dtype"]]
    reference = numpy_results(inputs, case["scale"])
    edge_checks.assert_close(pallas, reference, tol, f"pallas vs float64 {label}")
    edge_checks.assert_close(xla, reference, tol, f"xla vs float64 {label}")
    # The two paths agree with each other at least as well as each with float64.
    edge_checks.assert_close(pallas, xla, 2 * tol, f"pallas vs xla {label}")
    if case["mask"] == "fully-masked-row":
        index = tuple(b - 1 for b in case["batch"]) + (case["S"] - 1,)
        out, (dq, dk, dv, dbias, dgate) = pallas
        assert np.all(np.asarray(dq[index]) == 0) and np.all(np.asarray(dk[index]) == 0)
