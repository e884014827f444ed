"""Prometheus exposition of the snapshot: the metric spec, the collectors, and the
per-snapshot pre-rendered ``/metrics`` body."""
