"""The conditional-object interface, one suite for every cloud: moto's S3 server and Azurite on
loopback. What the buffer's guarantees rest on: a create is refused when the object exists, a
replace or delete when the object is no longer the version named, and a refusal changes nothing.
"""

from __future__ import annotations

import pytest
from fsspec.asyn import sync

from rlhf_pipeline.files.cloud_objects import (
    AzureObjects,
    CloudAccessError,
    ConditionFailed,
    ContainerNotFoundError,
    S3Objects,
    cloud_for,
    objects_at,
)


@pytest.fixture(params=["s3", "azure"])
def server(request):
    return request.getfixturevalue(f"{request.param}_server")


def call(objects, operation, *args):
    return sync(objects.loop, operation, *args)


def test_urls_choose_their_cloud():
    assert cloud_for("s3://bucket/x") is S3Objects and cloud_for("s3a://bucket/x") is S3Objects
    assert all(cloud_for(f"{scheme}container/x") is AzureObjects for scheme in ("az://", "abfs://", "abfss://"))
    assert cloud_for("/local/path") is None and cloud_for("gs://bucket/x") is None
    with pytest.raises(ValueError, match="not on a cloud object store.*az://"):
        objects_at("memory://x")


def test_a_create_is_refused_when_the_object_exists_and_changes_nothing(server):
    objects = objects_at(server.url("objects"), server.options)
    etag = call(objects, objects.create, "a/record.json", b"first")
    with pytest.raises(ConditionFailed):
        call(objects, objects.create, "a/record.json", b"second")
    seen = call(objects, objects.read, "a/record.json")
    assert (seen.body, seen.etag) == (b"first", etag)
    assert seen.age_s is not None and seen.age_s >= 0  # Date minus Last-Modified, both the server's
    assert call(objects, objects.read, "a/missing.json") is None


def test_a_replace_needs_the_version_it_names(server):
    objects = objects_at(server.url("objects"), server.options)
    first = call(objects, objects.create, "record.json", b"v1")
    second = call(objects, objects.replace, "record.json", b"v2", first)
    assert second != first
    with pytest.raises(ConditionFailed):  # a writer that read v1 is fenced
        call(objects, objects.replace, "record.json", b"stale", first)
    assert call(objects, objects.read, "record.json").body == b"v2"
    with pytest.raises(ConditionFailed):  # gone: refused too, never created by a replace
        call(objects, objects.replace, "never-written.json", b"x", second)
    assert call(objects, objects.read, "never-written.json") is None


def test_a_listing_names_each_objects_etag_as_a_read_gives_it(server):
    objects = objects_at(server.url("objects"), server.options)
    first = call(objects, objects.create, "weights/policy_00000001.safetensors", b"version 1")
    call(objects, objects.put, "weights/deeper/part", b"not directly under weights/")
    listed = call(objects, objects.list_etags, "weights")
    assert listed == {"policy_00000001.safetensors": first}  # objects only: no "deeper" directory
    assert call(objects, objects.read, "weights/policy_00000001.safetensors").etag == first
    assert call(objects, objects.etag, "weights/policy_00000001.safetensors") == first
    # a run started again at the URL: the same name, other bytes, another etag
    call(objects, objects.remove, "weights/policy_00000001.safetensors")
    again = call(objects, objects.create, "weights/policy_00000001.safetensors", b"another run's version 1")
    assert again != first
    assert call(objects, objects.list_etags, "weights") == {"policy_00000001.safetensors": again}
    assert call(objects, objects.list_etags, "nothing-here") == {}


def test_a_delete_needs_the_version_it_names(server):
    objects = objects_at(server.url("objects"), server.options)
    first = call(objects, objects.create, "writer.lock", b"holder 1")
    renewed = call(objects, objects.replace, "writer.lock", b"holder 1, renewed", first)
    with pytest.raises(ConditionFailed):
        call(objects, objects.delete, "writer.lock", first)
    assert call(objects, objects.read, "writer.lock").body == b"holder 1, renewed"
    call(objects, objects.delete, "writer.lock", renewed)
    assert call(objects, objects.read, "writer.lock") is None
    with pytest.raises(ConditionFailed):
        call(objects, objects.delete, "writer.lock", renewed)


def test_a_remove_deletes_whatever_version_and_a_missing_object_is_fine(server):
    objects = objects_at(server.url("objects"), server.options)
    call(objects, objects.create, "STOP", b"")
    call(objects, objects.replace, "STOP", b"again", call(objects, objects.etag, "STOP"))
    call(objects, objects.remove, "STOP")  # no version named: the newest goes
    assert call(objects, objects.read, "STOP") is None and call(objects, objects.etag, "STOP") is None
    call(objects, objects.remove, "STOP")  # gone already: nothing to do, no error
    call(objects, objects.remove, "never-written")


def test_a_missing_container_is_named_with_the_fix(server):
    scheme = server.url().split("://")[0]
    objects = objects_at(f"{scheme}://no-such-container-7/prefix", server.options)
    kind = "bucket" if scheme == "s3" else "container"
    # a remove too: a missing object is fine to it, a missing container is not
    for operation, args in ((objects.create, ("k", b"x")), (objects.read, ("k",)), (objects.remove, ("k",))):
        with pytest.raises(ContainerNotFoundError, match=f"the {kind} 'no-such-container-7' does not exist.*create it"):
            call(objects, operation, *args)


def test_azure_credentials_refused_say_where_they_come_from(azure_server):
    from azurite_server import connection_string

    wrong_key = connection_string(azure_server.endpoint, key="A" * 86 + "==")
    objects = objects_at(azure_server.url(), {"connection_string": wrong_key})
    with pytest.raises(CloudAccessError, match=r"blob '.*/buffer/k' in container .* denied.*AZURE_STORAGE_CONNECTION_STRING"):
        call(objects, objects.create, "k", b"x")
