//! The overview (with the reports of the last day by kind) and the failures
//! of the last hour: from the snapshot, no query per request.

use super::*;

struct CountRow {
    status: &'static str,
    count: i64,
}

/// Reports of one kind within the snapshot's window: a count, never an
/// address.
struct FeedbackRow {
    kind: &'static str,
    count: i64,
}

struct DaemonView {
    host: String,
    pid: i32,
    version: String,
    started: String,
    last_seen: String,
    in_flight: i32,
    sent: i64,
    silent: bool,
}

struct GroupView {
    label: String,
    outcome: String,
    count: i64,
    example: String,
    /// It ended mails (failed, unknown, stale), rather than put them off.
    final_outcome: bool,
}

struct FailureView {
    id: i64,
    status: String,
    at: String,
    error: String,
}

/// A route's relay on the overview.
struct RouteRow {
    label: String,
    trouble: Option<String>,
    active: &'static str,
    has_fallback: bool,
}

/// A send cap's use (DESIGN §16), as the daemon last read it.
struct CapRow {
    name: String,
    used: u64,
    max: u64,
    /// `ok`, `near` (90% or more) or `reached`.
    state: &'static str,
}

#[derive(Template)]
#[template(path = "overview.html", config = "src/http/askama.toml")]
struct OverviewPage {
    layout: Layout,
    healthy: bool,
    health: Vec<String>,
    database_ok: bool,
    database_error: String,
    /// `read 3s ago`, or empty before the first answer.
    figures_age: String,
    has_figures: bool,
    counts: Vec<CountRow>,
    total: i64,
    oldest_due: String,
    stale_locks: i64,
    rates: [String; 3],
    relay_trouble: Option<String>,
    /// Each route but the default, when there are any (DESIGN §13).
    routes: Vec<RouteRow>,
    /// Each send cap, when there are any.
    caps: Vec<CapRow>,
    relay_active: &'static str,
    has_fallback: bool,
    redirect: Option<String>,
    file_transport: bool,
    chart: Chart,
    daemons: Vec<DaemonView>,
    groups: Vec<GroupView>,
    recent: Vec<FailureView>,
    feedback: Vec<FeedbackRow>,
    feedback_total: i64,
    /// The same reports by where they came from (smtp, ingest, webhook).
    feedback_sources: Vec<FeedbackRow>,
}

fn group_views(snapshot: &Snapshot) -> Vec<GroupView> {
    let Some(figures) = &snapshot.figures else {
        return Vec::new();
    };
    figures
        .failures
        .iter()
        .map(|g| GroupView {
            label: failure_label(g.stage.as_deref(), g.smtp_code),
            outcome: g.outcome.clone(),
            count: g.count,
            example: redacted(&g.example),
            final_outcome: g.ended_the_mail(),
        })
        .collect()
}

pub(super) async fn overview(State(console): State<Arc<Console>>, headers: HeaderMap) -> Response {
    let session = console.auth.session(&headers);
    let observed = &console.observed;
    let snapshot = observed.snapshots.latest().await;
    let database_ok = snapshot.database_ok();
    let (healthy, health) = crate::metrics::health(&observed.metrics, database_ok);
    let figures = snapshot.figures.clone();
    let stats = figures
        .as_ref()
        .map(|f| f.stats.clone())
        .unwrap_or_default();
    let counts: Vec<CountRow> = STATUSES
        .iter()
        .map(|status| CountRow {
            status,
            count: stats.count(status),
        })
        .collect();
    // Every kind, in a fixed order, those without reports as 0.
    let feedback: Vec<FeedbackRow> = FeedbackKind::ALL
        .iter()
        .map(|kind| FeedbackRow {
            kind: kind.as_str(),
            count: figures
                .as_ref()
                .map(|f| f.feedback_count(kind.as_str()))
                .unwrap_or_default(),
        })
        .collect();
    let feedback_sources: Vec<FeedbackRow> = FeedbackSource::ALL
        .iter()
        .map(|source| FeedbackRow {
            kind: source.as_str(),
            count: figures
                .as_ref()
                .map(|f| f.feedback_from(source.as_str()))
                .unwrap_or_default(),
        })
        .collect();
    let transport = &observed.transport;
    let page = OverviewPage {
        layout: console.layout("overview", session.as_ref()),
        healthy,
        health: health.lines().map(str::to_string).collect(),
        database_ok,
        database_error: snapshot.error.clone().unwrap_or_default(),
        figures_age: snapshot
            .age()
            .map(|a| age(a.as_secs_f64()))
            .unwrap_or_default(),
        has_figures: figures.is_some(),
        total: counts.iter().map(|c| c.count).sum(),
        counts,
        oldest_due: match stats.oldest_due_age_seconds {
            Some(seconds) => age(seconds),
            None => "nothing due".into(),
        },
        stale_locks: stats.stale_locks,
        rates: [
            format!("{:.1}", stats.sent_last_1m as f64 / 60.0),
            format!("{:.1}", stats.sent_last_5m as f64 / 300.0),
            format!("{:.1}", stats.sent_last_15m as f64 / 900.0),
        ],
        relay_trouble: observed
            .metrics
            .relay_trouble()
            .map(|t| redact_addresses(&t)),
        routes: {
            let troubles = observed.metrics.route_troubles();
            observed
                .routes
                .iter()
                .map(|(label, transport)| RouteRow {
                    trouble: troubles
                        .iter()
                        .find(|(l, _)| l == label)
                        .and_then(|(_, t)| t.as_deref().map(redact_addresses)),
                    active: match transport.active() {
                        Role::Primary => "primary",
                        Role::Fallback => "fallback",
                    },
                    has_fallback: transport.has_fallback(),
                    label: label.clone(),
                })
                .collect()
        },
        caps: observed
            .metrics
            .cap_uses()
            .into_iter()
            .map(|c| CapRow {
                state: if c.used >= c.max {
                    "reached"
                } else if c.used * 10 >= c.max * 9 {
                    "near"
                } else {
                    "ok"
                },
                name: c.name,
                used: c.used,
                max: c.max,
            })
            .collect(),
        relay_active: match transport.active() {
            Role::Primary => "primary",
            Role::Fallback => "fallback",
        },
        has_fallback: transport.has_fallback(),
        redirect: transport
            .redirected_to()
            .map(|to| redact_addresses(to.as_ref())),
        file_transport: transport.outbox().is_some(),
        chart: match &figures {
            Some(f) => chart::per_minute(&f.minutes, f.read_at, CHART_MINUTES),
            None => chart::per_minute(&[], Utc::now(), CHART_MINUTES),
        },
        daemons: figures
            .as_ref()
            .map(|f| {
                f.daemons
                    .iter()
                    .map(|d| DaemonView {
                        host: d.host.clone(),
                        pid: d.pid,
                        version: d.version.clone(),
                        started: time(&d.started_at),
                        last_seen: time(&d.last_seen),
                        in_flight: d.in_flight,
                        sent: d.sent,
                        silent: d.silent,
                    })
                    .collect()
            })
            .unwrap_or_default(),
        groups: group_views(&snapshot).into_iter().take(8).collect(),
        recent: stats
            .recent_failures
            .iter()
            .map(|f| FailureView {
                id: f.id,
                status: f.status.clone(),
                at: optional_time(&f.processed_at),
                error: redacted(&f.last_error),
            })
            .collect(),
        feedback_total: feedback.iter().map(|f| f.count).sum(),
        feedback,
        feedback_sources,
    };
    render(StatusCode::OK, page)
}

#[derive(Template)]
#[template(path = "failures.html", config = "src/http/askama.toml")]
struct FailuresPage {
    layout: Layout,
    has_figures: bool,
    figures_age: String,
    ended: Vec<GroupView>,
    put_off: Vec<GroupView>,
}

pub(super) async fn failures(State(console): State<Arc<Console>>, headers: HeaderMap) -> Response {
    let session = console.auth.session(&headers);
    let snapshot = console.observed.snapshots.latest().await;
    let (ended, put_off) = group_views(&snapshot)
        .into_iter()
        .partition(|g| g.final_outcome);
    let page = FailuresPage {
        layout: console.layout("failures", session.as_ref()),
        has_figures: snapshot.figures.is_some(),
        figures_age: snapshot
            .age()
            .map(|a| age(a.as_secs_f64()))
            .unwrap_or_default(),
        ended,
        put_off,
    };
    render(StatusCode::OK, page)
}
