"""AlphaFold2's own model with msa_pallas inside: a patch of `alphafold.model.modules`.

`patch_alphafold2()` replaces, in AlphaFold2's `alphafold.model.modules`
(the `alphafold` package of DeepMind's AlphaFold2 or of ColabFold's
`alphafold-colabfold`), `MSARowAttentionWithPairBias` with
`msa_pallas.haiku.MSARowAttentionWithPairBias` and `TriangleAttention` (both
nodes, and the template stack's) with `msa_pallas.haiku_triangle.TriangleAttention`.
The drop-ins take the same configs and create the same parameters, so a model
built while the patch is on runs AlphaFold2's parameter files unchanged;
`EvoformerIteration`, `EmbeddingsAndEvoformer` and `AlphaFold` look the two
names up in `modules` when they are traced, and so pick the drop-ins up.

    import msa_pallas.alphafold2 as af2_patch

    with af2_patch.patched():               # a context manager ...
        params = forward.init(key, batch)   # trace (init / apply / jit) inside it
        out = jax.jit(forward.apply)(params, key, batch)

    undo = af2_patch.patch_alphafold2()     # ... or patch until undo() is called

The patch acts at trace time: a function traced before it (or after the
context exits) keeps AlphaFold2's modules, and a jitted function traced
inside keeps the drop-ins in its cache.

Options are handed to every drop-in: `implementation` and `block_config`
(the op's; None picks the kernels on a GPU and plain XLA elsewhere), and
`inference_chunk_bytes` (rows in chunks at inference, see
`drop_in_modules`), and `precision` of the projections, by default `Precision.DEFAULT`, the
precision AlphaFold2's own einsums run at (TF32 for float32 on a recent
GPU); pass `jax.lax.Precision.HIGHEST` for exact float32 projections.
AlphaFold2's `global_config.subbatch_size` chunking has nothing to chunk in
the drop-ins (the op needs no chunking); elsewhere in the model it stays.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any, Callable, Iterator

import jax

from msa_pallas.haiku import MSARowAttentionWithPairBias
from msa_pallas.haiku_triangle import TriangleAttention

__all__ = ["patch_alphafold2", "patched", "drop_in_modules", "PATCHED_NAMES"]

PATCHED_NAMES = ("MSARowAttentionWithPairBias", "TriangleAttention")


# Measured on the H200 (bf16 Evoformer iteration, S = 512, inference; benchmarks/log):
# 64 MiB chunks keep the peak below AlphaFold2's own at N = 256 (0.49 against 0.55 GiB),
# where 256 MiB went above it (0.60), and cost at most 8% of the time; 32 MiB saves
# nothing more.
INFERENCE_CHUNK_BYTES = 64 * 2**20


def drop_in_modules(*, implementation: str | None = None, block_config: Any = None,
                    precision: Any = jax.lax.Precision.DEFAULT, mask_mode: str = "replace",
                    inference_chunk_bytes: int | None = INFERENCE_CHUNK_BYTES) -> dict[str, type]:
    """The drop-in classes, with the options bound, under AlphaFold2's names.

    Each is called as AF2 calls its module: `cls(config, global_config, name=...)`.
    `mask_mode` is the row attention's (`msa_pallas.haiku`); `"replace"`
    reproduces AF2's clipped additive mask exactly. `inference_chunk_bytes`
    (64 MiB; None: off): at inference the rows go through the projections
    and the op in chunks whose projections take at most that much, where AF2
    chunks 4 rows at a time (`subbatch_size`) for the same end; training
    runs every row at once, as AF2 does.
    """

    class PatchedMSARowAttentionWithPairBias(MSARowAttentionWithPairBias):
        def __init__(self, config, global_config, name="msa_row_attention_with_pair_bias"):
            super().__init__(config, global_config, name=name, mask_mode=mask_mode,
                             implementation=implementation, block_config=block_config,
                             precision=precision, inference_chunk_bytes=inference_chunk_bytes)

    class PatchedTriangleAttention(TriangleAttention):
        def __init__(self, config, global_config, name="triangle_attention"):
            super().__init__(config, global_config, name=name,
                             implementation=implementation, block_config=block_config,
                             precision=precision, inference_chunk_bytes=inference_chunk_bytes)

    return {"MSARowAttentionWithPairBias": PatchedMSARowAttentionWithPairBias,
            "TriangleAttention": PatchedTriangleAttention}


def _alphafold_modules(modules):
    if modules is not None:
        return modules
    try:
        return importlib.import_module("alphafold.model.modules")
    except ImportError as err:
        raise ImportError(
            "patch_alphafold2 needs AlphaFold2's `alphafold` package (e.g. "
            f"pip install alphafold-colabfold colabfold-kernels); importing it failed: {err}"
        ) from err


def patch_alphafold2(modules=None, **options) -> Callable[[], None]:
    """Puts the drop-ins into `alphafold.model.modules` (or the module object
    `modules`); returns a function that puts AlphaFold2's classes back.

    `options`: `implementation`, `block_config`, `precision`, `mask_mode`
    (see `drop_in_modules`).
    """
    modules = _alphafold_modules(modules)
    missing = [name for name in PATCHED_NAMES if not hasattr(modules, name)]
    if missing:
        raise AttributeError(f"{modules.__name__} has no {missing}: not AlphaFold2's modules.")
    saved = {name: getattr(modules, name) for name in PATCHED_NAMES}
    for name, cls in drop_in_modules(**options).items():
        setattr(modules, name, cls)

    def undo() -> None:
        for name, cls in saved.items():
            setattr(modules, name, cls)

    return undo


@contextlib.contextmanager
def patched(modules=None, **options) -> Iterator[Any]:
    """Context manager: AlphaFold2's modules patched inside, restored on exit
    (also on an exception). Yields the patched `modules` object."""
    modules = _alphafold_modules(modules)
    undo = patch_alphafold2(modules, **options)
    try:
        yield modules
    finally:
        undo()


def evoformer_iteration(*, extra_msa: bool = False, is_training: bool = False,
                        deterministic: bool = True, subbatch_size: int = 4):
    """AlphaFold2's `EvoformerIteration` with AlphaFold2's configuration, as a
    `hk.transform`ed `f(msa, pair, msa_mask, pair_mask) -> (msa, pair)`.

    Which attention modules it runs is decided when it is traced: AF2's
    outside `patched()`, msa_pallas's inside. `extra_msa=True` is the
    extra-MSA stack's block (global column attention; AF2 feeds it c_m = 64);
    otherwise the main Evoformer's (c_m = 256). Activations in bfloat16 run
    as AF2's bfloat16 mode (float32 parameters cast where used, AF2's
    `half_context`). `deterministic=False` with `is_training=True` applies
    AF2's dropout (the `apply` rng). `subbatch_size` is AF2's
    `global_config.subbatch_size` (4), its inference chunking.

    Example::

        forward = evoformer_iteration()
        params = forward.init(key, msa, pair, msa_mask, pair_mask)
        with patched():
            msa_out, pair_out = jax.jit(forward.apply)(params, key, msa, pair, msa_mask, pair_mask)
    """
    import copy

    import haiku as hk
    from alphafold.model import config, prng, utils

    evoformer_config = copy.deepcopy(config.CONFIG.model.embeddings_and_evoformer.evoformer)
    global_config = copy.deepcopy(config.CONFIG.model.global_config)
    global_config.deterministic = deterministic
    global_config.subbatch_size = subbatch_size
    name = "extra_msa_stack" if extra_msa else "evoformer_iteration"

    def forward(msa, pair, msa_mask, pair_mask):
        modules = _alphafold_modules(None)  # looked up now: patched or not
        with utils.half_context():
            block = modules.EvoformerIteration(evoformer_config, global_config,
                                               is_extra_msa=extra_msa, name=name)
            out = block({"msa": msa, "pair": pair}, {"msa": msa_mask, "pair": pair_mask},
                        is_training=is_training, safe_key=prng.SafeKey(hk.next_rng_key()))
        return out["msa"], out["pair"]

    return hk.transform(forward)
