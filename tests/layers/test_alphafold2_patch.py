"""AlphaFold2's own EvoformerIteration (alphafold-colabfold 2.3.27) with its
MSARowAttentionWithPairBias and both TriangleAttention modules replaced by
msa_pallas's drop-ins (msa_pallas.alphafold2), against the unpatched model,
with random parameters."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("alphafold.model.modules", reason="needs alphafold-colabfold (test extra)")

from alphafold.model import modules  # noqa: E402

from helpers import rel_err  # noqa: E402
from msa_pallas import alphafold2  # noqa: E402


def evoformer_inputs(seed, S, N, c_m, c_z, dtype=jnp.float32):
    """Activations and AF2's 0/1 masks with padding: the last residues and the last
    MSA row masked (fully masked rows and columns, as AF2 pads its inputs)."""
    rng = np.random.default_rng(seed)
    msa = rng.normal(size=(S, N, c_m))
    pair = rng.normal(size=(N, N, c_z))
    residues = np.ones(N, np.float32)
    residues[-3:] = 0
    msa_mask = (rng.uniform(size=(S, N)) > 0.2) * residues
    msa_mask[-1] = 0
    pair_mask = residues[:, None] * residues[None, :]
    return (jnp.asarray(msa, dtype), jnp.asarray(pair, dtype),
            jnp.asarray(msa_mask, jnp.float32), jnp.asarray(pair_mask, jnp.float32))


def randomised(params, seed):
    """Every parameter moved off its init (AF2 zero-initialises output and gate weights)."""
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    moved = [x + 0.3 * jax.random.normal(k, x.shape) / np.sqrt(x.shape[0] if x.ndim > 1 else 1)
             for x, k in zip(leaves, keys)]
    return jax.tree.unflatten(tree, moved)


def run_both(extra_msa, inputs, seed, **options):
    forward = alphafold2.evoformer_iteration(extra_msa=extra_msa)
    key = jax.random.key(seed)
    params = jax.jit(forward.init)(key, *inputs)
    with alphafold2.patched(**options):
        patched_params = jax.jit(forward.init)(key, *inputs)
        patched_out = jax.jit(forward.apply)(randomised(params, seed), key, *inputs)
    # The drop-ins create AF2's parameter tree with AF2's initial values.
    assert jax.tree.structure(patched_params) == jax.tree.structure(params)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)),
                                     patched_params, params))
    plain_out = jax.jit(forward.apply)(randomised(params, seed), key, *inputs)
    return patched_out, plain_out


@pytest.mark.parametrize("extra_msa", [False, True], ids=["evoformer", "extra_msa"])
def test_patched_evoformer_iteration_matches_alphafold2_float32(seed, extra_msa):
    """With inference chunks of a few rows (3 of the 4 MSA rows, 6 or 3 of the
    16 pair rows: the last chunk padded), the lax.map path of the drop-ins."""
    c_m = 64 if extra_msa else 32
    inputs = evoformer_inputs(seed, S=4, N=16, c_m=c_m, c_z=16)
    patched_out, plain_out = run_both(extra_msa, inputs, seed, implementation="xla",
                                      inference_chunk_bytes=3 * 6 * 16 * c_m * 4)
    for got, want in zip(patched_out, plain_out):
        assert got.dtype == want.dtype == jnp.float32
        assert rel_err(got, want) < 1e-5


def test_patched_evoformer_on_the_triton_interpreter(seed):
    inputs = evoformer_inputs(seed, S=3, N=12, c_m=32, c_z=16)
    patched_out, plain_out = run_both(False, inputs, seed, implementation="pallas")
    for got, want in zip(patched_out, plain_out):
        assert rel_err(got, want) < 1e-5


def test_patched_evoformer_bfloat16(seed):
    """AF2's bfloat16 mode (float32 parameters, bf16 activations): within 2e-2.
    (The block's outputs come back in float32: AF2's modules promote them.)"""
    inputs = evoformer_inputs(seed, S=4, N=16, c_m=32, c_z=16, dtype=jnp.bfloat16)
    patched_out, plain_out = run_both(False, inputs, seed, implementation="xla")
    for got, want in zip(patched_out, plain_out):
        assert got.dtype == want.dtype
        assert rel_err(got, want) < 2e-2


def test_patch_is_used_and_undone():
    original = (modules.MSARowAttentionWithPairBias, modules.TriangleAttention)
    inputs = evoformer_inputs(0, S=2, N=8, c_m=32, c_z=16)
    forward = alphafold2.evoformer_iteration()
    # An implementation the op does not know fails at trace time: the drop-ins run.
    with pytest.raises(ValueError, match="implementation"):
        with alphafold2.patched(implementation="no-such-implementation"):
            forward.init(jax.random.key(0), *inputs)
    assert (modules.MSARowAttentionWithPairBias, modules.TriangleAttention) == original
    undo = alphafold2.patch_alphafold2(implementation="xla")
    assert modules.TriangleAttention is not original[1]
    undo()
    assert (modules.MSARowAttentionWithPairBias, modules.TriangleAttention) == original


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("extra_msa", [False, True], ids=["evoformer", "extra_msa"])
def test_gpu_patched_evoformer_matches_alphafold2(seed, dtype, extra_msa):
    """AF2's sizes at N = 256 (S = 64 rows): the kernels the op picks on the GPU.

    float32 at HIGHEST precision on both sides (AF2's einsums otherwise run
    TF32 on the GPU, which alone differs by more than 1e-5)."""
    c_m = 64 if extra_msa else 256
    inputs = evoformer_inputs(seed, S=64, N=256, c_m=c_m, c_z=128, dtype=dtype)
    precision = jax.lax.Precision.HIGHEST
    with jax.default_matmul_precision("highest" if dtype == jnp.float32 else "default"):
        patched_out, plain_out = run_both(extra_msa, inputs, seed, precision=precision)
    for got, want in zip(patched_out, plain_out):
        assert rel_err(got, want) < (1e-5 if dtype == jnp.float32 else 2e-2)
