"""A client for a gpu-exporter's ``/choose`` and ``/leases``: claim GPUs, keep them, let go.

Standard library only, so a job can import it before (and without) any framework::

    from gpu_exporter import use_gpus

    with use_gpus(2, min_free="20GiB") as gpus:  # sets CUDA_VISIBLE_DEVICES, holds a lease
        import torch  # only now: CUDA reads CUDA_VISIBLE_DEVICES once, when it initialises

        model = torch.nn.Linear(8, 8).to("cuda:0")  # the first of the two GPUs chosen
    # the lease is released and the environment is as it was

Device numbering: the chosen GPUs are named by UUID (``CUDA_VISIBLE_DEVICES=GPU-a,GPU-b``),
which means the same cards whatever ``CUDA_DEVICE_ORDER`` says; inside the process CUDA
renumbers them from 0, so PyTorch sees ``cuda:0`` and ``cuda:1`` and TensorFlow ``/GPU:0`` and
``/GPU:1``. :attr:`Choice.indices` are NVML (``nvidia-smi``) indices, for people and logs.

A lease (``lease="60s"``, the default) makes the server hand these GPUs to nobody else until
it is released or expires; :func:`use_gpus` renews it in the background while the block runs.
``lease=0`` asks for advice only: nothing is reserved. Only the lease's token
(:attr:`Choice.lease_token`, ``$GPU_LEASE``) renews or releases it; :attr:`Choice.lease_id`
is its public name. Every claim carries a fresh ``Idempotency-Key`` and is sent once more
after a timeout or a reset connection, which the server answers with the same lease.

The server is found from the ``url`` argument, else ``$GPU_EXPORTER_URL``, else
``http://localhost:9400``. A server with basic auth (``--web-config-file``) gets
``$GPU_EXPORTER_USER`` and ``$GPU_EXPORTER_PASSWORD``; an ``https://`` server's certificate
is checked against the system CAs, or the file in ``$SSL_CERT_FILE``. Every failure is a
:class:`GpuExporterError`:

* :class:`ServerUnreachable` — nothing answered (or not in time; ``maybe_received`` says
  whether the request may still have been served);
* :class:`ServerError` — the server said no; ``status``, ``code``, ``message``, ``param``;

  * :class:`NoGpusAvailable` — 503 ``not_enough_gpus``: fewer GPUs qualify than asked for;
  * :class:`LeaseNotFound` — 404 from a lease endpoint: the lease has ended (released,
    expired, or let go by the server once the job's work showed on its GPUs).

None of the client's modules imports Flask, werkzeug, prometheus_client or pynvml.
"""

from __future__ import annotations

from gpu_exporter.client.choosing import choose, choose_cluster
from gpu_exporter.client.hostapi import (
    DEFAULT_LEASE,
    LEASE_HEADER,
    Choice,
    ChooseAnswer,
    LeaseInfo,
    choose_raw,
    leases,
    register_pids,
    release,
    renew,
)
from gpu_exporter.client.local import choose_locally, choose_or_fallback
from gpu_exporter.client.query import Duration, FilterValue, duration_seconds, format_duration
from gpu_exporter.client.session import (
    GpuSession,
    LeaseKeeper,
    cuda_initialised_by,
    replaced_visible_devices,
    use_gpus,
)
from gpu_exporter.client.transport import (
    DEFAULT_TIMEOUT_SECONDS,
    DEFAULT_URL,
    PASSWORD_ENV,
    URL_ENV,
    USER_ENV,
    GpuExporterError,
    GpuExporterWarning,
    LeaseNotFound,
    NoGpusAvailable,
    NotAnExporter,
    ServerError,
    ServerUnreachable,
    error_from_response,
    resolve_url,
)
from gpu_exporter.fleet.placing import ClusterChoice
from gpu_exporter.outbound import is_loopback

__all__ = [
    "DEFAULT_LEASE",
    "DEFAULT_TIMEOUT_SECONDS",
    "DEFAULT_URL",
    "LEASE_HEADER",
    "PASSWORD_ENV",
    "URL_ENV",
    "USER_ENV",
    "Choice",
    "ChooseAnswer",
    "ClusterChoice",
    "Duration",
    "FilterValue",
    "GpuExporterError",
    "GpuExporterWarning",
    "GpuSession",
    "LeaseInfo",
    "LeaseKeeper",
    "LeaseNotFound",
    "NoGpusAvailable",
    "NotAnExporter",
    "ServerError",
    "ServerUnreachable",
    "choose",
    "choose_cluster",
    "choose_locally",
    "choose_or_fallback",
    "choose_raw",
    "cuda_initialised_by",
    "duration_seconds",
    "error_from_response",
    "format_duration",
    "is_loopback",
    "leases",
    "register_pids",
    "release",
    "renew",
    "replaced_visible_devices",
    "resolve_url",
    "use_gpus",
]
