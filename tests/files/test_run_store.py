"""The run store contract (``files/run_store.py``), one suite for every store: a run directory
on disk, a run at an ``s3://`` URL on moto's server and one at an ``az://`` URL on Azurite, both on
loopback. Then what only an object store needs (on both clouds): fencing of a superseded writer, atomic replacement seen by a concurrent reader,
and retries of throttled requests and of writes whose answer was lost (a fault-injecting proxy
in front of moto, ``tests/s3_faults.py``)."""

from __future__ import annotations

import threading

import pytest

from rlhf_pipeline.files.object_run_store import ObjectRunStore, RetryPolicy
from rlhf_pipeline.files.run_store import LocalRunStore, RunStoreError, StaleWriterError

FAST_RETRIES = RetryPolicy(attempts=6, first_delay_s=0.01, max_delay_s=0.05, budget_s=20.0)


class RunStoreContract:
    """What every run store does; a subclass only says how to build one (``make``)."""

    @pytest.fixture()
    def make(self):
        raise NotImplementedError

    def test_a_missing_key_reads_as_none_and_does_not_exist(self, make):
        store = make()
        assert store.read("settings.json") is None
        assert not store.exists("settings.json")
        assert store.list("weights") == []

    def test_write_replaces_the_whole_object(self, make):
        store = make()
        store.write("pacing.json", b"first, a longer content")
        store.write("pacing.json", b"second")
        assert store.read("pacing.json") == b"second"
        assert store.exists("pacing.json")

    def test_a_callback_writes_the_content(self, make):
        store = make()
        store.write("collector/shard-0000.pt", lambda f: f.write(b"from a callback"))
        assert store.read("collector/shard-0000.pt") == b"from a callback"

    def test_list_names_the_objects_directly_under_a_prefix(self, make):
        store = make()
        for name in ("policy_00000000.safetensors", "policy_00000001.safetensors"):
            store.create(f"weights/{name}", name.encode())
        store.write("weights/deeper/other", b"x")
        store.write("weightsX", b"not under weights/")
        assert sorted(n for n in store.list("weights") if not n.startswith("deeper")) == [
            "policy_00000000.safetensors", "policy_00000001.safetensors"]

    def test_create_twice_with_the_same_bytes_is_one_version(self, make):
        store = make()
        store.create("checkpoints/step_00000002.pt", b"checkpoint")
        store.create("checkpoints/step_00000002.pt", b"checkpoint")  # a retried request
        assert store.read("checkpoints/step_00000002.pt") == b"checkpoint"

    def test_etags_name_what_was_read_and_change_with_a_rewrite(self, make):
        store = make()
        assert store.list_etags("weights") == {} and store.read_with_etag("weights/x") is None
        store.create("weights/policy_00000001.safetensors", b"run A's version 1")
        store.write("weights/deeper/other", b"x")
        listed = store.list_etags("weights")
        assert list(listed) == ["policy_00000001.safetensors"]
        body, etag = store.read_with_etag("weights/policy_00000001.safetensors")
        assert (body, etag) == (b"run A's version 1", listed["policy_00000001.safetensors"])
        # a new run under the same prefix publishes its own version 1 (of another size: a file's
        # etag is its inode, size and mtime, and a freed inode may come back within one clock tick)
        store.delete("weights/policy_00000001.safetensors")
        store.create("weights/policy_00000001.safetensors", b"run B's version 1, another size")
        body, again = store.read_with_etag("weights/policy_00000001.safetensors")
        assert body == b"run B's version 1, another size" and again != etag
        assert store.list_etags("weights") == {"policy_00000001.safetensors": again}

    def test_delete_removes_and_a_missing_key_is_fine(self, make):
        store = make()
        store.write("STOP", b"", fence=False)
        store.delete("STOP")
        store.delete("STOP")
        assert not store.exists("STOP")

    def test_copy_puts_another_runs_object_here_as_its_own(self, make):
        parent, branch = make("parent"), make("branch")
        parent.create("checkpoints/step_00000006.pt", b"the parent's checkpoint")
        branch.copy("checkpoints/step_00000006.pt", "checkpoints/step_00000006.pt", source=parent)
        branch.copy("checkpoints/step_00000006.pt", "copied/again.pt")  # within one store
        parent.delete("checkpoints/step_00000006.pt")  # the parent prunes it: the branch keeps its copy
        assert branch.read("checkpoints/step_00000006.pt") == b"the parent's checkpoint"
        assert branch.read("copied/again.pt") == b"the parent's checkpoint"
        with pytest.raises(FileNotFoundError, match=r"parent.*step_00000006\.pt"):
            branch.copy("checkpoints/step_00000006.pt", "checkpoints/gone.pt", source=parent)
        assert not branch.exists("checkpoints/gone.pt")

    def test_walk_names_every_object_at_any_depth(self, make):
        store = make()
        for key in ("settings.json", "pipeline_modules/helper.py", "pipeline_modules/deep/er.py"):
            store.write(key, b"x")
        assert sorted(store.walk()) == ["pipeline_modules/deep/er.py", "pipeline_modules/helper.py",
                                        "settings.json"]
        assert sorted(store.walk("pipeline_modules")) == ["pipeline_modules/deep/er.py", "pipeline_modules/helper.py"]
        assert store.walk("nothing") == []
        store.delete_prefix("pipeline_modules")
        store.delete_prefix("nothing")
        assert store.walk() == ["settings.json"] and store.list("") == ["settings.json"]


class TestLocalRunStore(RunStoreContract):
    @pytest.fixture()
    def make(self, tmp_path):
        return lambda name="run": LocalRunStore(tmp_path / name)

    def test_a_copy_is_a_hard_link_where_the_file_system_allows(self, tmp_path):
        parent, branch = LocalRunStore(tmp_path / "parent"), LocalRunStore(tmp_path / "branch")
        assert parent.supports_link and parent.supports_rename and not parent.supports_server_copy
        parent.create("weights/policy_00000006.safetensors", b"weights")
        branch.copy("weights/policy_00000006.safetensors", "weights/policy_00000006.safetensors", source=parent)
        linked = branch.path("weights/policy_00000006.safetensors").stat()
        assert linked.st_ino == parent.path("weights/policy_00000006.safetensors").stat().st_ino
        assert linked.st_nlink == 2

    def test_a_copy_without_hard_links_that_is_cut_short_leaves_nothing_at_the_key(self, tmp_path, monkeypatch):
        # the copy fallback (another file system): a copy killed midway must not leave half a file under
        # the key, which a reader (a branch's kept weights) would take as whole
        import os
        import shutil

        parent, branch = LocalRunStore(tmp_path / "parent"), LocalRunStore(tmp_path / "branch")
        parent.create("weights/policy_00000006.safetensors", b"the whole weights file")

        def no_links(*_):
            raise OSError(18, "Invalid cross-device link")

        def cut_short(origin, target):
            with open(origin, "rb") as src, open(target, "wb") as dst:
                dst.write(src.read(5))
            raise KeyboardInterrupt  # killed mid-copy

        monkeypatch.setattr(os, "link", no_links)
        monkeypatch.setattr(shutil, "copyfile", cut_short)
        with pytest.raises(KeyboardInterrupt):
            branch.copy("weights/policy_00000006.safetensors", "weights/policy_00000006.safetensors", source=parent)
        assert not branch.exists("weights/policy_00000006.safetensors")
        monkeypatch.undo()
        monkeypatch.setattr(os, "link", no_links)
        branch.copy("weights/policy_00000006.safetensors", "weights/policy_00000006.safetensors", source=parent)
        assert branch.read("weights/policy_00000006.safetensors") == b"the whole weights file"

    def test_files_are_where_a_run_directory_had_them_and_no_partial_is_left(self, tmp_path):
        store = LocalRunStore(tmp_path / "run")
        store.write("collector/shard-0000.pt", b"state")
        store.create("weights/policy_00000003.safetensors", b"weights")
        assert (tmp_path / "run" / "collector" / "shard-0000.pt").read_bytes() == b"state"
        assert sorted(p.name for p in (tmp_path / "run").rglob("*") if p.is_file()) == [
            "policy_00000003.safetensors", "shard-0000.pt"]


class TestObjectRunStore(RunStoreContract):
    @pytest.fixture(params=["s3", "azure"])
    def make(self, request):
        server = request.getfixturevalue(f"{request.param}_server")
        home = server.url("home")
        return lambda name="run": ObjectRunStore(f"{home}/{name}", storage_options=server.options, retry=FAST_RETRIES)

    def test_only_s3_copies_on_the_server(self, make):
        store = make()
        assert not store.supports_link and not store.supports_rename
        assert store.supports_server_copy == store.location.startswith("s3://")

    def test_a_superseded_writer_cannot_overwrite_its_successors_state(self, make):
        old, new = make(), make()
        old.write("collector/shard-0000.pt", b"old writer, round 7")
        assert new.read("collector/shard-0000.pt") == b"old writer, round 7"  # the restart resumes from it
        new.write("collector/shard-0000.pt", b"new writer, round 8")
        with pytest.raises(StaleWriterError, match=r"collector/shard-0000.pt was replaced by another writer"):
            old.write("collector/shard-0000.pt", b"old writer, round 8")
        assert new.read("collector/shard-0000.pt") == b"new writer, round 8"
        new.write("collector/shard-0000.pt", b"new writer, round 9")  # the current writer goes on

    def test_a_restarted_writer_takes_over_objects_it_never_read(self, make):
        old, new = make(), make()
        old.write("pacing.json", b'{"step": 3}')
        new.write("pacing.json", b'{"step": 1}')  # HEAD, then If-Match on what is there
        with pytest.raises(StaleWriterError):
            old.write("pacing.json", b'{"step": 4}')

    def test_a_version_exists_once(self, make):
        first, second = make(), make()
        first.create("weights/policy_00000004.safetensors", b"learner A's version 4")
        with pytest.raises(StaleWriterError, match=r"policy_00000004.safetensors exists already with other contents"):
            second.create("weights/policy_00000004.safetensors", b"learner B's version 4")
        assert second.read("weights/policy_00000004.safetensors") == b"learner A's version 4"

    def test_a_reader_sees_the_old_or_the_new_object_never_a_mix(self, make):
        writer, reader = make(), make()
        contents = [bytes([i]) * (3 << 20) for i in range(1, 5)]  # 3 MB each: several packets a PUT
        writer.write("checkpoint-like", contents[0], fence=False)
        seen: list[bytes] = []
        done = threading.Event()

        def read_while_writing():
            while not done.is_set():
                seen.append(reader.read("checkpoint-like"))

        thread = threading.Thread(target=read_while_writing)
        thread.start()
        try:
            for content in contents[1:]:
                writer.write("checkpoint-like", content, fence=False)
        finally:
            done.set()
            thread.join()
        assert seen and all(s in contents for s in seen)


def test_a_run_store_at_an_az_url_refuses_a_missing_container_naming_it(azure_server):
    store = ObjectRunStore("az://no-such-container/run", storage_options=azure_server.options, retry=FAST_RETRIES)
    with pytest.raises(RunStoreError, match=r"az://no-such-container/run/pacing.json: HEAD failed: the container "
                                            r"'no-such-container' does not exist.*AZURE_STORAGE_CONNECTION_STRING"):
        store.write("pacing.json", b"{}")


@pytest.fixture()
def proxy(s3_server):
    from s3_faults import FaultyProxy

    proxy = FaultyProxy(s3_server.endpoint)
    yield proxy
    proxy.stop()


def _through(proxy, s3_server, url, retry=FAST_RETRIES):
    return ObjectRunStore(url, storage_options={**s3_server.options, "endpoint_url": proxy.endpoint}, retry=retry)


def test_a_copy_on_s3_never_reads_the_object_through_this_machine(s3_server):
    parent, branch = (ObjectRunStore(s3_server.url(name), storage_options=s3_server.options) for name in ("parent", "branch"))
    parent.create("checkpoints/step_00000006.pt", b"a large checkpoint")
    with s3_server.requests.recording() as requests:
        branch.copy("checkpoints/step_00000006.pt", "checkpoints/step_00000006.pt", source=parent)
    assert [method for method, _ in requests] == ["PUT"]  # CopyObject: a PUT naming its source
    assert branch.read("checkpoints/step_00000006.pt") == b"a large checkpoint"


def test_throttled_requests_are_retried_within_the_budget(s3_server, proxy):
    store = _through(proxy, s3_server, s3_server.url("run"))
    proxy.throttle(3)
    store.write("pacing.json", b"after three 503s")
    proxy.throttle(2)
    assert store.read("pacing.json") == b"after three 503s"
    assert proxy.statuses().count(503) == 5


def test_giving_up_names_the_object_the_tries_and_the_last_error(s3_server, proxy):
    policy = RetryPolicy(attempts=3, first_delay_s=0.01, max_delay_s=0.02, budget_s=10.0)
    store = _through(proxy, s3_server, s3_server.url("run"), retry=policy)
    proxy.throttle(100)
    with pytest.raises(RunStoreError, match=r"weights/policy_00000001.safetensors: PUT \(create\) gave up after 3 "
                                            r"tries .*retry budget: 3 tries.*SlowDown"):
        store.create("weights/policy_00000001.safetensors", b"w")
    assert proxy.statuses() == [503, 503, 503]


def test_a_body_damaged_in_transit_is_read_again(s3_server, proxy):
    store = _through(proxy, s3_server, s3_server.url("run"))
    store.create("weights/policy_00000001.safetensors", b"the published weights")
    proxy.damage(1)  # its CRC32 (sent on the PUT, checked on the GET) no longer matches
    assert store.read("weights/policy_00000001.safetensors") == b"the published weights"
    assert [status for method, _, status in proxy.seen if method == "GET"] == [200, 200]


def test_a_write_whose_answer_was_lost_is_settled_by_reading_it_back(s3_server, proxy):
    url = s3_server.url("run")
    store = _through(proxy, s3_server, url)
    store.write("collector/shard-0000.pt", b"round 1")
    proxy.lose_answer("PUT")  # the fenced PUT lands, its answer does not come back
    store.write("collector/shard-0000.pt", b"round 2")
    proxy.lose_answer("PUT")  # a new version: created on the first try, refused (412) on the retry
    store.create("checkpoints/step_00000002.pt", b"checkpoint 2")
    direct = ObjectRunStore(url, storage_options=s3_server.options)
    assert direct.read("collector/shard-0000.pt") == b"round 2"
    assert direct.read("checkpoints/step_00000002.pt") == b"checkpoint 2"
    store.write("collector/shard-0000.pt", b"round 3")  # its ETag is the landed write's: still the writer
    assert direct.read("collector/shard-0000.pt") == b"round 3"
    assert 412 in proxy.statuses()  # the retries met their own writes


def test_a_read_answered_before_this_stores_own_write_does_not_fence_the_writer_out(s3_server, proxy):
    """A learner and a collector in one process share a run store: the collector's read of pacing.json
    may be answered before the learner's write lands and heard of after it. The writer stays the
    writer (the stale answer's ETag is not remembered over the newer write's)."""
    url = s3_server.url("run")
    store = _through(proxy, s3_server, url)
    store.write("pacing.json", b'{"step": 1}')
    proxy.hold_answer("GET", "pacing.json")
    seen = []
    reader = threading.Thread(target=lambda: seen.append(store.read("pacing.json")))
    reader.start()
    assert proxy.held.wait(30)  # the read has its answer: step 1
    store.write("pacing.json", b'{"step": 2}')
    proxy.release()
    reader.join(30)
    assert seen == [b'{"step": 1}']
    store.write("pacing.json", b'{"step": 3}')  # the writer's own ETag, not the late read's
    assert ObjectRunStore(url, storage_options=s3_server.options).read("pacing.json") == b'{"step": 3}'
