import json

import pytest
import torch

from rlhf_pipeline.files.atomic import PARTIAL_SUFFIX, publish_json, save_torch_atomic, write_atomic


def test_publish_json_creates_parents_and_leaves_no_partial(tmp_path):
    path = tmp_path / "a" / "b" / "state.json"
    publish_json(path, {"n": 1})
    publish_json(path, {"n": 2}, durable=False)
    assert json.loads(path.read_text()) == {"n": 2}
    assert [p.name for p in path.parent.iterdir()] == ["state.json"]


def test_failed_write_keeps_the_old_file_and_removes_the_partial(tmp_path):
    path = tmp_path / "state.pt"
    save_torch_atomic({"step": 1}, path)

    def fail(f):
        f.write(b"half a file")
        raise RuntimeError("disk went away")

    with pytest.raises(RuntimeError, match="disk went away"):
        write_atomic(path, fail)
    assert torch.load(path, weights_only=True) == {"step": 1}
    assert not (tmp_path / ("state.pt" + PARTIAL_SUFFIX)).exists()


def test_partial_name_is_the_callers(tmp_path):
    path = tmp_path / "w.pt"
    seen = []
    write_atomic(path, lambda f: seen.append(sorted(p.name for p in tmp_path.iterdir())) or f.write(b"x"),
                 partial_name="w.pt.123.partial")
    assert seen == [["w.pt.123.partial"]]
    assert path.read_bytes() == b"x"
