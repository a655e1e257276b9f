"""Observing calibration: hooks that record per-expert statistics from the routing the
model really uses, their float64 accumulators, and the data-parallel reduction."""
