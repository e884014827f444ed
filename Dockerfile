# gpu-exporter: NVML metrics and /choose on :9400.
#   docker build -t gpu-exporter .
#   docker run --gpus all -p 9400:9400 gpu-exporter
FROM python:3.12-slim

# NVML is all we need from the driver: no CUDA, no compute capability.
ENV NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=utility \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
COPY pyproject.toml README.md ./
COPY gpu_exporter ./gpu_exporter
RUN pip install . && rm -rf /src

# The device nodes NVML opens are world-readable unless the driver was loaded with a
# restrictive NVreg_DeviceFileMode, so root is not needed.
RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin gpu-exporter \
    && install -d -o gpu-exporter -g gpu-exporter -m 0750 /var/lib/gpu-exporter
# Leases are kept here (mount a volume to keep them across containers); the exporter refuses
# to start without a writable state directory, and the user has no home to default to.
ENV GPU_EXPORTER_STATE_DIR=/var/lib/gpu-exporter
USER 10001
WORKDIR /

EXPOSE 9400
HEALTHCHECK --interval=30s --timeout=3s CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9400/healthz', timeout=2)"]
ENTRYPOINT ["gpu-exporter"]
CMD ["serve"]
