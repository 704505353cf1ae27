"""README.md's support matrix against the dispatch rule: every row's sample
calls, planned by `dispatch.plan_call` for the row's GPU generation, run the
kernels the row names, and README.md holds the table as
`tests/support_matrix.py` renders it from those plans.
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import pytest

import msa_pallas
import support_matrix
from msa_pallas import exporting

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.parametrize("row", support_matrix.ROWS, ids=lambda row: f"{row.gpu}|{row.dtype}|{row.bias}|d {row.head_dim}|N {row.n_res}")
def test_every_sample_of_a_row_runs_the_rows_kernels(row):
    expected = support_matrix.outcome(row.samples[0])
    for sample in row.samples:
        assert support_matrix.outcome(sample) == expected, sample


def test_the_readme_holds_the_rendered_table():
    text = README.read_text()
    assert text.count(support_matrix.BEGIN) == 1 and text.count(support_matrix.END) == 1
    table = text.split(support_matrix.BEGIN)[1].split(support_matrix.END)[0].strip()
    assert table == support_matrix.render(), (
        "README.md's support matrix is stale: paste `python tests/support_matrix.py`"
    )


@pytest.mark.parametrize("device_kind, n_res, kernels", [
    ("NVIDIA H200", 256, "mosaic"), ("NVIDIA H200", 128, "triton"), ("NVIDIA A100-SXM4-80GB", 256, "triton"),
])
def test_explain_under_a_gpu_target_agrees_with_the_matrix(device_kind, n_res, kernels):
    """The same rule through the path a user takes: `msa_pallas.explain` traced
    for a GPU named by its device kind (as `jax.export` from a CPU host)."""
    q = jax.ShapeDtypeStruct((1, 2, n_res, 4, 32), jnp.bfloat16)
    bias = jax.ShapeDtypeStruct((1, 4, n_res, n_res), jnp.float32)
    with exporting.gpu_target(device_kind):
        plan = msa_pallas.explain(q, q, q, bias)
    assert (plan.forward, plan.backward) == (kernels, kernels)
    sample = support_matrix.Sample(plan.target, jnp.bfloat16, jnp.float32, n_res, 32)
    assert support_matrix.outcome(sample) == (kernels.capitalize(),) * 2


def test_attention_dropout_runs_the_same_kernels_on_every_gpu():
    """The table leaves dropout out because it changes no choice: attention
    dropout (the layers' training mode with `dropout_mode="attention"`) runs
    the kernels that the same call without dropout runs, skipping padding
    as it does."""
    q = jax.ShapeDtypeStruct((1, 2, 256, 4, 32), jnp.bfloat16)
    bias = jax.ShapeDtypeStruct((1, 4, 256, 256), jnp.float32)
    mask = jax.ShapeDtypeStruct((1, 2, 256), jnp.bool_)
    for target in (support_matrix.HOPPER,) + support_matrix.OTHER_GPUS:
        with msa_pallas.skipping_padding():
            plan = msa_pallas.dispatch.plan_call(
                q, q, q, bias, mask, dropout_rate=0.1, dropout_rng=jax.random.key(0),
                target=target)
            without = msa_pallas.dispatch.plan_call(q, q, q, bias, mask, target=target)
        assert (plan.forward, plan.backward) == (without.forward, without.backward), target
        assert plan.dropout_rate == 0.1 and plan.skips_padding and without.skips_padding
        assert "dropout" in str(plan)
