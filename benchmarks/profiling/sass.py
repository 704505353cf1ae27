"""The Mosaic GPU kernels' machine code at one shape, compiled for a GPU: each kernel's
innermost loops that hold wgmma instructions, instruction by instruction kind.

    bash scripts/compile_for_gpu.sh sass --shape extra --bias-dtype f32
    bash scripts/compile_for_gpu.sh sass --shape extra --kernel-options staggered_bias=0
    python -m benchmarks profile sass --shape train --out DIR      # on a GPU

Compiles the op's forward+backward (or `--forward-only` its forward) as `profile
launches` does, with its arguments, while Mosaic GPU writes what it makes of each kernel
to a directory (`MOSAIC_GPU_DUMP_TO`): its passes' IR, which ends with the cubin it
compiled, and ptxas's report. Disassembles that cubin with nvdisasm (a CUDA toolkit's, or
`pip install nvidia-cuda-nvdisasm`); where the dump holds no cubin, assembles the
kernel's PTX with the toolkit's ptxas instead (whose version may not be Mosaic GPU's, so
the code may differ a little). Mosaic GPU's dump also runs nvdisasm itself, from the CUDA
toolkit, and says so on stderr where it finds none: harmless.

Then, per kernel, the registers a thread uses and the bytes it spills (ptxas's report),
and for each innermost loop that runs wgmma (`HGMMA`), in code order, the instructions
of one pass of its body and the counts of the opcodes that matter there (`LDL`: spilled
registers reloaded). In this library's kernels the first loop is the consumers' loop over
key (or query) tiles, one pass per tile: a count divided by the tile's logits per thread
is a count per logit. The later ones serve the epilogues and the other turn's path, and
a compiler's rotated loops may overlap. Counts compare two variants of a kernel exactly,
where a time needs the GPU; branches inside a loop body are counted once each.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from benchmarks.profiling import launches

# One SASS instruction line of `nvdisasm -c`: `/*0a50*/  @!P2 OPCODE.MODIFIERS ...;`.
_INSTRUCTION = re.compile(
    r"^\s+/\*(?P<address>[0-9a-f]+)\*/\s+(?:@!?U?P[T0-9]+\s+)?(?P<opcode>[A-Z][A-Z0-9_]*)"
    r"(?P<modifiers>\.[A-Z0-9_.]*)?"
)
_LABEL = re.compile(r"^(?P<label>\.L_x_\d+):")
_BRANCH = re.compile(r"\bBRA\s+`\((?P<label>\.L_x_\d+)\)")
_TARGET = re.compile(r"^\s*\.target\s+(\w+)", re.MULTILINE)
# The cubin in Mosaic GPU's pass dump: `gpu.binary @NAME [#gpu.object<..., bin = "...">]`,
# the string's bytes printed as they are or as \XX escapes.
_BINARY = re.compile(r'gpu\.binary @\w+\s+\[#gpu\.object<.*?bin = "((?:[^"\\]|\\.)*)"')
# The opcodes shown for every loop: the matrix units, the exponentials, the float
# arithmetic, the selects and byte permutes, shared-memory loads, conversions, shuffles,
# and local-memory loads (registers spilled).
SHOWN = ("HGMMA", "MUFU", "FFMA", "FADD", "FMUL", "FMNMX", "FSEL", "SEL", "PRMT", "F2FP",
         "LDS", "SHFL", "LDL")
# ptxas -v: the registers a thread uses and the bytes it spills.
_REGISTERS = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


@dataclasses.dataclass(frozen=True)
class Loop:
    """An innermost loop of a kernel's SASS: the lines of its first and last
    instruction (the back branch) and its body's opcode counts."""

    first: int
    last: int
    opcodes: collections.Counter

    @property
    def instructions(self) -> int:
        return sum(self.opcodes.values())


def wgmma_loops(sass: str) -> list[Loop]:
    """The innermost loops of `sass` (nvdisasm's text) that hold a wgmma: each a
    backward branch's target label to the branch, holding no other such loop."""
    lines = sass.splitlines()
    labels = {m["label"]: i for i, line in enumerate(lines) if (m := _LABEL.match(line))}
    spans = []
    for i, line in enumerate(lines):
        branch = _BRANCH.search(line)
        if branch and labels.get(branch["label"], i) < i:
            start = labels[branch["label"]]
            if any("HGMMA" in body_line for body_line in lines[start:i + 1]):
                spans.append((start, i))
    innermost = [
        (a, b) for a, b in spans
        if not any((c, d) != (a, b) and a <= c and d <= b for c, d in spans)
    ]
    loops = []
    for a, b in sorted(set(innermost)):
        opcodes = collections.Counter(
            m["opcode"] for line in lines[a:b + 1] if (m := _INSTRUCTION.match(line))
        )
        loops.append(Loop(a, b, opcodes))
    return loops


def loop_line(kernel: str, loop: Loop) -> str:
    shown = "  ".join(f"{name} {loop.opcodes[name]}" for name in SHOWN)
    lines = f"{loop.first + 1}-{loop.last + 1}"
    return f"{kernel:<10} {lines:>11} {loop.instructions:6d}  {shown}"


def find_tool(name: str) -> str:
    """`name`'s path: on PATH, in the CUDA toolkit (`launches.cuda_directory`), or in
    an NVIDIA pip wheel's bin directory (nvidia/cu*/bin)."""
    found = shutil.which(name)
    if found:
        return found
    directory = launches.cuda_directory()
    if directory and (Path(directory) / "bin" / name).exists():
        return str(Path(directory) / "bin" / name)
    wheels = importlib.util.find_spec("nvidia")  # NVIDIA's namespace package of wheels
    for location in (wheels.submodule_search_locations or []) if wheels else []:
        for candidate in Path(location).glob(f"cu*/bin/{name}"):
            return str(candidate)
    raise SystemExit(f"{name} not found: needs a CUDA toolkit's (PATH or CUDA_HOME)"
                     + (", or `pip install nvidia-cuda-nvdisasm`" if name == "nvdisasm" else ""))


def resources_line(ptxas_output: str) -> str:
    """`N registers, spills S B stored / L B loaded` from `ptxas -v`'s report."""
    registers = _REGISTERS.search(ptxas_output)
    spills = _SPILLS.search(ptxas_output)
    stored, loaded = spills.groups() if spills else ("?", "?")
    return (f"{registers.group(1) if registers else '?'} registers, spills {stored} B stored / "
            f"{loaded} B loaded")


def embedded_cubin(pass_dump: str) -> bytes | None:
    """The last cubin in a Mosaic GPU pass dump (`*.mlir-passes.log`), or None."""
    found = None
    for found in _BINARY.finditer(pass_dump):
        pass
    if found is None:
        return None
    text, data, index = found.group(1), bytearray(), 0
    while index < len(text):
        if text[index] != "\\":
            data += text[index].encode("latin-1")
            index += 1
        elif text[index + 1] in '\\"':
            data += text[index + 1].encode()
            index += 2
        else:
            data.append(int(text[index + 1:index + 3], 16))
            index += 3
    return bytes(data)


def disassemble(ptx: Path) -> tuple[str, str]:
    """The SASS of one kernel whose dump files start as `ptx` does, and ptxas's report
    of its registers and spills (`resources_line`): Mosaic GPU's own cubin and report
    where its dump holds them, else the PTX assembled here."""
    cubin = ptx.with_suffix(".cubin")
    passes, report = ptx.with_suffix(".mlir-passes.log"), ptx.with_suffix(".ptxas")
    binary = embedded_cubin(passes.read_text(errors="replace")) if passes.exists() else None
    if binary is not None and report.exists():
        cubin.write_bytes(binary)
        ptxas_output = report.read_text()
    else:
        target = _TARGET.search(ptx.read_text())
        if not target:
            raise SystemExit(f"{ptx}: no .target line")
        assembled = subprocess.run(
            [find_tool("ptxas"), "-v", f"-arch={target.group(1)}", str(ptx), "-o", str(cubin)],
            check=True, capture_output=True, text=True)
        ptxas_output = assembled.stdout + assembled.stderr
    sass = subprocess.run([find_tool("nvdisasm"), "-c", str(cubin)], check=True,
                          capture_output=True, text=True).stdout
    return sass, resources_line(ptxas_output)


def make_parser(prog: str | None = None):
    parser = launches.make_parser(prog)
    parser.description = __doc__.splitlines()[0]
    parser.add_argument("--out", default=None,
                        help="keep the PTX, the cubins and the SASS here (default: a temporary "
                             "directory, removed)")
    return parser


def main(argv=None, prog: str | None = None) -> int:
    args = make_parser(prog).parse_args(argv)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="msa_pallas_sass_"))
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.ptx"):
        stale.unlink()
    find_tool("nvdisasm")  # before the compile: a missing tool ends the run at once
    # Read by Mosaic GPU when it compiles a kernel (the directory must exist).
    os.environ["MOSAIC_GPU_DUMP_PTX"] = "1"
    os.environ["MOSAIC_GPU_DUMP_PTXAS"] = "1"
    os.environ["MOSAIC_GPU_DUMP_TO"] = str(out)
    mesh = launches.compile_mesh(args)
    launches.compile_op(args, mesh)
    ptx_files = sorted(out.glob("*.ptx"))
    print(f"# {launches.compiled_what(args, mesh)}: the Mosaic kernels' innermost wgmma "
          "loops, one pass of each body")
    if not ptx_files:
        print("no Mosaic GPU kernel was compiled")
        return 1
    print(f"{'kernel':<10} {'SASS lines':>11} {'instr':>6}  opcodes (loops in code order; "
          "rotated loops may overlap)")
    for ptx in ptx_files:
        sass, resources = disassemble(ptx)
        ptx.with_suffix(".sass").write_text(sass)
        kernel = re.sub(r"_\d+$", "", ptx.stem.removeprefix("msa_mosaic_"))
        print(f"{kernel:<10} {resources}")
        for loop in wgmma_loops(sass):
            print(loop_line(kernel, loop))
    if args.out:
        print(f"# PTX, cubins and SASS in {out}")
    else:
        shutil.rmtree(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
