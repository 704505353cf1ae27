"""msa_pallas.haiku.MSARowAttentionWithPairBias: AlphaFold2's Haiku module on the fused op.

- Its parameters (tree, initialisers, creation order) are AlphaFold2's:
  test_haiku_params.py.
- The output equals the independent NumPy float64 Algorithm 7
  (`af2_numpy_reference.py`) with random parameters, within 1e-5 in float32,
  with a fully and a partly masked MSA row, for both mask conventions.
- The same parameters through `msa_pallas.convert.from_alphafold2_params` into
  the Flax layer give the same output and input gradients.
- jit, grad (checked against float64 finite differences of the NumPy
  reference), the Pallas kernels (interpret mode on CPU), bf16 inputs, config
  objects, bad input, the optional import, and examples/haiku_evoformer.py.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import types

import numpy as np
import pytest

hk = pytest.importorskip("haiku")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from af2_numpy_reference import (  # noqa: E402
    af2_row_attention, haiku_nested, random_af2_params, random_msa_inputs,
)
from haiku_helpers import (  # noqa: E402
    ROOT, SCOPE, TOL, configs, dummy_inputs, masked_case, transformed,
)
from helpers import rel_err  # noqa: E402
from msa_pallas import convert  # noqa: E402
from msa_pallas.haiku import MSARowAttentionWithPairBias  # noqa: E402

# ---------------------------------------------------------------------------
# Maths: the independent NumPy float64 Algorithm 7.
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("mask_mode", ["replace", "additive"])
def test_matches_numpy_algorithm7(mask_mode):
    """Random (non-zero-init) params, float32, 1e-5 vs float64; fully + partly masked rows."""
    rng = np.random.default_rng(0)
    c_m, c_z, heads, d = 32, 16, 4, 8
    p = random_af2_params(rng, c_m, c_z, heads, d)
    m, z, mask = masked_case(rng, c_m=c_m, c_z=c_z)
    f = transformed(*configs(heads), mask_mode=mask_mode)
    out = np.asarray(jax.jit(f.apply)(haiku_nested(p, SCOPE), None, m, mask, z))
    expected = af2_row_attention(m, z, mask, p, mask_mode)
    assert out.shape == (6, 21, c_m) and np.all(np.isfinite(out))
    errors = {"all": rel_err(out, expected), "fully_masked_row": rel_err(out[1], expected[1]),
              "partly_masked_row": rel_err(out[2], expected[2])}
    assert max(errors.values()) < TOL, errors
    # The two conventions differ on the fully masked row only: the test tells them apart.
    other = af2_row_attention(m, z, mask, p, {"replace": "additive", "additive": "replace"}[mask_mode])
    assert rel_err(out[1], other[1]) > 1e-2
    keep = [s for s in range(6) if s != 1]
    assert rel_err(out[keep], other[keep]) < TOL


def test_default_equals_alphafold2_releases_in_float32():
    """AF2 v2.0-v2.3 add 1e9 * (mask - 1) in float32, where -1e9 + x == -1e9 for
    |x| < 32: a fully masked row gets uniform weights, as the default "replace"."""
    rng = np.random.default_rng(1)
    c_m, c_z, heads, d = 32, 16, 4, 8
    p = random_af2_params(rng, c_m, c_z, heads, d)
    m, z, mask = masked_case(rng, c_m=c_m, c_z=c_z)
    out = transformed(*configs(heads)).apply(haiku_nested(p, SCOPE), None, m, mask, z)
    released = af2_row_attention(m, z, mask, p, "additive_float32")
    assert rel_err(out, released) < TOL and rel_err(out[1], released[1]) < TOL
    assert np.float32(-1e9) + np.float32(31.0) == np.float32(-1e9)


def test_flax_layer_cross_check_forward_and_input_grads():
    """The same params via convert.from_alphafold2_params into the Flax layer: same output
    and same gradients w.r.t. msa_act and pair_act (jit + grad through both)."""
    rng = np.random.default_rng(2)
    c_m, c_z, heads, d = 32, 16, 4, 8
    params = haiku_nested(random_af2_params(rng, c_m, c_z, heads, d), SCOPE)
    m, z, mask = masked_case(rng, c_m=c_m, c_z=c_z)
    cot = rng.standard_normal(m.shape).astype(np.float32)

    f = transformed(*configs(heads))
    variables = convert.from_alphafold2_params(params)
    layer = convert.module_from_variables(variables, preset="alphafold2", implementation="xla")

    def haiku_loss(m, z):
        return jnp.sum(f.apply(params, None, m, mask, z) * cot)

    def flax_loss(m, z):
        return jnp.sum(layer.apply(variables, m, z, mask, deterministic=True) * cot)

    ours = jax.jit(jax.value_and_grad(haiku_loss, argnums=(0, 1)))(m, z)
    theirs = jax.jit(jax.value_and_grad(flax_loss, argnums=(0, 1)))(m, z)
    np.testing.assert_allclose(ours[0], theirs[0], rtol=1e-5)
    assert rel_err(f.apply(params, None, m, mask, z),
                   layer.apply(variables, m, z, mask, deterministic=True)) < TOL
    for a, b in zip(ours[1], theirs[1]):
        assert rel_err(a, b) < TOL


def test_param_grads_match_float64_finite_differences():
    """jax.grad w.r.t. every parameter (under jit), checked along a random direction
    against central differences of the NumPy float64 Algorithm 7.

    feat_2d_norm/offset shifts every pair-bias logit of a head by the same amount,
    which the softmax ignores: its true gradient is zero (float32 noise here)."""
    rng = np.random.default_rng(3)
    c_m, c_z, heads, d = 16, 8, 2, 8
    flat = random_af2_params(rng, c_m, c_z, heads, d)
    m, z, mask = masked_case(rng, S=4, N=9, c_m=c_m, c_z=c_z)
    cot = rng.standard_normal(m.shape)
    f = transformed(*configs(heads))

    def loss(params):
        return jnp.sum(f.apply(params, None, m, mask, z) * cot.astype(np.float32))

    grads = jax.jit(jax.grad(loss))(haiku_nested(flat, SCOPE))
    direction = {k: rng.standard_normal(v.shape) for k, v in flat.items()}
    loss_scale = float(np.sum(np.abs(af2_row_attention(m, z, mask, flat, "replace") * cot)))
    eps = 1e-5
    for key in flat:  # each parameter alone
        scope, _, name = key.rpartition("/")
        g = np.asarray(grads[f"{SCOPE}/{scope}" if scope else SCOPE][name], np.float64)
        assert np.all(np.isfinite(g)), key

        def numpy_loss(t):
            p = {k: np.asarray(v, np.float64) + (t * direction[k] if k == key else 0.0)
                 for k, v in flat.items()}
            return float(np.sum(af2_row_attention(m, z, mask, p, "replace") * cot))

        numeric = (numpy_loss(eps) - numpy_loss(-eps)) / (2 * eps)
        analytic = float(np.sum(g * direction[key]))
        if key == "feat_2d_norm/offset":
            assert abs(numeric) < 1e-8 * loss_scale
        else:
            assert abs(numeric) > 1e-3 * loss_scale, key  # a real test of this parameter
        assert abs(analytic - numeric) <= 1e-4 * abs(numeric) + 1e-7 * loss_scale, (
            key, analytic, numeric)


# ---------------------------------------------------------------------------
# Kernels, dtypes, configs, bad input.
# ---------------------------------------------------------------------------

def test_pallas_kernels_interpret_mode():
    """implementation="pallas" (interpret mode on CPU): forward and msa_act gradient."""
    rng = np.random.default_rng(4)
    c_m, c_z, heads, d = 16, 8, 2, 8
    p = random_af2_params(rng, c_m, c_z, heads, d)
    params = haiku_nested(p, SCOPE)
    m, z, mask = masked_case(rng, S=3, N=10, c_m=c_m, c_z=c_z)
    cot = rng.standard_normal(m.shape).astype(np.float32)

    def run(implementation):
        f = transformed(*configs(heads), implementation=implementation)
        out, vjp = jax.vjp(lambda m: f.apply(params, None, m, mask, z), m)
        return out, vjp(cot)[0]

    out, grad = jax.jit(lambda: run("pallas"))()
    out_xla, grad_xla = run("xla")
    assert rel_err(out, af2_row_attention(m, z, mask, p, "replace")) < TOL
    assert rel_err(out, out_xla) < TOL and rel_err(grad, grad_xla) < TOL


@pytest.mark.gpu
@pytest.mark.parametrize("c_m, heads", [(256, 8), (64, 8)], ids=["evoformer", "extra_msa"])
def test_gpu_default_implementation_af2_sizes(c_m, heads):
    """On a GPU, implementation=None runs the Triton kernels: AF2's sizes (c_z 128), a
    fully and a partly masked row; float32 to 1e-5 and bf16 to 2e-2 vs float64."""
    rng = np.random.default_rng(8)
    c_z, d, S, N = 128, c_m // heads, 16, 200
    p = random_af2_params(rng, c_m, c_z, heads, d)
    params = haiku_nested(p, SCOPE)
    m, z, mask = masked_case(rng, S=S, N=N, c_m=c_m, c_z=c_z)
    expected = af2_row_attention(m, z, mask, p, "replace")
    f = transformed(*configs(heads), implementation=None)
    out = jax.jit(f.apply)(params, None, m, mask, z)
    errors = {"all": rel_err(out, expected), "fully_masked_row": rel_err(out[1], expected[1]),
              "partly_masked_row": rel_err(out[2], expected[2])}
    print(f"[rel err] haiku module f32 c_m={c_m}: {errors}")
    assert max(errors.values()) < TOL, errors
    out16 = jax.jit(f.apply)(params, None, jnp.asarray(m, jnp.bfloat16), mask,
                             jnp.asarray(z, jnp.bfloat16))
    print(f"[rel err] haiku module bf16 c_m={c_m}: {rel_err(out16, expected):.2e}")
    assert out16.dtype == jnp.bfloat16 and rel_err(out16, expected) < 2e-2


def test_bfloat16_inputs():
    """bf16 in -> bf16 out; parameters stay float32 (AF2's bfloat16 mode); close to f32."""
    rng = np.random.default_rng(5)
    c_m, c_z, heads, d = 32, 16, 4, 8
    p = random_af2_params(rng, c_m, c_z, heads, d)
    m, z, mask = masked_case(rng, c_m=c_m, c_z=c_z)
    f = transformed(*configs(heads, zero_init=False))
    init = jax.eval_shape(f.init, jax.random.key(0), m.astype(jnp.bfloat16), mask,
                          z.astype(jnp.bfloat16))
    assert all(v.dtype == jnp.float32 for g in init.values() for v in g.values())
    out = jax.jit(f.apply)(haiku_nested(p, SCOPE), None, jnp.asarray(m, jnp.bfloat16), mask,
                           jnp.asarray(z, jnp.bfloat16))
    assert out.dtype == jnp.bfloat16 and np.all(np.isfinite(np.asarray(out, np.float32)))
    assert rel_err(out, af2_row_attention(m, z, mask, p, "replace")) < 2e-2


class AttrDict(dict):
    """A dict with attribute access (what ml_collections.ConfigDict offers)."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError as err:
            raise AttributeError(name) from err


@pytest.mark.parametrize("kind", ["attrdict", "dict"])
def test_config_objects(kind):
    """Configs as a dict with attribute access, or a plain Mapping, read like SimpleNamespace."""
    rng = np.random.default_rng(6)
    c_m, c_z, heads, d = 16, 8, 2, 8
    p = random_af2_params(rng, c_m, c_z, heads, d)
    m, z, mask = masked_case(rng, S=3, N=7, c_m=c_m, c_z=c_z)
    wrap = AttrDict if kind == "attrdict" else dict
    config = wrap(num_head=heads, gating=True, orientation="per_row", key_dim=c_m)
    f = transformed(config, wrap(zero_init=True))
    out = f.apply(haiku_nested(p, SCOPE), None, m, mask, z)
    assert rel_err(out, af2_row_attention(m, z, mask, p, "replace")) < TOL


def test_is_training_and_batch_axes():
    """is_training changes nothing (AF2 applies dropout outside); leading batch axes work."""
    rng = np.random.default_rng(7)
    c_m, c_z, heads, d = 16, 8, 2, 8
    p = random_af2_params(rng, c_m, c_z, heads, d)
    m, z, mask = random_msa_inputs(rng, (2,), 3, 7, c_m, c_z)
    f = transformed(*configs(heads))
    params = haiku_nested(p, SCOPE)
    out = f.apply(params, None, m, mask, z, is_training=True)
    np.testing.assert_array_equal(out, f.apply(params, None, m, mask, z, is_training=False))
    assert out.shape == (2, 3, 7, c_m)
    assert rel_err(out, af2_row_attention(m, z, mask, p)) < TOL
    # Batched and unbatched programs may add in another order: float32 rounding apart.
    assert rel_err(out[1], f.apply(params, None, m[1], mask[1], z[1])) < 1e-6


def test_bad_config_and_inputs():
    c_m, c_z = 16, 8
    args = dummy_inputs(2, 5, c_m, c_z)
    key = jax.random.key(0)
    cases = [
        (configs(4, key_dim=16, value_dim=32), ValueError, "per-head key dim 4"),
        (configs(3), ValueError, "divisible by num_head=3"),
        ((types.SimpleNamespace(num_head=2, gating=True, orientation="per_column"),
          types.SimpleNamespace(zero_init=True)), ValueError, "per_row"),
        ((types.SimpleNamespace(gating=True), types.SimpleNamespace(zero_init=True)),
         AttributeError, "'num_head'"),
        ((types.SimpleNamespace(num_head=2, gating=True), types.SimpleNamespace()),
         AttributeError, "'zero_init'"),
    ]
    for (config, global_config), error, match in cases:
        with pytest.raises(error, match=match):
            transformed(config, global_config).init(key, *args)
    f = transformed(*configs(2))
    m, mask, z = args
    with pytest.raises(ValueError, match=r"pair_act has shape \[5, 4, 8\]"):
        f.init(key, m, mask, z[:, :4])
    with pytest.raises(ValueError, match=r"msa_mask has shape \[2, 4\]; expected \[2, 5\]"):
        f.init(key, m, mask[:, :4], z)
    with pytest.raises(ValueError, match="msa_act has shape"):
        f.init(key, m[0], mask[0], z)
    with pytest.raises(ValueError, match="mask_mode='bogus'"):
        hk.transform(lambda: MSARowAttentionWithPairBias(*configs(2), mask_mode="bogus")).init(key)


# ---------------------------------------------------------------------------
# The optional import.
# ---------------------------------------------------------------------------

def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


def test_import_msa_pallas_does_not_import_haiku():
    result = _python(
        "import sys, msa_pallas\n"
        "assert 'haiku' not in sys.modules and 'msa_pallas.haiku' not in sys.modules, "
        "sorted(m for m in sys.modules if 'haiku' in m)\n"
        "sys.modules['haiku'] = None   # as if dm-haiku were not installed\n"
        "try:\n"
        "    import msa_pallas.haiku\n"
        "except ImportError as err:\n"
        "    print('ImportError:', err)\n")
    assert result.returncode == 0, result.stderr
    assert "ImportError:" in result.stdout
    # The hint gives the README's install line for the extra.
    readme_line = 'pip install -e ".[haiku]"'
    assert readme_line in (ROOT / "README.md").read_text()
    assert readme_line in result.stdout and "pip install dm-haiku" in result.stdout


# ---------------------------------------------------------------------------
# examples/haiku_evoformer.py.
# ---------------------------------------------------------------------------

def _load_example():
    path = ROOT / "examples" / "haiku_evoformer.py"
    spec = importlib.util.spec_from_file_location("haiku_evoformer", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_haiku_evoformer_example(capsys):
    example = _load_example()
    out, loaded, (msa_act, msa_mask, pair_act) = example.main(blocks=2, seqs=6, res=12)
    printed = capsys.readouterr().out
    assert "-> (6, 12, 64) float32" in printed and "//query_w'" in printed
    assert out.shape == msa_act.shape and np.all(np.isfinite(np.asarray(out)))
    assert rel_err(out, msa_act) > 1e-2  # the blocks do something

    # The npz is AF2's format: the Flax converter reads block 1's row attention from it,
    # and that layer equals block 1's Haiku row attention on the loaded parameters.
    prefix = (f"{example.EVOFORMER_SCOPE}/evoformer_iteration/"
              "msa_row_attention_with_pair_bias")
    flat = example.haiku_to_flat(loaded)
    assert f"{prefix}/attention//query_w" in flat and flat[f"{prefix}/attention//query_w"].shape[0] == 2
    variables = convert.from_alphafold2_params(flat, prefix, index=1)
    layer = convert.module_from_variables(variables, preset="alphafold2", implementation="xla")
    block1 = {k.replace(prefix, SCOPE, 1): {n: v[1] for n, v in g.items()}
              for k, g in loaded.items() if k.startswith(prefix)}
    config = example.af2_config().msa_row_attention_with_pair_bias
    haiku_out = jax.jit(transformed(config, types.SimpleNamespace(zero_init=False)).apply)(
        block1, None, msa_act, msa_mask, pair_act)
    flax_out = jax.jit(layer.apply)(variables, msa_act, pair_act, msa_mask)
    assert rel_err(haiku_out, flax_out) < TOL
