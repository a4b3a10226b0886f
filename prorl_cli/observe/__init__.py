"""Observability: per-job timelines, Prometheus metrics, traces, the live dashboard, inspector and report."""
