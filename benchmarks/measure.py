"""Inputs, timing and memory of one benchmark case, and the record of it for results.json.

A case is measured in two modes: `fwd` (the forward) and `fwd_bwd` (the forward plus the
gradients of q, k, v and bias). For each implementation and mode: the median and minimum
wall time of jitted calls (`timing.times_ms`: samples of back-to-back
calls; with `calls_per_program` > 1, of programs that each make that many calls,
`in_one_program`), XLA's compiled temporary and output memory, and the time against a
lower bound set by the exponentials and the matrix work.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import gc
import math
import statistics
import time
from typing import Callable, Protocol

import jax
import jax.numpy as jnp

from benchmarks import timing
from benchmarks.alternatives import IMPLEMENTATIONS, REFERENCE_POINTS, Unavailable
from benchmarks.shapes import Case, make_mask

MODES = ("fwd", "fwd_bwd")
MODE_LABELS = {"fwd": "fwd", "fwd_bwd": "f+b"}
CHECK_REFERENCE = "xla"  # forward outputs are compared with this implementation's
# Forward relative error (vs CHECK_REFERENCE) above which a note is added.
CHECK_TOLERANCE = {"bf16": 3e-2, "f16": 1e-2, "f32": 1e-4}

# --- an H200's rates, for the lower bound (measured on the card) -------------

L2_BYTES = 60e6
EXP_PER_S = 3.9e12
MATMUL_FLOP_PER_S = {"bf16": 790e12, "f16": 790e12, "f32": 60e12}
EXPS_PER_LOGIT = {"fwd": 1, "fwd_bwd": 3}  # fwd: 1; backward recomputes p twice
MATMUL_FLOPS_PER_LOGIT_AND_DIM = {"fwd": 4, "fwd_bwd": 14}  # 2 matmuls fwd, 5 bwd


def floor_ms(case: Case, mode: str) -> dict[str, float]:
    """Lower bound in ms: the exponentials, the matrix work, and their max (every logit counted)."""
    exp_ms = EXPS_PER_LOGIT[mode] * case.logits / EXP_PER_S * 1e3
    flops = MATMUL_FLOPS_PER_LOGIT_AND_DIM[mode] * case.logits * case.dims[4]
    matmul_ms = flops / MATMUL_FLOP_PER_S[case.dtype_name] * 1e3
    return {"exp_ms": exp_ms, "matmul_ms": matmul_ms, "floor_ms": max(exp_ms, matmul_ms)}


# --- inputs ---------------------------------------------------------------------


def input_key(seed: int) -> jax.Array:
    """The PRNG key of the inputs. XLA's RngBitGenerator ("rbg"): its programs compile in
    a fraction of a second on CPU, where threefry's take seconds; any values will do."""
    return jax.random.key(seed, impl="rbg")


def make_input_set(case: Case, key: jax.Array) -> tuple:
    """(q, k, v, bias, mask, ct): normal q/k/v/ct `[B, S, N, H, d]` in the case's dtype,
    a normal bias `[B, H, N, N]` in its bias dtype, and the shape's `[B, S, N]` bool mask."""
    return jax.block_until_ready(_input_set(case, key))


@functools.partial(jax.jit, static_argnums=0)  # one compiled program, not an op at a time
def _input_set(case: Case, key: jax.Array) -> tuple:
    b, s, n, h, d = case.dims
    kq, kk, kv, kb, km, kc = jax.random.split(key, 6)
    qkv_shape = (b, s, n, h, d)
    normal = lambda k_, shape, dtype: jax.random.normal(k_, shape, jnp.float32).astype(dtype)  # noqa: E731
    return (
        normal(kq, qkv_shape, case.dtype), normal(kk, qkv_shape, case.dtype),
        normal(kv, qkv_shape, case.dtype), normal(kb, (b, h, n, n), case.bias_dtype),
        make_mask(case.shape, km), normal(kc, qkv_shape, case.dtype),
    )


def input_set_bytes(case: Case) -> int:
    """Bytes of one input set: q, k, v, cotangent, bias and mask."""
    b, s, n, h, d = case.dims
    item, bias_item = jnp.dtype(case.dtype).itemsize, jnp.dtype(case.bias_dtype).itemsize
    return 4 * b * s * n * h * d * item + b * h * n * n * bias_item + b * s * n


def num_input_sets(case: Case) -> int:
    """Input sets to rotate: enough to exceed twice the L2 when one set fits in it,
    so that no implementation is timed on inputs the cache still holds."""
    set_bytes = input_set_bytes(case)
    if set_bytes >= L2_BYTES:
        return 1
    return int(min(16, max(2, math.ceil(2 * L2_BYTES / set_bytes))))


def mode_args(mode: str, inputs: tuple) -> tuple:
    """The arguments of the `mode` callable: fwd takes no cotangent."""
    return inputs[:5] if mode == "fwd" else inputs


# --- timing and memory ------------------------------------------------------------


def is_out_of_memory(text: str) -> bool:
    """Whether an error's text says the device ran out of memory."""
    lowered = text.lower()
    return "resource_exhausted" in lowered or "out of memory" in lowered


def describe_failure(exc: BaseException) -> str:
    """`OOM` for out-of-memory errors, otherwise `error: <first line>`."""
    if is_out_of_memory(f"{type(exc).__name__}: {exc}"):
        return "OOM"
    first = next((line for line in str(exc).splitlines() if line.strip()), "")
    return f"error: {type(exc).__name__}: {first.strip()}"[:200]


def memory_stats(compiled) -> dict[str, int | None]:
    """XLA's temporary and output bytes of a compiled executable (None if unknown)."""
    try:
        analysis = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - not every backend implements it
        analysis = None
    temp = getattr(analysis, "temp_size_in_bytes", None)
    output = getattr(analysis, "output_size_in_bytes", None)
    total = temp + output if temp is not None and output is not None else None
    return {"temp_bytes": temp, "output_bytes": output, "temp_plus_output_bytes": total}


def in_one_program(fn: Callable, calls: int) -> Callable:
    """`fn` (jitted, array arguments) made `calls` times in one jitted program, on the
    same inputs, giving every call's outputs (a tuple, the last call's last); `fn`
    itself for one call. Each call's inputs pass through `lax.optimization_barrier`
    with the previous call's outputs, so that XLA does not merge the calls (they see
    the same inputs; it may drop the barriers after that, and on one stream the calls
    still run one after the other); every call's outputs are the program's, so none is
    left out (it holds `calls` times one call's outputs). Timed,
    such a program leaves the host's cost of dispatching a program out of the time per
    call, as a model's compiled step does: where one call is short, that cost can
    exceed it."""
    if calls == 1:
        return fn

    @jax.jit
    def repeated(*args):
        outs = [fn(*args)]
        for _ in range(calls - 1):
            barred, _ = jax.lax.optimization_barrier((args, outs[-1]))
            outs.append(fn(*barred))
        return tuple(outs)

    return repeated


def measure_callable(
    jitted: Callable, arg_sets: list[tuple], iters: int, warmup: int, reps: int = 1,
    compiling: concurrent.futures.Future | None = None, calls: int = 1,
) -> tuple[dict, object]:
    """Compiles, reads memory, warms up, then takes `iters` samples rotating `arg_sets`.

    A sample is `reps` back-to-back calls, waited for once, divided by `reps`
    (`timing.times_ms`): the host's dispatch latency stays out of the number, unless
    the host queues a call no faster than the GPU runs it (`queued_ms`, the median
    of the samples' per-call queuing time, tells). `calls` > 1: each call is a program
    of that many calls (`in_one_program`), the times divided by it; the memory is a
    single call's, from a compile of its own. `compiling`: the compile started ahead
    (`compiled_ahead`, of `in_one_program(jitted, calls)`), a future of (the compiled
    program, seconds), in place of compiling here.

    Returns (result dict, output of the first call or None). Failures are
    recorded in the result's `status`, never raised.
    """
    result: dict = {"status": "ok"}
    first_output = None
    try:
        compiled, result["compile_s"] = (
            timing.compile_timed(lambda: in_one_program(jitted, calls).lower(*arg_sets[0]))
            if compiling is None else compiling.result())
        result.update(memory_stats(
            compiled if calls == 1 else jitted.lower(*arg_sets[0]).compile()))
        first_output = jax.block_until_ready(compiled(*arg_sets[0]))  # the first warm-up call
        if calls > 1:
            first_output = first_output[-1]
        queued: list[float] = []
        times = timing.times_ms(lambda i: compiled(*arg_sets[i % len(arg_sets)]),
                                samples=iters, reps=reps, warmup=max(1, warmup) - 1,
                                queued_ms=queued)
        times = [t / calls for t in times]
        result.update(median_ms=statistics.median(times), min_ms=min(times), times_ms=times,
                      queued_ms=statistics.median(queued) / calls)
    except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
        result["status"] = describe_failure(exc)
        result["detail"] = f"{type(exc).__name__}: {exc}"[:2000]
        first_output = None
    return result, first_output


@dataclasses.dataclass
class Built:
    """An implementation made for a case (`IMPLEMENTATIONS[impl](case)`), or why not, and
    the futures of its modes' compiles when they were started ahead."""

    impl: object | None
    unavailable: str | None = None
    compiling: dict[str, concurrent.futures.Future] = dataclasses.field(default_factory=dict)


def build(case: Case, impl: str) -> Built:
    try:
        return Built(IMPLEMENTATIONS[impl](case))
    except Unavailable as why:
        return Built(None, f"skipped: {why}")
    except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
        return Built(None, describe_failure(exc))


@contextlib.contextmanager
def compiled_ahead(case: Case, impls: list[str], arg_sets: list[tuple], threads: int,
                   calls: int = 1):
    """{impl: Built} of `impls`, each mode's compile started ahead (of its program of
    `calls` calls, `in_one_program`): traced here, one after
    the other (tracing may read global state), compiled on `threads` threads; the context
    is entered once every compile has ended, so that none runs beside a timing (XLA
    autotunes on the GPU while it compiles), and the GPU warmed up again
    (`timing.compiling_ahead`)."""
    with timing.compiling_ahead(threads) as pool:
        built = {}
        for impl in impls:
            built[impl] = build(case, impl)
            if built[impl].impl is None:
                continue
            for mode in MODES:
                jitted = in_one_program(getattr(built[impl].impl, mode), calls)
                args = mode_args(mode, arg_sets[0])
                built[impl].compiling[mode] = timing.start_compile(
                    pool, lambda jitted=jitted, args=args: jitted.lower(*args))
    yield built


def relative_error(out, reference, rows=None) -> float | None:
    """||out - reference|| / ||reference|| in float32; None if it cannot be computed.

    `rows`, `[B, S]` bool, keeps only those MSA rows of `[B, S, N, H, d]` outputs: the
    rows whose keys are all masked are padding, which implementations fill by different
    conventions and nobody reads.
    """
    try:
        out32 = jnp.asarray(out, jnp.float32)
        ref32 = jnp.asarray(reference, jnp.float32)
        if rows is not None:
            keep = jnp.asarray(rows)[:, :, None, None, None]
            out32, ref32 = jnp.where(keep, out32, 0.0), jnp.where(keep, ref32, 0.0)
        return float(jnp.linalg.norm(out32 - ref32) / jnp.linalg.norm(ref32))
    except Exception:  # noqa: BLE001 - a check, not a measurement
        return None


# --- one case -------------------------------------------------------------------


class Progress(Protocol):
    """Where the runner reports: what it measures now, and each finished result line."""

    def describe(self, text: str) -> None: ...

    def result(self, line: str) -> None: ...


@dataclasses.dataclass(frozen=True)
class Settings:
    """How to time: `iters` samples of `reps` calls after `warmup` calls; inputs from `seed`.
    `compile_threads` > 1: a case's cells are all traced first and compiled that many at a
    time, before the first of them is timed (`run_case`); 1: each cell compiled just
    before it is timed. `calls_per_program` > 1: each timed call is a program making
    that many (`in_one_program`)."""

    iters: int
    warmup: int
    reps: int
    seed: int = 0
    compile_threads: int = 1
    calls_per_program: int = 1


class Budget(Protocol):
    """Whether another measurement of a kind may start (runs.Budget), told how long each took."""

    def allows_another(self, kind: str) -> bool: ...

    def spent(self, seconds: float, kind: str) -> None: ...


def ok(cell: dict) -> bool:
    return cell.get("status") == "ok"


def kept_fraction(mask) -> float:
    """The fraction of keys the mask keeps: what is left of the work."""
    return float(jnp.mean(jnp.asarray(mask, jnp.float32)))


def case_key(record: dict) -> str:
    """The `Case.key` of a case's record in results.json."""
    return f"{record['shape']}/{record['dtype']}/bias {record.get('bias_dtype', record['dtype'])}"


def new_record(case: Case) -> dict:
    return {
        "shape": case.shape_name, "dims": dict(zip("BSNHd", case.dims)),
        "dtype": case.dtype_name, "bias_dtype": case.bias_dtype_name,
        "mask": case.shape.mask, "logits": case.logits,
        "floor": {mode: floor_ms(case, mode) for mode in MODES}, "impls": {},
        "input_sets": num_input_sets(case),
    }


def run_case(case: Case, impls: list[str], settings: Settings, progress: Progress,
             record: dict | None = None, budget: Budget | None = None) -> tuple[dict, int]:
    """Measures each implementation of `impls` on one case, both modes: a cell each.

    `record` holds the case's cells measured earlier (None: a new record); the new
    cells join it, and the implementations it already has keep their place. Before
    each cell `budget` is asked whether another "cell" may start; when it says no, the
    case stops there. Returns (the case's record, how many of `impls` it measured).
    """
    record = new_record(case) if record is None else record
    started = time.monotonic()
    try:
        keys = jax.random.split(input_key(settings.seed), record["input_sets"])
        arg_sets = [make_input_set(case, key) for key in keys]
        record["kept_fraction"] = kept_fraction(arg_sets[0][4])
        rows = jnp.any(arg_sets[0][4], axis=-1)  # [B, S]: rows with a key left
        record["fully_masked_rows"] = int(rows.size - jnp.sum(rows))
        check_rows = rows if record["fully_masked_rows"] else None
    except Exception as exc:  # noqa: BLE001 - every cell of the case records it
        status = f"inputs: {describe_failure(exc)}"
        for impl in impls:
            record["impls"][impl] = {mode: {"status": status} for mode in MODES}
            for mode in MODES:
                progress.result(format_result_line(case, impl, mode, record["impls"][impl][mode]))
        return finish_case(record), len(impls)

    # The reference implementation goes first so its forward output can check the others;
    # when an earlier run measured it, its forward runs once more, untimed.
    reference_out = None
    if CHECK_REFERENCE not in impls and ok(record["impls"].get(CHECK_REFERENCE, {}).get("fwd", {})):
        try:
            reference_out = IMPLEMENTATIONS[CHECK_REFERENCE](case).fwd(*arg_sets[0][:5])
        except Exception:  # noqa: BLE001 - the check is left out, the timing is not
            reference_out = None
    done = 0
    ordered = sorted(impls, key=lambda name: name != CHECK_REFERENCE)
    ahead = (compiled_ahead(case, ordered, arg_sets, settings.compile_threads,
                            settings.calls_per_program)
             if settings.compile_threads > 1 else contextlib.nullcontext({}))
    with ahead as built:
        if settings.compile_threads > 1:
            started = time.monotonic()  # the compiles ahead count for the case, not a cell
        for impl in ordered:
            if budget is not None and not budget.allows_another("cell"):
                break
            entry, out = run_impl(case, impl, arg_sets, settings, progress, reference_out,
                                  check_rows, built.pop(impl, None))
            record["impls"][impl] = entry
            done += 1
            if budget is not None:  # compiled here, the first cell's includes the inputs'
                budget.spent(time.monotonic() - started, "cell")
            started = time.monotonic()
            if impl == CHECK_REFERENCE:
                reference_out = out
            del out
            gc.collect()
    del arg_sets, reference_out
    gc.collect()
    return finish_case(record), done


def run_impl(case: Case, impl: str, arg_sets: list[tuple], settings: Settings,
             progress: Progress, reference_out, check_rows=None,
             built: Built | None = None) -> tuple[dict, object]:
    """Measures one implementation in both modes; returns (entry, forward output or None).

    The forward output is compared with `reference_out` when there is one, over the
    MSA rows of `check_rows` (`[B, S]` bool; None: all). `built`: the implementation
    made (and its compiles started) ahead (`compiled_ahead`); None: made here.
    """
    entry: dict = {}
    built = build(case, impl) if built is None else built
    if built.impl is not None:
        entry["info"] = built.impl.info
    fwd_out = None
    for mode in MODES:
        progress.describe(f"{case.key} {impl} {MODE_LABELS[mode]}")
        if built.impl is None:
            entry[mode] = {"status": built.unavailable}
        else:
            sets = [mode_args(mode, inputs) for inputs in arg_sets]
            entry[mode], out = measure_callable(
                getattr(built.impl, mode), sets, settings.iters, settings.warmup, settings.reps,
                built.compiling.pop(mode, None), settings.calls_per_program)
            if mode == "fwd":
                fwd_out = out
                if (out is not None and reference_out is not None
                        and impl not in REFERENCE_POINTS):
                    entry[mode]["rel_err_vs_" + CHECK_REFERENCE] = relative_error(
                        out, reference_out, check_rows)
            del out
        progress.result(format_result_line(case, impl, mode, entry[mode]))
    return entry, fwd_out


def finish_case(record: dict, subject: str = "msa_pallas") -> dict:
    """Adds every cell's fraction of the floor, and the subject's speed-ups over the others."""
    impls = list(record["impls"])
    for impl in impls:
        for mode in MODES:
            cell = record["impls"][impl][mode]
            if ok(cell):
                cell["fraction_of_floor"] = record["floor"][mode]["floor_ms"] / cell["median_ms"]
    record["speedup"] = {}
    if subject in impls:
        ours = record["impls"][subject]
        for other in impls:
            if other == subject:
                continue
            theirs = record["impls"][other]
            record["speedup"][other] = {
                mode: theirs[mode]["median_ms"] / ours[mode]["median_ms"]
                if ok(ours[mode]) and ok(theirs[mode]) else None
                for mode in MODES
            }
    return record


def format_result_line(case: Case, impl: str, mode: str, cell: dict) -> str:
    """One log line per measurement: shape, dtype, bias dtype, implementation, mode, result."""
    head = (f"{case.shape_name:>12} {case.dtype_name:>4} bias {case.bias_dtype_name:>4} "
            f"{impl:>14} {MODE_LABELS[mode]:>3}:")
    if not ok(cell):
        return f"{head} {cell['status']}"
    mem = cell.get("temp_plus_output_bytes")
    mem_text = f"{mem / 1e6:.1f} MB" if mem is not None else "?"
    text = (f"{head} median {cell['median_ms']:.4g} ms, min {cell['min_ms']:.4g} ms, "
            f"temp+out {mem_text}, compile {cell['compile_s']:.1f} s")
    if cell.get("queued_ms") is not None:
        text += f", queued {cell['queued_ms']:.4g} ms"
    err = cell.get("rel_err_vs_" + CHECK_REFERENCE)
    if err is not None:
        text += f", rel.err vs {CHECK_REFERENCE} {err:.1e}"
    return text
