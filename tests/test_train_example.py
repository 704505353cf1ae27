"""examples/train_stack.py: a jit-compiled adam step through the layer learns."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import numpy as np

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
