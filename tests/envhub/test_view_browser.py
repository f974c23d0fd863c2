"""``envhub view`` in a real headless Chromium: the list, a filter, a conversation with a tool call and an
image, the token view, the reward curve, a live run's new lines. Screenshots go to the test's tmp dir
(``ENVHUB_VIEW_SHOTS=dir`` keeps them)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from cdp_browser import CHROMIUM, Browser
from view_fixtures import run_record, write_eval_dir, write_run_dir

from envhub.server.run import ServerThread
from envhub.view import create_view_app

pytestmark = [pytest.mark.slow, pytest.mark.live,
              pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium)")]


@pytest.fixture
def shots(tmp_path) -> Path:
    out = Path(os.environ.get("ENVHUB_VIEW_SHOTS", tmp_path / "shots"))
    out.mkdir(parents=True, exist_ok=True)
    return out


def rows(browser: Browser) -> list[int]:
    return list(browser.eval("[...document.querySelectorAll('#list tbody tr')].map(tr => Number(tr.dataset.index))"))


def set_field(browser: Browser, element_id: str, value: str) -> None:
    """Set a filter input as a user would, firing its change event."""
    browser.eval(f"(() => {{ const e = document.getElementById({json.dumps(element_id)}); e.value = {json.dumps(value)};"
                 "e.dispatchEvent(new Event('change')); })()")


def check_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000, (path, len(data))


def test_eval_results_list_filter_conversation_and_image(tmp_path, shots) -> None:
    write_eval_dir(tmp_path / "ev", n=12)
    with ServerThread(create_view_app(tmp_path / "ev")) as server, Browser() as browser:
        browser.open(server.url + "/")
        browser.wait_for("document.querySelectorAll('#list tbody tr').length === 12", "12 episode rows")
        assert browser.eval("document.getElementById('count').textContent") == "12 episodes of 12"
        check_png(browser.screenshot(shots / "eval_list.png"))
        # a filter narrows the list: the wrong answers only
        set_field(browser, "f-reward-max", "0.5")
        browser.wait_for("document.querySelectorAll('#list tbody tr').length === 2", "the filtered rows")
        assert rows(browser) == [3, 7]
        set_field(browser, "f-reward-max", "")
        set_field(browser, "f-failure", "env_error")
        browser.wait_for("document.querySelectorAll('#list tbody tr').length === 1", "the failed episode")
        assert rows(browser) == [11]
        browser.eval("document.querySelector('#list tbody tr[data-index=\"11\"]').click()")
        browser.wait_for("document.getElementById('ep-failure').textContent === 'connection refused'", "the failure")
        set_field(browser, "f-failure", "")
        browser.wait_for("document.querySelectorAll('#list tbody tr').length === 12", "all rows again")
        # an episode opens as a conversation: a tool call, its result, an inline image that decoded
        browser.eval("document.querySelector('#list tbody tr[data-index=\"2\"]').click()")
        # episode 11's conversation (shown until now) has five messages too: wait for episode 2's own tool result
        browser.wait_for("document.querySelectorAll('#conv .msg').length === 5 && "
                         "document.querySelector('#conv .role-tool pre')?.textContent.includes('4')", "the conversation")
        roles = browser.eval("[...document.querySelectorAll('#conv .msg')].map(m => m.className)")
        assert roles == ["msg role-system", "msg role-user", "msg role-assistant", "msg role-tool", "msg role-assistant"]
        assert browser.eval("document.querySelector('#conv .tool-call .name').textContent") == "→ run_python"
        assert "4" in browser.eval("document.querySelector('#conv .role-tool pre').textContent")
        browser.wait_for("(() => { const i = document.querySelector('#conv img'); return i && i.complete && "
                         "i.naturalWidth === 24; })()", "the image to decode")
        assert "correct" in browser.eval("document.getElementById('rewards').textContent")
        assert browser.eval("location.hash") == "#episode=2"
        check_png(browser.screenshot(shots / "eval_episode.png"))


def test_training_run_tokens_curve_and_live_lines(tmp_path, shots) -> None:
    run = tmp_path / "run"
    write_run_dir(run, steps=5, per_step=4)
    with ServerThread(create_view_app(run)) as server, Browser() as browser:
        browser.open(server.url + "/#episode=4")
        browser.wait_for("document.querySelectorAll('#conv .msg').length === 5", "the episode from the URL")
        # the reward curve: one SVG polyline through the 5 metric points
        points = browser.wait_for("(() => { const p = document.querySelector('#curve-plot polyline');"
                                  "return p && p.getAttribute('points'); })()", "the reward curve")
        assert len(points.split()) == 5
        assert browser.eval("document.querySelector('#curve-plot polyline').dataset.key") == "train/reward_mean"
        set_field(browser, "metric-add", "train/loss")  # another metric, from the menu
        browser.wait_for("document.querySelectorAll('#curve-plot polyline').length === 2", "a second curve")
        badges = browser.eval("[...document.querySelectorAll('#conv .badge')].map(b => b.textContent)")
        assert badges == ["not trained", "not trained", "trained", "not trained", "trained"]
        # the token view: trained (mask 1) and untrained (mask 0) runs, coloured apart
        browser.eval("document.getElementById('tab-tokens').click()")
        browser.wait_for("document.querySelectorAll('#tokens .runs .tok').length === 4", "the token runs")
        classes = browser.eval("[...document.querySelectorAll('#tokens .runs .tok')].map(s => s.className)")
        assert classes == ["tok untrained", "tok trained", "tok untrained", "tok trained"]
        colours = browser.eval("[...document.querySelectorAll('#tokens .runs .tok')].map(s => getComputedStyle(s).backgroundColor)")
        assert colours[0] != colours[1] and colours[1] == colours[3]
        assert browser.eval("document.querySelectorAll('#tokens .runs .tok')[1].textContent").startswith("<tool_call>")
        assert browser.eval("document.getElementById('failures').hidden") is False
        assert "3/4parse_errorinvalid JSON in tool call" in browser.eval(
            "document.querySelector('#failures tbody tr').textContent")
        check_png(browser.screenshot(shots / "run_tokens.png"))
        # a live run: new lines appear on the next poll, a half-written last line waits
        with open(run / "trajectories.jsonl", "a") as handle:
            handle.write(json.dumps(run_record(6, 1.0)) + "\n" + "{not json\n" + json.dumps(run_record(7, 1.0))[:50])
        set_field(browser, "f-order", "1")
        browser.wait_for("document.getElementById('count').textContent === '21 episodes of 21'", "the new episode")
        assert rows(browser)[0] == 20
        assert "1 malformed line(s) in trajectories.jsonl" in browser.eval("document.getElementById('bad').textContent")
        check_png(browser.screenshot(shots / "run_live.png"))
