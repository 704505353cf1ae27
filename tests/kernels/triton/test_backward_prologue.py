"""The backward's prologue kernel (`msa_pallas.kernels.triton.backward_prologue`):
`do`, the gate's gradient, the stacked row statistics and the dead rows' dv,
against float64 NumPy, in interpret mode on the CPU and compiled on the GPU.

Dead rows' residuals hold NaN, as a kernel that never wrote them may leave
them: the prologue must not read them (nor live rows' means, also NaN). The
outputs start from fresh buffers, and every element is checked: an
element left unwritten fails the comparison. Cases: N no whole number of
tiles, one head per program, dead rows in the middle and at the end, a batch
element all padding, no dead row, and the row planes wider than N. Told
each batch element's last live row, the dead rows of the groups after it
(which no backward kernel reads) get no `do` or statistics: every other
element is still checked, among them dead rows that share a group with a
live one.

Masking queries (`query_mask`, the rows' key mask): every masked residue's
dout, gate and attention hold NaN (a dead row's all of them), proving them
read as 0 or not at all; where no gradient flows (masked residues, dead
rows) do, dgate and delta must be exactly 0.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
import mosaic_lowering
from msa_pallas import exporting
from msa_pallas.kernels import key_tiles
from msa_pallas.kernels.constants import MASKED_LOGIT_LOG2, MASKED_QUERY_ROW_MAX_LOG2
from msa_pallas.kernels.triton import backward_prologue

# (B, S, N, H, d, the rows made dead, the batch elements made all padding)
CASES = {
    "N37-H3-d8-middle-and-end": ((2, 5, 37, 3, 8), (1, 4), ()),
    "N64-H8-d8-dead-batch": ((2, 3, 64, 8, 8), (2,), (1,)),
    "N100-H8-d32": ((1, 4, 100, 8, 32), (0, 3), ()),
    "N40-H2-d128-no-dead-row": ((1, 3, 40, 2, 128), (), ()),
}


def case_keep(case, seed, middle=None):
    """`[B, S, N]` bool: the case's key mask (`helpers.padded_mask`), keys
    `middle` also masked in the odd rows."""
    shape, dead_rows, dead_batch = CASES[case]
    batch, rows, n_res = shape[:3]
    return helpers.padded_mask(batch, rows, n_res, seed, middle=middle, dead=dead_rows,
                               dead_batch=dead_batch)


def random_case(case, seed, *, gate_dtype=jnp.bfloat16, plane_padding=0, middle=None):
    """The prologue's arguments `(dout, gate, attention, means, row_max,
    row_log2_sum, key_end)` and the dead rows `[B, S]`. Dead rows' residuals
    and live rows' means are NaN; the row planes are `plane_padding` wider
    than N (NaN there); the key mask is `case_keep(case, seed, middle)`."""
    shape = CASES[case][0]
    batch, rows, n_res, heads, head_dim = shape
    rng = np.random.default_rng(seed)
    dout = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
    gate = jnp.asarray(rng.standard_normal(shape), gate_dtype)
    keep = case_keep(case, seed, middle)
    dead = ~keep.any(axis=-1)
    attention = rng.standard_normal(shape).astype(np.float32)
    attention[dead] = np.nan
    means = rng.standard_normal((batch, rows, heads, head_dim)).astype(np.float32)
    means[~dead] = np.nan
    planes = []
    for low, high in ((-5.0, 5.0), (0.0, math.log2(n_res))):
        plane = rng.uniform(low, high, (batch, rows, heads, n_res + plane_padding))
        plane = plane.astype(np.float32)
        plane[dead] = np.nan
        plane[..., n_res:] = np.nan
        planes.append(jnp.asarray(plane))
    _, key_end = key_tiles.key_spans(jnp.asarray(keep, jnp.int8), n_res)
    args = (dout, gate, jnp.asarray(attention), jnp.asarray(means), *planes, key_end)
    return args, dead


def expected(args, dead, do_rounded):
    """float64 NumPy: `(do, dgate, stats, dead_dv)`, `do` and dgate before
    rounding; delta and the dead rows' dv from `do_rounded`, the kernel's own
    `do` (checked against `do` here): a product rounded to 16 bits on the
    other side of a tie would move delta by a 16-bit ulp of one term."""
    dout, gate, attention, means, row_max, row_log2_sum, _ = args
    n_res = dout.shape[2]
    dout = helpers.to_f64(dout)
    ungated = np.where(dead[:, :, None, None, None],
                       np.asarray(means, np.float64)[:, :, None], helpers.to_f64(attention))
    if gate is None:
        do = dout
        dgate = None
    else:
        sigmoid = 1 / (1 + np.exp(-helpers.to_f64(gate)))
        do = dout * sigmoid
        dgate = dout * ungated * sigmoid * (1 - sigmoid)
    do_rounded = helpers.to_f64(do_rounded)
    delta = np.swapaxes((do_rounded * ungated).sum(axis=-1), 2, 3)
    dead_planes = dead[:, :, None, None]
    stats = np.stack([
        np.where(dead_planes, MASKED_LOGIT_LOG2, np.asarray(row_max)[..., :n_res]),
        np.where(dead_planes, math.log2(n_res), np.asarray(row_log2_sum)[..., :n_res]),
        delta,
    ], axis=3)
    dead_dv = np.where(dead[:, :, None, None], do_rounded.mean(axis=2), 0.0)
    return do, dgate, stats, dead_dv


def live_rows_end(dead):
    """`[B]` int32: each batch element's last live row + 1 (0: none)."""
    rows = np.arange(1, dead.shape[1] + 1)
    return jnp.asarray(np.where(dead, 0, rows).max(axis=1), jnp.int32)


def told_rows(dead, rows_per_group):
    """`(told, written)`: the prologue's keywords telling it each batch
    element's last live row (none for `rows_per_group` None), and `[B, S]`
    bool, the rows whose `do` and statistics it must still write."""
    if rows_per_group is None:
        return {}, np.ones(dead.shape, bool)
    told = {"live_rows_end": live_rows_end(dead), "rows_per_group": rows_per_group}
    group_start = np.arange(dead.shape[1]) // rows_per_group * rows_per_group
    return told, ~dead | (group_start[None, :] < np.asarray(told["live_rows_end"])[:, None])


def check(args, dead, *, interpret: bool, do_dtype=jnp.bfloat16, rows_per_group=None):
    """The prologue's results against float64; with `rows_per_group`, told
    each batch element's last live row, the rows it must still write."""
    told, written = told_rows(dead, rows_per_group)
    do, dgate, stats, dead_dv = backward_prologue.backward_prologue(
        *args, do_dtype=do_dtype, interpret=interpret, **told
    )
    # The rows left out have no `do` of the kernel's: their dv against the
    # float64 one, within its rounding to 16 bits.
    rows_written = written[:, :, None, None, None]
    want_do = expected(args, dead, do)[0]
    do_made = np.where(rows_written, helpers.to_f64(do), want_do)
    want_do, want_dgate, want_stats, want_dv = expected(args, dead, do_made)
    dout, gate = args[:2]
    batch, rows, n_res, heads, head_dim = dout.shape
    assert do.shape == dout.shape and do.dtype == jnp.dtype(do_dtype)
    assert stats.shape == (batch, rows, heads, 3, n_res) and stats.dtype == jnp.float32
    assert dead_dv.shape == (batch, rows, heads, head_dim) and dead_dv.dtype == jnp.float32
    # 16-bit results: within their rounding of float64.
    tolerance = 2 ** -7
    np.testing.assert_allclose(helpers.to_f64(do)[written], want_do[written], rtol=tolerance,
                               atol=1e-6)
    if gate is None:
        assert dgate is None and do is dout
    else:
        assert dgate.shape == gate.shape and dgate.dtype == gate.dtype
        np.testing.assert_allclose(helpers.to_f64(dgate), want_dgate, rtol=tolerance,
                                   atol=1e-6)
    stats, dead_dv = np.asarray(stats)[written], np.asarray(dead_dv)
    want_stats = want_stats[written]
    assert np.isfinite(stats).all() and np.isfinite(dead_dv).all()
    # The copied statistics exactly; delta and the means as float32 sums.
    np.testing.assert_array_equal(stats[:, :, :2], want_stats[:, :, :2].astype(np.float32))
    np.testing.assert_allclose(stats[:, :, 2], want_stats[:, :, 2], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dead_dv[written], want_dv[written], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dead_dv[~written], want_dv[~written], rtol=0, atol=2 ** -8)
    assert not dead_dv[~dead].any()


@pytest.mark.parametrize("case", list(CASES))
def test_prologue_against_float64(case, seed):
    args, dead = random_case(case, seed)
    check(args, dead, interpret=True)


# (case, rows per group): dead rows left out at the end, of a batch element
# all padding, and kept where they share a group with a live row.
UNREAD_CASES = [("N37-H3-d8-middle-and-end", 1), ("N64-H8-d8-dead-batch", 2),
                ("N100-H8-d32", 2)]


@pytest.mark.parametrize("case,rows_per_group", UNREAD_CASES)
def test_dead_rows_no_kernel_reads_get_no_do_or_statistics(case, rows_per_group, seed):
    args, dead = random_case(case, seed)
    # Each case leaves a dead row out or, the last, keeps one beside a live row.
    check(args, dead, interpret=True, rows_per_group=rows_per_group)


def test_without_a_gate_unread_dead_rows_get_their_dv(seed):
    args, dead = random_case("N64-H8-d8-dead-batch", seed)
    check((args[0], None, *args[2:]), dead, interpret=True, rows_per_group=1)


def test_float32_gate_float16_do_and_wide_planes(seed):
    args, dead = random_case("N37-H3-d8-middle-and-end", seed, gate_dtype=jnp.float32,
                             plane_padding=11)
    check(args, dead, interpret=True, do_dtype=jnp.float16)


def test_without_a_gate_do_is_the_cotangent(seed):
    args, dead = random_case("N64-H8-d8-dead-batch", seed)
    check((args[0], None, *args[2:]), dead, interpret=True)


def test_equals_the_xla_passes(seed):
    """Against the passes it replaces (`vjp`'s gate backward and delta, the
    selects and stack of the statistics, `dead_rows.dead_row_means`), in
    float32 on the CPU: do bit for bit, the rest to float32 rounding."""
    from msa_pallas.kernels.triton import dead_rows

    args, dead = random_case("N100-H8-d32", seed)
    dout, gate, attention, means, row_max, row_log2_sum, _ = args
    do, dgate, stats, dead_dv = backward_prologue.backward_prologue(
        *args, do_dtype=jnp.bfloat16, interpret=True
    )
    rows = dead[:, :, None, None, None]
    ungated = jnp.where(rows, means[:, :, None], attention)
    sigmoid = jax.nn.sigmoid(gate.astype(jnp.float32))
    want_do = (dout.astype(jnp.float32) * sigmoid).astype(jnp.bfloat16)
    want_dgate = (dout.astype(jnp.float32) * ungated * sigmoid * (1 - sigmoid)).astype(gate.dtype)
    np.testing.assert_array_equal(np.asarray(do, np.float32), np.asarray(want_do, np.float32))
    np.testing.assert_allclose(np.asarray(dgate, np.float32), np.asarray(want_dgate, np.float32),
                               rtol=2 ** -8, atol=0)
    want_delta = jnp.swapaxes(jnp.sum(want_do.astype(jnp.float32) * ungated, axis=-1), 2, 3)
    np.testing.assert_allclose(stats[:, :, :, 2], want_delta, rtol=1e-6, atol=1e-6)
    mask = jnp.asarray(~dead[:, :, None] & np.ones(dout.shape[2], bool), jnp.int8)
    want_dv = dead_rows.dead_row_means(do, mask, n_res=dout.shape[2], interpret=True)
    np.testing.assert_allclose(dead_dv.reshape(want_dv.shape), want_dv, rtol=1e-6, atol=1e-7)


def test_no_row_told_dead_reads_every_row(seed):
    """Without the means and the rows' ends (a forward that visited every
    row): every row's residuals read as they are, no dead rows' dv."""
    args, _ = random_case("N100-H8-d32", seed)
    dout, gate, attention, means, row_max, row_log2_sum, key_end = args
    rng = np.random.default_rng(seed)
    attention = jnp.asarray(rng.standard_normal(dout.shape), jnp.float32)
    row_max, row_log2_sum = (jnp.nan_to_num(plane, nan=1.5) for plane in (row_max, row_log2_sum))
    live = (dout, gate, attention, None, row_max, row_log2_sum, None)
    do, dgate, stats, dead_dv = backward_prologue.backward_prologue(
        *live, do_dtype=jnp.bfloat16, interpret=True)
    assert dead_dv is None
    no_dead = np.zeros(dout.shape[:2], bool)
    want_do, want_dgate, want_stats, _ = expected(
        (*live[:3], means, *live[4:]), no_dead, do)
    np.testing.assert_allclose(helpers.to_f64(do), want_do, rtol=2 ** -7, atol=1e-6)
    np.testing.assert_allclose(helpers.to_f64(dgate), want_dgate, rtol=2 ** -7, atol=1e-6)
    np.testing.assert_array_equal(stats[:, :, :, :2], want_stats[:, :, :, :2].astype(np.float32))
    np.testing.assert_allclose(stats[:, :, :, 2], want_stats[:, :, :, 2], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="both"):
        backward_prologue.backward_prologue(*live[:6], key_end, do_dtype=jnp.bfloat16,
                                            interpret=True)
    with pytest.raises(ValueError, match="live_rows_end"):
        backward_prologue.backward_prologue(
            *live, do_dtype=jnp.bfloat16, interpret=True,
            live_rows_end=jnp.zeros(dout.shape[:1], jnp.int32))


def test_rejects_what_it_does_not_take(seed):
    args, _ = random_case("N37-H3-d8-middle-and-end", seed)
    with pytest.raises(ValueError, match="without a gate"):
        backward_prologue.backward_prologue(args[0], None, *args[2:], do_dtype=jnp.float16,
                                            interpret=True)
    with pytest.raises(ValueError, match="means"):
        backward_prologue.backward_prologue(*args[:3], args[3][..., :-1, :], *args[4:],
                                            do_dtype=jnp.bfloat16, interpret=True)


def masked_case(case, seed, *, mask_padding=5, plane_padding=0):
    """Masking queries: the prologue's arguments `(dout, gate, attention,
    None, row_max, row_log2_sum, key_end)`, the query mask `[B, S, N +
    mask_padding]` int8 (1 past N: ignored), the keep `[B, S, N]` (keys
    masked in the middle of the odd rows too) and the dead rows `[B, S]`.
    Every masked residue's dout, gate and attention are NaN."""
    middle = (3, 9)
    args, dead = random_case(case, seed, middle=middle, plane_padding=plane_padding)
    keep = case_keep(case, seed, middle)
    dout, gate, attention, _, row_max, row_log2_sum, key_end = args
    masked = ~keep[..., None, None]
    dout, gate, attention = (jnp.where(masked, jnp.nan, x).astype(x.dtype)
                             for x in (dout, gate, attention))
    batch, rows, n_res = keep.shape
    query_mask = np.ones((batch, rows, n_res + mask_padding), np.int8)
    query_mask[..., :n_res] = keep
    args = (dout, gate, attention, None, row_max, row_log2_sum, key_end)
    return args, jnp.asarray(query_mask), keep, dead


def expected_masked(args, keep, do_rounded):
    """float64 NumPy, masking queries: `(do, dgate, stats)`, dout, gate and
    o taken as 0 at masked residues (whatever they hold: NaN here), delta
    from `do_rounded` (the kernel's do, checked against `do`) at kept ones;
    a live row's masked residues' row max `MASKED_QUERY_ROW_MAX_LOG2` and
    log2 sum 0 (their weights 0 wherever a kernel visits them)."""
    dout, gate, attention, _, row_max, row_log2_sum, _ = args
    n_res = dout.shape[2]
    kept = keep[..., None, None]
    dout = np.where(kept, helpers.to_f64(dout), 0.0)
    ungated = np.where(kept, helpers.to_f64(attention), 0.0)
    if gate is None:
        do, dgate = dout, None
    else:
        sigmoid = 1 / (1 + np.exp(-np.where(kept, helpers.to_f64(gate), 0.0)))
        do = dout * sigmoid
        dgate = dout * ungated * sigmoid * (1 - sigmoid)
    do_rounded = np.where(kept, helpers.to_f64(do_rounded), 0.0)
    delta = np.swapaxes((do_rounded * ungated).sum(axis=-1), 2, 3)
    dead_planes = ~keep.any(axis=-1)[:, :, None, None]
    masked_planes = ~keep[:, :, None, :]
    stats = np.stack([
        np.where(dead_planes, MASKED_LOGIT_LOG2, np.where(
            masked_planes, MASKED_QUERY_ROW_MAX_LOG2, np.asarray(row_max)[..., :n_res])),
        np.where(dead_planes, math.log2(n_res), np.where(
            masked_planes, 0.0, np.asarray(row_log2_sum)[..., :n_res])),
        np.where(dead_planes, 0.0, delta),
    ], axis=3)
    return do, dgate, stats


def check_masked(args, query_mask, keep, dead, *, interpret: bool, do_dtype=jnp.bfloat16,
                 rows_per_group=None):
    """The prologue's results masking queries against float64; with
    `rows_per_group`, told each batch element's last live row. Interpreted,
    the rows no kernel reads must be left unwritten (NaN: interpret mode's
    fresh buffers)."""
    told, written = told_rows(dead, rows_per_group)
    do_made, dgate, stats, dead_dv = backward_prologue.backward_prologue(
        *args, do_dtype=do_dtype, interpret=interpret, query_mask=query_mask, **told
    )
    dout, gate = args[:2]
    batch, rows, n_res, heads, head_dim = dout.shape
    # Every dead row's dv is 0: none is made. `do` is written even without a gate.
    assert dead_dv is None
    assert do_made is not dout
    assert do_made.shape == dout.shape and do_made.dtype == jnp.dtype(do_dtype)
    assert stats.shape == (batch, rows, heads, 3, n_res) and stats.dtype == jnp.float32
    want_do, want_dgate, want_stats = expected_masked(args, keep, do_made)
    do, stats = helpers.to_f64(do_made), np.asarray(stats)
    # No gradient flows from a masked query: exactly 0 (dead rows' too,
    # where written), whatever its inputs held.
    masked = ~keep & written[:, :, None]
    assert (do[masked] == 0).all()
    assert (np.swapaxes(stats[:, :, :, 2], 2, 3)[masked] == 0).all()
    tolerance = 2 ** -7
    np.testing.assert_allclose(do[written], want_do[written], rtol=tolerance, atol=1e-6)
    if gate is None:
        assert dgate is None
    else:
        assert dgate.shape == gate.shape and dgate.dtype == gate.dtype
        dgate = helpers.to_f64(dgate)
        assert (dgate[~keep] == 0).all()
        np.testing.assert_allclose(dgate, want_dgate, rtol=tolerance, atol=1e-6)
    assert np.isfinite(stats[written]).all()
    np.testing.assert_array_equal(stats[written][:, :, :2],
                                  want_stats[written][:, :, :2].astype(np.float32))
    np.testing.assert_allclose(stats[written][:, :, 2], want_stats[written][:, :, 2],
                               rtol=1e-5, atol=1e-5)
    if interpret:
        assert np.isnan(do[~written]).all() and np.isnan(stats[~written]).all()


# (case, gated, rows per group or None: every dead row read).
MASKED_CASES = [
    ("N37-H3-d8-middle-and-end", True, None),
    ("N37-H3-d8-middle-and-end", False, 1),
    ("N64-H8-d8-dead-batch", True, 2),
    ("N64-H8-d8-dead-batch", False, None),
    ("N100-H8-d32", True, 1),
    ("N40-H2-d128-no-dead-row", False, None),
]


def masked_id(case, gated, rows_per_group):
    told = "all-read" if rows_per_group is None else f"groups-of-{rows_per_group}"
    return f"{case}-{'gated' if gated else 'no-gate'}-{told}"


@pytest.mark.parametrize("case,gated,rows_per_group", MASKED_CASES,
                         ids=[masked_id(*c) for c in MASKED_CASES])
def test_query_mask_against_float64(case, gated, rows_per_group, seed):
    args, query_mask, keep, dead = masked_case(case, seed)
    if not gated:
        args = (args[0], None, *args[2:])
    check_masked(args, query_mask, keep, dead, interpret=True, rows_per_group=rows_per_group)


@pytest.mark.parametrize("min_programs", [0, 16, 24])
def test_query_mask_chunks_of_residues_change_nothing(min_programs, monkeypatch, seed):
    """A row's residues split among programs (N = 100 in four 32-residue
    tiles, 8 row slices): one program per row slice (0), two tiles per
    program (16; 24 asks for three chunks, which two tiles each make two),
    one (the default, 2048): the results are the same, bit for bit, and
    each is checked against float64 with its unwritten rows left NaN."""
    args, query_mask, keep, dead = masked_case("N100-H8-d32", seed)
    got = {}
    for programs in (min_programs, backward_prologue._MIN_PROGRAMS):
        with monkeypatch.context() as patched:
            patched.setattr(backward_prologue, "_MIN_PROGRAMS", programs)
            check_masked(args, query_mask, keep, dead, interpret=True, rows_per_group=2)
            got[programs] = backward_prologue.backward_prologue(
                *args, do_dtype=jnp.bfloat16, interpret=True, query_mask=query_mask,
                **told_rows(dead, 2)[0])
    for ours, default in zip(*got.values()):
        if ours is not None:
            np.testing.assert_array_equal(np.asarray(ours, np.float32),
                                          np.asarray(default, np.float32))


def test_query_mask_float32_gate_float16_do_and_wide_planes(seed):
    args, query_mask, keep, dead = masked_case("N37-H3-d8-middle-and-end", seed,
                                               mask_padding=0, plane_padding=11)
    args = (args[0], args[1].astype(jnp.float32), *args[2:])
    check_masked(args, query_mask, keep, dead, interpret=True, do_dtype=jnp.float16)


def test_query_mask_rejects_what_it_does_not_take(seed):
    args, query_mask, _, _ = masked_case("N37-H3-d8-middle-and-end", seed)
    means = jnp.zeros(args[0].shape[:2] + args[0].shape[3:], jnp.float32)

    def prologue(*arguments, mask=query_mask):
        return backward_prologue.backward_prologue(*arguments, do_dtype=jnp.bfloat16,
                                                   interpret=True, query_mask=mask)

    with pytest.raises(ValueError, match="query_mask: dead rows are told by key_end alone"):
        prologue(*args[:3], means, *args[4:])
    with pytest.raises(ValueError, match="query_mask: dead rows are told by key_end alone"):
        prologue(*args[:6], None)
    for bad in (query_mask[..., :36], query_mask[:1], query_mask.astype(jnp.int32),
                query_mask[..., None]):
        with pytest.raises(ValueError, match=r"query_mask .*int8"):
            prologue(*args, mask=bad)


@pytest.mark.parametrize("x64", [False, True], ids=["x32", "x64"])
def test_lowers_for_the_gpu(x64):
    """The kernel lowers to Triton for an H200 on this machine, with and
    without `jax_enable_x64`, gated or not, dead rows told or not, the
    unread ones told or not."""
    shape = (1, 4, 200, 8, 8)
    rows = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    attention = jax.ShapeDtypeStruct(shape, jnp.float32)
    means = jax.ShapeDtypeStruct((1, 4, 8, 8), jnp.float32)
    plane = jax.ShapeDtypeStruct((1, 4, 8, 256), jnp.float32)
    key_end = jax.ShapeDtypeStruct((1, 4), jnp.int32)
    live_end = jax.ShapeDtypeStruct((1,), jnp.int32)

    def kernels(dout, gate, attention, means, row_max, row_log2_sum, key_end, live_end):
        gated = backward_prologue.backward_prologue(
            dout, gate, attention, means, row_max, row_log2_sum, key_end,
            do_dtype=jnp.bfloat16, interpret=False)
        ungated = backward_prologue.backward_prologue(
            dout, None, attention, means, row_max, row_log2_sum, key_end,
            do_dtype=jnp.bfloat16, interpret=False)
        every_row = backward_prologue.backward_prologue(
            dout, gate, attention, None, row_max, row_log2_sum, None,
            do_dtype=jnp.bfloat16, interpret=False)
        unread_rows = backward_prologue.backward_prologue(
            dout, gate, attention, means, row_max, row_log2_sum, key_end,
            do_dtype=jnp.bfloat16, interpret=False, live_rows_end=live_end, rows_per_group=2)
        return gated, ungated[2:], every_row[:3], unread_rows

    with jax.enable_x64(x64):
        text = mosaic_lowering.lowered_for_cuda(
            kernels, rows, rows, attention, means, plane, plane, key_end, live_end)
    assert text.count(exporting.TRITON_CUSTOM_CALL) == 4, text[:2000]


def test_query_mask_lowers_for_the_gpu():
    """Masking queries, the kernel lowers to Triton, gated and not, the
    unread rows told and not."""
    shape = (1, 4, 200, 8, 8)
    rows = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    attention = jax.ShapeDtypeStruct(shape, jnp.float32)
    plane = jax.ShapeDtypeStruct((1, 4, 8, 256), jnp.float32)
    key_end = jax.ShapeDtypeStruct((1, 4), jnp.int32)
    live_end = jax.ShapeDtypeStruct((1,), jnp.int32)
    query_mask = jax.ShapeDtypeStruct((1, 4, 256), jnp.int8)

    def kernels(dout, gate, attention, row_max, row_log2_sum, key_end, live_end, query_mask):
        gated = backward_prologue.backward_prologue(
            dout, gate, attention, None, row_max, row_log2_sum, key_end,
            do_dtype=jnp.bfloat16, interpret=False, live_rows_end=live_end, rows_per_group=2,
            query_mask=query_mask)
        ungated = backward_prologue.backward_prologue(
            dout, None, attention, None, row_max, row_log2_sum, key_end,
            do_dtype=jnp.bfloat16, interpret=False, query_mask=query_mask)
        return gated[:3], (ungated[0], ungated[2])

    text = mosaic_lowering.lowered_for_cuda(
        kernels, rows, rows, attention, plane, plane, key_end, live_end, query_mask)
    assert text.count(exporting.TRITON_CUSTOM_CALL) == 2, text[:2000]


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
def test_gpu_prologue_against_float64(case, seed):
    args, dead = random_case(case, seed, plane_padding=3)
    check(args, dead, interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("case,rows_per_group", UNREAD_CASES)
def test_gpu_dead_rows_no_kernel_reads_get_no_do_or_statistics(case, rows_per_group, seed):
    args, dead = random_case(case, seed, plane_padding=3)
    check(args, dead, interpret=False, rows_per_group=rows_per_group)


@pytest.mark.gpu
@pytest.mark.parametrize("case,gated,rows_per_group", MASKED_CASES[:3],
                         ids=[masked_id(*c) for c in MASKED_CASES[:3]])
def test_gpu_query_mask_against_float64(case, gated, rows_per_group, seed):
    args, query_mask, keep, dead = masked_case(case, seed, plane_padding=3)
    if not gated:
        args = (args[0], None, *args[2:])
    check_masked(args, query_mask, keep, dead, interpret=False, rows_per_group=rows_per_group)
