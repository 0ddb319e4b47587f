"""Awaiting an answer from the decode engine thread on the event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from common.errors import ServiceError


async def engine_answer(submit: Callable[[Callable[[object], None]], None]):
    """Calls submit(done) and awaits the value the engine thread passes to done; a ServiceError
    value is raised. done may be called from any thread, and after the awaiting task was
    cancelled (the answer is then dropped)."""
    loop = asyncio.get_running_loop()
    answer: asyncio.Future = loop.create_future()

    def done(result) -> None:
        loop.call_soon_threadsafe(lambda: answer.done() or answer.set_result(result))

    submit(done)
    result = await answer
    if isinstance(result, ServiceError):
        raise result
    return result
