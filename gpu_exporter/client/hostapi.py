"""One exporter's lease endpoints from Python: choose GPUs there, renew, release, list leases.

Choosing across a fleet (:mod:`gpu_exporter.fleet`) claims through
:func:`choose_host` on the host it picked; :func:`gpu_exporter.client.choose` is the front door
to both.

A lease has a public id and a secret token (``<id>.<secret>``, in ``X-GPU-Lease``): renewing
and releasing send the token. Every claim sends a fresh ``Idempotency-Key`` and is retried
once, with the same key, when no answer came back (a timeout, a reset connection): the server
then returns the lease the first try made, if it made one, instead of claiming again. If the
retry fails too, a lease the server may have granted has no holder until its TTL runs out
(``lease``, 60 s by default): the client never got its token, so it cannot release it.
"""

from __future__ import annotations

import json
import logging
import os
import urllib.parse
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from gpu_exporter.choose.memory import caps_env
from gpu_exporter.choose.tokens import IDEMPOTENCY_HEADER, lease_id_of
from gpu_exporter.client.allocation import HostGpu, allocation, cuda_indices
from gpu_exporter.client.query import (
    Duration,
    FilterValue,
    choose_params,
    duration_seconds,
    format_duration,
)
from gpu_exporter.client.transport import (
    DEFAULT_TIMEOUT_SECONDS,
    URL_ENV,
    GpuExporterError,
    ServerUnreachable,
    json_body,
    request,
    resolve_url,
    str_or_none,
)

log = logging.getLogger(__name__)

DEFAULT_LEASE: Final = "60s"
LEASE_HEADER: Final = "X-GPU-Lease"  # the lease's token


# -- results -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LeaseInfo:
    """A claim on GPUs, as the server keeps it. Times are Unix seconds.

    ``id`` is public (the status page shows it); ``token`` renews and releases it, and is
    known only from the claim's answer (None in ``/leases``).
    """

    id: str
    gpus: tuple[str, ...]  # UUIDs
    created_at: float
    expires_at: float
    owner: str | None = None
    requester: str | None = None
    token: str | None = field(default=None, repr=False)
    pids: tuple[int, ...] = ()  # the job's processes registered with it

    @property
    def ttl_seconds(self) -> float:
        """How long the server granted (it may cap what was asked for)."""
        return max(0.0, self.expires_at - self.created_at)

    @classmethod
    def from_json(cls, data: Any) -> LeaseInfo:
        try:
            return cls(
                id=str(data["id"]),
                gpus=tuple(str(u) for u in data.get("gpus") or ()),
                created_at=float(data["created_at"]),
                expires_at=float(data["expires_at"]),
                owner=str_or_none(data.get("owner")),
                requester=str_or_none(data.get("requester")),
                token=str_or_none(data.get("token")),
                pids=tuple(int(p) for p in data.get("pids") or ()),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise GpuExporterError(f"malformed lease in the server's answer: {data!r}") from exc


@dataclass(frozen=True, slots=True)
class Choice:
    """GPUs chosen for this job, best first, and the lease that reserves them.

    ``uuids`` name the cards for ``CUDA_VISIBLE_DEVICES``; ``indices`` are their NVML
    (``nvidia-smi``) indices. ``lease_id`` is ``None`` when nothing reserves them (``lease=0``,
    or ``local``: chosen from this host's NVML because no server answered). ``lease_token``
    renews and releases the lease (``GPU_LEASE`` in :meth:`env`); keep it to yourself.
    """

    uuids: tuple[str, ...]
    indices: tuple[int, ...]
    lease_id: str | None
    expires_at: float | None  # Unix time; None without a lease
    url: str  # the server asked (and to renew and release at)
    lease: LeaseInfo | None = field(default=None, compare=False)
    local: bool = False
    details: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """The server's whole JSON answer: every chosen GPU's figures, why others were passed over."""
    host: str | None = None
    """Set when chosen across a fleet (``prometheus=``/``hosts=``): the host the GPUs are on."""
    lease_token: str | None = field(default=None, repr=False)
    """The lease's token (an older server sends none: then its id is its token)."""
    mem_bytes: int | None = None
    """A memory lease (``mem=``): the bytes reserved on each card; None for whole cards."""
    mem_fraction: float | None = None
    """Its cap as a share of the card (after the CUDA context allowance), for the frameworks."""

    def apply_torch(self) -> None:
        """Cap PyTorch's allocator on every visible card to this memory lease (see
        :func:`gpu_exporter.client.caps.apply_torch`)."""
        from gpu_exporter.client.caps import apply_torch

        apply_torch(self)

    def apply_tensorflow(self) -> None:
        """Cap TensorFlow on every visible card to this memory lease, before TF initialises
        (see :func:`gpu_exporter.client.caps.apply_tensorflow`)."""
        from gpu_exporter.client.caps import apply_tensorflow

        apply_tensorflow(self)

    @property
    def lease_ref(self) -> str | None:
        """What renews and releases the lease: its token (its id from an older server)."""
        return self.lease_token or self.lease_id

    @property
    def cuda_visible_devices(self) -> str:
        """``"GPU-a,GPU-b"``: CUDA then numbers these cards 0, 1, … in this order."""
        return ",".join(self.uuids)

    def env(self) -> dict[str, str]:
        """The environment variables a process needs to use exactly these GPUs.

        >>> Choice(("GPU-a", "GPU-b"), (0, 3), "l1", None, "http://h:9400").env()
        ... # doctest: +NORMALIZE_WHITESPACE
        {'CUDA_DEVICE_ORDER': 'PCI_BUS_ID', 'CUDA_VISIBLE_DEVICES': 'GPU-a,GPU-b',
         'GPU_LEASE': 'l1'}
        """
        env = {}
        if self.host is not None:  # chosen across a fleet: where to run, and whom to ask
            env["GPU_HOST"] = self.host
            env[URL_ENV] = self.url
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        env["CUDA_VISIBLE_DEVICES"] = self.cuda_visible_devices
        if self.lease_ref is not None:
            env["GPU_LEASE"] = self.lease_ref
        if self.mem_bytes is not None and self.mem_fraction is not None:
            env.update(caps_env(self.mem_bytes, self.mem_fraction))
        return env

    @classmethod
    def from_json(cls, data: Any, *, url: str, lease_header: str | None = None) -> Choice:
        """Build from ``/choose?format=json``'s answer (and its ``X-GPU-Lease`` header: the
        lease's token)."""
        try:
            chosen = data["chosen"]
            uuids = tuple(str(g["uuid"]) for g in chosen)
            indices = tuple(int(g["index"]) for g in chosen)
            raw_lease = data.get("lease")
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise GpuExporterError(f"unexpected answer from {url}/choose: {data!r}") from exc
        lease = LeaseInfo.from_json(raw_lease) if raw_lease else None
        mem = data.get("mem") if isinstance(data, dict) else None
        token = (lease.token if lease is not None else None) or lease_header
        lease_id = lease.id if lease is not None else lease_id_of(token) if token else None
        return cls(
            uuids=uuids,
            indices=indices,
            lease_id=lease_id,
            expires_at=lease.expires_at if lease is not None else None,
            url=url,
            lease=lease,
            details=data,
            lease_token=token,
            mem_bytes=int(mem["bytes"]) if isinstance(mem, dict) else None,
            mem_fraction=float(mem["fraction"]) if isinstance(mem, dict) else None,
        )


@dataclass(frozen=True, slots=True)
class ChooseAnswer:
    """``/choose``'s answer as the server wrote it (for ``gpu-exporter choose``)."""

    body: str  # e.g. "GPU-a,GPU-b" and a newline, exactly as sent
    lease_id: str | None  # the lease's public id
    url: str
    lease_token: str | None = field(default=None, repr=False)  # the X-GPU-Lease header


# -- the endpoints -----------------------------------------------------------------------


def choose_raw(
    n: int = 1,
    url: str | None = None,
    *,
    format: str = "uuid",
    lease: Duration | None = DEFAULT_LEASE,
    wait: Duration | None = None,
    owner: str | None = None,
    timeout: float = DEFAULT_TIMEOUT_SECONDS,
    ignore_mask: bool = False,
    **filters: FilterValue,
) -> ChooseAnswer:
    """Ask ``/choose`` and return its body untouched (``"GPU-a,GPU-b\\n"``) and lease.

    Same arguments as :func:`gpu_exporter.client.choose`, plus ``format`` (``uuid``,
    ``index``, ``env``, ``json``). Each call sends a fresh ``Idempotency-Key``; when no
    answer comes back (timeout, reset), the claim is sent once more with the same key: the
    server answers a retry of a granted claim with the same lease, so a retry never takes
    a second lease.

    Inside a job a launcher gave GPUs (Slurm, a container, ``CUDA_VISIBLE_DEVICES``), only
    those are chosen from (:mod:`~gpu_exporter.client.allocation`); ``ignore_mask`` chooses
    among every GPU of the host.
    """
    base = resolve_url(url)
    asked = filters if ignore_mask else within_allocation(filters, lambda: host_gpus(base, timeout))
    params = choose_params(n, format, lease, wait, owner, asked)
    waited = duration_seconds(wait) if wait is not None else None
    headers = {IDEMPOTENCY_HEADER: f'"{uuid.uuid4()}"'}  # the draft's structured-field string
    for attempt in (1, 2):
        try:
            resp = request(
                "POST", base, "/choose", params, timeout=timeout + (waited or 0.0), headers=headers
            )
            break
        except ServerUnreachable as exc:
            if attempt == 2 or not exc.maybe_received:
                raise
            log.warning("%s; asking again with the same Idempotency-Key", exc.reason)
    body = resp.body.decode("utf-8", "replace")
    token = resp.header(LEASE_HEADER)
    return ChooseAnswer(body, lease_id_of(token) if token else None, base, token)


def within_allocation(
    filters: Mapping[str, FilterValue], gpus: Callable[[], Sequence[HostGpu]]
) -> Mapping[str, FilterValue]:
    """``filters`` with ``include=`` this job's GPUs, where a launcher gave it some."""
    found = allocation(os.environ, gpus)
    if found is None:
        return filters
    if filters.get("include") not in (None, "", (), []):
        raise GpuExporterError(
            f"include= and this job's GPUs ({found.source}) together: leave include= out to "
            "choose among the job's GPUs, or add --ignore-mask (ignore_mask=True)"
        )
    return {**filters, "include": ",".join(found.include)}


def as_indices(choice: Choice, timeout: float = DEFAULT_TIMEOUT_SECONDS) -> dict[str, str]:
    """``choice.env()`` with ``CUDA_VISIBLE_DEVICES`` as indices (under
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID``) that name the same cards, for tools that cannot take
    UUIDs; read before the environment is changed. Without a server (a local choice) NVML's
    own indices, which follow the PCI bus order. For a choice across the fleet on another
    host (``choice.host``), that host's own order: this host's masks do not describe it."""
    env = choice.env()
    if choice.local:
        if any(os.environ.get(v) for v in ("SLURM_JOB_GPUS", "NVIDIA_VISIBLE_DEVICES")):
            raise GpuExporterError(
                "indices inside a launcher's allocation need the exporter's view of the host"
            )
        places: tuple[int, ...] = choice.indices
    else:
        environ = os.environ if choice.host is None else {}
        places = cuda_indices(choice.uuids, environ, lambda: host_gpus(choice.url, timeout))
    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in places)
    return env


def host_gpus(base: str, timeout: float) -> list[HostGpu]:
    """The whole GPUs of the host the exporter at ``base`` serves (``/gpus``)."""
    body = request("GET", base, "/gpus", timeout=timeout).body
    try:
        listed = json.loads(body)["gpus"]
        return [
            HostGpu(g["index"], g["uuid"], g["pci_bus_id"] or "", g["name"] or "") for g in listed
        ]
    except (ValueError, KeyError, TypeError) as exc:
        raise GpuExporterError(f"{base}/gpus: unexpected answer ({exc})") from None


def choose_host(
    n: int,
    url: str | None,
    *,
    lease: Duration | None,
    wait: Duration | None,
    owner: str | None,
    timeout: float,
    ignore_mask: bool = False,
    **filters: FilterValue,
) -> Choice:
    """:func:`gpu_exporter.client.choose` on the one exporter at ``url``."""
    answer = choose_raw(
        n, url, format="json", lease=lease, wait=wait, owner=owner, timeout=timeout,
        ignore_mask=ignore_mask, **filters,
    )  # fmt: skip
    try:
        return Choice.from_json(
            json.loads(answer.body), url=answer.url, lease_header=answer.lease_token
        )
    except (ValueError, GpuExporterError) as exc:
        if answer.lease_token is not None:  # giving up: give back what was granted
            try:
                release(answer.lease_token, answer.url, timeout=timeout)
            except GpuExporterError as failed:
                log.warning("could not release lease %s: %s", answer.lease_id, failed)
        if isinstance(exc, GpuExporterError):
            raise
        raise GpuExporterError(
            f"{answer.url}/choose: expected JSON, got {answer.body[:200]!r}"
        ) from None


def release(
    choice_or_id: Choice | LeaseInfo | str,
    url: str | None = None,
    *,
    timeout: float = DEFAULT_TIMEOUT_SECONDS,
) -> None:
    """Give the GPUs back now. A :class:`Choice` without a lease is a no-op.

    A string is the lease's token (``$GPU_LEASE``); its id alone is refused (403) unless
    the server's ``--lease-admins`` names the user in ``$GPU_EXPORTER_USER``.

    Raises :class:`~gpu_exporter.client.LeaseNotFound` if the server no longer holds it
    (released, expired, or let go once the job's work showed on its GPUs).
    """
    ref, base = _lease_ref(choice_or_id, url)
    if ref is None:
        return
    request("DELETE", base, _lease_path(ref), timeout=timeout, lease_endpoint=True)


def renew(
    choice_or_id: Choice | LeaseInfo | str,
    ttl: Duration | None = None,
    url: str | None = None,
    *,
    timeout: float = DEFAULT_TIMEOUT_SECONDS,
) -> LeaseInfo:
    """Extend the lease to ``ttl`` from now (the server's default when None); the new lease.

    Raises :class:`~gpu_exporter.client.LeaseNotFound` once the lease has ended; if it
    expired, its GPUs may be someone else's by then (see
    :class:`~gpu_exporter.client.LeaseKeeper`).
    """
    ref, base = _lease_ref(choice_or_id, url)
    if ref is None:
        raise GpuExporterError("nothing to renew: this choice holds no lease")
    params = {"ttl": format_duration(ttl)} if ttl is not None else None
    resp = request(
        "POST", base, _lease_path(ref, "/renew"), params, timeout=timeout, lease_endpoint=True
    )
    return LeaseInfo.from_json(json_body(resp, f"{base}/leases/{lease_id_of(ref)}/renew"))


def register_pids(
    choice_or_id: Choice | LeaseInfo | str,
    pids: Iterable[int],
    url: str | None = None,
    *,
    timeout: float = DEFAULT_TIMEOUT_SECONDS,
) -> str | None:
    """Tell the server these processes (and their descendants) are the lease's job, so that
    only their work ends it early (``POST /leases/<id>/pids``); None when registered, else a
    note saying why not.

    Never raises: a server from before 13.1 (404), a lease already ended or no answer leaves
    the lease as it was, ended early only by a new process nobody else claims.
    """
    ref, base = _lease_ref(choice_or_id, url)
    if ref is None:
        return None
    path, params = _lease_path(ref, "/pids"), {"pid": ",".join(str(p) for p in pids)}
    try:
        request("POST", base, path, params, timeout=timeout, lease_endpoint=True)
    except GpuExporterError as exc:
        note = (  # the public id: a note is printed, and the token is the lease's secret
            f"could not register the job's process with lease {lease_id_of(ref)} (an older "
            f"gpu-exporter?): {exc}; the lease works without it"
        )
        log.info("%s", note)
        return note
    return None


def leases(url: str | None = None, *, timeout: float = DEFAULT_TIMEOUT_SECONDS) -> list[LeaseInfo]:
    """Every lease the server holds now."""
    base = resolve_url(url)
    data = json_body(request("GET", base, "/leases", timeout=timeout), f"{base}/leases")
    try:
        return [LeaseInfo.from_json(item) for item in data["leases"]]
    except (KeyError, TypeError) as exc:
        raise GpuExporterError(f"unexpected answer from {base}/leases: {data!r}") from exc


def _lease_ref(choice_or_id: Choice | LeaseInfo | str, url: str | None) -> tuple[str | None, str]:
    """What names the lease to the server (its token where known), and the server."""
    if isinstance(choice_or_id, Choice):
        return choice_or_id.lease_ref, url or choice_or_id.url
    if isinstance(choice_or_id, LeaseInfo):
        return choice_or_id.token or choice_or_id.id, resolve_url(url)
    return choice_or_id, resolve_url(url)


def _lease_path(lease_id: str, suffix: str = "") -> str:
    return "/leases/" + urllib.parse.quote(lease_id, safe="") + suffix
