"""msa_pallas' benchmarks: one package, one entry point, `python -m benchmarks COMMAND`.

Run from the repository root (the package imports `msa_pallas` from the working tree
when it is not installed). `python -m benchmarks` lists the commands; each says more
with `--help`. The modules:

- shapes.py: the shapes, dtypes and masks, once (the tests take theirs from here too);
- alternatives.py (with packages.py): the table of implementations the op is timed against;
- timing.py: the one timing loop; runs.py: progress line, time budget, resumable results;
- op.py, layer.py, model.py, multi_gpu.py (with multi_gpu_problems.py): the benchmarks;
- measure.py: one case of the op benchmark; report.py: its tables and plot; page.py: the
  `report` command and RESULTS.md;
- check.py, compare.py, merge.py: the alternatives checked, two runs compared, parts merged;
- profiling/: per-kernel timings and the Nsight Compute tools.

Nothing here imports jax at package level: `profile memory` sets XLA_FLAGS before it does.
"""

from __future__ import annotations

import importlib
import sys


def dispatch(prog: str, commands: dict[str, tuple[str, str]], argv: list[str]) -> int:
    """Runs `commands[argv[0]]`, a (module, summary) pair, with the rest of `argv`.

    The module is imported only then, so that a command's environment (XLA_FLAGS,
    say) can be set before jax is. Returns the command's exit status (an int; a
    `main` that returns something else has succeeded).
    """
    if not argv or argv[0] in ("-h", "--help"):
        width = max(map(len, commands))
        print(f"usage: {prog} COMMAND [ARGS ...]   ({prog} COMMAND --help for more)\n\ncommands:")
        for name, (_, summary) in commands.items():
            print(f"  {name:<{width}}  {summary}")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in commands:
        print(f"{prog}: unknown command {name!r}; expected one of {', '.join(commands)}",
              file=sys.stderr)
        return 2
    module = importlib.import_module(commands[name][0])
    status = module.main(rest, prog=f"{prog} {name}")
    return status if isinstance(status, int) else 0
