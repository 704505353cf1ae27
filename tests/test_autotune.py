"""The autotuner on CPU (interpret mode): it picks among the candidates, the
picked tiles compute the right thing, and the cache is read back."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
import msa_pallas
from msa_pallas import autotune
from msa_pallas.block_sizes import KernelTiles
from msa_pallas.kernels.mosaic.tiles import MosaicTiles

SHAPE = (1, 2, 40, 2, 16)  # N = 40: several 16-wide tiles and a tail
CANDIDATES = {
    name: (KernelTiles(16, 16, 4, 2), KernelTiles(32, 16, 4, 2))
    for name in autotune.DEFAULT_CANDIDATES
}
# The fused dq+dbias kernel needs every key in one tile (block_k >= N).
CANDIDATES["backward_dq_dbias"] = (KernelTiles(16, 64, 4, 2), KernelTiles(16, 64, 2, 2))
SEPARATE = [name for name in CANDIDATES if name != "backward_dq_dbias"]


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MSA_PALLAS_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_picks_candidates_and_caches(cache_dir):
    config = autotune.autotune(SHAPE, jnp.float32, candidates=CANDIDATES, iters=1, reps=1)
    for name in SEPARATE:
        assert getattr(config, name) in CANDIDATES[name]
    # Kept only where it beat dq plus dbias.
    assert config.backward_dq_dbias in (None, *CANDIDATES["backward_dq_dbias"])
    cached = json.loads((cache_dir / autotune.CACHE_FILE).read_text())
    key = autotune.cache_key(SHAPE, jnp.float32, True, False)
    assert set(cached) == {key}

    # A second call reads the file instead of timing: plant a different
    # (valid) answer there and get it back.
    planted = {name: {"block_q": 16, "block_k": 32, "num_warps": 2, "num_stages": 1}
               for name in SEPARATE}
    planted["backward_dq_dbias"] = None
    (cache_dir / autotune.CACHE_FILE).write_text(json.dumps({key: planted}))
    again = autotune.autotune(SHAPE, jnp.float32, candidates=CANDIDATES, iters=1, reps=1)
    assert again.forward == KernelTiles(16, 32, 2, 1)
    assert again.backward_dbias == KernelTiles(16, 32, 2, 1)
    assert again.backward_dq_dbias is None


def test_tuned_config_is_correct(cache_dir):
    config = autotune.autotune(
        SHAPE, jnp.float32, candidates=CANDIDATES, iters=1, reps=1, use_cache=False
    )
    assert not (cache_dir / autotune.CACHE_FILE).exists()
    rng = np.random.default_rng(11)
    q, k, v, gate = (rng.standard_normal(SHAPE).astype(np.float32) for _ in range(4))
    bias = rng.standard_normal((SHAPE[0], SHAPE[3], SHAPE[2], SHAPE[2])).astype(np.float32)
    mask = rng.random(SHAPE[:3]) > 0.2
    out = msa_pallas.msa_row_attention(
        q, k, v, bias, mask, gate, implementation="pallas", block_config=config
    )
    ref = msa_pallas.msa_row_attention(q, k, v, bias, mask, gate, implementation="xla")
    err = np.linalg.norm(np.asarray(out) - np.asarray(ref)) / np.linalg.norm(np.asarray(ref))
    assert err < 1e-5


def test_returns_the_fastest_candidate(cache_dir):
    """With an injected timer (given times, nothing run): each kernel gets its
    fastest candidate, wherever it stands in the list, and the fused dq+dbias
    kernel is kept only when it beats dq plus dbias."""
    tiles = [KernelTiles(16, 16, 4, 2), KernelTiles(32, 16, 4, 2), KernelTiles(16, 32, 2, 1),
             KernelTiles(32, 32, 8, 3)]
    fused = [KernelTiles(16, 64, 4, 2), KernelTiles(16, 64, 2, 2), KernelTiles(16, 64, 4, 3)]
    candidates = {name: tuple(tiles) for name in SEPARATE}
    candidates["backward_dq_dbias"] = tuple(fused)
    rng = np.random.default_rng(3)
    for fused_wins in (True, False):
        # Distinct random times; the fastest of each kernel at a different place.
        times = {name: dict(zip(candidates[name], rng.permutation(len(candidates[name])) + 1.0))
                 for name in candidates}
        fastest = {name: min(times[name], key=times[name].get) for name in times}
        separate_ms = times["backward_dq"][fastest["backward_dq"]] + \
            times["backward_dbias"][fastest["backward_dbias"]]
        scale = 0.5 if fused_wins else 2.0  # fused best vs dq + dbias best (each >= 1 ms)
        times["backward_dq_dbias"] = {t: ms * scale * separate_ms for t, ms in
                                      times["backward_dq_dbias"].items()}
        timed = []

        def timer(name, tiles, run):
            assert callable(run)
            timed.append((name, tiles))
            return times[name][tiles]

        config = autotune.autotune(SHAPE, jnp.float32, candidates=candidates, timer=timer,
                                   use_cache=False)
        assert set(timed) == {(n, t) for n in candidates for t in candidates[n]}
        assert len(timed) == sum(len(c) for c in candidates.values())  # each timed once
        for name in SEPARATE:
            assert getattr(config, name) == fastest[name], (name, times[name])
        assert config.backward_dq_dbias == (fastest["backward_dq_dbias"] if fused_wins else None)
    # The fastest anywhere but first and last too: a tuner that keeps the first,
    # the last or the slowest candidate fails this.
    times = {name: dict(zip(candidates[name], (3.0, 1.0, 4.0, 2.0)[:len(candidates[name])]))
             for name in candidates}
    config = autotune.autotune(SHAPE, jnp.float32, candidates=candidates, use_cache=False,
                               timer=lambda name, tiles, run: times[name][tiles])
    assert config.forward == tiles[1] and config.backward_dkdv == tiles[1]


MOSAIC_SHAPE = (1, 2, 20, 1, 16)  # N = 20: no multiple of 8, one partial tile


def test_mosaic_candidates_are_the_defaults_and_their_neighbours():
    """Each Mosaic kernel's candidates start with its own default choice (the
    op's plan) and step one choice from it; no persistent forward off a GPU;
    no Mosaic forward for float32 (the Triton forward runs there)."""
    shape = (1, 4, 384, 8, 32)
    found = autotune.mosaic_candidates(shape, jnp.bfloat16)
    assert tuple(found) == autotune.MOSAIC_KERNELS
    q = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    bias = jax.ShapeDtypeStruct((1, 8, 384, 384), jnp.float32)
    plan = msa_pallas.explain(q, q, q, bias, jax.ShapeDtypeStruct(shape[:3], jnp.bool_),
                              implementation="mosaic")
    assert found["mosaic_forward"][0] == plan.forward_tiles
    for kernel in ("dkdv", "dq", "dbias"):
        default, *neighbours = found[f"mosaic_{kernel}"]
        assert default == plan.tiles_of(kernel) and len(neighbours) >= 3
        for tiles in neighbours:
            changed = [name for name in ("block_q", "block_k", "num_stages", "msa_rows")
                       if getattr(tiles, name) != getattr(default, name)]
            assert len(changed) == 1, (default, tiles)
    assert not any(tiles.persistent for tiles in found["mosaic_forward"])
    assert "mosaic_forward" not in autotune.mosaic_candidates(shape, jnp.float32)
    # The dk/dv kernel at block_k = 192 launches with a misaligned address on
    # the H200, which poisons the process: no candidate of any kernel has it.
    assert all(tiles.block_k != 192 for candidates in found.values() for tiles in candidates)


def test_tunes_the_mosaic_tiles_in_the_interpreter(cache_dir):
    """`mosaic=True` on CPU: every Mosaic candidate runs in the Mosaic GPU
    interpreter (a tiny shape), the fastest by the given times is kept per
    kernel, the op on the result matches float64, and the cache gives the
    same config back."""
    small = {name: (KernelTiles(16, 16, 4, 1),) for name in autotune.DEFAULT_CANDIDATES}
    small["backward_dq_dbias"] = (KernelTiles(16, 32, 4, 1),)
    # Two candidates per kernel (each one an interpreter compile of 1-3 s).
    mosaic = {
        name: (MosaicTiles(64, 64, 2, msa_rows=1), MosaicTiles(64, 128, 3, msa_rows=2))
        for name in autotune.MOSAIC_KERNELS
    }
    # The fastest candidate alternates from kernel to kernel.
    times = {name: dict(zip(mosaic[name], np.roll([1.0, 2.0], shift)))
             for shift, name in enumerate(autotune.MOSAIC_KERNELS)}
    ran = []

    def timer(name, tiles, run):
        jax.block_until_ready(run())
        ran.append((name, tiles))
        return times[name][tiles] if name in times else 1.0

    config = autotune.autotune(MOSAIC_SHAPE, jnp.bfloat16, has_gate=True, mosaic=True,
                               candidates=small | mosaic, timer=timer)
    assert {(n, t) for n, t in ran if n in mosaic} == {
        (n, t) for n in mosaic for t in mosaic[n]}
    fastest = {name: min(times[name], key=times[name].get) for name in times}
    assert config.mosaic_forward == fastest["mosaic_forward"]
    backward = config.mosaic_backward
    assert (backward.dkdv, backward.dq, backward.dbias) == (
        fastest["mosaic_dkdv"], fastest["mosaic_dq"], fastest["mosaic_dbias"])

    inputs = helpers.random_inputs(5, 1, 2, 20, 1, 16, jnp.bfloat16, fully_masked_row=True)
    result = helpers.fwd_bwd("mosaic", block_config=config)(*inputs.args)
    helpers.assert_shapes_dtypes_finite(result, inputs)
    helpers.compare(result, helpers.numpy_results(inputs), helpers.tolerance(jnp.bfloat16),
                    "tuned mosaic")
    again = autotune.autotune(MOSAIC_SHAPE, jnp.bfloat16, has_gate=True, mosaic=True,
                              timer=lambda *a: pytest.fail("timed again"))
    assert again == config
    # The Triton-only entry is another key: no Mosaic tiles come back from it.
    assert autotune.cache_key(MOSAIC_SHAPE, jnp.bfloat16, True, True, True) != \
        autotune.cache_key(MOSAIC_SHAPE, jnp.bfloat16, True, True)


def test_cache_leaves_the_kernels_ways_to_the_defaults(cache_dir):
    """A cached Mosaic entry gives back its tiles, and the fields that choose how
    a kernel computes (`autotune.UNTUNED_FIELDS`) come from today's defaults: an
    entry written when masked keys' ds took a select, or with a field since
    removed, reads as today's kernels with its tiles. Entries written now hold
    no such field."""
    config = msa_pallas.default_block_config(20, 16, jnp.bfloat16, jnp.bfloat16)
    mine = MosaicTiles(64, 128, 3, msa_rows=1)
    old_entry = {
        name: None if tiles is None else dataclasses.asdict(tiles)
        for name, tiles in ((f.name, getattr(config, f.name)) for f in dataclasses.fields(config))
        if name not in ("mosaic_forward", "mosaic_backward")
    }
    written_then = dataclasses.asdict(mine) | {
        "staggered_bias": False, "mask_without_select": False, "prefetch_next_item": False}
    old_entry["mosaic_forward"] = written_then
    old_entry["mosaic_backward"] = {kernel: written_then for kernel in ("dkdv", "dq", "dbias")}
    old_entry["mosaic_backward"]["ping_pong"] = False
    key = autotune.cache_key(MOSAIC_SHAPE, jnp.bfloat16, True, True, True)
    (cache_dir / autotune.CACHE_FILE).write_text(json.dumps({key: old_entry}))
    cached = autotune.autotune(MOSAIC_SHAPE, jnp.bfloat16, has_gate=True, mosaic=True,
                               timer=lambda *a: pytest.fail("timed"))
    assert mine.mask_without_select and mine.staggered_bias
    assert cached.mosaic_forward == mine
    backward = cached.mosaic_backward
    assert (backward.dkdv, backward.dq, backward.dbias) == (mine, mine, mine)
    assert not backward.ping_pong
    written_now = autotune._config_to_json(cached)
    for fields in (written_now["mosaic_forward"], written_now["mosaic_backward"]["dq"]):
        assert fields["block_k"] == 128 and not set(autotune.UNTUNED_FIELDS) & set(fields)


def test_rejects_bad_shape(cache_dir):
    with pytest.raises(ValueError, match="expected \\(B, S, N, H, d\\)"):
        autotune.autotune((2, 8, 32), jnp.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_tunes_on_the_gpu(cache_dir, dtype):
    """The compiled kernels: every candidate is timed, the winners compute the
    op and its gradients as the plain-jnp path does, and the cache is written."""
    shape = (1, 8, 200, 4, 32)  # N = 200: partial tiles at every tile size
    candidates = {
        "forward": (KernelTiles(64, 64, 4, 2), KernelTiles(64, 32, 4, 1)),
        "backward_dkdv": (KernelTiles(32, 64, 4, 2), KernelTiles(32, 64, 4, 1)),
        "backward_dq": (KernelTiles(64, 32, 4, 2), KernelTiles(64, 64, 4, 1)),
        "backward_dbias": (KernelTiles(64, 64, 4, 3), KernelTiles(64, 64, 4, 1)),
        "backward_dq_dbias": (KernelTiles(16, 256, 2, 2), KernelTiles(16, 256, 4, 1)),
    }
    config = autotune.autotune(shape, dtype, has_gate=True, candidates=candidates, iters=3)
    assert (cache_dir / autotune.CACHE_FILE).exists()
    rng = np.random.default_rng(5)
    q, k, v, gate, dout = (jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(5))
    bias = jnp.asarray(rng.standard_normal((1, 4, 200, 200)), jnp.float32)
    mask = jnp.asarray(rng.random(shape[:3]) > 0.2)

    def results(implementation, block_config=None):
        def f(q, k, v, bias, gate):
            return msa_pallas.msa_row_attention(
                q, k, v, bias, mask, gate,
                implementation=implementation, block_config=block_config)
        out, pullback = jax.vjp(f, q, k, v, bias, gate)
        return (out, *pullback(dout))

    tuned = results("pallas", config)
    reference = results("xla")
    tolerance = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    for name, got, want in zip(("out", "dq", "dk", "dv", "dbias", "dgate"), tuned, reference):
        want = np.asarray(want, np.float64)
        err = np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want)
        assert err < tolerance, (name, err, config)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_tunes_the_mosaic_tiles_on_the_gpu(cache_dir, dtype):
    """On Hopper, `autotune` tunes the Mosaic kernels' tiles by default (their
    default choices and neighbours; those past shared memory skipped), and
    the op on the result matches the plain-jnp path, forward and gradients."""
    if not msa_pallas.dispatch.current_target().hopper:
        pytest.skip("the Mosaic GPU kernels need an sm90 GPU")
    shape = (1, 8, 256, 4, 32)
    triton = {name: candidates[:1] for name, candidates in autotune.DEFAULT_CANDIDATES.items()}
    config = autotune.autotune(shape, dtype, has_gate=True, candidates=triton, iters=3)
    assert config.mosaic_backward is not None
    assert (config.mosaic_forward is None) == (dtype == jnp.float32)
    rng = np.random.default_rng(6)
    q, k, v, gate, dout = (jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(5))
    bias = jnp.asarray(rng.standard_normal((1, 4, 256, 256)), jnp.float32)
    mask = jnp.asarray(rng.random(shape[:3]) > 0.2)

    def results(implementation, block_config=None):
        def f(q, k, v, bias, gate):
            return msa_pallas.msa_row_attention(
                q, k, v, bias, mask, gate,
                implementation=implementation, block_config=block_config)
        out, pullback = jax.vjp(f, q, k, v, bias, gate)
        return (out, *pullback(dout))

    tuned, reference = results("mosaic", config), results("xla")
    tolerance = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    for name, got, want in zip(("out", "dq", "dk", "dv", "dbias", "dgate"), tuned, reference):
        want = np.asarray(want, np.float64)
        err = np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want)
        assert err < tolerance, (name, err, config)
