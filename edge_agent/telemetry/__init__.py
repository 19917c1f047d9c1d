"""Telemetry: hardware readings (`hardware`: psutil, NVML and Jetson sysfs behind one
reader interface), the Prometheus registry (`metrics`), and the task kinds a request is
counted by (`task_kinds`, pure: the fleet's release materials name the same words).

Never: a reading on the request path, or an error counted twice (the registry keeps its
own record of what it counted). Next: `metrics.Metrics`.
"""
