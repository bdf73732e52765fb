"""The episode browser in a real headless Chromium (Debian's chromium and chromium-driver, driven by
Selenium): the list shows every episode, the success filter works, stepping through a 3-turn
episode shows its three frames and responses in order; an evaluation writes the page, and
`python -m vagen.browse` rewrites it.

Without Chromium these tests fail and say how to install it: apt-get install -y chromium chromium-driver."""

import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from PIL import Image

from vagen.browse import episode_data, screenshot, write_browser
from vagen.config import load_config

ROOT = Path(__file__).resolve().parent.parent
INSTALL = "apt-get install -y chromium chromium-driver (Debian/Ubuntu) and pip install -e \".[test]\" (selenium)"
COLOURS = [(200, 40, 40), (40, 160, 60), (40, 70, 200)]


@pytest.fixture(scope="module")
def browser():
    """A headless Chromium under Selenium, with the system's chromedriver (no driver download)."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.fail(f"selenium is not installed; install what these tests need: {INSTALL}")
    binary = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
    driver_path = shutil.which("chromedriver")
    if binary is None or driver_path is None:
        pytest.fail(f"headless Chromium is needed (found chromium: {binary}, chromedriver: {driver_path}); "
                    f"install it: {INSTALL}")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,800"):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    yield driver
    driver.quit()


def _turn(number: int, colour, success: bool, grade: float | None = None):
    """A turn as vagen.rollout records it: a frame of one colour, a response naming the turn."""
    parsed = {"think": f"thinking at turn {number}", "answer": f"Right, Up ({number})"}
    info = {"actions": ["Right", "Up"], "parsed": parsed, "format_ok": True, "action_is_valid": True,
            "success": success, "grounding_score": grade, "worldmodel_score": None,
            "state_before": [["player", "left", "box"]], "state_after": []}
    if grade is not None:
        parsed["observation"] = "the box is right of me"
    return SimpleNamespace(observation=f"Turn {number}: <image>", images=[Image.new("RGB", (84, 84), colour)],
                           response=f"<think>{parsed['think']}</think><answer>{parsed['answer']}</answer>",
                           reward=0.5 * number, info=info)


def _episode(seed: int, turns: int, success: bool, grade: float | None = None):
    played = [_turn(k + 1, COLOURS[k % 3], success and k == turns - 1, grade if k == 0 else None) for k in range(turns)]
    return SimpleNamespace(env_name="sokoban", seed=seed, success=success, turns=played, error=None,
                           system_prompt="You are a Sokoban solver.")


def _visible_seeds(driver) -> list[int]:
    rows = driver.find_elements("css selector", "#episodes tbody tr.episode")
    return [int(r.get_attribute("data-seed")) for r in rows if r.is_displayed()]


def test_the_page_lists_filters_and_steps_through_episodes(browser, tmp_path):
    from selenium.webdriver.support.ui import Select

    episodes = [_episode(11, 1, True), _episode(12, 3, False, grade=0.5), _episode(13, 2, True),
                _episode(14, 2, False)]
    page = write_browser(tmp_path, load_config("sokoban_visual"), episode_data(episodes))
    assert page == tmp_path / "index.html" and "data:image" not in page.read_text()  # frames are files
    browser.get(page.as_uri())
    assert _visible_seeds(browser) == [11, 12, 13, 14]
    assert browser.find_element("id", "shown").text == "showing 4 of 4 episodes"

    success = Select(browser.find_element("id", "filter-success"))
    success.select_by_value("yes")
    assert _visible_seeds(browser) == [11, 13]
    success.select_by_value("no")
    assert _visible_seeds(browser) == [12, 14]
    assert browser.find_element("id", "shown").text == "showing 2 of 4 episodes"

    browser.find_element("css selector", "tr.episode[data-seed='12']").click()
    seen = []
    for number in (1, 2, 3):
        assert browser.find_element("id", "turn-label").text == f"turn {number} of 3"
        image = browser.find_element("css selector", "#turn-frame img")
        # loaded from the file next to the page, and that file is the frame the agent saw
        assert browser.execute_script("return arguments[0].complete && arguments[0].naturalWidth", image) == 84
        src = image.get_attribute("src")
        assert src.endswith(f"frames/seed12_turn{number}_0.png"), src
        assert Image.open(tmp_path / "frames" / f"seed12_turn{number}_0.png").getpixel((5, 5)) == COLOURS[number - 1]
        response = browser.find_element("id", "turn-response").get_attribute("textContent")
        seen.append(response)
        assert browser.find_element("id", "turn-reward").text == f"reward {0.5 * number:.2f}"
        if number < 3:
            browser.find_element("id", "turn-next").click()
    assert seen == [f"<think>thinking at turn {n}</think><answer>Right, Up ({n})</answer>" for n in (1, 2, 3)]
    assert not browser.find_element("id", "turn-next").is_enabled()
    browser.find_elements("css selector", "#stepper .dot")[0].click()  # back to turn 1: graded
    assert browser.find_element("id", "turn-label").text == "turn 1 of 3"
    text = browser.find_element("id", "turn-text").text
    assert "grade 0.50" in text and "the box is right of me" in text and "true state: (player, left, box)" in text


def test_an_evaluation_writes_the_page_and_vagen_browse_rewrites_it(browser, tmp_path):
    from vagen.eval import main as evaluate_main

    out = tmp_path / "run" / "eval" / "step_2"
    assert evaluate_main(["--config", "sokoban_visual", "--checkpoint", "assets:sokoban_visual", "--episodes", "3",
                          "--videos", "0", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    lines = (out / "episodes.jsonl").read_text().splitlines()
    episodes = [json.loads(line) for line in lines]
    assert [e["seed"] for e in episodes] == [r["seed"] for r in results["episodes"]]
    for ep, record in zip(episodes, results["episodes"]):
        assert len(ep["turns"]) == record["turns"] and ep["success"] == record["success"]
        for turn in ep["turns"]:
            (frame,) = turn["frames"]
            assert Image.open(out / frame).size == (168, 168)  # 6x6 Sokoban at 28 px per cell

    page = (out / "index.html").read_text()
    (out / "index.html").unlink()
    done = subprocess.run([sys.executable, "-m", "vagen.browse", str(tmp_path / "run")], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert (out / "index.html").read_text() == page
    assert done.stdout.split() == [str(out / "index.html"), str(tmp_path / "run" / "index.html")]
    browser.get((tmp_path / "run" / "index.html").as_uri())
    browser.find_element("link text", "eval/step_2").click()
    assert _visible_seeds(browser) == [e["seed"] for e in episodes]

    longest = max(episodes, key=lambda e: len(e["turns"]))
    png = screenshot(out / "index.html", tmp_path / "browser.png", f"seed={longest['seed']}&turn=1")
    shot = Image.open(png)
    assert shot.size == (1280, 760) and len(shot.convert("L").getcolors(256 * 256) or []) > 20, "a blank page"


def test_browse_says_what_it_expected(tmp_path):
    done = subprocess.run([sys.executable, "-m", "vagen.browse", str(tmp_path)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "no evaluation under" in done.stderr and "episodes.jsonl" in done.stderr
