"""A refused request: :class:`ApiError`, the HTTP status, error code, message and parameter.

Every part of choosing and leasing refuses this one way (a bad parameter, a lease limit, too
few GPUs), and :mod:`gpu_exporter.web.errors` answers it by the error contract.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ApiError(Exception):
    status: int
    code: str
    message: str
    param: str | None = None

    def __str__(self) -> str:
        return self.message
