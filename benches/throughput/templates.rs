//! Templates in the database (DESIGN §15), `--templates`: the drain of a
//! burst of order confirmations (a non-ASCII subject, text and HTML, ten
//! line items) rendered by the daemon from `mail_template` against the same
//! mails inserted pre-rendered, in pairs, the order alternating from run to
//! run: what rendering at send time costs. The pre-rendered bodies are the
//! template's own output, rendered here by the daemon's code.

use tablemail::{
    store::TemplateRow,
    templates::{Catalog, Request},
};

use super::{line, paired, paired_report, spread, Drain, Setup, Shape, Side};

pub(super) const SUBJECT: &str = "Ihre Bestellung wurde bestätigt – Nr. {{ number }}";

pub(super) const TEXT: &str = "Sehr geehrte{{ ' Frau' if salutation == 'f' else 'r Herr' }} {{ name }},

vielen Dank für Ihre Bestellung bei {{ shop }}. Wir haben Ihre Zahlung erhalten und bereiten den Versand Ihrer Artikel vor; sobald das Paket unser Lager verlässt, erhalten Sie eine weitere Nachricht mit der Sendungsnummer.

{% for item in items %}{{ item.qty }} × {{ item.title }} ............ {{ item.price }} €
{% endfor %}
Summe: {{ total }} €

Mit freundlichen Grüßen
Ihr Kundenservice
";

pub(super) const HTML: &str = "<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>Bestellbestätigung</title></head>\
<body style=\"font-family: Helvetica, Arial, sans-serif; color: #222; background: #fff\">\
<table width=\"100%\" cellpadding=\"0\" cellspacing=\"0\"><tr><td>\
<p>Sehr geehrte{{ ' Frau' if salutation == 'f' else 'r Herr' }} {{ name }},</p><p>vielen Dank für Ihre Bestellung bei {{ shop }}. \
Wir haben Ihre Zahlung erhalten und bereiten den Versand Ihrer Artikel vor.</p><table>\
{% for item in items %}<tr><td style=\"padding: 4px 8px\">{{ item.qty }} × {{ item.title }}</td><td align=\"right\">{{ item.price }} €</td></tr>{% endfor %}\
<tr><td><b>Summe</b></td><td align=\"right\"><b>{{ total }} €</b></td></tr></table>\
<p>Mit freundlichen Grüßen<br>Ihr Kundenservice</p></td></tr></table></body></html>";

/// Every mail's data but its number, as the JSON object's text after
/// `{"number": N, `.
pub(super) fn data_rest() -> String {
    let titles = [
        "Roggenbrot „Schwarzwälder“ (750 g)",
        "Dinkelvollkornbrötchen",
        "Laugenbrezel",
        "Apfelstrudel mit Sahne",
        "Käsekuchen „Omas Art“",
        "Baguette aus Steinofen",
        "Brötchen-Mischung (6 Stück)",
        "Quarkbällchen",
        "Nusszopf",
        "Früchtebrot",
    ];
    let items: Vec<serde_json::Value> = titles
        .iter()
        .enumerate()
        .map(|(i, t)| serde_json::json!({"qty": 1 + i % 3, "title": t, "price": format!("{},{:02}", 2 + i, 5 * i % 100)}))
        .collect();
    let rest = serde_json::json!({
        "salutation": "f",
        "name": "Müller",
        "shop": "Bäckerei Größenwahn & Söhne",
        "items": items,
        "total": "81,45",
    });
    let text = rest.to_string();
    text[1..].to_string()
}

/// The template as `mail_template` holds it.
pub(super) fn row() -> TemplateRow {
    TemplateRow {
        name: "order".into(),
        locale: String::new(),
        subject: SUBJECT.into(),
        body: Some(TEXT.into()),
        body_html: Some(HTML.into()),
        updated_at: chrono::Utc::now(),
    }
}

/// (subject prefix, text, HTML) of mail `number`, as the daemon renders
/// them: the subject without its number.
pub(super) fn rendered() -> (String, String, String) {
    let data = format!("{{\"number\": 1, {}", data_rest());
    let r = Catalog::from_rows(&[row()])
        .render(&Request {
            name: "order",
            locale: None,
            data: Some(&data),
            subject: true,
            text: true,
            html: true,
            max_output: u64::MAX,
        })
        .expect("the bench template renders");
    let subject = r.subject.unwrap_or_default();
    let prefix = subject
        .trim_end_matches(" 1")
        .trim_end_matches('1')
        .trim_end();
    (
        prefix.to_string(),
        r.text.unwrap_or_default(),
        r.html.unwrap_or_default(),
    )
}

/// (pre-rendered, templated), one pair per run.
pub(super) async fn cost(setup: &Setup<'_>, mails: usize, runs: usize) -> Vec<(Drain, Drain)> {
    paired(
        Side {
            name: "pre-rendered",
            setup,
            shape: Shape::Order,
        },
        Side {
            name: "templated",
            setup,
            shape: Shape::OrderTemplated,
        },
        mails,
        runs,
    )
    .await
}

pub(super) fn report(pairs: &[(Drain, Drain)]) {
    let of = |f: &dyn Fn(&(Drain, Drain)) -> f64| pairs.iter().map(f).collect::<Vec<f64>>();
    paired_report(
        "templates: order confirmations (ten items, text + HTML) rendered at send time against pre-rendered",
        "templated / pre-rendered",
        pairs,
    );
    line("  pre-rendered", spread(of(&|p| p.0.rate), "/s", 0));
    line("  templated", spread(of(&|p| p.1.rate), "/s", 0));
}
