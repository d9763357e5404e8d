//! A small HTTP/1.1 client for the tests (the console, the probes,
//! chromedriver): one request per connection, `Content-Length` or chunked
//! bodies. A few dozen lines instead of an HTTP client crate.

use std::{
    io::{BufRead, BufReader, Write},
    net::TcpStream,
    time::Duration,
};

/// An answer: status, headers (names lower-case), body.
#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Response {
    /// The first header `name` (lower-case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// `name=value` of the cookie this answer sets, if it sets `name`.
    pub fn cookie(&self, name: &str) -> Option<String> {
        self.headers
            .iter()
            .filter(|(n, _)| n == "set-cookie")
            .filter_map(|(_, v)| v.split(';').next())
            .find(|pair| pair.split_once('=').is_some_and(|(n, _)| n == name))
            .map(str::to_string)
    }
}

/// One request to `127.0.0.1:port`; `Err` when nothing answers.
pub fn request(
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<(&str, &[u8])>,
) -> std::io::Result<Response> {
    let mut stream = TcpStream::connect(("127.0.0.1", port))?;
    stream.set_read_timeout(Some(Duration::from_secs(60)))?;
    let mut head =
        format!("{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n");
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    if let Some((content_type, bytes)) = body {
        head.push_str(&format!(
            "Content-Type: {content_type}\r\nContent-Length: {}\r\n",
            bytes.len()
        ));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes())?;
    if let Some((_, bytes)) = body {
        stream.write_all(bytes)?;
    }
    read_response(&mut BufReader::new(stream))
}

fn read_response(reader: &mut impl BufRead) -> std::io::Result<Response> {
    let bad = |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_string());
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| bad(&format!("no status line: {line:?}")))?;
    let mut headers = Vec::new();
    loop {
        line.clear();
        reader.read_line(&mut line)?;
        let text = line.trim_end();
        if text.is_empty() {
            break;
        }
        if let Some((name, value)) = text.split_once(':') {
            headers.push((name.trim().to_ascii_lowercase(), value.trim().to_string()));
        }
    }
    let find = |name: &str| {
        headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.clone())
    };
    let mut body = Vec::new();
    if find("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked")) {
        loop {
            line.clear();
            reader.read_line(&mut line)?;
            let size = usize::from_str_radix(line.trim().split(';').next().unwrap_or(""), 16)
                .map_err(|_| bad("chunk size"))?;
            if size == 0 {
                break;
            }
            let mut chunk = vec![0; size + 2];
            reader.read_exact(&mut chunk)?;
            body.extend_from_slice(&chunk[..size]);
        }
    } else if let Some(length) = find("content-length").and_then(|v| v.parse::<usize>().ok()) {
        body.resize(length, 0);
        reader.read_exact(&mut body)?;
    } else {
        reader.read_to_end(&mut body)?;
    }
    Ok(Response {
        status,
        headers,
        body: String::from_utf8_lossy(&body).into_owned(),
    })
}

/// `GET path`, with the cookie if one is given; panics when nothing answers.
pub fn get(port: u16, path: &str, cookie: Option<&str>) -> Response {
    try_get(port, path, cookie).unwrap_or_else(|e| panic!("GET {path}: {e}"))
}

/// `GET path`, with the cookie if one is given; `Err` when nothing answers
/// (yet, or any more) or the answer breaks off: for a test that polls.
pub fn try_get(port: u16, path: &str, cookie: Option<&str>) -> std::io::Result<Response> {
    let headers: Vec<(&str, &str)> = cookie.map(|c| ("Cookie", c)).into_iter().collect();
    request(port, "GET", path, &headers, None)
}

/// `POST path` of a form, with the cookie and extra headers given.
pub fn post_form(
    port: u16,
    path: &str,
    cookie: Option<&str>,
    extra: &[(&str, &str)],
    form: &[(&str, &str)],
) -> Response {
    let body = form
        .iter()
        .map(|(k, v)| format!("{}={}", encode(k), encode(v)))
        .collect::<Vec<_>>()
        .join("&");
    let mut headers: Vec<(&str, &str)> = cookie.map(|c| ("Cookie", c)).into_iter().collect();
    headers.extend_from_slice(extra);
    request(
        port,
        "POST",
        path,
        &headers,
        Some(("application/x-www-form-urlencoded", body.as_bytes())),
    )
    .unwrap_or_else(|e| panic!("POST {path}: {e}"))
}

/// Percent-encodes everything but the unreserved characters.
pub fn encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}
