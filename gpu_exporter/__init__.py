"""gpu-exporter: one NVML snapshot per GPU host, served as Prometheus metrics and as /choose."""

__version__ = "0.1.0"
