"""The AlphaFold2 converters on AlphaFold2's real parameter names and against its own modules.

The parameters are made by AlphaFold2's code (alphafold-colabfold 2.3.27): its
`EvoformerIteration` and extra-MSA block stacked over layers by its `layer_stack`
under the scopes of its model (`alphafold/alphafold_iteration/evoformer/...`), so the
module paths, names and the leading layer axis are those of `params_model_*.npz`.
One layer is picked out of the stack by `msa_pallas.convert`, and the converted linen
layer is compared with AlphaFold2's own `MSARowAttentionWithPairBias` and
`TriangleAttention` run on the same layer's parameters.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("alphafold.model.modules", reason="needs alphafold-colabfold (test extra)")

import haiku as hk  # noqa: E402
from alphafold.model import config, layer_stack, modules, prng  # noqa: E402

from helpers import rel_err  # noqa: E402
from msa_pallas import convert  # noqa: E402

LAYERS, PICK = 3, 1
C_Z = 8
# (stack name, c_m): AlphaFold2 feeds the extra-MSA block c_m = 64, the main one 256.
STACKS = {"evoformer_iteration": 16, "extra_msa_stack": 8}
EVOFORMER = "alphafold/alphafold_iteration/evoformer/"


def stacked_alphafold2_params(seed: int, n_seq: int, n_res: int) -> dict:
    """Haiku params `{module path: {name: [LAYERS, ...]}}` as AlphaFold2's model names them,
    every array moved off AF2's initial values (some are zeros or ones)."""
    evoformer_config = config.CONFIG.model.embeddings_and_evoformer.evoformer
    global_config = config.CONFIG.model.global_config

    def stacks(msa_main, msa_extra, pair, msa_mask, pair_mask):
        with hk.experimental.name_scope("alphafold"), \
                hk.experimental.name_scope("alphafold_iteration"), \
                hk.experimental.name_scope("evoformer"):
            for name, msa in (("evoformer_iteration", msa_main), ("extra_msa_stack", msa_extra)):
                block = modules.EvoformerIteration(evoformer_config, global_config,
                                                   is_extra_msa=name == "extra_msa_stack",
                                                   name=name)

                def iteration(x, block=block):
                    return block(x, {"msa": msa_mask, "pair": pair_mask}, is_training=False,
                                 safe_key=prng.SafeKey(jax.random.key(0)))

                layer_stack.layer_stack(LAYERS)(iteration)({"msa": msa, "pair": pair})

    rng = np.random.default_rng(seed)
    inputs = (rng.normal(size=(n_seq, n_res, STACKS["evoformer_iteration"])),
              rng.normal(size=(n_seq, n_res, STACKS["extra_msa_stack"])),
              rng.normal(size=(n_res, n_res, C_Z)), np.ones((n_seq, n_res)),
              np.ones((n_res, n_res)))
    params = hk.transform(stacks).init(jax.random.key(seed),
                                       *(jnp.asarray(x, jnp.float32) for x in inputs))
    leaves, tree = jax.tree.flatten(params)
    moved = [np.asarray(x) + 0.3 * rng.normal(size=x.shape).astype(np.float32)
             / np.sqrt(x.shape[1] if x.ndim > 2 else 1) for x in leaves]
    return jax.tree.unflatten(tree, moved)


def as_npz(params: dict) -> dict:
    """The flat `{"module/path//name": array}` of AlphaFold2's `params_*.npz` files."""
    return {f"{path}//{name}": value for path, names in params.items()
            for name, value in names.items()}


def one_layer(params: dict, module_path: str, index: int) -> dict:
    """The Haiku params of one layer of the stack, under the module's own name."""
    name = module_path.rsplit("/", 1)[-1]
    return {name + path[len(module_path):]: {k: v[index] for k, v in arrays.items()}
            for path, arrays in params.items() if path.startswith(module_path)}


def alphafold2_module(cls_name: str, config_name: str, module_path: str, params: dict,
                      *inputs):
    """AlphaFold2's own module `cls_name`, run on layer PICK's parameters."""
    module_config = config.CONFIG.model.embeddings_and_evoformer.evoformer[config_name]
    global_config = config.CONFIG.model.global_config
    name = module_path.rsplit("/", 1)[-1]
    forward = hk.transform(lambda *x: getattr(modules, cls_name)(
        module_config, global_config, name=name)(*x, is_training=False))
    return forward.apply(one_layer(params, module_path, PICK), None, *inputs)


@pytest.fixture(scope="module")
def params():
    return stacked_alphafold2_params(seed=7, n_seq=5, n_res=12)


@pytest.mark.parametrize("stack", list(STACKS))
def test_row_attention_on_alphafold2_names(params, stack, seed):
    module_path = EVOFORMER + stack + "/msa_row_attention_with_pair_bias"
    c_m = STACKS[stack]
    rng = np.random.default_rng(seed)
    msa = jnp.asarray(rng.normal(size=(5, 12, c_m)), jnp.float32)
    pair = jnp.asarray(rng.normal(size=(12, 12, C_Z)), jnp.float32)
    mask = (rng.uniform(size=(5, 12)) > 0.25).astype(np.float32)
    mask[-1] = 0.0  # a padding row
    mask = jnp.asarray(mask)
    expected = alphafold2_module("MSARowAttentionWithPairBias", "msa_row_attention_with_pair_bias",
                                 module_path, params, msa, mask, pair)
    for source in (params, as_npz(params)):
        variables = convert.from_alphafold2_params(source, module_path, index=PICK)
        layer = convert.module_from_variables(variables, preset="alphafold2",
                                              implementation="xla")
        out = layer.apply(variables, msa[None], pair[None], mask[None] > 0)[0]
        # The padding row: AF2's clipped additive mask gives it uniform weights too.
        assert rel_err(out, expected) < 1e-5
    with pytest.raises(ValueError, match="stacked over 3 layers"):
        convert.from_alphafold2_params(params, module_path)


@pytest.mark.parametrize("stack", list(STACKS))
@pytest.mark.parametrize("node", ["triangle_attention_starting_node",
                                  "triangle_attention_ending_node"])
def test_triangle_attention_on_alphafold2_names(params, stack, node, seed):
    module_path = f"{EVOFORMER}{stack}/{node}"
    rng = np.random.default_rng(seed)
    pair = jnp.asarray(rng.normal(size=(12, 12, C_Z)), jnp.float32)
    residues = np.ones(12, np.float32)
    residues[-2:] = 0.0  # padding residues, as AlphaFold2 pads a crop
    mask = jnp.asarray(residues[:, None] * residues[None, :])
    expected = alphafold2_module("TriangleAttention", node, module_path, params, pair, mask)
    for source in (params, as_npz(params)):
        variables = convert.triangle_from_alphafold2_params(source, module_path, index=PICK)
        layer = convert.triangle_module_from_variables(
            variables, starting=node.endswith("starting_node"), implementation="xla")
        assert rel_err(layer.apply(variables, pair, mask > 0), expected) < 1e-5
