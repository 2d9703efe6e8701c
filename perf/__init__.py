"""ringserve benchmarks. `perf.serving` is the online serving benchmark client (`ringserve bench`)."""
