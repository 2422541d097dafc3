"""``rlhf-pipeline inspect`` on real buffers: the table, the JSON and the not-a-buffer error."""

from __future__ import annotations

import json

from helpers import make_batch

from rlhf_pipeline.cli.main import main
from rlhf_pipeline.storage.memmap import MemmapTrajectoryStore


def test_inspect_prints_json_and_a_table(tmp_path, capsys):
    path = tmp_path / "buffer"
    with MemmapTrajectoryStore.create(path, segment_rows=8) as store:
        store.append(make_batch(2, 4, policy_version=3))
        store.append(make_batch(1, 4, seed=1, first_group_id=2, policy_version=4))
        expected = store.stats()
        # the writer is still open: inspect takes no lock
        assert main(["inspect", str(path), "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
    assert data["rows"] == 12 and data["groups"] == 3 and data["segments"] == 2
    assert data["policy_versions"] == {"3": 8, "4": 4}
    assert data["response_tokens"] == expected.response_tokens
    assert data["compression_ratio"] == expected.compression_ratio
    assert main(["inspect", str(path)]) == 0
    table = capsys.readouterr().out
    assert "rows held" in table and "v3: 8, v4: 4" in table and "memmap" in table


def test_inspect_of_a_non_buffer_says_so(tmp_path, capsys):
    assert main(["inspect", str(tmp_path)]) == 2
    assert "is not a replay buffer" in capsys.readouterr().err
