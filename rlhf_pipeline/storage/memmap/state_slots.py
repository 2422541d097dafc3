"""The published state of a memmap store in two CRC-checked slots written in turn, so that frequent
publishes need no rename (:class:`StateSlots`; what a read found: :class:`SlotReading`, :class:`SlotDamage`).
Design: docs/storage.md#the-state-slots."""

from __future__ import annotations

import json
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf_pipeline.files.atomic import fsync_dir


@dataclass(frozen=True)
class SlotDamage:
    """A slot that fails its check and may hold a publish newer than the intact one.

    ``claimed_seq`` is the sequence number its header claims (None when the header itself is
    damaged); ``claimed_state`` is its payload when that still parses as JSON (untrusted: it
    failed its CRC, but it usually tells what was rolled back).
    """

    path: Path
    claimed_seq: int | None
    reason: str
    claimed_state: dict[str, Any] | None = None

    def describe(self) -> str:
        publish = f"publish {self.claimed_seq}" if self.claimed_seq is not None else "an unknown publish"
        return f"{self.path} ({publish}: {self.reason})"


@dataclass(frozen=True)
class SlotReading:
    """What :meth:`StateSlots.read` found: the newest intact publish above ``after`` (``seq`` and
    ``state`` are None when there is none) and the damaged slots that may be newer than it."""

    seq: int | None
    state: dict[str, Any] | None
    damaged: tuple[SlotDamage, ...] = ()
    slots_in_use: int = 0  # slots that hold (or held) a publish: a header was written
    path: Path | None = None  # the slot file ``state`` was read from
    missing: tuple[Path, ...] = ()  # slot files that are not there at all
    unpublished: tuple[Path, ...] = ()  # slot files there that never got a publish's header


class StateSlots:
    """Publishes a JSON state many times a second without a rename: two slots, written in turn.

    Renaming a file over another costs 0.5-5 ms on ext4 here (the rename forces the new
    file's delayed blocks out), which is most of an append's cost. Instead, publish ``k``
    overwrites slot ``k % 2`` in place with ``[magic][crc32][seq][length][json]``; the
    other slot still holds publish ``k - 1``. A reader takes the valid slot with the
    highest sequence number. Readers never go back: :meth:`latest` only returns sequence
    numbers above ``after``.

    The payload is written first and the 24-byte header last, in a separate write within the
    file's first page. A writer killed at any moment therefore leaves the slot it was writing
    with its *old* header (a lower sequence number than the other slot's) or the complete new
    record, never a newest slot that fails its check: a slot whose header claims the newest
    publish and fails its CRC was damaged after it was written (or torn by a power loss), and
    :meth:`read` reports it as :class:`SlotDamage`. A reader racing the writer can still read
    a slot mid-rewrite; it notices that a header changed under it and reads again.

    Files: ``<stem>.0`` and ``<stem>.1`` next to the manifest, both created empty with the store
    (:meth:`create_files`): once publish 2 has landed each holds a publish, so a missing slot file, or
    one with no publish beside a slot holding publish 2 or later, was lost outside this library.
    """

    _MAGIC = b"RLS1"
    _HEADER = struct.Struct("<4sIQQ")  # magic, crc32 of the payload, sequence number, payload length
    _UNUSED = bytes(_HEADER.size)  # a slot file created but never published (its header never written)
    _ATTEMPTS = 16

    def __init__(self, directory: str | os.PathLike, stem: str = "state"):
        self.paths = tuple(Path(directory) / f"{stem}.{i}" for i in (0, 1))
        self._fds: list[int | None] = [None, None]
        self._writable = [False, False]

    def _fd(self, slot: int, *, create: bool) -> int | None:
        """The slot's open file; ``create=True`` (writers) opens it writable, creating it."""
        if create and not self._writable[slot] and self._fds[slot] is not None:
            os.close(self._fds[slot])  # opened read-only by latest(); reopen for writing
            self._fds[slot] = None
        if self._fds[slot] is None:
            try:
                flags = os.O_RDWR | os.O_CREAT if create else os.O_RDONLY
                self._fds[slot] = os.open(self.paths[slot], flags, 0o644)
            except FileNotFoundError:
                return None
            self._writable[slot] = create
        return self._fds[slot]

    def create_files(self) -> None:
        """Creates both slot files, empty (no publish yet), unless they exist; the entries are made
        durable, so that a store's manifest is never on disk without them."""
        for path in self.paths:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o644))
        fsync_dir(self.paths[0].parent)

    def publish(self, seq: int, data: dict[str, Any], *, durable: bool = True) -> None:
        """Writes publish number ``seq`` (> every earlier one) into slot ``seq % 2``: payload, then header."""
        payload = json.dumps(data, separators=(",", ":"), sort_keys=True).encode()
        header = self._HEADER.pack(self._MAGIC, zlib.crc32(payload), seq, len(payload))
        slot = seq % 2
        new_file = self._fds[slot] is None and not self.paths[slot].exists()
        fd = self._fd(slot, create=True)
        view = memoryview(payload)
        offset = 0
        while offset < len(payload):
            offset += os.pwrite(fd, view[offset:], self._HEADER.size + offset)
        if os.pwrite(fd, header, 0) != len(header):  # 24 bytes within one page: never split
            raise OSError(f"short write of the header of {self.paths[slot]}")
        if durable:
            os.fdatasync(fd)
            if new_file:
                fsync_dir(self.paths[slot].parent)

    def latest(self, after: int = 0) -> tuple[int, dict[str, Any]] | None:
        """``(seq, state)`` of the newest intact publish with ``seq > after``, or None."""
        reading = self.read(after)
        return None if reading.seq is None else (reading.seq, reading.state)

    def read(self, after: int = 0) -> SlotReading:
        """The newest intact publish with ``seq > after``, and the damaged slots that may be newer."""
        for _ in range(self._ATTEMPTS):
            headers = [self._header(0), self._header(1)]
            if after and self._nothing_newer(headers, after):
                return _NOTHING_NEWER  # a reader's refresh with no news: two header reads, as before
            reading = self._read_once(headers, after)
            if reading is not None:
                return reading
        raise OSError(f"{self.paths[0].parent}: the state slots kept changing while being read")

    def _nothing_newer(self, headers: list[bytes | None], after: int) -> bool:
        """True when every slot holds a well-formed header of a publish ``<= after`` (or none)."""
        for raw in headers:
            if raw is None or raw == self._UNUSED[: len(raw)]:
                continue  # missing, or created and never published (an open told of a missing one)
            if len(raw) != self._HEADER.size:
                return False
            magic, _, seq, _ = self._HEADER.unpack(raw)
            if seq > after or (magic != self._MAGIC and raw != self._UNUSED):
                return False
        return True

    def _header(self, slot: int) -> bytes | None:
        """The slot's raw header bytes (shorter when the file is), or None when the file is missing."""
        fd = self._fd(slot, create=False)
        if fd is None:
            return None
        return os.pread(fd, self._HEADER.size, 0)

    def _read_once(self, headers: list[bytes | None], after: int) -> SlotReading | None:
        """One attempt; None when a header changed meanwhile (a writer is publishing): try again."""
        parsed: list[tuple[int, int, int, int] | None] = []  # per slot: (slot, seq, crc, length)
        damaged: list[SlotDamage] = []
        in_use = 0
        missing = tuple(self.paths[slot] for slot, raw in enumerate(headers) if raw is None)
        unpublished = []
        for slot, raw in enumerate(headers):
            if raw is None or raw in (b"", self._UNUSED) or raw == self._UNUSED[: len(raw)]:
                parsed.append(None)  # missing, or created and never published
                if raw is not None:
                    unpublished.append(self.paths[slot])
                continue
            in_use += 1
            if len(raw) < self._HEADER.size:
                damaged.append(SlotDamage(self.paths[slot], None, f"holds {len(raw)} bytes, fewer than a header"))
                parsed.append(None)
                continue
            magic, crc, seq, length = self._HEADER.unpack(raw)
            if magic != self._MAGIC:
                damaged.append(SlotDamage(self.paths[slot], None, "its header is damaged"))
                parsed.append(None)
                continue
            parsed.append((slot, seq, crc, length))
        best: tuple[int, dict[str, Any], Path] | None = None
        # only publishes the caller has not seen are read: a reader's refresh with no news costs
        # two header reads, as before
        newer = [p for p in parsed if p is not None and p[1] > after]
        for slot, seq, crc, length in sorted(newer, key=lambda p: -p[1]):
            fd = self._fds[slot]
            payload = os.pread(fd, length, self._HEADER.size)
            if [self._header(s) for s in (0, 1)] != headers:
                return None  # rewritten while we read: the writer is active
            problem = None
            if len(payload) != length:
                problem = f"its payload is {len(payload)} bytes, the header says {length}"
            elif zlib.crc32(payload) != crc:
                problem = "its payload fails the CRC check"
            else:
                try:
                    state = json.loads(payload)
                except ValueError:
                    problem = "its payload passes the CRC check but is not JSON"
            if problem is None:
                best = (seq, state, self.paths[slot])
                break
            damaged.append(SlotDamage(self.paths[slot], seq, problem, _try_json(payload)))
        newest = best[0] if best is not None else (after if after else -1)
        if after:  # a damaged header cannot be placed; the caller was told when it first opened
            damaged = [d for d in damaged if d.claimed_seq is not None]
        newer_damage = tuple(d for d in damaged if d.claimed_seq is None or d.claimed_seq > newest)
        if best is None:
            return SlotReading(None, None, newer_damage, in_use, None, missing, tuple(unpublished))
        return SlotReading(best[0], best[1], newer_damage, in_use, best[2], missing, tuple(unpublished))

    def remove(self) -> None:
        self.close()
        for path in self.paths:
            path.unlink(missing_ok=True)

    def close(self) -> None:
        for slot, fd in enumerate(self._fds):
            if fd is not None:
                os.close(fd)
                self._fds[slot] = None


_NOTHING_NEWER = SlotReading(None, None)


def _try_json(payload: bytes) -> dict[str, Any] | None:
    try:
        data = json.loads(payload)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None
