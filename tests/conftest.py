"""Test configuration.

The `gpu` and `slow` markers are registered in pyproject.toml. Tests marked
`gpu` are skipped unless JAX's default backend is a GPU. The `seed` fixture
gives every test its own PRNG seed, derived from the test's id, so no two
tests draw the same inputs while every run of one test draws the same ones.
"""

from __future__ import annotations

import zlib

import jax
import pytest


def pytest_collection_modifyitems(config, items):
    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason=f"needs a GPU (JAX backend is {jax.default_backend()!r})")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def seed(request) -> int:
    """A per-test seed: crc32 of the test id."""
    return zlib.crc32(request.node.nodeid.encode())
