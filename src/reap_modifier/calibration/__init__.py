"""Observing calibration: hooks that record per-expert statistics from the routing the
model really uses, their float64 accumulators, the data-parallel reduction, and forward
passes on packed (compressed-tensors) experts, one MoE layer dense at a time."""
