"""The console and playground at /ui, in a real headless Chromium (the DevTools protocol over a
pipe, ``tests/e2e/browser.py``) on one ``tiny-omni`` server with an API key and a control key,
its image decoder run as two replicas (``--stage-replicas 1=2``): without the key the page shows
its login prompt and no data; signed in, both stages awake; sleep stage 1 at level 2 and see its
state and released memory within 2 s, wake it; a level typed by hand that the server refuses
shows the server's 400; one replica of stage 1 sleeps and wakes from its own row while the stage
stays awake; a chat gets its reply, and its picture; and a three-stage pipeline
(``tiny-qwen3-omni``) fits a 1280 px window. A screenshot of
each step goes to ``$OMNISTAGE_UI_SCREENSHOTS`` (else pytest's temp folder; the path is
printed), and each is checked for overflow: no sideways scrolling, nothing out of its card."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.browser import Browser, Page, ensure_chromium
from tests.e2e.server import Server, running_server

API_KEY = "ui-data-key"
CONTROL_KEY = "ui-control-key"
STAGE_0 = '.stage[data-stage-id="0"]'
STAGE_1 = '.stage[data-stage-id="1"]'  # two replicas: --stage-replicas 1=2


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with running_server(
        "--pipeline",
        "tiny-omni",
        "--enable-sleep-mode",
        "--api-key",
        API_KEY,
        "--control-api-key",
        CONTROL_KEY,
        "--stage-replicas",
        "1=2",
    ) as server:
        yield server


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    browser = Browser(ensure_chromium(), tmp_path_factory.mktemp("chromium"))
    try:
        yield browser
    finally:
        browser.close()


@pytest.fixture(scope="module")
def shots(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    given = os.environ.get("OMNISTAGE_UI_SCREENSHOTS")
    folder = Path(given) if given else tmp_path_factory.mktemp("ui-screenshots")
    folder.mkdir(parents=True, exist_ok=True)
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"\nUI screenshots: {folder}")
    return folder


@pytest.fixture(scope="module")
def page(browser: Browser, server: Server, shots: Path) -> Iterator[Page]:
    """A tab signed in with both keys; it must end without a JavaScript error."""
    page = browser.page()
    sign_in(page, server)
    yield page
    assert page.errors() == []
    page.close()


def sign_in(page: Page, server: Server) -> None:
    """Open the console, type both keys in its prompt, wait for the two stages."""
    page.goto(server.url + "/ui")
    page.wait_for("document.querySelector('#login').open")
    page.type("#api-key", API_KEY)
    page.type("#control-key", CONTROL_KEY)
    page.click("#login-submit")
    page.wait_for("document.querySelectorAll('.stage').length === 2")


def snap(page: Page, path: Path) -> None:
    """A screenshot of the page, which must fit its window: no card cut off, nothing sticking
    out of its card."""
    page.screenshot(path)
    assert page.overflows() == [], path.name


def text(page: Page, selector: str) -> str:
    return str(page.eval(f"document.querySelector({json.dumps(selector)})?.textContent ?? ''"))


def test_without_the_key_the_page_shows_its_login_prompt_and_no_data(
    browser: Browser, server: Server, shots: Path
) -> None:
    page = browser.page()  # a tab of its own: no key in its session storage
    try:
        page.goto(server.url + "/ui")
        page.wait_for("document.querySelector('#login').open")
        assert "401" in text(page, "#login-reason")
        page.type("#api-key", "wrong")
        page.click("#login-submit")
        page.wait_for("document.querySelector('#login').open")
        snap(page, shots / "01-login.png")
        shown = str(page.eval("document.body.innerText"))
        assert page.eval("document.querySelectorAll('.stage, .msg, #acks tbody tr').length") == 0
        assert "thinker" not in shown and "tiny-omni" not in shown, shown
        assert page.errors() == []
    finally:
        page.close()


# The page's first call to /v1/omni/stages, sent before any key, answered 3 s late.
SLOW_FIRST_STAGES = """(() => {
  const real = window.fetch.bind(window);
  let first = true;
  window.fetch = async (url, init) => {
    const response = await real(url, init);
    if (first && String(url).includes("v1/omni/stages")) {
      first = false;
      await new Promise((done) => setTimeout(done, 3000));
      window.slowAnswered = true;
    }
    return response;
  };
})();"""


def test_a_401_to_a_call_sent_before_signing_in_asks_for_nothing(
    browser: Browser, server: Server
) -> None:
    """The page's first calls go out without keys; one answered after the user signed in
    (its 401 late) leaves the prompt closed over the data it now shows."""
    page = browser.page()
    try:
        page.call("Page.addScriptToEvaluateOnNewDocument", {"source": SLOW_FIRST_STAGES})
        sign_in(page, server)
        page.wait_for("window.slowAnswered === true")
        time.sleep(0.3)  # the late 401 read and handed to the page's listeners
        assert page.eval("document.querySelector('#login').open") is False
    finally:
        page.close()


def test_signed_in_the_pipeline_shows_both_stages_awake(page: Page, shots: Path) -> None:
    page.wait_for("document.querySelectorAll('.stage[data-state=awake]').length === 2")
    assert text(page, '.stage[data-stage-id="0"] h3') == "0 · thinker"
    assert text(page, f"{STAGE_1} h3") == "1 · image-decoder"
    assert text(page, f"{STAGE_1} .released").startswith("0 B")
    page.wait_for("document.querySelectorAll('.memory-chart polyline').length >= 4")
    snap(page, shots / "02-both-awake.png")


def test_sleep_stage_1_at_level_2_and_wake_it(page: Page, server: Server, shots: Path) -> None:
    page.type(f"{STAGE_1} input.level", "2")
    pressed = time.monotonic()
    page.click(f"{STAGE_1} button.sleep")
    page.wait_for(
        f"""document.querySelector('{STAGE_1}').dataset.state === 'asleep'
            && document.querySelector('{STAGE_1} .state').textContent.includes('level 2')
            && !document.querySelector('{STAGE_1} .released').textContent.startsWith('0 B')"""
    )
    assert time.monotonic() - pressed < 2.0
    stages = httpx.get(server.url + "/v1/omni/stages", headers=server.control_headers()).json()
    released = stages["stages"][1]["memory"]["reserved_bytes"]
    assert released > 0 and stages["stages"][1]["memory"]["resident_bytes"] == 0
    shown = page.eval(f"import('./static/dom.js').then((dom) => dom.bytes({released}))")
    assert text(page, f"{STAGE_1} .released") == f"{shown} released"
    page.wait_for("document.querySelector('#acks tbody tr')?.textContent.includes('sleep')")
    snap(page, shots / "03-stage-1-asleep.png")

    page.click(f"{STAGE_1} button.wake")
    page.wait_for(
        f"""document.querySelector('{STAGE_1}').dataset.state === 'awake'
            && document.querySelector('{STAGE_1} .released').textContent.startsWith('0 B')"""
    )
    page.wait_for("document.querySelector('#acks tbody tr')?.textContent.includes('wake_up')")
    assert "HTTP 200" in text(page, "#answer")
    snap(page, shots / "04-stage-1-awake-again.png")


def test_a_level_the_server_refuses_shows_its_400(page: Page, server: Server, shots: Path) -> None:
    page.type(f"{STAGE_1} input.level", "7")
    page.click(f"{STAGE_1} button.sleep")
    page.wait_for("document.querySelector('#answer').dataset.status === '400'")
    said = httpx.post(
        server.url + "/v1/omni/sleep",
        json={"stage_ids": [1], "level": 7},
        headers=server.control_headers(),
    )
    assert said.status_code == 400
    answer = text(page, "#answer")
    assert "HTTP 400" in answer and json.dumps(said.json(), indent=2) in answer
    assert said.json()["error"]["message"] in text(page, f"{STAGE_1} .reply")
    assert page.eval(f"document.querySelector('{STAGE_1}').dataset.state") == "awake"
    snap(page, shots / "05-level-7-refused.png")
    page.type(f"{STAGE_1} input.level", "2")


def replica(i: int) -> str:
    return f'{STAGE_1} .replica[data-replica-id="{i}"]'


def as_shown(page: Page, n: int) -> str:
    """``n`` bytes as the page writes them."""
    return str(page.eval(f"import('./static/dom.js').then((dom) => dom.bytes({n}))"))


def test_one_replica_sleeps_and_wakes_from_its_row_while_the_stage_serves(
    page: Page, server: Server, shots: Path
) -> None:
    """Stage 1's card has a row per replica (state, in flight, pid, memory), stage 0's none;
    *Sleep* on replica 1's row sends ``replica_ids: [1]``: that row says asleep with its memory
    released while the stage and replica 0 stay awake; *Wake* on the row brings it back."""
    page.wait_for(f"document.querySelectorAll('{STAGE_1} .replica[data-state=awake]').length === 2")
    assert page.eval(f"document.querySelectorAll('{STAGE_0} .replicas').length") == 0
    stages = httpx.get(server.url + "/v1/omni/stages", headers=server.control_headers()).json()
    for r in stages["stages"][1]["replicas"]:
        row = replica(r["replica_id"])
        assert text(page, f"{row} .replica-state") == "awake"
        assert text(page, f"{row} .replica-load") == f"in flight 0 · running 0 · pid {r['pid']}"
        resident = as_shown(page, r["memory"]["resident_bytes"])
        assert text(page, f"{row} .replica-bytes") == f"{resident} resident · 0 B released"

    page.type(f"{STAGE_1} input.level", "2")
    page.click(f"{replica(1)} button.replica-sleep")
    page.wait_for(
        f"""document.querySelector('{replica(1)}').dataset.state === 'asleep'
            && document.querySelector('{replica(1)} .replica-state').textContent
                === 'asleep · level 2'"""
    )
    answer = text(page, "#answer")
    assert '{"stage_ids":[1],"replica_ids":[1],"level":2}' in answer and "HTTP 200" in answer
    stages = httpx.get(server.url + "/v1/omni/stages", headers=server.control_headers()).json()
    image = stages["stages"][1]
    assert image["state"] == "awake"
    assert [r["state"] for r in image["replicas"]] == ["awake", "asleep"]
    assert page.eval(f"document.querySelector('{STAGE_1}').dataset.state") == "awake"
    assert page.eval(f"document.querySelector('{replica(0)}').dataset.state") == "awake"
    released = as_shown(page, image["replicas"][1]["memory"]["released_bytes"])
    assert text(page, f"{replica(1)} .replica-bytes") == f"0 B resident · {released} released"
    assert "weights asleep" in text(page, f"{replica(1)} .replica-load")
    page.wait_for(
        "[...document.querySelectorAll('#acks tbody tr')]"
        ".some((tr) => tr.children[2].textContent === '1.1')"
    )
    snap(page, shots / "05a-replica-1-asleep.png")

    page.click(f"{replica(1)} button.replica-wake")
    page.wait_for(
        f"""document.querySelector('{replica(1)}').dataset.state === 'awake'
            && document.querySelector('{replica(1)} .replica-bytes').textContent
                .endsWith(' 0 B released')"""
    )
    assert '{"stage_ids":[1],"replica_ids":[1]}' in text(page, "#answer")
    assert page.eval(f"document.querySelector('{STAGE_1}').dataset.state") == "awake"
    snap(page, shots / "05b-replica-1-awake-again.png")


def test_a_chat_in_the_playground_gets_the_servers_reply(
    page: Page, server: Server, shots: Path
) -> None:
    page.type("#temperature", "0")
    page.type("#max-tokens", "8")
    page.type("#chat-input", "Hello")
    page.click("#send")
    page.wait_for("!!document.querySelector('.msg.assistant[data-done]')")
    reply = httpx.post(
        server.url + "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "Hello"}],
            "max_tokens": 8,
            "temperature": 0,
        },
        headers=server.data_headers(),
        timeout=60,
    ).json()
    assert text(page, ".msg.assistant .text") == reply["choices"][0]["message"]["content"]
    assert "finish: length" in text(page, ".msg.assistant .meta")

    page.click("#modalities input[value=image]")  # the image decoder draws the reply
    page.type("#chat-input", "Draw it")
    page.click("#send")
    page.wait_for("document.querySelectorAll('.msg.assistant[data-done]').length === 2")
    page.wait_for("document.querySelector('.reply-image')?.naturalWidth > 0")
    assert page.eval("document.querySelectorAll('.msg.error').length") == 0
    snap(page, shots / "06-chat.png")


def test_pictures_sounds_and_a_recording_go_to_the_server(
    page: Page, server: Server, shots: Path, tmp_path: Path
) -> None:
    """Attached files and a recording from the (fake) microphone travel as OpenAI's parts;
    tiny-omni's thinker takes neither, and the page shows the server's 400 as it came."""
    import wave

    from PIL import Image

    Image.new("RGB", (8, 8), (200, 30, 30)).save(tmp_path / "red.png")
    with wave.open(str(tmp_path / "tone.wav"), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(16000)
        out.writeframes(b"\x00\x10" * 1600)
    page.click("#new-chat")
    page.choose_files("#attach", [tmp_path / "red.png", tmp_path / "tone.wav"])
    page.wait_for("document.querySelectorAll('.attachment').length === 2")
    page.click("#record")
    page.wait_for("Number(document.querySelector('#record').dataset.seconds) >= 0.5")
    page.click("#record")
    page.wait_for("document.querySelectorAll('.attachment').length === 3")
    kinds = page.eval("[...document.querySelectorAll('.attachment')].map((e) => e.className)")
    assert [k.split()[-1] for k in kinds] == ["image", "audio", "audio"], kinds
    page.type("#chat-input", "What is this?")
    page.click("#send")
    page.wait_for("!!document.querySelector('.msg.assistant[data-done]')")
    sent = page.eval("document.querySelector('.msg.user img').src")  # the picture as sent
    part = {"type": "image_url", "image_url": {"url": sent}}
    said = httpx.post(
        server.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": [part]}]},
        headers=server.data_headers(),
    )
    assert said.status_code == 400
    shown = page.eval("document.querySelector('.msg.assistant').dataset.error")
    assert shown == said.json()["error"]["message"]
    assert "HTTP 400" in text(page, ".msg.assistant .error-detail")
    snap(page, shots / "07-media-refused.png")
    page.click("#new-chat")


def test_speech_plays_from_pieces_cut_anywhere(page: Page) -> None:
    """The playground's decoder of streamed speech (delta.audio): a WAV cut at odd places in
    its base64 and its bytes, with known or unknown sizes, and raw pcm16 give back every
    sample at the audio's rate."""
    result = page.eval(
        """(async () => {
          const { PcmStream, encodeWav } = await import("./static/audio.js");
          const rate = 24000, n = 4801;
          const wave = Float32Array.from({ length: n }, (_, i) => 0.5 * Math.sin(i / 7));
          const wav = encodeWav(wave, rate);
          const unknown = wav.slice();
          new DataView(unknown.buffer).setUint32(4, 0xffffffff, true);
          new DataView(unknown.buffer).setUint32(40, 0xffffffff, true);
          const b64 = (bytes) => btoa(String.fromCharCode(...bytes));
          const run = (format, pieces) => {
            const pcm = new PcmStream(format);
            const got = [];
            let rateSeen = 0;
            for (const piece of pieces) {
              const out = pcm.push(piece);
              if (out) { got.push(...out.data[0]); rateSeen = out.rate; }
            }
            const err = Math.max(...got.map((v, i) => Math.abs(v - wave[i])));
            return { n: got.length, rate: rateSeen, err };
          };
          const text = b64(wav);
          const cuts = [];  // base64 cut at 1, 2, 3, 5, ... characters: inside quanta too
          for (let at = 0, step = 1; at < text.length; at += step, step = step % 13 + 1) {
            cuts.push(text.slice(at, at + step));
          }
          const byBytes = [];  // each piece its own base64, cut inside the header and samples
          for (const [a, b] of [[0, 7], [7, 45], [45, 46], [46, 2001], [2001, wav.length]]) {
            byBytes.push(b64(unknown.slice(a, b)));
          }
          const raw = wav.slice(44);
          return {
            chars: run("wav", cuts),
            bytes: run("wav", byBytes),
            pcm16: run("pcm16", [b64(raw.slice(0, 301)), b64(raw.slice(301))]),
          };
        })()"""
    )
    for name, got in result.items():
        assert got["n"] == 4801 and got["rate"] == 24000, (name, got)
        assert got["err"] <= 1 / 32767, (name, got)


def test_three_stages_fit_a_1280_px_window_in_every_state(browser: Browser, shots: Path) -> None:
    """tiny-qwen3-omni's three cards side by side at 1280 px, awake, one asleep (with its host
    copy and its last sleep), woken again, and the ACK table's SKIPPED row: no sideways
    scrolling, nothing out of its card."""
    with running_server("--pipeline", "tiny-qwen3-omni", "--enable-sleep-mode") as server:
        page = browser.page()
        try:
            page.resize(1280, 900)
            page.goto(server.url + "/ui")
            page.wait_for("document.querySelectorAll('.stage[data-state=awake]').length === 3")
            code2wav = '.stage[data-stage-id="2"]'
            snap(page, shots / "08-three-stages-1280.png")
            for _ in range(2):  # the second is SKIPPED: "already asleep" in the ACK table
                reply = httpx.post(
                    server.url + "/v1/omni/sleep", json={"stage_ids": [2], "level": 1}, timeout=60
                )
                assert reply.status_code == 200, reply.text
            page.wait_for(
                f"""document.querySelector('{code2wav}').dataset.state === 'asleep'
                    && document.querySelector('{code2wav} .last-ops').textContent
                        .includes('kept on host')
                    && document.querySelector('#acks tbody').textContent.includes('already')"""
            )
            snap(page, shots / "09-three-stages-code2wav-asleep-1280.png")
            httpx.post(server.url + "/v1/omni/wakeup", json={"stage_ids": [2]}, timeout=60)
            page.wait_for(
                f"""document.querySelector('{code2wav}').dataset.state === 'awake'
                    && document.querySelector('#acks tbody').textContent.includes('wake_up')"""
            )
            snap(page, shots / "10-three-stages-awake-again-1280.png")
            assert page.errors() == []
        finally:
            page.close()
