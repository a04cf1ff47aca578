"""Experiment drivers: sweeps, benchmarks and kernel checks on top of m3_jax and pallas_kernels.

Run every driver from the repo root as a module, e.g. `python -m experiments.bench_msa --help` or
`python -m experiments.native_vs_cpt --size=cpu`: the repo root is then on sys.path, so m3_jax, pallas_kernels and
configs import without PYTHONPATH or an install (the GPU box runs a plain copy of the repo). The drivers share
experiments/lib (config + overrides, compilation cache, sweeps that resume, metrics reading, timing).
"""
