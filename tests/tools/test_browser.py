"""The report and the demo page in a real browser: headless Chromium (Debian's `chromium`, installed by
.ci/run) driven by Playwright (requirements.txt; it starts the system's browser, it downloads
none). Nothing is played: the test checks what a person would see. Screenshots go to
test-artifacts/ at the repository root (git-ignored): report.png and demo.png.

Skipped, with the reason, where Playwright or Chromium is missing."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from common.data.manifest import read_librispeech
from tests.harness.harness import ROOT, python
from tests.tools.test_demo import options, serving, trained_asr, trained_tts

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS = ROOT / "test-artifacts"

pytestmark = [pytest.mark.slow, pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH "
                                                   "(Debian: apt-get install chromium; .ci/run installs it)")]
playwright = pytest.importorskip("playwright.sync_api", reason="no playwright (pip install -r requirements.txt)")


@pytest.fixture(scope="module")
def browser():
    with playwright.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])  # root in CI: no sandbox
        yield chromium
        chromium.close()


def test_the_decode_report_shows_its_rows_with_audio_and_sorts(browser, tiny_corpus, reference, tmp_path):
    asr = trained_asr(reference, tiny_corpus)
    proc = python([ROOT / "recipes" / "asr" / "decode.py", "--checkpoint", asr, "--split", "test",
                   "--data_dir", tiny_corpus / "librispeech", "--output", tmp_path])
    assert proc.returncode == 0, proc.stderr[-2000:]
    page = browser.new_page()
    page.goto((tmp_path / "test-greedy.html").as_uri())
    rows = page.locator("table.rows tr[data-id]")
    n = len(read_librispeech(tiny_corpus / "librispeech", "test"))
    assert rows.count() == min(n, 50)
    for src in page.locator("table.rows audio").evaluate_all("els => els.map(e => e.getAttribute('src'))"):
        assert (tmp_path / src).is_file() and (tmp_path / src).stat().st_size > 0  # points at real audio
    wer = lambda: [float(t.rstrip(" %")) if t != "–" else None  # noqa: E731 — the WER column as shown
                   for t in page.locator("table.rows tr[data-id] td:nth-child(4)").all_inner_texts()]
    assert wer() == sorted(wer(), reverse=True)  # opens worst first
    page.locator("th[data-key=wer]").click()
    assert wer() == sorted(wer())  # a click reverses
    page.locator("th[data-key=id]").click()
    ids = page.locator("table.rows tr[data-id]").evaluate_all("els => els.map(e => e.dataset.id)")
    assert ids == sorted(ids, reverse=True)
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=ARTIFACTS / "report.png", full_page=True)


def test_the_demo_page_transcribes_an_upload_and_speaks_a_sentence(browser, tiny_corpus, reference):
    asr, tts = trained_asr(reference, tiny_corpus), trained_tts(reference, tiny_corpus)
    utterance = read_librispeech(tiny_corpus / "librispeech", "test")[0]["path"]
    with serving(options(asr, tts)) as url:
        page = browser.new_page()
        page.goto(url + "/")
        asr_section, tts_section = page.locator("section.asr"), page.locator("section.tts")
        asr_section.locator("input[type=file]").set_input_files(utterance)
        asr_section.locator("button.send").click()
        page.wait_for_function("document.querySelector('section.asr .out').textContent !== '…'", timeout=60_000)
        assert asr_section.locator(".err").inner_text() == ""
        assert asr_section.locator("audio.heard").is_visible()
        tts_section.locator("textarea").fill("a cat said she")
        tts_section.locator("button.send").click()
        page.wait_for_function("!document.querySelector('section.tts .spoken').hidden", timeout=60_000)
        assert tts_section.locator("audio.spoken").get_attribute("src").startswith("data:audio/wav;base64,")
        duration = page.evaluate("""() => new Promise(done => { const a = document.querySelector('section.tts .spoken');
            if (a.readyState > 0) done(a.duration); else a.onloadedmetadata = () => done(a.duration); })""")
        assert duration > 0  # the browser decodes what came back as audio
        assert tts_section.locator("img.picture").evaluate("img => img.complete && img.naturalWidth > 0")
        tts_section.locator("textarea").fill("ж")
        tts_section.locator("button.send").click()
        page.wait_for_function("document.querySelector('section.tts .err').textContent !== ''", timeout=60_000)
        assert "this voice's symbols" in tts_section.locator(".err").inner_text()  # refused in the page
        tts_section.locator("textarea").fill("a cat said she")
        tts_section.locator("button.send").click()
        page.wait_for_function("!document.querySelector('section.tts .spoken').hidden", timeout=60_000)
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=ARTIFACTS / "demo.png", full_page=True)
