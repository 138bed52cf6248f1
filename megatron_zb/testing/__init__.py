"""Support for tests, benchmarks and the CPU demo: a gloo worker pool and a toy GPT on megatron-core."""
