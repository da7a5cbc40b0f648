"""Observability: structlog setup, Prometheus metrics, trace records."""
