"""Telemetry: hardware readings (`hardware`: psutil, NVML and Jetson sysfs behind one
reader interface) and the Prometheus registry (`metrics`).

Never: a reading on the request path, or an error counted twice (the registry keeps its
own record of what it counted). Next: `metrics.Metrics`.
"""
