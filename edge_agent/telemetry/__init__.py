"""Telemetry: hardware readings and the Prometheus registry."""
