use chrono::{TimeZone, Utc};
use proptest::prelude::*;

use super::*;

fn row(name: &str, locale: &str, subject: &str, text: &str, html: &str) -> TemplateRow {
    TemplateRow {
        name: name.into(),
        locale: locale.into(),
        subject: subject.into(),
        body: (!text.is_empty()).then(|| text.into()),
        body_html: (!html.is_empty()).then(|| html.into()),
        updated_at: Utc.timestamp_opt(1_700_000_000, 0).unwrap(),
    }
}

fn request<'a>(name: &'a str, locale: &'a str, data: &'a str) -> Request<'a> {
    Request {
        name,
        locale: Some(locale),
        data: Some(data),
        subject: true,
        text: true,
        html: true,
        max_output: 1 << 20,
    }
}

#[test]
fn locales_fall_back_to_the_language_then_the_default() {
    assert_eq!(
        locale_chain("de-AT").collect::<Vec<_>>(),
        ["de-AT", "de", ""]
    );
    assert_eq!(
        locale_chain("zh-Hant-TW").collect::<Vec<_>>(),
        ["zh-Hant-TW", "zh-Hant", "zh", ""]
    );
    assert_eq!(locale_chain("").collect::<Vec<_>>(), [""]);
    let catalog = Catalog::from_rows(&[
        row("order", "", "Order {{ n }}", "", ""),
        row("order", "de", "Bestellung {{ n }}", "", ""),
    ]);
    for (wanted, subject) in [
        ("de-AT", "Bestellung 7"),
        ("de", "Bestellung 7"),
        ("fr", "Order 7"),
        ("", "Order 7"),
    ] {
        let r = catalog
            .render(&request("order", wanted, r#"{"n": 7}"#))
            .unwrap();
        assert_eq!(r.subject.as_deref(), Some(subject), "{wanted}");
    }
}

#[test]
fn html_is_escaped_and_text_is_not() {
    let catalog = Catalog::from_rows(&[row(
        "t",
        "",
        "Hi {{ name }}\n",
        "Hello {{ name }}",
        "<p>Hello {{ name }}</p>",
    )]);
    let r = catalog
        .render(&request("t", "", r#"{"name": "<Tom & Jerry>"}"#))
        .unwrap();
    assert_eq!(r.subject.as_deref(), Some("Hi <Tom & Jerry>"));
    assert_eq!(r.text.as_deref(), Some("Hello <Tom & Jerry>"));
    assert_eq!(
        r.html.as_deref(),
        Some("<p>Hello &lt;Tom &amp; Jerry&gt;</p>")
    );
}

#[test]
fn failures_name_the_template_and_the_reason() {
    let catalog = Catalog::from_rows(&[
        row("t", "", "{{ missing }}", "", ""),
        row(
            "loop",
            "",
            "",
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
            "",
        ),
        row(
            "big",
            "",
            "",
            "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
            "",
        ),
        row("file", "", "", "{% include '/etc/passwd' %}", ""),
        row("broken", "", "{% if %}", "", ""),
        row(
            "deep",
            "",
            "",
            "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
            "",
        ),
    ]);
    let err = |name: &str| {
        let mut r = request(name, "", "{}");
        r.max_output = 100_000;
        catalog.render(&r).unwrap_err().to_string()
    };
    let e = err("t");
    assert!(
        e.contains("\"t\"") && e.contains("`missing` is undefined"),
        "{e}"
    );
    let e = err("loop");
    assert!(e.contains("fuel"), "{e}");
    let e = err("big");
    assert!(e.contains("max_message_size"), "{e}");
    let e = err("file");
    assert!(e.contains("\"/etc/passwd\" does not exist"), "{e}");
    let e = err("broken");
    assert!(e.contains("syntax error"), "{e}");
    let e = err("deep");
    assert!(e.contains("recursion"), "{e}");
    let e = err("nothing");
    assert!(e.contains("\"nothing\" does not exist"), "{e}");
    let e = catalog
        .render(&request("t", "", "[1]"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("not a JSON object"), "{e}");
}

#[test]
fn includes_reach_templates_of_the_table_in_the_same_part_and_locale() {
    let catalog = Catalog::from_rows(&[
        row("footer", "", "", "-- {{ shop }}", "<i>{{ shop }}</i>"),
        row("footer", "de", "", "-- Ihr {{ shop }}", ""),
        row(
            "order",
            "de",
            "",
            "Danke\n{% include 'footer' %}",
            "<b>x</b>{% include 'footer' %}",
        ),
    ]);
    let r = catalog
        .render(&request("order", "de-AT", r#"{"shop": "A&B"}"#))
        .unwrap();
    assert_eq!(r.text.as_deref(), Some("Danke\n-- Ihr A&B"));
    // The German footer has no HTML: the default one's is taken.
    assert_eq!(r.html.as_deref(), Some("<b>x</b><i>A&amp;B</i>"));
    assert_eq!(r.locale, "de");
}

#[test]
fn an_update_recompiles_only_what_changed() {
    let mut catalog = Catalog::from_rows(&[row("a", "", "A1", "", ""), row("b", "", "B1", "", "")]);
    let mut a2 = row("a", "", "A2", "", "");
    a2.updated_at = Utc.timestamp_opt(1_700_000_001, 0).unwrap();
    assert_eq!(catalog.update(&[a2, row("b", "", "B1", "", "")]), 1);
    let r = catalog.render(&request("a", "", "{}")).unwrap();
    assert_eq!(r.subject.as_deref(), Some("A2"));
    assert_eq!(catalog.update(&[]), 0);
    assert!(catalog.render(&request("a", "", "{}")).is_err());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Whatever text a template holds and whatever data comes with it,
    /// rendering ends with output or an error, never a panic.
    #[test]
    fn rendering_any_template_text_never_panics(
        source in "(\\{\\{|\\}\\}|\\{%|%\\}|\\{#|#\\}|for |in |if |endfor|endif|include |macro |set |range\\(|\\)|\\(|'|\"|x|y|\\||~|\\*|-|1|9|\\.|,|=| |\n|<|&|\u{e9}){0,40}",
        data in "(\\{|\\}|\"x\"|:|1|\\[|\\]|,|\"y\"|null){0,12}",
    ) {
        let catalog = Catalog::from_rows(&[
            row("t", "", &source, &source, &source),
            row("x", "", &source, &source, &source),
        ]);
        let mut r = request("t", "", &data);
        r.max_output = 64 * 1024;
        let _ = catalog.render(&r);
        let _ = catalog.render(&request("t", "", "{\"x\": [1, 2], \"y\": \"<a>\"}"));
    }
}
