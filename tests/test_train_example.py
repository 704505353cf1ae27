"""examples/train_stack.py: a jit-compiled adam step through the layer learns,
and the same step on a device mesh gives the one-device loss curve."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_stack.py"


def load_example():
    spec = importlib.util.spec_from_file_location("train_stack", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # flax dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_training_reduces_loss_xla():
    losses = load_example().main(30, implementation="xla", verbose=False)
    assert len(losses) == 30 and np.all(np.isfinite(losses))
    assert losses[-1] < 0.8 * losses[0], losses
    assert losses[-1] < min(losses[:10]), losses


def test_training_steps_pallas_interpret():
    """Three steps through the Pallas kernels (interpret mode on CPU): same start, loss falls."""
    example = load_example()
    pallas = example.main(3, implementation="pallas", verbose=False)
    xla = example.main(3, implementation="xla", verbose=False)
    assert abs(pallas[0] - xla[0]) < 1e-5 * abs(xla[0])
    assert pallas[-1] < pallas[0] and abs(pallas[-1] - xla[-1]) < 1e-3 * abs(xla[-1]), (pallas, xla)


def test_training_with_attention_dropout_on_the_kernels():
    """Attention dropout 0.1 in the Triton kernels (interpret mode on CPU):
    the same masks as the xla path's, so the same loss curve; the loss falls."""
    example = load_example()
    kernels = example.main(3, implementation="triton", dropout=0.1, verbose=False)
    xla = example.main(3, implementation="xla", dropout=0.1, verbose=False)
    plain = example.main(3, implementation="xla", verbose=False)
    np.testing.assert_allclose(kernels, xla, rtol=1e-5)
    assert kernels[-1] < kernels[0] and abs(kernels[1] - plain[1]) > 1e-6 * abs(plain[1])


# --- several devices --------------------------------------------------------------

# The sharded step adds the same float32 numbers in another order (the
# gradient and loss all-reduces, each device's partial sums), 6e-8 relative
# per addition; over 30 adam steps the loss curves were measured to differ by
# at most 4e-7 relative on simulated CPU devices. 1e-5 leaves a 25x margin and
# is still 100x below what a wrong partitioning does (a gradient that misses
# one device's rows or counts them twice moves the loss by 1e-3 and more from
# the second step on).
FLOAT32_CURVE_TOLERANCE = 1e-5

_MESH_RUNS = """
import json, sys
sys.path.insert(0, {examples!r})
import train_stack
runs = {{}}
for name, options in {runs!r}:
    runs[name] = train_stack.main(verbose=False, implementation="xla", **options)
print("RESULT" + json.dumps(runs))
"""


def _run_on_cpu_devices(runs, devices=4) -> dict:
    """`main(**options)` for each (name, options) of `runs` in a subprocess with
    `devices` simulated CPU devices (fixed when JAX initialises)."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
    ).strip()
    env["JAX_PLATFORMS"] = "cpu"
    root = str(EXAMPLE.parents[1])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    code = _MESH_RUNS.format(examples=str(EXAMPLE.parent), runs=runs)
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=root,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT")][-1]
    return json.loads(line[len("RESULT"):])


def test_mesh_training_matches_one_device():
    """On 4 simulated CPU devices, `mesh="data=2,rows=2"` (B sharded over data
    and the MSA rows over rows, both at once), with the AlphaFold2 preset and
    its output dropout on (its mask must not depend on the sharding), gives the
    one-device loss curve, and the curve learns."""
    steps = 30
    options = dict(steps=steps, batch=2, num_layers=1, alphafold2=True, dropout=0.15)
    runs = [("mesh", dict(options, mesh="data=2,rows=2")), ("single", options)]
    losses = _run_on_cpu_devices(runs)
    a, b = losses["mesh"], losses["single"]
    assert len(a) == len(b) == steps and np.all(np.isfinite(a)), a
    assert b[-1] < 0.9 * b[0], b
    difference = load_example().compare_curves(a, b)
    print(f"largest relative loss difference {difference:.2e}")
    assert difference <= FLOAT32_CURVE_TOLERANCE, (difference, a, b)


def test_mesh_argument_errors():
    example = load_example()
    assert example.parse_mesh("data=2,rows=4") == {"data": 2, "rows": 4}
    assert example.parse_mesh(None) == {}
    for bad in ("heads=2", "data=0", "data=2,data=2", "data"):
        with pytest.raises(ValueError, match="--mesh"):
            example.parse_mesh(bad)
    with pytest.raises(ValueError, match="must divide"):
        example.main(1, rows=3, mesh="rows=2", verbose=False)


@pytest.mark.gpu
@pytest.mark.skipif(jax.device_count() < 2, reason="needs two or more devices")
@pytest.mark.parametrize("mesh,dtype,tolerance", [
    ("rows=2", None, FLOAT32_CURVE_TOLERANCE),
    ("data=2", "bfloat16", 1e-2),
])
def test_mesh_training_on_gpus(mesh, dtype, tolerance):
    """The Pallas kernels on 2 GPUs, rows or batch sharded, against one GPU
    (benchmarks/run_multi_gpu.sh runs the other two pairs through the CLI).
    bfloat16 compute: Flax's Dense layers round each device's part of a
    parameter gradient to bfloat16 before the sum (1.5e-4 relative on CPU)."""
    example = load_example()
    dtype = None if dtype is None else jax.numpy.bfloat16
    options = dict(implementation="pallas", verbose=False, dtype=dtype, rows=16, res=64,
                   msa_dim=64, pair_dim=32, batch=2)
    sharded = example.main(30, mesh=mesh, **options)
    single = example.main(30, **options)
    difference = example.compare_curves(sharded, single)
    print(f"{mesh} {dtype}: largest relative loss difference {difference:.2e}")
    assert single[-1] < 0.9 * single[0], single
    assert difference <= tolerance, (difference, sharded, single)
