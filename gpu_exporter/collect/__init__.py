"""Reading NVML: one GPU's read (``read``, ``fields``), the sampler thread, the snapshot cache
and its history, and the background readers (Xid events, PCIe throughput, process details
from ``/proc``).

Only this room calls the driver (through :mod:`gpu_exporter.nvml`); it imports nothing from
``export``, ``choose``, ``web`` or ``client``.
"""
