"""How dcgm-exporter's users read it: its names, labels and queries, as test data.

Written down from NVIDIA/dcgm-exporter at commit d5e5f510 (2026-05-12, "Rename Hostname
label to hostname (#655)"); each block says which file it comes from. Nothing here is copied
from gpu-exporter's code: the tests check the code against this.
"""

from __future__ import annotations

# etc/default-counters.csv (its etc/dcp-metrics-included.csv lists the same uncommented
# names): every name dcgm-exporter serves by default, with its type and # HELP.
DEFAULT_COUNTERS: dict[str, tuple[str, str]] = {
    "DCGM_FI_DEV_SM_CLOCK": ("gauge", "SM clock frequency (in MHz)."),
    "DCGM_FI_DEV_MEM_CLOCK": ("gauge", "Memory clock frequency (in MHz)."),
    "DCGM_FI_DEV_MEMORY_TEMP": ("gauge", "Memory temperature (in C)."),
    "DCGM_FI_DEV_GPU_TEMP": ("gauge", "GPU temperature (in C)."),
    "DCGM_FI_DEV_POWER_USAGE": ("gauge", "Power draw (in W)."),
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": (
        "counter",
        "Total energy consumption since boot (in mJ).",
    ),
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": ("counter", "Total number of PCIe retries."),
    "DCGM_FI_DEV_GPU_UTIL": ("gauge", "GPU utilization (in %)."),
    "DCGM_FI_DEV_MEM_COPY_UTIL": ("gauge", "Memory utilization (in %)."),
    "DCGM_FI_DEV_ENC_UTIL": ("gauge", "Encoder utilization (in %)."),
    "DCGM_FI_DEV_DEC_UTIL": ("gauge", "Decoder utilization (in %)."),
    "DCGM_FI_DEV_XID_ERRORS": ("gauge", "Value of the last XID error encountered."),
    "DCGM_FI_DEV_FB_FREE": ("gauge", "Framebuffer memory free (in MiB)."),
    "DCGM_FI_DEV_FB_USED": ("gauge", "Framebuffer memory used (in MiB)."),
    "DCGM_FI_DEV_FB_RESERVED": ("gauge", "Framebuffer memory reserved (in MiB)."),
    "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL": (
        "counter",
        "Total number of NVLink bandwidth counters for all lanes.",
    ),
    "DCGM_FI_DEV_VGPU_LICENSE_STATUS": ("gauge", "vGPU License status"),
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": (
        "counter",
        "Number of remapped rows for uncorrectable errors",
    ),
    "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": (
        "counter",
        "Number of remapped rows for correctable errors",
    ),
    "DCGM_FI_DEV_ROW_REMAP_FAILURE": ("gauge", "Whether remapping of rows has failed"),
    "DCGM_FI_PROF_GR_ENGINE_ACTIVE": ("gauge", "Ratio of time the graphics engine is active."),
    "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": (
        "gauge",
        "Ratio of cycles the tensor (HMMA) pipe is active.",
    ),
    "DCGM_FI_PROF_DRAM_ACTIVE": (
        "gauge",
        "Ratio of cycles the device memory interface is active sending or receiving data.",
    ),
    "DCGM_FI_PROF_PCIE_TX_BYTES": (
        "gauge",
        "The rate of data transmitted over the PCIe bus - including both protocol headers and "
        "data payloads - in bytes per second.",
    ),
    "DCGM_FI_PROF_PCIE_RX_BYTES": (
        "gauge",
        "The rate of data received over the PCIe bus - including both protocol headers and "
        "data payloads - in bytes per second.",
    ),
}
# Served beyond that set: the DCGM_FI_PROF_* names of etc/dcp-metrics-included.csv (commented
# out there, with these helps) and DCGM's own HMMA/IMMA/DFMA and NVLink byte-rate fields,
# which GPM gives too (help in the same words as their neighbours).
OTHER_SERVED = {
    "DCGM_FI_PROF_SM_ACTIVE": ("gauge", "The ratio of cycles an SM has at least 1 warp assigned."),
    "DCGM_FI_PROF_SM_OCCUPANCY": ("gauge", "The ratio of number of warps resident on an SM."),
    "DCGM_FI_PROF_PIPE_TENSOR_HMMA_ACTIVE": (
        "gauge",
        "Ratio of cycles the tensor (HMMA) pipe is active.",
    ),
    "DCGM_FI_PROF_PIPE_TENSOR_IMMA_ACTIVE": (
        "gauge",
        "Ratio of cycles the tensor (IMMA) pipe is active.",
    ),
    "DCGM_FI_PROF_PIPE_TENSOR_DFMA_ACTIVE": (
        "gauge",
        "Ratio of cycles the tensor (DFMA) pipe is active.",
    ),
    "DCGM_FI_PROF_PIPE_FP64_ACTIVE": ("gauge", "Ratio of cycles the fp64 pipes are active."),
    "DCGM_FI_PROF_PIPE_FP32_ACTIVE": ("gauge", "Ratio of cycles the fp32 pipes are active."),
    "DCGM_FI_PROF_PIPE_FP16_ACTIVE": ("gauge", "Ratio of cycles the fp16 pipes are active."),
    "DCGM_FI_PROF_NVLINK_TX_BYTES": (
        "gauge",
        "The rate of data transmitted over NVLink, in bytes per second.",
    ),
    "DCGM_FI_PROF_NVLINK_RX_BYTES": (
        "gauge",
        "The rate of data received over NVLink, in bytes per second.",
    ),
}
# The same file's "label" row: DCGM_FI_DRIVER_VERSION is a label on every series.
DRIVER_LABEL = "DCGM_FI_DRIVER_VERSION"

# Names of DEFAULT_COUNTERS that gpu-exporter does not serve, and why (docs/dcgm-compat.md
# says the same): no NVML source gpu-exporter reads for them.
NOT_SERVED = {
    "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL": "no cumulative NVLink byte counter read",
    "DCGM_FI_DEV_VGPU_LICENSE_STATUS": "vGPU guests only; not read",
}

# internal/pkg/rendermetrics/render_metrics.go (gpuMetricsFormat) and
# internal/pkg/collector/gpu_collector.go (toMetric): the labels of every GPU series, in its
# order. "Hostname" was its name up to release 4.5.3-4.8.2; #655 renamed it "hostname".
GPU_LABELS = ("gpu", "UUID", "pci_bus_id", "device", "modelName")
HOSTNAME_LABELS = ("Hostname", "hostname")
# The same template: a MIG device's series add these (gpu, UUID … are its parent's).
MIG_LABELS = ("GPU_I_PROFILE", "GPU_I_ID")
# internal/pkg/transformation/const.go: with Kubernetes, a device held by a pod's container.
POD_LABELS = ("container", "namespace", "pod")
# gpu_collector.go: DCGM_FI_DEV_XID_ERRORS's own labels, err_code="0",err_msg="No Error" at 0.
XID_LABELS = ("err_code", "err_msg")

# grafana/dcgm-exporter-dashboard.json ("NVIDIA DCGM Exporter Dashboard"): its template
# variables (label_values(DCGM_FI_DEV_GPU_TEMP, instance) and (…, gpu), written as the series
# Grafana asks Prometheus for) and every panel's query, as Grafana sends them with "All".
DASHBOARD_VARIABLES = {
    "instance": "DCGM_FI_DEV_GPU_TEMP",
    "gpu": "DCGM_FI_DEV_GPU_TEMP",
}
DASHBOARD_PANELS = {
    "GPU Temperature": 'DCGM_FI_DEV_GPU_TEMP{instance=~"$instance", gpu=~"$gpu"}',
    "GPU Avg. Temp": 'avg(DCGM_FI_DEV_GPU_TEMP{instance=~"$instance", gpu=~"$gpu"})',
    "GPU Power Usage": 'DCGM_FI_DEV_POWER_USAGE{instance=~"$instance", gpu=~"$gpu"}',
    "GPU Power Total": 'sum(DCGM_FI_DEV_POWER_USAGE{instance=~"$instance", gpu=~"$gpu"})',
    "GPU SM Clocks": 'DCGM_FI_DEV_SM_CLOCK{instance=~"$instance", gpu=~"$gpu"} * 1000000',
    "GPU Utilization": 'DCGM_FI_DEV_GPU_UTIL{instance=~"$instance", gpu=~"$gpu"}',
    "GPU Framebuffer Mem Used": 'DCGM_FI_DEV_FB_USED{instance=~"$instance", gpu=~"$gpu"}',
    "Tensor Core Utilization": (
        'DCGM_FI_PROF_PIPE_TENSOR_ACTIVE{instance=~"$instance", gpu=~"$gpu"}'
    ),
}
# The panels whose name gpu-exporter does not serve yet (NOT_SERVED): to check, not to skip.
PANELS_WAITING: dict[str, str] = {}

# Query shapes its users write on these labels (issue 26; dcgm-exporter's README and its
# issues #490 and #655): per host under either label name, per pod, memory as a share.
USER_QUERIES = {
    "per host (Hostname)": "sum by (Hostname) (DCGM_FI_DEV_POWER_USAGE)",
    "per host (hostname)": "sum by (hostname) (DCGM_FI_DEV_POWER_USAGE)",
    "per model": "count by (modelName) (DCGM_FI_DEV_GPU_UTIL)",
    "by UUID and device": 'DCGM_FI_DEV_GPU_UTIL{UUID=~"GPU-.+", device=~"nvidia[0-9]+"}',
    "by bus id": 'DCGM_FI_DEV_GPU_TEMP{pci_bus_id=~"[0-9A-F]{8}:.+"}',
    "by driver": 'count by (DCGM_FI_DRIVER_VERSION) (DCGM_FI_DEV_GPU_TEMP{DCGM_FI_DRIVER_VERSION!=""})',
    "memory share": "DCGM_FI_DEV_FB_USED / (DCGM_FI_DEV_FB_USED + DCGM_FI_DEV_FB_FREE)",
    "energy as power": "rate(DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION[1m]) / 1000",
    "last Xid": 'DCGM_FI_DEV_XID_ERRORS{err_code="0"} == 0',
}

# Each DCGM name against the gpu-exporter series it converts (label uuid = UUID), in PromQL:
# the units of default-counters.csv's help (MHz, C, W, mJ, %, MiB).
CONVERSIONS = {
    "DCGM_FI_DEV_SM_CLOCK": 'gpu_clock_hz{clock="sm"} / 1e6',
    "DCGM_FI_DEV_MEM_CLOCK": 'gpu_clock_hz{clock="memory"} / 1e6',
    "DCGM_FI_DEV_GPU_TEMP": "gpu_temperature_celsius",
    "DCGM_FI_DEV_POWER_USAGE": "gpu_power_draw_watts",
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": "gpu_energy_joules_total * 1000",
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": "gpu_pcie_replay_errors_total",
    "DCGM_FI_DEV_GPU_UTIL": "gpu_utilization_ratio * 100",
    "DCGM_FI_DEV_MEM_COPY_UTIL": "gpu_memory_utilization_ratio * 100",
    "DCGM_FI_DEV_ENC_UTIL": "gpu_encoder_utilization_ratio * 100",
    "DCGM_FI_DEV_DEC_UTIL": "gpu_decoder_utilization_ratio * 100",
    "DCGM_FI_DEV_FB_FREE": "gpu_memory_free_bytes / 1048576",
    "DCGM_FI_DEV_FB_USED": "gpu_memory_used_bytes / 1048576",
    "DCGM_FI_DEV_FB_RESERVED": "gpu_memory_reserved_bytes / 1048576",
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": 'gpu_remapped_rows_total{cause="uncorrectable"}',
    "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": 'gpu_remapped_rows_total{cause="correctable"}',
    "DCGM_FI_DEV_ROW_REMAP_FAILURE": "gpu_remapped_rows_failed",
    "DCGM_FI_DEV_MEMORY_TEMP": "gpu_memory_temperature_celsius",
    "DCGM_FI_PROF_GR_ENGINE_ACTIVE": "gpu_graphics_active_ratio",
    "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": "gpu_tensor_active_ratio",
    "DCGM_FI_PROF_DRAM_ACTIVE": "gpu_dram_active_ratio",
    "DCGM_FI_PROF_PCIE_TX_BYTES": 'gpu_pcie_traffic_bytes_per_second{direction="tx"}',
    "DCGM_FI_PROF_PCIE_RX_BYTES": 'gpu_pcie_traffic_bytes_per_second{direction="rx"}',
    "DCGM_FI_PROF_SM_ACTIVE": "gpu_sm_active_ratio",
    "DCGM_FI_PROF_SM_OCCUPANCY": "gpu_sm_occupancy_ratio",
    "DCGM_FI_PROF_PIPE_TENSOR_HMMA_ACTIVE": 'gpu_tensor_pipe_active_ratio{pipe="hmma"}',
    "DCGM_FI_PROF_PIPE_TENSOR_IMMA_ACTIVE": 'gpu_tensor_pipe_active_ratio{pipe="imma"}',
    "DCGM_FI_PROF_PIPE_TENSOR_DFMA_ACTIVE": 'gpu_tensor_pipe_active_ratio{pipe="dfma"}',
    "DCGM_FI_PROF_PIPE_FP64_ACTIVE": 'gpu_fp_pipe_active_ratio{precision="fp64"}',
    "DCGM_FI_PROF_PIPE_FP32_ACTIVE": 'gpu_fp_pipe_active_ratio{precision="fp32"}',
    "DCGM_FI_PROF_PIPE_FP16_ACTIVE": 'gpu_fp_pipe_active_ratio{precision="fp16"}',
    "DCGM_FI_PROF_NVLINK_TX_BYTES": 'gpu_nvlink_traffic_bytes_per_second{direction="tx"}',
    "DCGM_FI_PROF_NVLINK_RX_BYTES": 'gpu_nvlink_traffic_bytes_per_second{direction="rx"}',
}

# promtool check metrics' complaints about dcgm-exporter's own names (issue 26): counters
# without _total, the camelCase modelName label, "counter" in a metric name.
DCGM_LINT = (
    'counter metrics should have "_total" suffix',
    "label names should be written in 'snake_case' not 'camelCase'",
    "metric name should not include type 'counter'",
)
