"""Stand-in for the `xprof` package (see benchmarks/_stubs/README.md)."""
