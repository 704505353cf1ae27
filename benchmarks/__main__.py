"""The entry point: `python -m benchmarks COMMAND`, the commands and the modules that run them."""

from __future__ import annotations

import sys

from benchmarks import dispatch

COMMANDS = {
    "op": ("benchmarks.op", "the op against every alternative at every shape: the table"),
    "layer": ("benchmarks.layer", "the Flax layer with each attention core: a training step"),
    "model": ("benchmarks.model", "an AlphaFold2 Evoformer iteration, patched and not"),
    "multi-gpu": ("benchmarks.multi_gpu", "forward+backward sharded over every GPU against one"),
    "check": ("benchmarks.check", "every implementation's output and gradients against float32"),
    "profile": ("benchmarks.profiling", "per-kernel times and the Nsight Compute tools"),
    "compare": ("benchmarks.compare", "two op results files, cell by cell (exit 1: a regression)"),
    "merge": ("benchmarks.merge", "op results files of one commit and device into one"),
    "report": ("benchmarks.page", "the table and plot of an op results file; RESULTS.md"),
}

if __name__ == "__main__":
    sys.exit(dispatch("python -m benchmarks", COMMANDS, sys.argv[1:]))
