"""Waiting for work that must finish even when the caller is cancelled."""

from __future__ import annotations

import asyncio
from typing import Any


async def wait_uncancelled(task: asyncio.Future) -> tuple[Any, bool]:
    """``task``'s result, waited for even if the caller is cancelled meanwhile, and
    whether it was: engines changing weights or versions must finish, and be recorded,
    before they resume and serving reopens. The caller re-raises the cancellation."""
    cancelled = False
    while True:
        try:
            return await asyncio.shield(task), cancelled
        except asyncio.CancelledError:
            if task.cancelled():
                raise
            cancelled = True
