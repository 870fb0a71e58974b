"""SIGHUP reads the tenants file again: new keys, rights and shares apply to the requests that
arrive next, while those accepted keep going. A file that cannot be used is logged and changes
nothing: the tenants stay as they were."""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path

from punica.server.tenants import read_tenants

log = logging.getLogger("punica.server")


class TenantsReload:
    """Applies the tenants file at `path` to `state` (punica.server.app.ServerState) on every SIGHUP."""

    def __init__(self, state, path: str | Path):
        self.state, self.path = state, path
        self._lock = asyncio.Lock()        # one reload at a time: the last signal's read wins
        self._tasks: set[asyncio.Task] = set()  # the loop holds tasks weakly

    def install(self) -> None:
        """Handle SIGHUP on the running loop (it must run in the main thread)."""
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self._on_signal)

    def uninstall(self) -> None:
        asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)

    def _on_signal(self) -> None:
        task = asyncio.ensure_future(self.reload())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def reload(self) -> bool:
        """Read the file and serve its tenants; False (logged) when it cannot be used."""
        async with self._lock:
            try:
                tenants = await asyncio.to_thread(read_tenants, self.path)
                await self.state.set_tenants(tenants)
            except Exception as e:  # noqa: BLE001 - logged; the server keeps serving the tenants it had
                log.error("SIGHUP: the tenants stay as they were: %s", e)
                return False
            log.info("SIGHUP: serving the tenants of %s (%d tenants)", self.path, len(tenants.shares))
            return True
