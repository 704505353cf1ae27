"""Where a kernel's warps wait, from Nsight Compute's per-instruction samples.

Reads the source-page CSVs that `NCU_SOURCE=1 benchmarks/profiling/profile_ncu.sh`
writes (one per profiled launch: each SASS instruction with its warp-state
samples by stall reason) and prints, per kernel:

- the samples by stall reason, over the whole kernel and over its hot loop
  (the instructions executed at least half as often as its most executed
  wgmma, and no more often: the consumers' key or query loop, without the
  producer, the epilogues and the retries of mbarrier waits);
- the hot loop's samples by opcode, with the reasons that dominate each;
- the instructions with the most samples, each after the instruction before
  it: a `BRA` that waits on a long scoreboard right after a
  `SYNCS.PHASECHK...TRYWAIT` is an mbarrier wait, the barrier named by the
  wait's shared-memory operand.

    python -m benchmarks profile stalls OUT_DIR/source_0.csv [more.csv ...] [--top 12]

Stall reasons are those of Nsight Compute: `wait` is a fixed-latency
dependency, `long_sb` a scoreboard on an L1TEX operation (in these kernels,
which load nothing from global memory in their loops, the mbarrier waits),
`short_sb` one on shared memory or the special-function unit, `barrier` a
CTA barrier or a wgmma wait, `selected` a cycle that issued.
"""

from __future__ import annotations

import argparse
import collections
import csv

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return 0.0


def read_source_page(path: str):
    """(kernel name, [instruction dicts]) of one `--page source --csv` export."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    kernel = next((row[1] for row in rows if row and row[0] == "Kernel Name"), path)
    start = next(i for i, row in enumerate(rows) if row and row[0] == "Address")
    header = rows[start]
    instructions = []
    for row in rows[start + 1:]:
        if len(row) != len(header):
            continue
        fields = dict(zip(header, row))
        text = fields["Source"].strip()
        words = [w for w in text.split() if not w.startswith("@")]
        fields.update(
            text=text, opcode=words[0].split(".")[0] if words else "",
            samples=_number(fields.get(SAMPLES, "")), executed=_number(fields.get(EXECUTED, "")),
            stalls={
                name[len("stall_"):]: _number(value) for name, value in fields.items()
                if name.startswith("stall_") and "Not Issued" not in name
            },
        )
        instructions.append(fields)
    return kernel, instructions


def _reasons(instructions) -> collections.Counter:
    total = collections.Counter()
    for ins in instructions:
        total.update(ins["stalls"])
    return total


def _share_line(counter: collections.Counter, total: float, top: int) -> str:
    return ", ".join(
        f"{name} {value / total:.0%}" for name, value in counter.most_common(top) if value
    )


def summarise(path: str, top: int) -> str:
    kernel, instructions = read_source_page(path)
    lines = [f"## {kernel} ({path})"]
    total = sum(ins["samples"] for ins in instructions) or 1.0
    most = max(
        (ins["executed"] for ins in instructions if ins["opcode"] == "HGMMA"),
        default=max(ins["executed"] for ins in instructions),
    )
    hot = [ins for ins in instructions if most / 2 <= ins["executed"] <= most]
    hot_total = sum(ins["samples"] for ins in hot) or 1.0
    lines.append(f"samples {total:.0f}; by reason: {_share_line(_reasons(instructions), total, 8)}")
    lines.append(
        f"hot loop: {len(hot)} instructions, executed {most / 2:.0f} to {most:.0f} times, "
        f"{hot_total / total:.0%} of the samples; by reason: "
        f"{_share_line(_reasons(hot), hot_total, 8)}"
    )
    by_opcode = collections.defaultdict(list)
    for ins in hot:
        by_opcode[ins["opcode"]].append(ins)
    lines.append("hot loop by opcode (instructions, share of the loop's samples: top reasons):")
    ranked = sorted(by_opcode.items(), key=lambda kv: -sum(i["samples"] for i in kv[1]))
    for opcode, group in ranked[:top]:
        samples = sum(i["samples"] for i in group)
        lines.append(
            f"  {opcode:<10} {len(group):>4}  {samples / hot_total:5.1%}: "
            f"{_share_line(_reasons(group), samples or 1.0, 3)}"
        )
    lines.append("instructions with the most samples (share of all; executed; top reasons):")
    order = sorted(range(len(instructions)), key=lambda i: -instructions[i]["samples"])
    for i in order[:top]:
        ins = instructions[i]
        before = instructions[i - 1]["text"] if i else ""
        lines.append(
            f"  {ins['samples'] / total:5.1%} x{ins['executed']:.0f} [{i}] {ins['text'][:60]}"
            f"  ({_share_line(collections.Counter(ins['stalls']), ins['samples'] or 1.0, 2)})"
            f"  after: {before[:60]}"
        )
    return "\n".join(lines)


def main(argv=None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("csv", nargs="+", help="source-page CSVs of profile_ncu.sh")
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args(argv)
    for path in args.csv:
        print(summarise(path, args.top), end="\n\n")
    return 0
