//! Headless Chromium driven through chromedriver's WebDriver HTTP API
//! (W3C WebDriver: a few JSON requests), for the console's browser tests.
//! Debian's `chromium` and `chromium-driver`; scripts/test installs them.
//! Missing, they skip the test, except under CI=true where that fails it.

use std::{
    path::Path,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use serde_json::{json, Value};

use super::{free_port, http, tool, TempDir};

/// How W3C WebDriver names an element in its JSON.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// A browser session; the browser and chromedriver go when it is dropped.
pub struct Browser {
    driver: Child,
    port: u16,
    session: String,
    _profile: TempDir,
}

/// An element of the current page.
#[derive(Debug, Clone)]
pub struct Element(String);

impl Browser {
    /// Starts chromedriver and a headless Chromium; `None` when they are
    /// not installed (a failure under CI=true).
    pub fn start() -> Option<Browser> {
        let chromium = ["chromium", "chromium-browser"]
            .iter()
            .find_map(|name| which(name))
            .or_else(|| tool("chromium"))?;
        let chromedriver = tool("chromedriver")?;
        let port = free_port();
        let driver = Command::new(chromedriver)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start chromedriver");
        let profile = TempDir::new();
        let mut browser = Browser {
            driver,
            port,
            session: String::new(),
            _profile: profile,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let ready = http::request(port, "GET", "/status", &[], None)
                .ok()
                .and_then(|r| serde_json::from_str::<Value>(&r.body).ok())
                .is_some_and(|v| v["value"]["ready"] == true);
            if ready {
                break;
            }
            assert!(Instant::now() < deadline, "chromedriver did not get ready");
            std::thread::sleep(Duration::from_millis(50));
        }
        let profile_dir = browser._profile.path().display().to_string();
        let created = browser.call(
            "POST",
            "/session",
            Some(json!({"capabilities": {"alwaysMatch": {
                "browserName": "chrome",
                "goog:chromeOptions": {
                    "binary": chromium,
                    "args": [
                        "--headless", "--no-sandbox", "--disable-gpu",
                        "--disable-dev-shm-usage", "--disable-background-networking",
                        "--disable-component-update", "--disable-sync", "--no-first-run",
                        "--window-size=1280,1000", "--hide-scrollbars",
                        format!("--user-data-dir={profile_dir}"),
                    ],
                },
            }}})),
        );
        browser.session = created["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("no session: {created}"))
            .to_string();
        Some(browser)
    }

    /// One WebDriver command; its `value`. Panics on an error answer.
    fn call(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        let text = body.map(|b| b.to_string());
        let answer = http::request(
            self.port,
            method,
            path,
            &[],
            text.as_deref()
                .map(|t| ("application/json; charset=utf-8", t.as_bytes())),
        )
        .unwrap_or_else(|e| panic!("chromedriver {method} {path}: {e}"));
        let value: Value = serde_json::from_str(&answer.body)
            .unwrap_or_else(|e| panic!("chromedriver {method} {path}: {e}: {}", answer.body));
        assert!(
            answer.status == 200,
            "chromedriver {method} {path}: {} {}",
            answer.status,
            answer.body
        );
        value["value"].clone()
    }

    fn session_call(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        self.call(method, &format!("/session/{}{path}", self.session), body)
    }

    /// Opens `url` and waits for the page to load.
    pub fn goto(&self, url: &str) {
        self.session_call("POST", "/url", Some(json!({ "url": url })));
    }

    /// The current page's address.
    pub fn url(&self) -> String {
        self.session_call("GET", "/url", None)
            .as_str()
            .unwrap_or_default()
            .to_string()
    }

    /// Waits (up to 10 s) until the current address satisfies `check`: a
    /// click that submits a form returns before the next page is there.
    pub fn wait_for_url(&self, what: &str, check: impl Fn(&str) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let url = self.url();
            if check(&url) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the browser never reached {what}: at {url}\n{}",
                self.source()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The first element that `css` selects (panics if there is none).
    pub fn find(&self, css: &str) -> Element {
        let found = self.session_call(
            "POST",
            "/element",
            Some(json!({"using": "css selector", "value": css})),
        );
        Element(
            found[ELEMENT]
                .as_str()
                .unwrap_or_else(|| panic!("no element {css}: {found}"))
                .to_string(),
        )
    }

    /// Every element that `css` selects.
    pub fn find_all(&self, css: &str) -> Vec<Element> {
        let found = self.session_call(
            "POST",
            "/elements",
            Some(json!({"using": "css selector", "value": css})),
        );
        found
            .as_array()
            .map(|all| {
                all.iter()
                    .filter_map(|e| e[ELEMENT].as_str())
                    .map(|id| Element(id.to_string()))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The visible text of an element.
    pub fn text(&self, element: &Element) -> String {
        self.session_call("GET", &format!("/element/{}/text", element.0), None)
            .as_str()
            .unwrap_or_default()
            .to_string()
    }

    /// An attribute of an element.
    pub fn attribute(&self, element: &Element, name: &str) -> Option<String> {
        self.session_call(
            "GET",
            &format!("/element/{}/attribute/{name}", element.0),
            None,
        )
        .as_str()
        .map(str::to_string)
    }

    /// Types `text` into an input (after clearing it).
    pub fn type_into(&self, element: &Element, text: &str) {
        self.session_call(
            "POST",
            &format!("/element/{}/clear", element.0),
            Some(json!({})),
        );
        self.session_call(
            "POST",
            &format!("/element/{}/value", element.0),
            Some(json!({ "text": text })),
        );
    }

    pub fn click(&self, element: &Element) {
        self.session_call(
            "POST",
            &format!("/element/{}/click", element.0),
            Some(json!({})),
        );
    }

    /// The page's HTML as the browser has it.
    pub fn source(&self) -> String {
        self.session_call("GET", "/source", None)
            .as_str()
            .unwrap_or_default()
            .to_string()
    }

    /// Resizes the window (the screenshot's size).
    pub fn resize(&self, width: u32, height: u32) {
        self.session_call(
            "POST",
            "/window/rect",
            Some(json!({"width": width, "height": height})),
        );
    }

    /// Writes a PNG of the window to `path`.
    pub fn screenshot(&self, path: &Path) {
        use base64::Engine as _;
        let png = self.session_call("GET", "/screenshot", None);
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(png.as_str().expect("base64 PNG"))
            .expect("a PNG");
        assert!(bytes.starts_with(b"\x89PNG"), "not a PNG");
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).unwrap();
        }
        std::fs::write(path, bytes).unwrap();
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        if !self.session.is_empty() {
            let _ = http::request(
                self.port,
                "DELETE",
                &format!("/session/{}", self.session),
                &[],
                None,
            );
        }
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

/// The path of a command, if it is installed (no skip, no failure).
fn which(name: &str) -> Option<String> {
    Command::new("sh")
        .args(["-c", &format!("command -v {name}")])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
}
