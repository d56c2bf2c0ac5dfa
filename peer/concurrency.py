"""Running a few tasks side by side with plain exceptions.

trio's nurseries wrap every child failure in an ExceptionGroup. Where a caller handles specific errors
(a session closing mid-exchange, a deadline), `together` re-raises the first real failure as itself, so
an ordinary `except SessionClosed:` works. When several tasks fail at once (a dead session fails the
sender and the receiver alike) the first is raised and the whole group is attached as its cause.
"""

from __future__ import annotations

from typing import Awaitable, Callable

import trio


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for sub in exc.exceptions for leaf in _leaves(sub)]
    return [exc]


async def together(*fns: Callable[[], Awaitable[None]]) -> None:
    """Run `fns` concurrently; when one fails the others are cancelled and its error is raised."""
    try:
        async with trio.open_nursery() as nursery:
            for fn in fns:
                nursery.start_soon(fn)
    except BaseExceptionGroup as group:
        real = [e for e in _leaves(group) if not isinstance(e, trio.Cancelled)]
        if real:
            raise real[0] from group
        raise
