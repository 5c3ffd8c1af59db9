"""The chat page of ``llmsession serve`` (``GET /``) in a real headless Chromium: Debian's
``chromium`` and ``chromium-driver`` (``scripts/fetch_browser.py`` installs them), driven by
Selenium. One browser for the module; one server with an API key on SmolLM2 for most tests, one
without a key on SmolLM2 with the tiny vision projector for images (each server is an origin of its
own, so each has its own localStorage). Without the browser the tests fail, they never skip.

Screenshots of the main states go to a temporary folder (its path is printed with ``-s``);
``tests/data/chat-page.png``, the README's, is one of them.
"""

from __future__ import annotations

import base64
import json
import re
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import jsonschema
import pytest
from selenium import webdriver
from selenium.common.exceptions import NoAlertPresentException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.remote.webelement import WebElement
from serve_helpers import KEY, WEATHER, Served, metric, running, three_models

from llmsession import Model, Models, SessionConfig
from llmsession.serve.app import create_app
from llmsession.serve.images import MAX_IMAGES
from llmsession.serve.page import FILES, STATIC

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")  # (fetch_browser.py's)
WIDTH, HEIGHT = 1100, 750
README_SHOT = Path(__file__).parent / "data" / "chat-page.png"
MARKUP = "<img src=x onerror=alert(1)><script>window.pwned=1</script><b>bold</b>"
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "likes_tea": {"type": "boolean"}},
    "required": ["name", "likes_tea"],
    "additionalProperties": False,
}
T = TypeVar("T")
STATIC_IMPORT = r"""^\s*(?:import|export)\b[^;]*?\bfrom\s*["']([^"']*)["']"""  # import {a} from "./x.js"
IMPORTS = re.compile(STATIC_IMPORT + r"""|^\s*import\s*["']([^"']*)["']""", re.M)  # (or import "./x.js")
SINKS = ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function")


def wait_for(check: Callable[[], T], what: str, timeout: float = 30.0) -> T:
    """``check()`` once it is truthy (polled), else the test fails saying ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.03)


@dataclass
class Page:
    """The browser on one server's page, with what the tests do to it."""

    driver: WebDriver
    base: str  # http://127.0.0.1:PORT/
    shots: Path
    key: str | None = None

    def js(self, script: str, *args: Any) -> Any:
        return self.driver.execute_script(script, *args)

    def by(self, css: str) -> list[WebElement]:
        return self.driver.find_elements(By.CSS_SELECTOR, css)

    def one(self, css: str) -> WebElement:
        return self.driver.find_element(By.CSS_SELECTOR, css)

    def load(self) -> None:
        """The page, (re)loaded, connected: the key entered if it asks for one."""
        self.driver.get(self.base)
        wait_for(lambda: self.ready() or self.asks_key(), "the page to connect or ask for a key")
        if not self.ready():
            assert self.key is not None, "the page asked for a key on a server without one"
            self.one("#key-input").send_keys(self.key, Keys.ENTER)
        wait_for(self.ready, "the page to connect")

    def ready(self) -> bool:
        return bool(self.js("return document.body.dataset.ready") == "1")

    def asks_key(self) -> bool:
        return bool(self.js("return !document.getElementById('key-form').hidden"))

    def new_chat(self, **settings: Any) -> None:
        """A new conversation with these settings (the rest reset: short greedy replies)."""
        if not self.driver.current_url.startswith(self.base) or not self.ready():
            self.load()
        self.one("#new-chat").click()
        values = {"system": "", "temperature": 0, "max-tokens": 24, "schema": "", "tools": ""}
        values.update({"tool-choice": "auto", "parallel": True})
        values.update({name.replace("_", "-"): value for name, value in settings.items()})
        self.settings(**values)

    def settings(self, **values: Any) -> None:
        """Fields of the settings panel set (as typing would: their input events fire)."""
        for name, value in values.items():
            text = value if isinstance(value, str) else json.dumps(value)
            self.js(
                "const f = document.getElementById(arguments[0]);"
                "if (f.type === 'checkbox') f.checked = arguments[2]; else f.value = arguments[1];"
                "f.dispatchEvent(new Event('input')); f.dispatchEvent(new Event('change'));",
                "set-" + name.replace("_", "-"),
                text,
                value,
            )

    def type(self, *keys: str) -> None:
        self.one("#input").send_keys(*keys)

    def busy(self) -> bool:
        return bool(self.js("return document.body.dataset.busy") == "1")

    def ended(self) -> int:
        """How many replies ended since the page loaded."""
        return int(self.js("return document.body.dataset.ended || '0'"))

    def answered(self, action: Callable[[], object], timeout: float = 60.0) -> dict[str, str]:
        """``action`` done, then its reply waited for to end: the reply's stats."""
        before = self.ended()
        action()
        wait_for(lambda: self.ended() > before, "the reply to end", timeout)
        assert not self.busy()
        return self.stats()

    def send(self, text: str) -> dict[str, str]:
        """``text`` sent with Enter; the stats of its reply once it ended."""
        return self.answered(lambda: self.type(text, Keys.ENTER))

    def messages(self, role: str = "") -> list[WebElement]:
        return self.by(f"#messages .message[data-role={role}]" if role else "#messages .message")

    def stats(self) -> dict[str, str]:
        """The numbers under the last reply (its ``.stats`` data attributes)."""
        last = self.messages("assistant")[-1]
        errors = last.find_elements(By.CSS_SELECTOR, ".error")
        assert not errors, errors[0].text
        return dict(self.js("return {...arguments[0].querySelector('.stats').dataset}", last))

    def reply_text(self) -> str:
        last = "#messages .message:last-child .body"
        return str(self.js("return document.querySelector(arguments[0]).textContent", last))

    def shot(self, name: str) -> Path:
        path = self.shots / f"{name}.png"
        self.driver.save_screenshot(str(path))
        return path

    def no_script_ran(self) -> None:
        """No alert open, no ``window.pwned``, nothing refused by the page's CSP."""
        with pytest.raises(NoAlertPresentException):
            self.driver.switch_to.alert.text  # noqa: B018
        assert self.js("return window.pwned") is None
        refused = [e["message"] for e in self.driver.get_log("browser") if "Refused to" in e["message"]]
        assert not refused, refused


def browser_binaries() -> None:
    missing = [str(path) for path in (CHROMIUM, CHROMEDRIVER) if not path.exists()]
    if missing:  # (a failure, not a skip: `make test` runs scripts/fetch_browser.py first)
        pytest.fail(f"the browser tests need {', '.join(missing)}: run `python scripts/fetch_browser.py`")


@pytest.fixture(scope="module")
def driver() -> Iterator[WebDriver]:
    browser_binaries()
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    browser = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))
    try:
        browser.execute_cdp_cmd(
            "Emulation.setDeviceMetricsOverride",
            {"width": WIDTH, "height": HEIGHT, "deviceScaleFactor": 1, "mobile": False},
        )
        browser.set_script_timeout(10)
        yield browser
    finally:
        browser.quit()


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("page-screenshots")
    print(f"screenshots of the chat page: {folder}")
    return folder


@pytest.fixture(scope="module")
def served(smollm2_path: Path) -> Iterator[Served]:
    with Model(smollm2_path, threads=2) as model:
        app = create_app(model, api_key=KEY)
        with running(app) as url:
            yield Served(model, url, app.state.server.model_name, app.state.server)


@pytest.fixture(scope="module")
def vision_served(smollm2_path: Path, fixture_path: Callable[[str], Path]) -> Iterator[Served]:
    with Model(smollm2_path, mmproj_path=fixture_path("mmproj-tiny.gguf"), threads=2) as model:
        app = create_app(model)
        with running(app) as url:
            yield Served(model, url, app.state.server.model_name, app.state.server, key=None)


@pytest.fixture
def page(driver: WebDriver, served: Served, shots: Path) -> Page:
    return Page(driver, served.url.removesuffix("v1"), shots, KEY)


# -- the files -----------------------------------------------------------------------------------
def test_the_page_needs_no_key_and_is_served_with_a_strict_policy(served: Served) -> None:
    with served.http(None) as http:
        page = http.get("/")
        script, style = http.get("/static/main.js"), http.get("/static/style.css")
        missing = [http.get(path).status_code for path in ("/static/x.js", "/static/..%2Fpage.py")]
        api = http.get("/v1/models")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    policy = page.headers["content-security-policy"]
    rules = ("default-src 'none'", "script-src 'self'", "connect-src 'self'", "img-src 'self' data: blob:")
    assert all(rule in policy for rule in rules), policy
    assert "unsafe" not in policy and page.headers["x-content-type-options"] == "nosniff"
    assert script.status_code == 200 and script.headers["content-type"].startswith("text/javascript")
    assert style.status_code == 200 and style.headers["content-type"].startswith("text/css")
    assert missing == [404, 404] and api.status_code == 401  # the API still needs the key


def test_the_static_files_fetch_nothing_and_never_parse_html() -> None:
    files = {path.name: path.read_text() for path in STATIC.iterdir()}
    assert set(files) == {"index.html", "main.js", "dom.js", "store.js", "api.js", "view.js", "style.css"}
    for name, text in files.items():
        assert "http://" not in text and "https://" not in text and "//cdn" not in text, name
        assert "@import" not in text and "url(" not in text, name
    assert "<script>" not in files["index.html"] and not re.search(r"\son\w+=", files["index.html"])
    scripts = [name for name in files if name.endswith(".js")]
    for name in scripts:  # (every module)
        for sink in SINKS:
            assert sink not in files[name], (name, sink)
    assert '<script type="module" src="static/main.js"></script>' in files["index.html"]


def page_modules(entry: str = "main.js") -> list[str]:
    """``entry`` and the modules it imports, transitively (``import ... from "./x.js"``, each only
    from this folder; no dynamic ``import()``, so the static imports are all of them)."""
    seen: list[str] = []
    todo = [entry]
    while todo:
        name = todo.pop(0)
        if name not in seen:
            seen.append(name)
            text = (STATIC / name).read_text()
            assert "import(" not in text, f"{name}: a dynamic import"
            for found in IMPORTS.finditer(text):
                specifier = found.group(1) or found.group(2)
                assert re.fullmatch(r"\./[\w-]+\.js", specifier), f"{name} imports {specifier!r}"
                todo.append(specifier.removeprefix("./"))
    return seen


def check_modules_served(files: Mapping[str, str]) -> list[str]:
    """Every module of the page in ``files`` (page.py's ``FILES``, what is served) as JavaScript,
    which a module script must be: the modules."""
    modules = page_modules()
    missing = [name for name in modules if name not in files]
    assert not missing, f"modules the page imports that are not served: {missing}"
    wrong = [name for name in modules if not files[name].startswith("text/javascript")]
    assert not wrong, f"modules not served as JavaScript: {wrong}"
    return modules


def test_every_module_main_imports_is_served_as_javascript(served: Served) -> None:
    modules = check_modules_served(FILES)
    assert set(modules) == {path.name for path in STATIC.glob("*.js")}  # (all found, none unused)
    for name in modules:  # the check fails on a FILES without any one of them
        with pytest.raises(AssertionError, match=re.escape(repr(name))):
            check_modules_served({other: kind for other, kind in FILES.items() if other != name})
    with pytest.raises(AssertionError, match="as JavaScript"):
        check_modules_served({**FILES, "view.js": "text/plain"})
    with served.http(None) as http:
        responses = {name: http.get(f"/static/{name}") for name in modules}
    for name, response in responses.items():
        assert response.status_code == 200, name
        assert response.headers["content-type"].startswith("text/javascript"), (name, response.headers)
        assert response.text == (STATIC / name).read_text(), name


# -- the browser ---------------------------------------------------------------------------------
def test_a_wrong_key_shows_an_error_and_the_right_one_is_kept_for_the_tab(page: Page) -> None:
    page.driver.get(page.base)
    page.js("sessionStorage.clear()")
    page.driver.refresh()
    wait_for(page.asks_key, "the key form")
    page.one("#key-input").send_keys("sk-wrong", Keys.ENTER)
    banner = page.one("#banner")
    wait_for(lambda: banner.is_displayed() and "invalid or missing API key" in banner.text, "the error")
    assert page.asks_key() and "refused" in banner.text
    assert page.one("#new-chat").is_displayed() and page.one("#key-input").is_displayed()  # not blank
    page.shot("key-refused")
    page.one("#key-input").send_keys(KEY, Keys.ENTER)
    wait_for(page.ready, "the page to connect")
    assert not banner.is_displayed() and not page.asks_key()
    assert page.js("return sessionStorage.getItem('llmsession.apiKey')") == KEY
    page.driver.refresh()  # the tab keeps it: not asked again
    wait_for(page.ready, "the page to reconnect")
    assert not page.asks_key()


def test_a_reply_streams_in_and_shows_its_numbers(page: Page) -> None:
    page.new_chat(max_tokens=40)
    assert not page.by("#attach") and not page.by("#file-input")  # no projector: no image control
    page.type("Tell me about the sea.")
    ActionChains(page.driver).key_down(Keys.SHIFT).send_keys(Keys.ENTER).key_up(Keys.SHIFT).perform()
    page.type("Two sentences.")
    assert page.one("#input").get_attribute("value") == "Tell me about the sea.\nTwo sentences."
    assert not page.messages()  # Shift+Enter added a line, sent nothing
    before = page.ended()
    page.type(Keys.ENTER)
    seen: list[int] = []
    deadline = time.monotonic() + 60
    while page.ended() == before:
        assert time.monotonic() < deadline, "the reply did not end"
        length = len(page.reply_text().replace("…", ""))
        if not seen or length != seen[-1]:
            seen.append(length)
        time.sleep(0.01)
    final = len(page.reply_text())
    assert len([n for n in seen if 0 < n < final]) >= 2, (seen, final)  # it grew, piece by piece
    assert seen == sorted(seen)
    user = page.messages("user")[0].find_element(By.CSS_SELECTOR, ".body").text
    assert user == "Tell me about the sea.\nTwo sentences."
    stats = page.stats()
    assert float(stats["ttft"]) > 0 and float(stats["tps"]) > 0 and int(stats["completion"]) > 3
    assert int(stats["prompt"]) > 10 and stats["cached"].isdigit() and stats["finish"] in ("stop", "length")
    assert "tok/s" in page.one(".message:last-child .stats").text
    assert page.one("#title").text == "Tell me about the sea."
    page.shot("reply")


def test_a_follow_up_is_served_from_the_cache(page: Page) -> None:
    page.new_chat(max_tokens=60)
    first = page.send("Write a Python function that adds two numbers.")
    second = page.send("Now one that multiplies them.")
    assert int(second["cached"]) > 0, second
    assert int(first["prompt"]) <= int(second["cached"]) < int(second["prompt"]), (first, second)
    assert len(page.messages()) == 4
    page.shot("follow-up")  # (the README's: tests/data/chat-page.png)


def test_regenerate_and_edit_resend_the_history_up_to_them(page: Page) -> None:
    page.new_chat(max_tokens=12, temperature=1.0)
    first = page.send("Name a fruit.")
    page.send("Name a city.")
    regenerate = page.messages("assistant")[-1].find_element(By.CSS_SELECTOR, ".regenerate")
    regenerated = page.answered(regenerate.click)
    assert len(page.messages()) == 4 and int(regenerated["cached"]) > int(first["prompt"]), regenerated
    page.messages("user")[1].find_element(By.CSS_SELECTOR, ".edit").click()
    editor = page.one(".message[data-index='2'] .edit-input")
    editor.clear()
    edited = page.answered(lambda: editor.send_keys("Name a river.", Keys.ENTER))
    texts = [m.find_element(By.CSS_SELECTOR, ".body").text for m in page.messages("user")]
    assert texts == ["Name a fruit.", "Name a river."] and len(page.messages()) == 4
    assert int(edited["cached"]) >= int(first["prompt"]), edited  # only the edited turn decoded
    page.shot("edited")


@pytest.mark.parametrize("how", ["button", "escape"])
def test_stop_cancels_the_reply_and_the_servers_decode(page: Page, served: Served, how: str) -> None:
    page.new_chat(max_tokens=1500)
    cancelled = 'llmsession_replies_total{finish_reason="cancelled"}'
    generated = "llmsession_completion_tokens_total"
    before = served.metrics()
    page.type("Write a very long story about a dragon and a knight, with many chapters.", Keys.ENTER)
    wait_for(lambda: len(page.reply_text()) > 30, "some of the reply")
    assert page.one("#stop").is_displayed() and not page.one("#send").is_displayed()
    if how == "button":
        page.one("#stop").click()
    else:
        ActionChains(page.driver).send_keys(Keys.ESCAPE).perform()
    wait_for(lambda: not page.busy(), "the reply to stop", 10)
    stats = page.stats()
    assert stats["finish"] == "stopped" and "prompt" not in stats and float(stats["ttft"]) > 0  # (no usage)
    shown = page.reply_text()
    wait_for(lambda: metric(served.metrics(), cancelled) == metric(before, cancelled) + 1, "the cancel", 10)
    after = served.metrics()
    time.sleep(0.3)
    later = served.metrics()
    decoded = metric(after, generated) - metric(before, generated)
    assert 0 < decoded < 1500 and metric(later, generated) == metric(after, generated)  # it stopped
    wait_for(lambda: metric(served.metrics(), "llmsession_requests_in_flight") == 0, "nothing in flight", 10)
    assert page.reply_text() == shown and page.one("#send").is_displayed()
    if how == "button":
        page.shot("stopped")


def test_markup_in_a_schema_reply_shows_as_text(page: Page) -> None:
    page.new_chat(max_tokens=120, schema={"type": "string", "enum": [MARKUP]})
    stats = page.send("Say it.")
    assert stats["finish"] == "stop"
    shown = page.one(".message:last-child .code pre").text
    assert json.loads(shown) == MARKUP and MARKUP in page.one("#messages").text
    assert not page.by("#messages img, #messages script, #messages b")
    page.no_script_ran()


def test_stored_markup_renders_as_text(page: Page) -> None:
    """A conversation saved with markup everywhere (as a reply could hold it): all of it text."""
    page.new_chat()
    hostile = {
        "id": "hostile",
        "title": "<img src=x onerror=alert(2)>",
        "settings": {"system": "<script>window.pwned=2</script>"},
        "messages": [
            {"role": "user", "content": "<script>window.pwned=3</script>", "images": ["javascript:alert(3)"]},
            {
                "role": "assistant",
                "content": f"Before {MARKUP}\n```html\n<script>window.pwned=4</script>\n```\nafter <i>it</i>",
                "toolCalls": [{"id": "c", "name": "<b>tool</b>", "arguments": '{"a": "<script>x</script>"}'}],
                "stats": {"finish": "<img src=y onerror=alert(5)>", "promptTokens": 3, "cachedTokens": 1},
            },
        ],
    }
    page.js(
        "const s = JSON.parse(localStorage.getItem('llmsession.chat.v1'));"
        "s.conversations.unshift(arguments[0]); s.current = 'hostile';"
        "localStorage.setItem('llmsession.chat.v1', JSON.stringify(s));",
        hostile,
    )
    page.load()
    text = page.one("#messages").text
    for literal in ("<script>window.pwned=3</script>", MARKUP, "after <i>it</i>", "Tool call: <b>tool</b>"):
        assert literal in text
    assert page.one("#title").text == hostile["title"] and hostile["title"] in page.one("#conversations").text
    code = page.one(".message:last-child .code")
    assert code.find_element(By.CSS_SELECTOR, "pre").text == "<script>window.pwned=4</script>"
    assert "<img src=y onerror=alert(5)>" in page.one(".message:last-child .stats").text
    assert not page.by("#app img, #app script, #app b, #app i")
    code.find_element(By.CSS_SELECTOR, ".copy").click()
    wait_for(lambda: code.find_element(By.CSS_SELECTOR, ".copy").text == "Copied", "the copy button")
    pre = code.find_element(By.CSS_SELECTOR, "pre")
    font = page.js("return getComputedStyle(arguments[0]).fontFamily", pre)
    assert "mono" in font.lower(), font
    page.no_script_ran()
    page.shot("markup-as-text")


def test_a_json_schema_reply_is_shown_formatted(page: Page) -> None:
    page.new_chat(max_tokens=60, schema=PERSON)
    stats = page.send("Describe a person as JSON.")
    shown = page.one(".message:last-child .code pre").text
    jsonschema.validate(json.loads(shown), PERSON)
    assert shown.startswith("{\n  ") and stats["finish"] == "stop"
    page.shot("json-schema")
    page.one("#settings-toggle").click()  # the conversation's settings, as the request used them
    assert json.loads(page.one("#set-schema").get_attribute("value")) == PERSON
    page.shot("settings")
    page.one("#settings-toggle").click()
    assert not page.one("#settings").is_displayed()


def test_a_tool_call_shows_as_a_card_and_its_result_goes_back(page: Page) -> None:
    page.new_chat(max_tokens=120, tools=[WEATHER], tool_choice="required", parallel=False)
    stats = page.send("What is the weather in Paris?")
    card = page.one(".message:last-child .tool-call")
    assert stats["finish"] == "tool_calls" and card.find_element(By.CSS_SELECTOR, ".tool-name").text == (
        "Tool call: get_weather"
    )
    arguments = json.loads(card.find_element(By.CSS_SELECTOR, ".tool-args").text)
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])  # type: ignore[index]
    assert isinstance(arguments["city"], str)
    page.shot("tool-call")
    page.type("Never mind.", Keys.ENTER)  # (words after calls no result answers: the APIs refuse them)
    banner = wait_for(lambda: page.one("#banner").is_displayed() and page.one("#banner").text, "the banner")
    assert "results first" in banner and page.one("#input").get_attribute("value") == "Never mind."
    assert [m.get_attribute("data-role") for m in page.messages()] == ["user", "assistant"]
    assert not page.busy()
    page.one("#input").clear()
    page.settings(tool_choice="none")
    card.find_element(By.CSS_SELECTOR, ".tool-result").send_keys("Sunny, 21 C")
    page.answered(page.one(".message:last-child .send-results").click)
    roles = [m.get_attribute("data-role") for m in page.messages()]
    assert roles == ["user", "assistant", "tool", "assistant"], roles
    assert page.stats()["finish"] in ("stop", "length")
    assert "Sunny, 21 C" in page.messages("tool")[0].text and not page.by(".tool-result, .send-results")


def test_a_message_after_a_failed_reply_joins_the_one_no_reply_answered(page: Page) -> None:
    """A reply refused (a pattern the server does not check) is dropped when the next message
    goes out: that message joins the one no reply answered, so the roles alternate (two user
    messages in a row were sent, which the templates that require turns to alternate refuse)."""
    page.new_chat(schema=json.dumps({"type": "string", "pattern": "(?=a)"}))
    before = page.ended()
    page.type("Hi.", Keys.ENTER)
    wait_for(lambda: page.ended() > before, "the refused reply to end")
    assert page.by("#messages .message:last-child .error")
    page.settings(schema="")
    page.js("window.sent = []; const f = window.fetch; window.fetch = (u, o) => "
            "(window.sent.push(o && o.body), f(u, o));")  # fmt: skip
    page.send("Hello?")
    (body,) = [json.loads(b) for b in page.js("return window.sent") if b]
    assert body["messages"] == [{"role": "user", "content": "Hi.\n\nHello?"}], body["messages"]
    assert [m.get_attribute("data-role") for m in page.messages()] == ["user", "assistant"]


def test_conversations_are_kept_across_a_reload(page: Page) -> None:
    page.new_chat(max_tokens=4)
    page.send("Say hello.")
    talked = page.one("#conversations .conversation.active").get_attribute("data-id")
    page.new_chat()
    count = len(page.by("#conversations .conversation"))
    page.one("#new-chat").click()  # an empty chat is not doubled
    assert len(page.by("#conversations .conversation")) == count
    page.by("#conversations .conversation")[0].find_element(By.CSS_SELECTOR, ".rename").click()
    rename = page.one("#conversations .rename-input")
    rename.send_keys("Renamed chat", Keys.ENTER)  # (it opens with the old title selected)
    assert page.by("#conversations .open")[0].text == "Renamed chat" == page.one("#title").text
    page.new_chat()
    assert len(page.by("#conversations .conversation")) == count + 1
    doomed = page.one("#conversations .conversation.active")  # the new, empty one
    doomed_id = doomed.get_attribute("data-id")
    doomed.find_element(By.CSS_SELECTOR, ".delete").click()
    page.driver.switch_to.alert.accept()
    titles = [e.text for e in page.by("#conversations .open")]
    ids = [e.get_attribute("data-id") for e in page.by("#conversations .conversation")]
    assert doomed_id not in ids and talked in ids and len(ids) == count
    page.one(f"#conversations .conversation[data-id='{talked}'] .open").click()  # the one with messages
    shown = page.one("#messages").text
    assert shown
    page.load()
    assert not page.asks_key()
    assert [e.text for e in page.by("#conversations .open")] == titles
    assert [e.get_attribute("data-id") for e in page.by("#conversations .conversation")] == ids
    assert page.one("#messages").text == shown


def test_an_image_goes_to_a_server_with_a_projector(
    driver: WebDriver, vision_served: Served, shots: Path, fixture_path: Callable[[str], Path]
) -> None:
    page = Page(driver, vision_served.url.removesuffix("v1"), shots)
    page.new_chat(max_tokens=8)
    assert page.one("#attach").is_displayed()
    page.one("#file-input").send_keys(str(fixture_path("image-red.png")))  # the file picker
    wait_for(lambda: len(page.by("#attachments img")) == 1, "the picked image")
    blue = base64.b64encode(fixture_path("image-blue.png").read_bytes()).decode()
    page.js(  # a file dropped on the page
        "const bytes = Uint8Array.from(atob(arguments[0]), c => c.charCodeAt(0));"
        "const data = new DataTransfer(); data.items.add(new File([bytes], 'blue.png', {type: 'image/png'}));"
        "for (const type of ['dragenter', 'dragover', 'drop'])"
        "  document.getElementById('messages').dispatchEvent("
        "    new DragEvent(type, {bubbles: true, cancelable: true, dataTransfer: data}));",
        blue,
    )
    wait_for(lambda: len(page.by("#attachments img")) == 2, "the dropped image")
    page.shot("images-attached")
    question = "What colors are these?"
    stats = page.send(question)
    assert len(page.by(".message[data-role=user] .images img")) == 2 and not page.by("#attachments img")
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": 1, "temperature": 0}
    with vision_served.http(None) as http:
        text_only = http.post("/v1/chat/completions", json=body).json()["usage"]["prompt_tokens"]
    assert int(stats["prompt"]) > text_only, (stats, text_only)  # the images were in the prompt
    page.shot("image-reply")
    # Each turn sends the chat's images again: past what a request carries, the next turn would
    # be refused, and every one after it. The page takes no more than fit, and says why; two
    # drops at once (each reads the room before the other's files load) are caught at sending.
    drop = (
        "const bytes = Uint8Array.from(atob(arguments[0]), c => c.charCodeAt(0));"
        "for (let drop = 0; drop < arguments[1]; drop++) {"
        "  const data = new DataTransfer();"
        "  for (let i = 0; i < 7; i++)"
        "    data.items.add(new File([bytes], `blue${i}.png`, {type: 'image/png'}));"
        "  for (const type of ['dragenter', 'dragover', 'drop'])"
        "    document.getElementById('messages').dispatchEvent("
        "      new DragEvent(type, {bubbles: true, cancelable: true, dataTransfer: data}));"
        "}"
    )
    page.js(drop, blue, 2)
    wait_for(lambda: len(page.by("#attachments img")) == 2 * (MAX_IMAGES - 2), "both drops' images")
    assert f"at most {MAX_IMAGES} images" in page.one("#banner").text
    page.one("#input").send_keys("And these?")
    page.one("#send").click()
    wait_for(lambda: "remove some" in page.one("#banner").text, "the turn held back")
    assert len(page.by(".message[data-role=user]")) == 1  # (nothing sent)
    page.js("arguments[0].forEach(() => document.querySelector('#attachments button').click())", [0] * 6)
    assert len(page.by("#attachments img")) == MAX_IMAGES - 2
    stats = page.send("")
    assert len(page.by(".message[data-role=user] .images img")) == MAX_IMAGES  # (answered: not refused)


@pytest.fixture(scope="module")
def thinking_served(smollm2_path: Path) -> Iterator[Served]:
    """SmolLM2 under DeepSeek R1's template, served thinking (the page asks for no effort):
    every reply opens with its reasoning."""
    template = Path(__file__).parent / "data" / "templates" / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja"
    with Model(smollm2_path, chat_template=template.read_text(encoding="utf-8"), threads=2) as model:
        app = create_app(model, session=SessionConfig(thinking=True))
        with running(app) as url:
            yield Served(model, url, app.state.server.model_name, app.state.server, key=None)


def test_a_replys_reasoning_is_shown_apart_and_not_sent_back(
    driver: WebDriver, thinking_served: Served, shots: Path
) -> None:
    """The reasoning a thinking template splits off streams into its own block above the text
    (it was dropped: a reply all reasoning showed "…" and no first token), and the next turn's
    request carries the reply's text only."""
    page = Page(driver, thinking_served.url.removesuffix("v1"), shots)
    page.new_chat(max_tokens=16)
    stats = page.send("Why is the sky blue?")
    block = page.one("#messages .message:last-child .reasoning .muted").text
    text = page.js("return [...document.querySelectorAll('#messages .message:last-child .body .text')]"
                   ".map((t) => t.textContent).join('')")  # fmt: skip
    assert block.strip() and block not in text and "ttft" in stats, (block, text, stats)
    page.js("window.sent = []; const f = window.fetch; window.fetch = (u, o) => "
            "(window.sent.push(o && o.body), f(u, o));")  # fmt: skip
    page.send("And at sunset?")
    (body,) = [json.loads(b) for b in page.js("return window.sent") if b]
    first = body["messages"][1]
    assert first["role"] == "assistant" and set(first) == {"role", "content"}, first


@pytest.fixture(scope="module")
def models_served(
    smollm2_path: Path, gemma3_path: Path, fixture_path: Callable[[str], Path]
) -> Iterator[tuple[Models, str]]:
    with three_models(smollm2_path, gemma3_path, fixture_path("bert-tiny.gguf")) as served:
        yield served


def test_a_server_of_several_models_gets_a_picker_and_the_picked_one_loads(
    driver: WebDriver, models_served: tuple[Models, str], shots: Path
) -> None:
    models, url = models_served
    models.load("bert")  # (once loaded, it says it embeds: the picker leaves it out)
    page = Page(driver, url.removesuffix("v1"), shots)
    page.new_chat(max_tokens=4)
    options = [(o.get_attribute("value"), o.text) for o in page.by("#model-picker option")]
    assert options == [("smol", "smol (unloaded)"), ("gemma", "gemma (unloaded)")]
    assert page.one("#model-picker").is_displayed() and not page.by("#attach")
    page.js("const p = document.getElementById('model-picker'); p.value = 'gemma';"
            "p.dispatchEvent(new Event('change'));")  # fmt: skip
    page.send("Hi.")
    assert page.js("return document.body.dataset.loaded") == "gemma"  # (it showed the load)
    wait_for(lambda: page.one("#model-picker option[value=gemma]").text == "gemma (loaded)", "the new state")
    assert page.one("#model-name").text == "model: gemma" and page.reply_text()
    assert [s.name for s in models.status() if s.loaded] == ["gemma"]
    page.shot("model-picker")


def test_the_readme_screenshot_is_small() -> None:
    data = README_SHOT.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) < 150_000
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (WIDTH, HEIGHT)
