"""The launches that padding skipping adds to the op's compiled program, for every padded
shape, both backends, both bias dtypes, forward and forward+backward, with and without
dropout: compiled for an H200 and an A100 on a host without a GPU
(benchmarks/profiling/launches.py, set up as scripts/compile_for_gpu.sh does).

    PYTHONPATH=.cuda-plugin:. python benchmarks/log/2026-12-05-01-padding-summary/launch_counts.py

The tool is loaded from this repository by path, msa_pallas from PYTHONPATH, so the same
script counts an older checkout's launches (PYTHONPATH=.cuda-plugin:OLD_CHECKOUT).
"""

import importlib.util
import itertools
import pathlib
import sys

TOOL = pathlib.Path(__file__).resolve().parents[2] / "profiling" / "launches.py"
spec = importlib.util.spec_from_file_location("launches_tool", TOOL)
tool = importlib.util.module_from_spec(spec)
sys.modules["launches_tool"] = tool
spec.loader.exec_module(tool)
tool.prepare_deviceless_environment()

import msa_pallas  # noqa: E402

print("# msa_pallas from", msa_pallas.__file__)
meshes = {gpu: tool.deviceless_mesh(gpu) for gpu in ("h200", "a100")}
for gpu, impl, shape, bias, forward_only, rate in itertools.product(
        ("h200", "a100"), ("default", "triton"), ("train_padded", "extra_padded", "long_padded"),
        ("f32", "input"), (False, True), (0.0, 0.1)):
    if gpu == "a100" and impl == "triton":
        continue  # the A100's default is the Triton kernels
    counts = []
    for skip in (False, True):
        argv = ["--shape", shape, "--bias-dtype", bias, "--implementation", impl,
                "--dropout-rate", str(rate)]
        argv += ["--skip"] * skip + ["--forward-only"] * forward_only
        compiled = tool.compile_op(tool.make_parser().parse_args(argv), meshes[gpu])
        counts.append(len(tool.entry_launches(compiled.as_text())))
    print(f"{gpu} {impl} {shape} bias={bias} {'fwd' if forward_only else 'f+b'} rate={rate}: "
          f"plain {counts[0]} skip {counts[1]} (+{counts[1] - counts[0]})", flush=True)
