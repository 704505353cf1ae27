"""The layer's step with the q/k/v/gate projections fused (as committed) and separate (as before).

    PYTHONPATH=. python benchmarks/log/2026-12-04-10-layer-projections/fused_against_separate.py
(an argument: the CPU smoke cases at `tiny`). Run at 6bf0a61, where `fused_projections`
made one product whatever the biases."""
import sys
import jax, jax.numpy as jnp
from benchmarks import timing
from benchmarks.layer import LayerProgram, core_options, layer_shape
import msa_pallas.layers as layers
fused = layers.fused_projections

def separate(x, projections, *, dtype=None, precision=None):
    outs = []
    for kernel, bias in projections:
        dt = dtype or jnp.result_type(x, kernel)
        y = jax.lax.dot_general(x.astype(dt), kernel.astype(dt), (((x.ndim - 1,), (0,)), ((), ())), precision=precision)
        outs.append(y if bias is None else y + bias.astype(dt))
    return tuple(outs)

cases0 = [("reference", s, c) for s in ("train", "finetune") for c in ("default", "default+dropout", "xla+dropout")]
cases = cases0 + [("alphafold2", s, "default") for s in ("train", "finetune", "extra")] if len(sys.argv) < 2 else [("reference", "tiny", "xla+dropout"), ("alphafold2", "tiny", "xla")]
for preset, shape, core in cases:
    rate = 0.1 if core.endswith("+dropout") else 0.0
    for name, fn in (("fused", fused), ("separate", separate)):
        layers.fused_projections = fn
        prog = LayerProgram(layer_shape(shape), preset, rate, jnp.bfloat16, jnp.bfloat16, core_options(core))
        fwd, step = prog.compile()
        f = timing.median_ms(lambda i: fwd(*prog.args[:4], prog.args[5]), samples=7, reps=10, warmup=3)
        s = timing.median_ms(lambda i: step(*prog.args), samples=7, reps=10, warmup=3)
        print(f"{preset} {shape} {core} {name}: fwd {f:.4f} step {s:.4f} ms", flush=True)
