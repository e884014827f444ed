"""No server answered: choose from this host's NVML instead, as the server would, but unleased.

:func:`choose_or_fallback` asks the exporter and, when nothing answers, :func:`choose_locally`
ranks this host's GPUs with the server's own filters and ranking
(:mod:`gpu_exporter.choose`). No lease protects such a choice, so it comes with a
:class:`~gpu_exporter.client.GpuExporterWarning`; with no driver or no GPU it raises instead:
a job never silently runs on CPU.

This is the one place the client reaches for NVML and the sampler, and it imports them only
when it needs them (:func:`choose_locally`), so ``import gpu_exporter.client`` loads neither
pynvml nor the exporter's collectors. How NVML is opened is a parameter (``open_nvml``):
tests hand in a simulated one.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, TypeAlias

from gpu_exporter.choose.defaults import SHIPPED_DEFAULTS
from gpu_exporter.choose.filters import Filters
from gpu_exporter.choose.params import LOCAL_FILTERS
from gpu_exporter.choose.rank import NotEnoughGpus
from gpu_exporter.choose.rank import choose as rank_and_choose
from gpu_exporter.choose.refusal import ApiError
from gpu_exporter.choose.request import parse_choose_args
from gpu_exporter.choose.selectors import check_selectors
from gpu_exporter.client.allocation import HostGpu
from gpu_exporter.client.hostapi import Choice, choose_host, within_allocation
from gpu_exporter.client.query import Duration, FilterValue, filter_value
from gpu_exporter.client.transport import (
    GpuExporterError,
    GpuExporterWarning,
    NoGpusAvailable,
    ServerUnreachable,
)

if TYPE_CHECKING:
    from gpu_exporter.nvml import Nvml

OpenNvml: TypeAlias = "Callable[[], Nvml]"
"""Returns this host's NVML, not yet initialised; None stands for the real driver."""


def choose_locally(
    n: int,
    filters: Mapping[str, FilterValue],
    *,
    url: str = "",
    open_nvml: OpenNvml | None = None,
    ignore_mask: bool = False,
) -> Choice:
    """Rank this host's GPUs through NVML, as the server would, but with no lease.

    Takes every ``/choose`` filter except ``idle_for`` (and ``mig``), and applies the shipped
    defaults (:data:`~gpu_exporter.choose.defaults.SHIPPED_DEFAULTS`) to those not given. Raises
    :class:`GpuExporterError` when NVML cannot be loaded or sees no GPU, and
    :class:`NoGpusAvailable` when too few qualify — never an empty choice.
    """
    from gpu_exporter.collect.read import read_gpu
    from gpu_exporter.nvml import Nvml, NvmlError

    given = {k: v for k, v in filters.items() if v is not None}
    if "idle_for" in given:
        raise GpuExporterError(
            "choosing locally cannot apply idle_for: it needs the history only a running "
            "gpu-exporter keeps"
        )
    if "mem" in given:
        raise GpuExporterError(
            "choosing locally cannot lease a share of a card (mem=): only a running "
            "gpu-exporter admits memory leases, so no server means no share"
        )
    unknown = sorted(set(given) - set(LOCAL_FILTERS))
    if unknown:
        raise GpuExporterError(f"unknown filter {', '.join(unknown)}")
    try:
        local_filters, sort = _local_filters(given)
    except (ValueError, TypeError) as exc:
        raise GpuExporterError(f"choosing locally: {exc}") from None

    try:
        nvml = open_nvml() if open_nvml is not None else Nvml()
        nvml.init()
    except (NvmlError, OSError, ImportError) as exc:
        raise GpuExporterError(
            f"no NVIDIA driver to choose GPUs with ({exc}); refusing to run without a GPU"
        ) from None
    try:
        count = nvml.device_count()
        unsupported_fields: set[tuple[str, str]] = set()
        samples = [read_gpu(nvml, i, None, unsupported_fields)[0] for i in range(count)]
    except NvmlError as exc:
        raise GpuExporterError(f"NVML failed while reading the GPUs: {exc}") from None
    finally:
        nvml.shutdown()
    if not samples:
        raise GpuExporterError("NVML sees no GPU on this host; refusing to run without a GPU")
    if not ignore_mask:  # inside what a launcher gave this job, as the server path does
        whole = [HostGpu(g.index, g.uuid, g.pci_bus_id or "", g.name or "") for g in samples]
        masked = within_allocation(given, lambda: whole)
        if masked is not given:
            local_filters, sort = _local_filters(masked)
    try:
        check_selectors(tuple(samples), local_filters.include, local_filters.exclude)
    except ApiError as exc:
        raise GpuExporterError(f"choosing locally: {exc}") from None
    try:
        picked = rank_and_choose(samples, n, local_filters, sort=sort).chosen
    except NotEnoughGpus as exc:
        raise NoGpusAvailable(503, str(exc), code="not_enough_gpus") from None
    return Choice(
        uuids=tuple(g.uuid for g in picked),
        indices=tuple(g.index for g in picked),
        lease_id=None,
        expires_at=None,
        url=url,
        local=True,
        details={"n": n, "chosen": [g.to_json() for g in picked], "lease": None},
    )


def _local_filters(given: Mapping[str, FilterValue]) -> tuple[Filters, str]:
    """``/choose``'s filter parameters, parsed as the server parses them, and the sort."""
    args = {name: filter_value(name, value) for name, value in given.items()}
    try:
        req = parse_choose_args(args, allowed=(*LOCAL_FILTERS, "n"), defaults=SHIPPED_DEFAULTS)
    except ApiError as exc:
        raise ValueError(exc.message) from None
    return req.filters, req.sort


def choose_or_fallback(
    n: int,
    url: str | None,
    *,
    lease: Duration | None,
    wait: Duration | None,
    owner: str | None,
    timeout: float,
    local_fallback: bool,
    filters: Mapping[str, FilterValue],
    stacklevel: int = 2,
    open_nvml: OpenNvml | None = None,
    ignore_mask: bool = False,
) -> Choice:
    """:func:`~gpu_exporter.client.hostapi.choose_host`; if no server answers and
    ``local_fallback``, :func:`choose_locally` (with NVML from ``open_nvml``).

    Only when the claim surely never reached a server (nothing listening, no route): an
    exporter that timed out or dropped the connection may hold leases on these cards, so then
    :class:`GpuExporterError` says so instead of choosing without them.
    """
    try:
        return choose_host(
            n, url, lease=lease, wait=wait, owner=owner, timeout=timeout,
            ignore_mask=ignore_mask, **filters,
        )  # fmt: skip
    except ServerUnreachable as exc:
        if not local_fallback:
            raise
        if exc.maybe_received:  # it may hold leases here, even one granted to this claim
            raise GpuExporterError(
                f"{exc}; not choosing from this host's NVML instead, because the exporter "
                "is running and its leases would be ignored: retry, or give it more time "
                "(--timeout)"
            ) from None
        unreachable = exc
    try:
        choice = choose_locally(
            n, filters, url=unreachable.url, open_nvml=open_nvml, ignore_mask=ignore_mask
        )
    except NoGpusAvailable:
        raise
    except GpuExporterError as exc:
        raise GpuExporterError(f"{unreachable}; and cannot choose locally: {exc}") from None
    warnings.warn(
        f"{unreachable}; chose GPU {','.join(map(str, choice.indices))} from this host's "
        "NVML instead. No lease protects this choice: another job may pick the same GPUs.",
        GpuExporterWarning,
        stacklevel=stacklevel,
    )
    return choice
