"""Holding GPUs while a job runs: :func:`use_gpus`, :class:`GpuSession`, :class:`LeaseKeeper`.

:func:`use_gpus` chooses (falling back to this host's NVML when no server answers), points
``CUDA_VISIBLE_DEVICES`` at the chosen cards, renews the lease from a daemon thread
(:class:`LeaseKeeper`) and, on the way out, releases it and puts the environment back.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable
from types import TracebackType
from typing import Literal

from gpu_exporter.choose.memory import JAX_FRACTION_CONFLICT, MEM_ENV_NAMES
from gpu_exporter.client.caps import FRAMEWORKS, apply
from gpu_exporter.client.envcheck import near_miss_warning
from gpu_exporter.client.hostapi import (
    DEFAULT_LEASE,
    Choice,
    as_indices,
    register_pids,
    release,
    renew,
)
from gpu_exporter.client.local import OpenNvml, choose_or_fallback
from gpu_exporter.client.query import Duration, FilterValue, format_duration
from gpu_exporter.client.transport import (
    DEFAULT_TIMEOUT_SECONDS,
    GpuExporterError,
    GpuExporterWarning,
    LeaseNotFound,
    NoGpusAvailable,
    ServerError,
)

log = logging.getLogger(__name__)

OnUnavailable = Literal["error", "cpu"]  # use_gpus(): raise, or run the block on the CPU


class LeaseKeeper:
    """Renews a lease from a daemon thread every third of its TTL until :meth:`stop`.

    A failed renewal is logged and retried at the next turn (two more chances before the
    lease runs out). Once the server no longer knows the lease, renewing stops and
    :attr:`ended` says why:

    * ``"dropped"`` — it ended before its expiry: someone released it, or, before its first
      renewal, the job's own work showed on its GPUs (NVML's figures keep others away from
      then on; a renewed lease is never let go that way). Logged at INFO.
    * ``"expired"`` — renewals failed until it ran out: its GPUs may be handed to someone
      else. Logged as an error.

    If this process dies, renewals stop and the lease simply expires.
    """

    def __init__(self, choice: Choice, *, timeout: float = DEFAULT_TIMEOUT_SECONDS) -> None:
        if choice.lease_id is None or choice.lease_ref is None:
            raise ValueError("nothing to keep: this choice holds no lease")
        self.lease_id: str = choice.lease_id  # public: for logs
        self._token: str = choice.lease_ref  # secret: for renewals
        self.url = choice.url
        ttl = choice.lease.ttl_seconds if choice.lease is not None else 0.0
        self.ttl_seconds = ttl if ttl > 0 else 60.0
        self.interval_seconds = max(0.05, self.ttl_seconds / 3)
        self.expires_at = choice.expires_at
        self.renewals = 0
        self.ended: str | None = None  # "dropped" or "expired", once the server lost it
        self._timeout = min(timeout, max(1.0, self.interval_seconds))
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"gpu-lease-{self.lease_id}", daemon=True
        )

    def start(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def stop(self, timeout: float | None = None) -> None:
        """Stop renewing; waits for a renewal in flight (at most ``timeout`` seconds)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self._timeout + 1.0 if timeout is None else timeout)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    @property
    def lost(self) -> bool:
        """The lease ran out while this process still wanted it."""
        return self.ended == "expired"

    def _run(self) -> None:
        ttl = format_duration(round(self.ttl_seconds, 3))
        while not self._stop.wait(self.interval_seconds):
            try:
                lease = renew(self._token, ttl, self.url, timeout=self._timeout)
            except LeaseNotFound:
                if not self._stop.is_set():
                    self._gone()
                return
            except GpuExporterError as exc:
                if not self._stop.is_set():
                    log.warning("could not renew lease %s (will retry): %s", self.lease_id, exc)
                continue
            self.expires_at = lease.expires_at
            self.renewals += 1

    def _gone(self) -> None:
        if self.expires_at is not None and time.time() < self.expires_at:
            self.ended = "dropped"
            log.info(
                "lease %s ended before it expired (the job's work reached its GPUs, or it was "
                "released elsewhere); no longer renewing it",
                self.lease_id,
            )
        else:
            self.ended = "expired"
            log.error(
                "lease %s expired before it could be renewed: its GPUs may now be handed to "
                "someone else",
                self.lease_id,
            )


def keep(
    choice: Choice, timeout: float = DEFAULT_TIMEOUT_SECONDS
) -> tuple[LeaseKeeper | None, str | None]:
    """Renew ``choice``'s lease from now on, first registering this process as its job where
    the GPUs are here (a PID names one host's process): the keeper (None without a lease), and
    a note when registering failed."""
    if choice.lease_id is None:
        return None, None
    note = register_pids(choice, [os.getpid()], timeout=timeout) if choice.host is None else None
    return LeaseKeeper(choice, timeout=timeout).start(), note


def let_go(
    choice: Choice | None, keeper: LeaseKeeper | None, timeout: float = DEFAULT_TIMEOUT_SECONDS
) -> str | None:
    """Stop renewing and release the lease; a warning when it could not be released."""
    if keeper is not None:
        keeper.stop()
    if choice is None or choice.lease_id is None:
        return None
    try:
        release(choice, timeout=timeout)
    except LeaseNotFound:  # ended already: see LeaseKeeper.ended
        log.debug("lease %s had already ended", choice.lease_id)
    except GpuExporterError as exc:
        return f"could not release lease {choice.lease_id} (it expires by itself): {exc}"
    return None


def cuda_initialised_by() -> list[str]:
    """Frameworks already imported here that have initialised CUDA (where one can tell).

    Once CUDA is initialised in a process, changing ``CUDA_VISIBLE_DEVICES`` has no effect.
    Only looks: never imports a framework or touches a GPU.
    """
    found = []
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_initialized():
                found.append("torch")
        except Exception:  # an odd build or a stub: cannot tell
            log.debug("cannot tell whether torch has initialised CUDA", exc_info=True)
    context = sys.modules.get("tensorflow.python.eager.context")
    ctx = getattr(context, "_context", None) if context is not None else None
    if ctx is not None and getattr(ctx, "_context_handle", None) is not None:
        found.append("tensorflow")
    return found


# Set (or taken out) for the block, and put back as they were afterwards.
_ENV_KEYS = (
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    "GPU_LEASE",
    *MEM_ENV_NAMES,
    JAX_FRACTION_CONFLICT,
)


def replaced_visible_devices(choice: Choice) -> str | None:
    """A warning when ``choice`` would replace a different CUDA_VISIBLE_DEVICES already set
    (asked with ``ignore_mask``: otherwise the choice is inside it).

    Slurm and the Kubernetes device plugin set it to the GPUs they allocated; replacing it
    silently would put a job on cards the scheduler gave someone else.
    """
    previous = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not previous or previous == choice.cuda_visible_devices:
        return None
    return (
        f"replacing CUDA_VISIBLE_DEVICES={previous} with the chosen GPUs; if a scheduler "
        "(Slurm, Kubernetes) set it, choose among its GPUs with include= (or don't choose)"
    )


class GpuSession:
    """What :func:`use_gpus` returns: a context manager; ``with … as gpus`` gives the Choice."""

    def __init__(
        self,
        choose: Callable[..., Choice],
        url: str | None,
        timeout: float,
        on_unavailable: OnUnavailable,
        framework: str | None,
        ignore_mask: bool = False,
        indices: bool = False,
    ) -> None:
        self._choose = choose  # choose_or_fallback with the request's arguments
        self._url = url
        self._timeout = timeout
        self._on_unavailable = on_unavailable
        self._framework = framework
        self._ignore_mask = ignore_mask  # then replacing a launcher's mask is warned about
        self._indices = indices  # CUDA_VISIBLE_DEVICES as indices (hostapi.as_indices)
        self.choice: Choice | None = None
        self.keeper: LeaseKeeper | None = None
        self._saved: dict[str, str | None] = {}

    def __enter__(self) -> Choice:
        if self.choice is not None:
            raise RuntimeError("use_gpus(...) is not reentrant; make a new one")
        initialised = cuda_initialised_by()
        if initialised:
            warnings.warn(
                f"{' and '.join(initialised)} already initialised CUDA in this process, so "
                "setting CUDA_VISIBLE_DEVICES now has no effect here; enter use_gpus() before "
                "the first CUDA call (or import the framework inside the block)",
                GpuExporterWarning,
                stacklevel=2,
            )
        typo = near_miss_warning()
        if typo is not None:
            warnings.warn(typo, GpuExporterWarning, stacklevel=2)
        try:
            choice = self._choose(stacklevel=3)
        except GpuExporterError as exc:
            choice = self._cpu_instead(exc)
        self.choice = choice
        try:
            self.keeper, _ = keep(choice, self._timeout)
            replacing = replaced_visible_devices(choice) if self._ignore_mask else None
            if replacing is not None:
                warnings.warn(replacing, GpuExporterWarning, stacklevel=2)
            # Indices are read against the job's environment as it was, mask included.
            env = as_indices(choice, self._timeout) if self._indices else choice.env()
            self._saved = {key: os.environ.get(key) for key in _ENV_KEYS}
            for key in _ENV_KEYS:
                os.environ.pop(key, None)
            os.environ.update(env)
            if self._framework is not None and choice.mem_bytes is not None:
                apply(choice, self._framework)
        except BaseException:
            self._finish()
            raise
        return choice

    def _cpu_instead(self, exc: GpuExporterError) -> Choice:
        """With ``on_unavailable="cpu"``: no GPU to be had (none free, no server or driver to
        ask) gives a choice of none, so the block runs with every GPU hidden; a refused
        request (bad argument, a limit) still raises."""
        refused = isinstance(exc, ServerError) and not isinstance(exc, NoGpusAvailable)
        if self._on_unavailable != "cpu" or refused:
            raise exc
        message = f"no GPU available ({exc}); running on the CPU: CUDA_VISIBLE_DEVICES=''"
        log.warning("%s", message)
        warnings.warn(message, GpuExporterWarning, stacklevel=3)
        return Choice((), (), None, None, self._url or "")

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._finish()

    def _finish(self) -> None:
        for key, value in self._saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._saved = {}
        warning = let_go(self.choice, self.keeper, self._timeout)
        if warning is not None:
            log.warning("%s", warning)


def use_gpus(
    n: int = 1,
    url: str | None = None,
    *,
    lease: Duration | None = DEFAULT_LEASE,
    wait: Duration | None = None,
    owner: str | None = None,
    timeout: float = DEFAULT_TIMEOUT_SECONDS,
    local_fallback: bool = True,
    open_nvml: OpenNvml | None = None,
    on_unavailable: OnUnavailable = "error",
    framework: str | None = None,
    ignore_mask: bool = False,
    indices: bool = False,
    **filters: FilterValue,
) -> GpuSession:
    """Run a block on ``n`` GPUs that nobody else is handed meanwhile.

    On entry: chooses (same arguments as :func:`~gpu_exporter.client.choose`), sets
    ``CUDA_VISIBLE_DEVICES`` to the chosen UUIDs, ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` and
    ``GPU_LEASE``, and renews the lease in a daemon thread every third of its TTL. On exit,
    even by an exception: stops renewing, releases the lease, and restores those variables as
    they were. ::

        with use_gpus(2, min_free="20GiB", wait="10m") as gpus:
            import torch  # CUDA must not be initialised before the block

            print(gpus.uuids, torch.cuda.device_count())  # (...), 2: cuda:0 and cuda:1

    With ``CUDA_VISIBLE_DEVICES=GPU-a,GPU-b``, PyTorch sees ``cuda:0`` and ``cuda:1`` and
    TensorFlow ``/GPU:0`` and ``/GPU:1``. A framework that initialised CUDA before the block
    ignores the variable; that is warned about where it can be detected (PyTorch, TensorFlow).

    If no server answers and ``local_fallback`` is true, the GPUs are chosen from this host's
    NVML instead, with a :class:`GpuExporterWarning` — no lease protects such a choice. With
    no driver or no GPU it raises :class:`GpuExporterError`: it never silently runs on CPU.
    ``open_nvml`` returns the NVML to choose from then (default: this host's driver).

    ``on_unavailable="cpu"`` is for code that must also run where no GPU is free: when none
    can be had (none qualifies, no server and no driver), the block runs with
    ``CUDA_VISIBLE_DEVICES=""`` (every GPU hidden), ``gpus.uuids == ()``, and a warning says
    so. A refused request (a bad argument, a lease limit) still raises.
    Environment variables that look like typos of ``CUDA_VISIBLE_DEVICES`` (which CUDA
    silently ignores) are warned about.

    Inside a job a launcher already gave GPUs (Slurm's ``SLURM_JOB_GPUS``, a container's
    ``NVIDIA_VISIBLE_DEVICES``, an outer ``CUDA_VISIBLE_DEVICES``), only those are chosen
    from (:mod:`~gpu_exporter.client.allocation`); ``ignore_mask=True`` chooses among every
    GPU of the host, and warns when it replaces a ``CUDA_VISIBLE_DEVICES`` already set.
    ``indices=True`` sets ``CUDA_VISIBLE_DEVICES`` to indices (under
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID``) that name the leased cards, for tools that cannot take
    UUIDs (:func:`~gpu_exporter.client.hostapi.as_indices`).

    ``mem="8GiB"`` asks for a memory lease: that much of each card, on cards shared with other
    such jobs; the environment then also carries the caps (``GPU_MEM_LIMIT_BYTES``,
    ``GPU_MEM_FRACTION``, ``XLA_PYTHON_CLIENT_MEM_FRACTION`` …), and ``framework`` applies the
    hard cap in this process: ``"torch"`` (:meth:`Choice.apply_torch`), ``"tensorflow"``
    (:meth:`Choice.apply_tensorflow`, before TensorFlow initialises) or ``"jax"`` (the
    environment is the cap; warns if jax was imported already).
    """
    if on_unavailable not in ("error", "cpu"):
        raise ValueError(f"on_unavailable must be 'error' or 'cpu', not {on_unavailable!r}")
    if framework is not None and framework not in FRAMEWORKS:
        raise ValueError(f"framework must be one of {', '.join(FRAMEWORKS)} or None")
    if framework is not None and filters.get("mem") is None:
        raise ValueError(f"framework={framework!r} caps memory: give mem= too")
    choose = functools.partial(
        choose_or_fallback,
        n,
        url,
        lease=lease,
        wait=wait,
        owner=owner,
        timeout=timeout,
        local_fallback=local_fallback,
        filters=dict(filters),
        open_nvml=open_nvml,
        ignore_mask=ignore_mask,
    )
    return GpuSession(choose, url, timeout, on_unavailable, framework, ignore_mask, indices)
