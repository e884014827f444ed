"""``--kubernetes``: which pod holds which GPU, asked of the kubelet on a thread of its own.

Every 10 s (never per scrape) :class:`PodResourcesPoller` calls the kubelet's PodResources v1
``List`` over its Unix socket (``/var/lib/kubelet/pod-resources/kubelet.sock``), with a
deadline, and publishes the devices each container holds to a
:class:`~gpu_exporter.podallocations.PodAllocations`. A missing socket, a kubelet that does not
answer in time or answers garbage marks it down (``gpu_exporter_kubernetes_up 0``) and keeps the
last answer; nothing else waits for it. The log says so once per change of state (down, and
why; answering again), not every poll.

gRPC is ``grpcio`` (the ``kubernetes`` extra), imported only here and only when the flag is
given; the messages are decoded by :mod:`gpu_exporter.collect.podresources`. Each poll opens
a fresh channel and closes it: a Unix socket costs nothing to connect to every 10 s, and a
kubelet that restarts is seen at the next poll, not after gRPC's reconnect backoff.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from gpu_exporter.collect.background import BackgroundThread
from gpu_exporter.collect.podresources import LIST_METHOD, DecodeError, decode_list_response
from gpu_exporter.config import ServeConfig
from gpu_exporter.podallocations import PodAllocations

log = logging.getLogger(__name__)

POLL_SECONDS = 10.0
TIMEOUT_SECONDS = 5.0
NOT_ASKED = "not asked yet"  # the state before the first poll: its failure is a fall too
MAX_MESSAGE_BYTES = 16 * 2**20  # a node with hundreds of pods answers in well under this


class ListError(Exception):
    """The kubelet did not answer ``List`` (one line: why)."""


def list_pod_resources(socket_path: str, timeout_seconds: float = TIMEOUT_SECONDS) -> bytes:
    """One ``List`` call over a fresh channel: the answer's bytes, or :class:`ListError`."""
    import grpc

    if not os.path.exists(socket_path):
        raise ListError(f"no socket at {socket_path}")
    options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
    with grpc.insecure_channel(f"unix://{os.path.abspath(socket_path)}", options) as channel:
        call = channel.unary_unary(
            LIST_METHOD,
            request_serializer=bytes,
            response_deserializer=bytes,
        )
        try:
            answer: bytes = call(b"", timeout=timeout_seconds)
        except grpc.RpcError as exc:
            # The error raised is also a grpc.Call, which the stubs cannot express.
            code, details = getattr(exc, "code", None), getattr(exc, "details", None)
            name = code().name if callable(code) else "ERROR"
            raise ListError(f"{name}: {details() if callable(details) else exc}") from None
    return answer


def kubelet_poller(config: ServeConfig) -> PodResourcesPoller | None:
    """The poller ``--kubernetes`` asks for (not started), or None without the flag."""
    if config.kubernetes_socket is None:
        return None
    interval = config.kubernetes_poll_seconds
    return PodResourcesPoller(
        config.kubernetes_socket,
        PodAllocations(),
        interval_seconds=interval,
        timeout_seconds=min(TIMEOUT_SECONDS, interval),  # a call never outlives its period
    )


class PodResourcesPoller(BackgroundThread):
    """Polls ``lister`` (default: :func:`list_pod_resources` on ``socket_path``) every
    ``interval_seconds`` into ``allocations``, on a daemon thread."""

    name = "kubelet-pod-resources"

    def __init__(
        self,
        socket_path: str,
        allocations: PodAllocations,
        *,
        interval_seconds: float = POLL_SECONDS,
        timeout_seconds: float = TIMEOUT_SECONDS,
        lister: Callable[[], bytes] | None = None,
    ) -> None:
        super().__init__()
        self.socket_path = socket_path
        self.allocations = allocations
        self.interval_seconds = interval_seconds
        self._list = lister or (lambda: list_pod_resources(socket_path, timeout_seconds))
        self._problem: str | None = NOT_ASKED  # what the log last said was wrong

    def _run(self) -> None:
        while not self.stopping:
            self.poll_once()
            self.wait(self.interval_seconds)

    def poll_once(self) -> bool:
        """One ``List``; whether it worked. Never raises."""
        try:
            devices = decode_list_response(self._list())
        except (ListError, DecodeError) as exc:
            self._down(str(exc))
            return False
        except Exception as exc:  # a bug or an unforeseen gRPC error must not end the thread
            log.debug("PodResources List failed", exc_info=True)
            self._down(f"{type(exc).__name__}: {exc}")
            return False
        self.allocations.publish(devices)
        if self._problem is not None:
            pods = {d.pod_ref for d in devices}
            log.info(
                "kubelet PodResources at %s answers: %d devices allocated to %d pods",
                self.socket_path,
                len(devices),
                len(pods),
            )
            self._problem = None
        return True

    def _down(self, why: str) -> None:
        self.allocations.fail()
        # A warning once per fall (answering, or never asked, to failing); a poll that fails
        # the same way again says nothing, and one that fails another way while still down
        # (a kubelet stopping says UNAVAILABLE, then its socket is gone) says so at info.
        if why.split(":", 1)[0] == (self._problem or "").split(":", 1)[0]:
            return
        level = logging.INFO if self._problem not in (None, NOT_ASKED) else logging.WARNING
        log.log(
            level,
            "kubelet PodResources at %s: %s; gpu_exporter_kubernetes_up is 0, the last "
            "answer is kept (asking again every %g s)",
            self.socket_path,
            why,
            self.interval_seconds,
        )
        self._problem = why
