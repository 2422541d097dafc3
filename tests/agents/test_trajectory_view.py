"""``rlhf-pipeline show``: a stored multi-turn trajectory, token by token, as text and as HTML.

The view is how users find a wrong mask or a drifted tokenization, so each test checks it
against the episode that wrote the rows: the same ids, the same trained/not-trained split,
pieces that join back to the decoded text (multi-byte characters included)."""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
from html.parser import HTMLParser

import pytest
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
        # past int64, where the ids are kept: torch raised OverflowError, a traceback out of `show`
        with pytest.raises(TrajectoryNotFound, match=f"trajectory {2**64} is not in .* ids run from 0 to 2"):
            find_trajectory(store, 2**64)


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
    page = tmp_path / "pages" / "t.html"  # in a directory not made yet: made, as export's and plot's are
    assert main(["show", str(path), "--trajectory", "0", "--html", str(page), "--color", "never"]) == 0
    out = capsys.readouterr()
    assert "trajectory 0 " in out.out and f"[{episodes[0].token_ids[0]}]" in page.read_text()
    assert out.out.count("── turn ") == len(episodes[0].turns) and "--pipeline" in out.err
    assert main(["show", str(path), "--trajectory", "9"]) == 2
    assert "trajectory 9 is not in" in capsys.readouterr().err

    # a page show wrote is written again; a file it did not write is refused before the buffer is read, and kept
    assert main(["show", str(path), "--trajectory", "1", "--html", str(page), "--color", "never"]) == 0
    assert f"[{episodes[1].token_ids[0]}]" in page.read_text() and "trajectory 1" in page.read_text()
    notes = tmp_path / "notes.html"
    notes.write_text("<html>the user's own page</html>")
    capsys.readouterr()
    assert main(["show", str(path), "--trajectory", "0", "--html", str(notes), "--color", "never"]) == 2
    out = capsys.readouterr()
    assert f"--html {notes} already exists and is not a page show wrote" in out.err and out.out == "", out
    assert notes.read_text() == "<html>the user's own page</html>"
    assert sorted(p.name for p in page.parent.iterdir()) == ["t.html"]  # no partial file left beside the page
    assert episodes[0].reason in TerminationReason


# Measures the page as a browser lays it out: its height with every token table closed, the lines
# each turn's tokens take and the lines its trained tokens take; then, every table opened, how many
# of their rows are shown. Added to a copy of the page only: the page itself runs no script.
_MEASURE = """<script>
const tops = spans => { const seen = new Set();
  for (const span of spans) for (const r of span.getClientRects()) seen.add(Math.round(r.top));
  return seen.size; };
const blocks = [...document.querySelectorAll('.tokens')];
const closed = document.documentElement.scrollHeight;
const lines = blocks.map(b => tops(b.querySelectorAll('span')));
const trained = blocks.map(b => tops(b.querySelectorAll('span.trained')));
document.querySelectorAll('details').forEach(d => { d.open = true; });
const rows = [...document.querySelectorAll('table.ids tr')].filter(r => r.offsetHeight > 0 && r.querySelector('td'));
document.body.setAttribute('data-measured', JSON.stringify({closed, lines, trained, rows: rows.length}));
</script>"""


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    pytest.skip("rendering the page needs chromium (Debian: apt-get install -y chromium)")


def _render(page: str, tmp_path) -> dict:
    copy = tmp_path / "measured.html"
    copy.write_text(page.replace("</body>", _MEASURE + "</body>"), encoding="utf-8")
    dom = subprocess.run(
        [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}",
         "--window-size=1280,800", "--dump-dom", copy.as_uri()],
        capture_output=True, text=True, timeout=120)
    measured = re.search(r'data-measured="([^"]*)"', dom.stdout)
    assert measured, dom.stderr[-2000:]
    return json.loads(html.unescape(measured.group(1)))


def test_the_page_reads_as_text_in_a_browser_with_every_id_a_keypress_away(stored, bpe_tokenizer, tmp_path):
    path, episodes = stored
    with open_store(str(path), mode="r") as store:
        view = find_trajectory(store, 1)  # 5 turns, 620 tokens, most one character each (a scripted sampler)
    page = trajectory_html(view, bpe_tokenizer)
    measured = _render(page, tmp_path)
    # one span per line made it a column of single characters, 17,258 px tall
    assert measured["closed"] < 2500, measured
    for turn, lines, trained in zip(view.turns, measured["lines"], measured["trained"], strict=True):
        text = bpe_tokenizer.decode(turn.prompt_ids + turn.response_ids)
        assert lines <= 2 * (text.count("\n") + 1), (turn.step, lines, text)  # a line of text wraps at most once
        assert trained == 1, turn.step  # each sampled answer is one short line, read as one line
    assert measured["rows"] == sum(len(t.prompt_ids) + len(t.response_ids) for t in view.turns)
    tables = re.findall(r'<table class="ids">(.*?)</table>', page, flags=re.S)
    first = view.turns[0]
    lp = first.response_log_probs[0]
    assert f"<td>{first.response_ids[0]}</td><td>yes</td><td>{lp:.4f}</td>" in tables[0]
    assert len(tables) == len(view.turns) and "<details" in page
