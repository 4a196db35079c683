"""What every kernel family shares: tuned config tables per GPU model (``tables``; pure Python)
and the rotated-weight CUDA-graph timer used by tuning and the benchmarks (``timing``)."""
