"""Raw key/value access to a Zarr store reached through ``zarr.abc.store.Store`` (a zip file, an fsspec
URL), batched on Zarr's event loop: the base that :mod:`.object_store` extends with conditional writes,
and that :mod:`.location` hands out for every location that is not a local directory.
Design: docs/zarr-layout.md#where-a-store-lives."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from rlhf_pipeline.storage.zarr.units import ROOT_META


class ZarrStoreKV:
    """Keys through a ``zarr.abc.store.Store`` (zip, fsspec URLs), batched on Zarr's event loop."""

    def __init__(self, store, *, read_only: bool):
        self.store = store
        self.read_only = read_only

    def _sync(self, coro):
        from zarr.core.sync import sync

        return sync(coro)

    def get(self, key: str) -> bytes | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Iterable[str]) -> list[bytes | None]:
        import asyncio

        from zarr.core.buffer import default_buffer_prototype

        proto = default_buffer_prototype()

        async def fetch():
            bufs = await asyncio.gather(*(self.store.get(k, prototype=proto) for k in keys))
            return [None if b is None else b.to_bytes() for b in bufs]

        return self._sync(fetch())

    def put_many(self, items: Iterable[tuple[str, bytes]] | Mapping[str, bytes], *, durable: bool = False,
                 threaded: bool = True, defer_sync: bool = False) -> None:
        import asyncio

        from zarr.core.buffer import default_buffer_prototype

        proto = default_buffer_prototype()

        pairs = [(k, v if isinstance(v, bytes) else b"".join(v) if isinstance(v, (list, tuple))
                  else bytes(memoryview(v).cast("B")))
                 for k, v in (items.items() if isinstance(items, Mapping) else items)]

        async def put():
            await asyncio.gather(*(self.store.set(k, proto.buffer.from_bytes(v)) for k, v in pairs))

        self._sync(put())

    def publish_record(self, document: dict[str, Any]) -> None:
        """Replaces the root ``zarr.json`` with one PUT (an object store overrides this)."""
        self.put_many({ROOT_META: json.dumps(document, separators=(",", ":")).encode()})

    def close(self) -> None:
        if hasattr(self.store, "close"):
            self.store.close()

    def list_dir(self, prefix: str) -> list[str]:
        async def ls():
            return sorted([k async for k in self.store.list_dir(prefix)])

        return self._sync(ls())

    def delete_prefix(self, prefix: str) -> None:
        self._sync(self.store.delete_dir(prefix))

    def delete_unit(self, prefix: str, keys: list[str]) -> None:
        """Deletes a unit, whose ``keys`` under ``prefix`` its kind names (an object store deletes just
        them: no listing)."""
        self.delete_prefix(prefix)

    def size_of(self, prefix: str) -> int:
        async def total():
            n = 0
            async for key in self.store.list_prefix(prefix):
                n += await self.store.getsize(key)
            return n

        return self._sync(total())
