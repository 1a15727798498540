"""Whether a failed MLflow write may succeed later: the one classification both of trainguard's
writers retry by (the tracker's, :mod:`trainguard.tracking.writer`, and the Ray workers' designated
writer, :mod:`trainguard.raytrain.tracking`). It lives below both so that neither imports the other.
"""

from __future__ import annotations

__all__ = ["PERMANENT_CODES", "PermanentWriteError", "is_permanent_error"]

#: MLflow error codes of requests that can never succeed (retrying would not help)
PERMANENT_CODES = frozenset({
    "INVALID_PARAMETER_VALUE", "RESOURCE_ALREADY_EXISTS", "RESOURCE_DOES_NOT_EXIST", "BAD_REQUEST",
    "INVALID_STATE", "PERMISSION_DENIED", "UNAUTHENTICATED",
})


class PermanentWriteError(Exception):
    """A tracking write that can never succeed (retrying would not help)."""


def is_permanent_error(exc: BaseException) -> bool:
    """Whether a failed MLflow write failed for good (a bad request, a missing file, a
    :class:`PermanentWriteError`) rather than for now (the store unreachable or locked): the
    writers retry only the latter."""
    if isinstance(exc, (PermanentWriteError, OSError)) and not isinstance(exc, ConnectionError):
        return isinstance(exc, (PermanentWriteError, FileNotFoundError))
    try:
        from mlflow.exceptions import MlflowException
    except ImportError:  # pragma: no cover
        return True
    if isinstance(exc, MlflowException):
        return getattr(exc, "error_code", "") in PERMANENT_CODES
    return False
