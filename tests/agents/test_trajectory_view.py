"""``rlhf-pipeline show``: a stored multi-turn trajectory, token by token, as text and as HTML.

The view is how users find a wrong mask or a drifted tokenization, so each test checks it
against the episode that wrote the rows: the same ids, the same trained/not-trained split,
pieces that join back to the decoded text (multi-byte characters included)."""

from __future__ import annotations

from html.parser import HTMLParser

import pytest
import torch
from test_storage_bytes import episode_of, multiply, store_episodes

from rlhf_pipeline.agents.tools import ToolBox
from rlhf_pipeline.cli.main import main
from rlhf_pipeline.dataio.trajectory_view import (
    TrajectoryNotFound,
    find_trajectory,
    format_trajectory,
    token_pieces,
    trajectory_html,
)
from rlhf_pipeline.storage import open_store
from rlhf_pipeline.schema.termination import TerminationReason


@pytest.fixture()
def stored(tmp_path, bpe_tokenizer):
    box = ToolBox([multiply])
    episodes = [episode_of(bpe_tokenizer, box, turns, seed) for seed, turns in enumerate((3, 5, 1))]
    store_episodes(tmp_path / "buffer", episodes).close()
    box.close()
    return tmp_path / "buffer", episodes


class _Spans(HTMLParser):
    def __init__(self):
        super().__init__()
        self.spans, self._open = [], None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "span" and attrs.get("class") in ("trained", "context") and "title" in attrs:  # not the legend
            self._open = [attrs["class"], attrs.get("title", ""), ""]

    def handle_data(self, data):
        if self._open is not None:
            self._open[2] += data

    def handle_endtag(self, tag):
        if tag == "span" and self._open is not None:
            self.spans.append(tuple(self._open))
            self._open = None


def test_the_view_holds_the_episodes_ids_and_mask_turn_by_turn(stored):
    path, episodes = stored
    with open_store(str(path), mode="r") as store:
        for trajectory, episode in enumerate(episodes):
            view = find_trajectory(store, trajectory)
            ids = [t for turn in view.turns for t in turn.prompt_ids + turn.response_ids]
            mask = [m for turn in view.turns for m in [0] * len(turn.prompt_ids) + [1] * len(turn.response_ids)]
            assert ids == list(episode.token_ids) and mask == list(episode.loss_mask)
            assert [turn.step for turn in view.turns] == list(range(len(episode.turns)))
            assert view.termination_reason is episode.reason
            assert view.trained_tokens == sum(episode.loss_mask)
        newest = find_trajectory(store)  # no id: the trajectory whose done row is last
        assert newest.trajectory_id == len(episodes) - 1
        assert find_trajectory(store, row=4).trajectory_id == 1  # rows 0-2 are trajectory 0's three turns
        with pytest.raises(TrajectoryNotFound, match="trajectory 7 is not in .* ids run from 0 to 2"):
            find_trajectory(store, 7)


def test_pieces_join_to_the_decoded_text_even_across_split_characters(bpe_tokenizer):
    text = "12 × 34 = 408 ✓ naïve 日本"
    ids = bpe_tokenizer.encode(text, add_special_tokens=False)
    singles = [bpe_tokenizer.decode([i]) for i in ids]
    assert any("\ufffd" in s for s in singles)  # the premise: one token per decode splits characters
    pieces = token_pieces(ids, bpe_tokenizer)
    assert len(pieces) == len(ids) and "".join(pieces) == text
    assert token_pieces(ids[:2], None) == [f"[{ids[0]}]", f"[{ids[1]}]"]


def test_text_and_html_show_every_token_once_with_its_training_status(stored, bpe_tokenizer):
    path, episodes = stored
    with open_store(str(path), mode="r") as store:
        view = find_trajectory(store, 1)
    episode = episodes[1]
    text = format_trajectory(view, bpe_tokenizer, log_probs=True)
    assert f"ended: {episode.reason.name}" in text
    assert text.count("── turn ") == len(episode.turns)
    first_lp = view.turns[0].response_log_probs[0]
    assert f"⟨{first_lp:.2f}⟩" in text

    page = trajectory_html(view, bpe_tokenizer)
    assert "<script" not in page and "http" not in page  # self-contained
    parser = _Spans()
    parser.feed(page)
    kinds = [kind for kind, _, _ in parser.spans]
    assert kinds == ["context" if m == 0 else "trained" for m in episode.loss_mask]
    assert "".join(piece for _, _, piece in parser.spans) == bpe_tokenizer.decode(list(episode.token_ids))
    trained = [(title, lp) for (kind, title, _), lp in zip(
        [s for s in parser.spans if s[0] == "trained"],
        [lp for turn in view.turns for lp in turn.response_log_probs], strict=True)]
    assert all(f"sampled log-prob {lp:.4f}" in title for title, lp in trained)
    tokens = [t for turn in view.turns for t in turn.prompt_ids + turn.response_ids]
    assert all(title.startswith(f"id {t} ") for (_, title, _), t in zip(parser.spans, tokens, strict=True))


def test_show_command_prints_by_id_without_a_tokenizer_and_names_a_missing_id(stored, tmp_path, capsys):
    path, episodes = stored
    page = tmp_path / "t.html"
    assert main(["show", str(path), "--trajectory", "0", "--html", str(page), "--color", "never"]) == 0
    out = capsys.readouterr()
    assert "trajectory 0 " in out.out and f"[{episodes[0].token_ids[0]}]" in page.read_text()
    assert out.out.count("── turn ") == len(episodes[0].turns) and "--pipeline" in out.err
    assert main(["show", str(path), "--trajectory", "9"]) == 2
    assert "trajectory 9 is not in" in capsys.readouterr().err
    assert episodes[0].reason in TerminationReason
