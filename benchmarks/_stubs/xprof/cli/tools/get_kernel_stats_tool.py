"""Stand-in for `xprof.cli.tools.get_kernel_stats_tool` (see benchmarks/_stubs/README.md).

tokamax 0.0.17 imports this module at start-up and calls `compute_kernel_stats`
only from its xprof-based timing (`tokamax.benchmarking` with timing method
'xprof' or 'hermetic_xprof'), which msa_pallas' benchmark does not use.
"""

STUB = True


def compute_kernel_stats(*args, **kwargs):
    raise NotImplementedError(
        "xprof is not installed: this is msa_pallas' stand-in module "
        "(benchmarks/_stubs/xprof), which cannot compute kernel statistics")
