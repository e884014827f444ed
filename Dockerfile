# gpu-exporter: NVML metrics and /choose on :9400.
#   docker build -t gpu-exporter .
#   docker run --gpus all -p 9400:9400 -v gpu-exporter-state:/var/lib/gpu-exporter gpu-exporter
FROM python:3.12-slim

# NVML is all we need from the driver: no CUDA, no compute capability.
ENV NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=utility \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    GPU_EXPORTER_STATE_DIR=/var/lib/gpu-exporter

# gpu_exporter_build_info{revision=…}: docker build --build-arg REVISION="$(git rev-parse HEAD)"
ARG REVISION=unknown
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY gpu_exporter ./gpu_exporter
# The project with its `kubernetes` extra (grpcio, for --kubernetes): versions bounded by
# pyproject.toml, which DL3013 cannot see through the extra's brackets.
# hadolint ignore=DL3013
RUN printf '%s\n' "$REVISION" > gpu_exporter/_revision.txt && pip install '.[kubernetes]' && rm -rf /src

# The device nodes NVML opens are world-readable unless the driver was loaded with a
# restrictive NVreg_DeviceFileMode, so root is not needed.
RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin gpu-exporter \
    && install -d -o 10001 -g 10001 -m 0700 /var/lib/gpu-exporter
# Leases (leases.json) survive a restart only on a volume: docker run -v NAME:/var/lib/gpu-exporter.
# The exporter refuses to start without a writable state directory, and its user has no home.
VOLUME ["/var/lib/gpu-exporter"]
USER 10001
WORKDIR /

EXPOSE 9400
HEALTHCHECK --interval=30s --timeout=3s CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9400/healthz', timeout=2)"]
ENTRYPOINT ["gpu-exporter"]
CMD ["serve"]
