"""A fix to the S3 server the tests and benchmarks run on loopback (moto), kept where both import it.

moto (5.2.5) computes an object's ETag on first use by seeking and reading the object's buffer
without the object's lock, while a GET reads the same buffer under it: concurrent LISTs and GETs
of a new object over 5 MB (a file buffer, slow enough to interleave) then saw different ETags and
bodies that failed their checksum. Real S3 computes the ETag once, at the PUT; with
:func:`lock_moto_etags` moto computes it under the object's lock, so every reader sees one.
Design: docs/development.md#tests.
"""

from __future__ import annotations


def lock_moto_etags() -> None:
    """Makes moto's ``FakeKey.etag`` take the object's lock (once per process; moto must be installed)."""
    from moto.s3.models import FakeKey

    unlocked = FakeKey.etag.fget
    if getattr(unlocked, "locked", False):
        return

    def etag(key):
        with key.lock:
            return unlocked(key)

    etag.locked = True
    FakeKey.etag = property(etag)
