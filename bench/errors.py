"""What a benchmark reports as the user's problem rather than its own: a request the services
refused or failed, a model or a window the benchmark cannot use, services that did not start.
`kvhandoff bench` prints these and exits 2 (bench/cli.py): one line, or for services that did
not start the line and their log's tail; anything else is a bug and keeps its traceback."""

from __future__ import annotations


class BenchRequestFailed(RuntimeError):
    """A request the benchmark sent ended in an error; the message names the request and the
    error the services gave."""


def user_errors() -> tuple[type[BaseException], ...]:
    """The exception types `kvhandoff bench` reports in one line: a model that is missing or
    unsupported, a window the model cannot serve, services that did not start, a failed
    request. Imported when called, so the CLI's help stays free of torch."""
    from common.capacity import CapacityError
    from common.model.config import UnsupportedModelError
    from common.model.loader import ModelNotFoundError
    from common.server.launch import ServiceStartError

    return (CapacityError, UnsupportedModelError, ModelNotFoundError, ServiceStartError,
            BenchRequestFailed)
