"""A Zarr store's writer side (``ZarrAppending``): appending units, publishing the commit record, sealing.

An append writes a new unit under new keys (a whole segment sealed, any other piece a packed fragment),
then replaces the root ``zarr.json`` whose attributes are the commit record (rows, units, the append's
``writer_state``): locally by an atomic rename after one sync of the unit and the record, remotely by one
PUT. A reader sees the old or the new record, and every unit either names is complete. A completed
segment is sealed in the background (:mod:`.writer`); ``capacity_rows`` and retention's drop take whole
sealed segments out in one publish, and their objects are deleted right after it.
Design: docs/zarr-layout.md#consistency-rules-what-makes-it-safe-without-a-synchronizer."""

from __future__ import annotations

from rlhf_pipeline.schema import TrajectoryBatch
from rlhf_pipeline.storage.segmented import DroppedSegment, writer_state_entry
from rlhf_pipeline.storage.zarr.layout import UNITS_PREFIX
from rlhf_pipeline.storage.zarr.location import ROOT_META, parse_record, publish
from rlhf_pipeline.storage.zarr.unit_cache import DecodedUnit, concat_arrays, encode_columns, slice_arrays
from rlhf_pipeline.storage.zarr.unit_constants import RECORD_KEY, constants_of, record_entry, unit_key
from rlhf_pipeline.storage.zarr.units import PACKED_FRAGMENT, SEALED_PACKED, UnitRef
from rlhf_pipeline.storage.zarr.writer import plan_pieces


class ZarrAppending:
    """The write path of :class:`~rlhf_pipeline.storage.zarr.store.ZarrTrajectoryStore`, which holds
    the state it works on (the record, its units, the unit I/O, the sealer and the publish lock)."""

    def _append_validated(self, batch: TrajectoryBatch | None, writer_state: bytes | None) -> None:
        self._check_open()
        self._sealer.check()
        if batch is None:  # the writer's state alone, in one publish of the record
            try:
                with self._publish_lock:
                    self._publish(list(self._units), self._next_row, [], writer_state=writer_state)
            except BaseException:
                self._resync_with_the_record([])
                raise
            return
        n, start = len(batch), self._next_row  # only this thread moves next_row
        arrays = encode_columns(batch, self._schema)
        pieces, complete, constants = [], [], {}
        for pos, rows, whole, completes in plan_pieces(start, n, self._segment_rows):
            part = arrays if rows == n else slice_arrays(arrays, self._arrays, pos, pos + rows)
            unit = UnitRef(start + pos, rows, SEALED_PACKED if whole else PACKED_FRAGMENT)
            pieces.append((unit, part))
            constants[unit_key(unit)] = constants_of(part)
            if completes:
                complete.append(start + pos + rows - self._segment_rows)
        written = [unit for unit, _ in pieces]
        try:
            pending = [self.unit_io.write(unit, part) for unit, part in pieces]
        except BaseException:  # a full disk: nothing published, and the space the units took is back
            self.unit_io.discard(written, published={u.name for u in self._units})
            raise
        try:
            with self._publish_lock:
                self._publish(self._units + written, start + n, pending, constants, writer_state=writer_state)
        except BaseException:
            self._resync_with_the_record(written)
            raise
        for unit, part in pieces:
            self._cache.put(unit.name, DecodedUnit(unit.first_row, unit.rows, part))
        for first_row in complete:
            self._sealer.submit(first_row)
        if complete and self._capacity_rows is not None:
            self._sealer.wait()  # eviction drops sealed segments only: keep the bound exact

    def _resync_with_the_record(self, written: list[UnitRef]) -> None:
        """After a publish that raised (Ctrl-C, a failed request, a full disk) the writer takes its state
        from the record, which may or may not have landed (else it would reuse published row ids), and
        discards the ``written`` units it does not name."""
        try:
            record = parse_record(self._loc.kv.get(ROOT_META), self._location, self._loc)
        except Exception:  # noqa: BLE001 - unreadable now: appending on could overwrite, so stop
            self._closed = True
            if self._lock is not None:
                self._lock.release()
            return
        with self._publish_lock:
            self._apply(record)
            self.unit_io.discard(written, published={u.name for u in self._units})

    def _publish(self, units: list[UnitRef], next_row: int, pending, constants=None,
                 writer_state: bytes | None = None) -> None:
        """Publishes ``units`` (caller holds the publish lock), then drops what fell out; ``constants``:
        the new units' constant fields (:mod:`.unit_constants`); ``writer_state``: the append's (None:
        the record's stays, as the sealer's and retention's publishes keep it)."""
        names = {u.name for u in units}
        dropped = [u for u in self._units if u.name not in names]
        if self._capacity_rows is not None:
            # as memmap: drop the oldest sealed segments while more than capacity rows are held
            while units and units[0].sealed and next_row - units[0].first_row > self._capacity_rows:
                dropped.append(units.pop(0))
        record = dict(self._record, first_row=units[0].first_row if units else self._first_row, next_row=next_row,
                      units=[[u.first_row, u.rows, u.kind] for u in units])
        record[RECORD_KEY] = record_entry(units, {**self._constants, **(constants or {})})
        record = writer_state_entry(record, writer_state)
        publish(self._loc, record, durable=self._durable, pending=pending)
        self._apply(record)
        self._cache.retain({u.name for u in units})
        for unit in dropped:
            self._collector.delete(unit.prefix, self.unit_io.keys(unit))

    def _drop_sealed_before(self, global_row: int) -> list[DroppedSegment]:
        """Retention's drop: the sealed segments wholly before ``global_row`` leave the commit record
        in one publish; their objects (files) are deleted right after, as evicted ones are."""
        self._check_open()
        self._sealer.wait()  # a completed segment is sealed first: only sealed segments are dropped
        with self._publish_lock:
            units, dropped = list(self._units), []
            while len(units) > 1 and units[0].sealed and units[0].first_row + units[0].rows <= global_row:
                dropped.append(units.pop(0))
            if not dropped:
                return []
            sizes = [DroppedSegment(u.first_row, u.rows, self._loc.kv.size_of(u.prefix)) for u in dropped]
            self._publish(units, self._next_row, [])
        self._collector.wait()  # the space is free when this returns
        return sizes

    def _seal(self, first_row: int) -> None:
        """Background: rewrites the fragments of segment ``first_row`` as one sealed segment."""
        size = self._segment_rows
        with self._publish_lock:
            fragments = [u for u in self._units if not u.sealed and first_row <= u.first_row < first_row + size]
        if sum(u.rows for u in fragments) != size:
            return  # sealed already
        rows = concat_arrays([self._unit(u).arrays for u in fragments], self._arrays)
        segment = UnitRef(first_row, size, SEALED_PACKED)
        pending = self.unit_io.write(segment, rows, threaded=False)
        with self._publish_lock:
            replaced = {u.name for u in fragments}
            units = [u for u in self._units if u.name not in replaced]
            at = next((i for i, u in enumerate(units) if u.first_row > first_row), len(units))
            self._publish(units[:at] + [segment] + units[at:], self._next_row, [pending],
                          {unit_key(segment): constants_of(rows)})
        self._cache.put(segment.name, DecodedUnit(first_row, size, rows))

    def _merge_tail(self) -> None:
        """On close: the open segment's fragments become one, so a closed store holds at most
        one fragment (two files) besides its sealed segments."""
        open_start = self._next_row - self._next_row % self._segment_rows
        tail = [u for u in self._units if not u.sealed and u.first_row >= open_start]
        if len(tail) < 2 and all(u.kind == PACKED_FRAGMENT for u in tail):
            return
        rows = concat_arrays([self._unit(u).arrays for u in tail], self._arrays)
        unit = UnitRef(tail[0].first_row, sum(u.rows for u in tail), PACKED_FRAGMENT)
        pending = self.unit_io.write(unit, rows)
        with self._publish_lock:
            replaced = {u.name for u in tail}
            self._publish([u for u in self._units if u.name not in replaced] + [unit], self._next_row, [pending],
                          {unit_key(unit): constants_of(rows)})

    def _delete_orphans(self) -> None:
        """Deletes units no commit record names: left by a writer that died before publishing."""
        published = {u.name for u in self._units}
        for name in self._loc.kv.list_dir(UNITS_PREFIX):
            if name != ROOT_META and name not in published and not name.endswith(".partial"):
                self._loc.kv.delete_prefix(f"{UNITS_PREFIX}/{name}")
