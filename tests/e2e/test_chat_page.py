"""The chat page at `/` in headless Chromium (Debian's chromium + chromium-driver, driven by
Selenium), against the real server on the embedded model with an API key: the page loads
without the key, a question without it shows the 401, with it the answer streams in (the text
grows, then the turn is done), Stop aborts a long answer on the server too, and later turns
send the whole history (system prompt, questions, answers, the stopped one as far as it got).
The markdown renderer is checked in the same browser: escaping first, links only for http(s)."""

from __future__ import annotations

import http.client
import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.service import API_KEY, Server

KEY = API_KEY  # the shared keyed server (tests/e2e/conftest.py)
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
SYSTEM = "You are a helpful assistant. Answer briefly."
QUESTION = "What is the capital of France?"
TURN_TIMEOUT = 240.0  # seconds for a 64-token answer on a busy 2-core machine


def api(port: int, method: str, path: str, body: Any = None, key: str | None = KEY) -> tuple[int, Any, dict[str, str]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        headers = {"Content-Type": "application/json"}
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        conn.request(method, path, body=None if body is None else json.dumps(body).encode(), headers=headers)
        resp = conn.getresponse()
        raw = resp.read()
        is_json = resp.getheader("content-type", "").startswith("application/json")
        return resp.status, json.loads(raw) if is_json else raw.decode(), {k.lower(): v for k, v in resp.getheaders()}
    finally:
        conn.close()


@pytest.fixture(scope="module")
def browser(keyed_server: Server) -> Iterator[Any]:
    webdriver = pytest.importorskip("selenium.webdriver")
    if not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()):
        pytest.skip("needs Debian's chromium and chromium-driver (bash scripts/setup.sh --test)")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,860", "--lang=en-US"):  # fmt: skip
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_script_timeout(30)
    driver.get(f"{keyed_server.base_url}/")
    yield driver
    driver.quit()


def wait_for(predicate: Any, timeout: float, what: str, interval: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def by_id(driver: Any, element_id: str) -> Any:
    from selenium.webdriver.common.by import By

    return driver.find_element(By.ID, element_id)


def last_answer(driver: Any) -> Any:
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, ".message.assistant")[-1]


def set_value(driver: Any, element_id: str, value: str) -> None:
    """As a user would: the page listens to `input` (sliders, fields) and `change` (the key)."""
    driver.execute_script(
        "const el = document.getElementById(arguments[0]); el.value = arguments[1];"
        "el.dispatchEvent(new Event('input')); el.dispatchEvent(new Event('change'));", element_id, value)


def ask(driver: Any, text: str) -> None:
    before = answers(driver)
    by_id(driver, "prompt").send_keys(text + "\n")  # Enter sends
    wait_for(lambda: answers(driver) == before + 1, 30, "the answer bubble")


def answers(driver: Any) -> int:
    return int(driver.execute_script("return document.querySelectorAll('.message.assistant').length"))


def watch_turn(driver: Any, timeout: float = TURN_TIMEOUT) -> tuple[str, list[int]]:
    """Poll the answer until it is no longer streaming: its final state and the text lengths seen."""
    lengths: list[int] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state, length = driver.execute_script(
            "const m = [...document.querySelectorAll('.message.assistant')].pop();"
            "return [m.dataset.state, m.querySelector('.content').textContent.length];")
        lengths.append(int(length))
        if state != "streaming":
            return str(state), lengths
        time.sleep(0.05)
    raise AssertionError(f"the answer still streams after {timeout:.0f} s")


# Installed in the page: the answer's text length at every DOM change while it streams.
RECORD_SIZES = (
    "window.__sizes = [];"
    "new MutationObserver(() => {"
    " const m = [...document.querySelectorAll('.message.assistant')].pop();"
    " if (m && m.dataset.state === 'streaming') window.__sizes.push(m.querySelector('.content').textContent.length);"
    "}).observe(document.body, {subtree: true, childList: true, characterData: true, attributes: true});"
)


def sent_bodies(driver: Any) -> list[dict[str, Any]]:
    return list(driver.execute_script("return window.__sent"))


def test_page_and_its_files_need_no_key(keyed_server: Server) -> None:
    status, html, headers = api(keyed_server.port, "GET", "/", key=None)
    assert status == 200 and headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in headers["content-security-policy"]
    assert '<script src="/static/chat.js">' in html and "http" not in html  # nothing from the network
    for path, media in (("/static/chat.js", "text/javascript"), ("/static/markdown.js", "text/javascript"),
                        ("/static/chat.css", "text/css")):  # fmt: skip
        status, _, headers = api(keyed_server.port, "GET", path, key=None)
        assert status == 200 and headers["content-type"].startswith(media), path
    status, body, _ = api(keyed_server.port, "GET", "/v1/models", key=None)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    status, body, _ = api(keyed_server.port, "GET", "/static/other.js", key=None)
    assert status == 401  # only the page's own files are open


def test_markdown_is_rendered_safely(browser: Any) -> None:
    render = "return window.renderMarkdown(arguments[0])"
    html = browser.execute_script(render, "# Title\n\nSome **bold**, *italic* and `co*de*`.\n\n- one\n- two\n\n"
                                          "2. b\n3. c\n\n```python\nprint('<b>')\n```\n[site](https://example.org/?a=1&b=2)")
    assert "<h1>Title</h1>" in html
    assert "<strong>bold</strong>" in html and "<em>italic</em>" in html and "<code>co*de*</code>" in html
    assert "<ul><li>one</li><li>two</li></ul>" in html and '<ol start="2"><li>b</li><li>c</li></ol>' in html
    assert '<pre><code class="language-python">print(&#39;&lt;b&gt;&#39;)</code></pre>' in html
    assert '<a href="https://example.org/?a=1&amp;b=2" target="_blank" rel="noopener noreferrer">site</a>' in html
    hostile = browser.execute_script(render, '<script>alert(1)</script> <img src=x onerror="alert(1)"> '
                                             "[x](javascript:alert(1)) [y](data:text/html,hi) **<i>b</i>**")
    assert "<script" not in hostile and "<img" not in hostile and "<i>" not in hostile
    assert "&lt;script&gt;" in hostile and "href" not in hostile
    assert "<strong>&lt;i&gt;b&lt;/i&gt;</strong>" in hostile
    # An unclosed fence (an answer still streaming) is code up to the end.
    assert browser.execute_script(render, "```\nx < 1") == "<pre><code>x &lt; 1</code></pre>"


def test_chat_streams_stops_and_keeps_history(browser: Any, keyed_server: Server, tmp_path: Path) -> None:
    port = keyed_server.port
    browser.execute_script(  # record what the page sends (the request bodies)
        "window.__sent = []; const real = window.fetch;"
        "window.fetch = (url, init) => { if (String(url).endsWith('/v1/chat/completions'))"
        " window.__sent.push(JSON.parse(init.body)); return real(url, init); };")
    assert "API key" in by_id(browser, "model").text  # /v1/models answered 401

    # Without the key: the 401 shows in the answer, and the question is not kept.
    ask(browser, QUESTION)
    state, _ = watch_turn(browser)
    assert state == "error" and "401" in last_answer(browser).text
    assert by_id(browser, "prompt").get_attribute("value") == QUESTION  # given back to edit and resend
    by_id(browser, "prompt").clear()

    set_value(browser, "api-key", KEY)
    served = api(port, "GET", "/v1/models")[1]["data"][0]["id"]
    wait_for(lambda: by_id(browser, "model").text == served, 120, "the model name")
    set_value(browser, "system", SYSTEM)
    set_value(browser, "temperature", "0")
    set_value(browser, "top-p", "1")
    set_value(browser, "max-tokens", "64")

    # Turn 1 streams: the text grows over several updates while the state is "streaming". The page
    # records each update itself (a poll from here can miss them: the default server streams a
    # short answer in ~0.1 s).
    browser.execute_script(RECORD_SIZES)
    ask(browser, QUESTION)
    state, _ = watch_turn(browser)
    assert state == "done", last_answer(browser).text
    sizes = browser.execute_script("return window.__sizes")
    assert len({n for n in sizes if n > 0}) >= 3, sizes  # several sizes before done (markdown may shrink it)
    first = sent_bodies(browser)[-1]
    assert first["stream"] is True and first["temperature"] == 0 and first["top_p"] == 1 and first["max_tokens"] == 64
    assert first["messages"] == [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    # The same request without streaming (greedy) gives the answer the page showed.
    plain = {k: v for k, v in first.items() if k not in ("stream", "stream_options")}
    status, reference, _ = api(port, "POST", "/v1/chat/completions", plain)
    assert status == 200, reference
    answer_1 = reference["choices"][0]["message"]["content"]
    assert "finish: " in last_answer(browser).find_element("css selector", ".note").text

    # Turn 2: a long answer, stopped once it has started; the server aborts it.
    set_value(browser, "max-tokens", "2000")
    ask(browser, "Write a very long story about dragons, with many chapters.")
    wait_for(lambda: last_answer(browser).find_element("css selector", ".content").text, TURN_TIMEOUT, "the first text")
    by_id(browser, "stop").click()
    state, _ = watch_turn(browser, timeout=30)
    assert state == "stopped", last_answer(browser).text
    stopped_text = last_answer(browser).find_element("css selector", ".content").text
    time.sleep(1.5)
    assert last_answer(browser).find_element("css selector", ".content").text == stopped_text  # no more text
    wait_for(lambda: _idle(port), 60, "the server to abort the stopped request")  # 2000 tokens would take minutes
    assert "Aborting request" in keyed_server.log()

    # Turn 3 carries the history: system, both questions and both answers (the stopped one as
    # far as it got).
    set_value(browser, "max-tokens", "8")
    ask(browser, "Thanks. And of Italy?")
    state, _ = watch_turn(browser)
    assert state == "done", last_answer(browser).text
    third = sent_bodies(browser)[-1]
    roles = [m["role"] for m in third["messages"]]
    assert roles == ["system", "user", "assistant", "user", "assistant", "user"]
    assert third["messages"][2]["content"] == answer_1
    assert third["messages"][4]["content"].strip() and len(third["messages"][4]["content"]) < 4000
    assert third["messages"][5]["content"] == "Thanks. And of Italy?"

    browser.save_screenshot(str(tmp_path / "chat_page.png"))
    assert (tmp_path / "chat_page.png").stat().st_size > 10_000

    # New chat forgets the history.
    by_id(browser, "new-chat").click()
    assert answers(browser) == 0
    set_value(browser, "max-tokens", "4")
    ask(browser, "Hello")
    assert watch_turn(browser)[0] == "done"
    assert [m["role"] for m in sent_bodies(browser)[-1]["messages"]] == ["system", "user"]


def _idle(port: int) -> bool:
    stats = api(port, "GET", "/v1/internal/stats")[1]
    return stats["running"] == 0 and stats["waiting"] == 0 and stats["live_requests"] == 0
