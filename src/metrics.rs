//! What operators scrape: counters of outcomes, a send-latency histogram, the
//! relay and database state, queue depth, as Prometheus text (`/metrics`),
//! and whether the database and the relay can be reached (`/healthz`). The
//! counters are live; the queue's figures come from the snapshot that
//! [`crate::http`] refreshes on a connection of its own, so a scrape never
//! runs a query. [`crate::http`] serves both.

use std::{
    fmt::Write as _,
    sync::atomic::{AtomicU64, Ordering},
    time::Duration,
};

use crate::{smtp::Role, store::QueueStats};

/// Upper bounds of the send-latency histogram, in seconds.
const LATENCY_BUCKETS: [f64; 12] = [
    0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0, 30.0,
];

/// A mail's outcome as logged and counted (DESIGN §5's `outcome` field).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Sent,
    Retry,
    Failed,
    Ambiguous,
    /// Back to `queued` with the attempt refunded (at once, or deferred).
    Released,
    /// Every recipient is on the suppression list: never sent (DESIGN §12).
    Suppressed,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Sent => "sent",
            Outcome::Retry => "retry",
            Outcome::Failed => "failed",
            Outcome::Ambiguous => "ambiguous",
            Outcome::Released => "released",
            Outcome::Suppressed => "suppressed",
        }
    }

    const ALL: [Outcome; 6] = [
        Outcome::Sent,
        Outcome::Retry,
        Outcome::Failed,
        Outcome::Ambiguous,
        Outcome::Released,
        Outcome::Suppressed,
    ];
}

impl Default for Metrics {
    /// One route, the default.
    fn default() -> Self {
        Metrics::new(&["default"])
    }
}

/// What is known of one route's relay.
#[derive(Debug, Default)]
struct RouteMetrics {
    label: String,
    trouble: std::sync::Mutex<Option<String>>,
    sent_through: [AtomicU64; 2],
}

/// Counters the worker updates as it writes outcomes, and what it knows of
/// the relays.
#[derive(Debug)]
pub struct Metrics {
    /// Per [`Outcome`], in the order of `Outcome::ALL`.
    outcomes: [AtomicU64; 6],
    lock_lost: AtomicU64,
    /// Per bucket of `LATENCY_BUCKETS`, then +Inf.
    latency_buckets: [AtomicU64; LATENCY_BUCKETS.len() + 1],
    latency_sum_us: AtomicU64,
    latency_count: AtomicU64,
    /// Each route's label (the default route's is `default`), why its relay
    /// is unavailable (`None` while it works), and the mails its primary and
    /// its fallback took.
    routes: Vec<RouteMetrics>,
    /// Attachment bytes (as stored) of the mails written as sent.
    attachment_bytes: AtomicU64,
    /// Configuration faults found at start (no sender, AUTH that would go
    /// in clear): mail waits until an operator fixes them and restarts.
    config_faults: std::sync::Mutex<Vec<String>>,
    /// Recipients left out of envelopes as suppressed (DESIGN §12).
    suppressed: AtomicU64,
    /// Reports this daemon recorded, per kind of `FeedbackKind::ALL`.
    feedback: [AtomicU64; 6],
    /// Each send cap's use as the database last counted it (DESIGN §16).
    caps: std::sync::Mutex<Vec<crate::store::CapUse>>,
}

impl Metrics {
    /// Counts one outcome as it is written (`None`: fenced out, the lock
    /// had been taken away), with the time its SMTP transaction took.
    pub fn record(&self, outcome: Option<Outcome>, send_time: Option<Duration>) {
        let Some(outcome) = outcome else {
            self.lock_lost.fetch_add(1, Ordering::Relaxed);
            return;
        };
        let i = Outcome::ALL.iter().position(|o| *o == outcome).unwrap_or(0);
        self.outcomes[i].fetch_add(1, Ordering::Relaxed);
        // Only mails that reached the relay have a send time.
        if let Some(time) = send_time {
            let seconds = time.as_secs_f64();
            let bucket = LATENCY_BUCKETS
                .iter()
                .position(|le| seconds <= *le)
                .unwrap_or(LATENCY_BUCKETS.len());
            self.latency_buckets[bucket].fetch_add(1, Ordering::Relaxed);
            self.latency_sum_us
                .fetch_add(time.as_micros() as u64, Ordering::Relaxed);
            self.latency_count.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Outcomes of this kind written since start.
    pub fn count(&self, outcome: Outcome) -> u64 {
        let i = Outcome::ALL.iter().position(|o| *o == outcome).unwrap_or(0);
        self.outcomes[i].load(Ordering::Relaxed)
    }

    /// A mail with this many attachment bytes was written as sent.
    pub fn attachments_sent(&self, bytes: u64) {
        self.attachment_bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    /// Attachment bytes of the mails sent since start.
    pub fn attachment_bytes(&self) -> u64 {
        self.attachment_bytes.load(Ordering::Relaxed)
    }

    /// Counters for these routes (labels), the default route first.
    pub fn new(routes: &[&str]) -> Metrics {
        Metrics {
            outcomes: Default::default(),
            lock_lost: AtomicU64::new(0),
            latency_buckets: Default::default(),
            latency_sum_us: AtomicU64::new(0),
            latency_count: AtomicU64::new(0),
            routes: routes
                .iter()
                .map(|label| RouteMetrics {
                    label: label.to_string(),
                    ..RouteMetrics::default()
                })
                .collect(),
            attachment_bytes: AtomicU64::new(0),
            config_faults: Default::default(),
            suppressed: AtomicU64::new(0),
            feedback: Default::default(),
            caps: Default::default(),
        }
    }

    fn route(&self, label: &str) -> Option<&RouteMetrics> {
        self.routes.iter().find(|r| r.label == label)
    }

    /// A mail of route `route` went through `relay`.
    pub fn sent_through(&self, route: &str, relay: Role) {
        if let Some(r) = self.route(route) {
            let i = usize::from(relay == Role::Fallback);
            r.sent_through[i].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A route's relay was found unavailable.
    pub fn route_down(&self, route: &str, reason: &str) {
        if let Some(r) = self.route(route) {
            *r.trouble.lock().unwrap() = Some(reason.to_string());
        }
    }

    /// A route's relay took a mail, or answered a probe.
    pub fn route_up(&self, route: &str) {
        if let Some(r) = self.route(route) {
            *r.trouble.lock().unwrap() = None;
        }
    }

    /// Each route's label and why its relay is unavailable, if it is.
    pub fn route_troubles(&self) -> Vec<(String, Option<String>)> {
        self.routes
            .iter()
            .map(|r| (r.label.clone(), r.trouble.lock().unwrap().clone()))
            .collect()
    }

    /// Why a relay is unavailable, if one is: the reason alone with one
    /// route, each route's otherwise.
    pub fn relay_trouble(&self) -> Option<String> {
        let down: Vec<(String, String)> = self
            .route_troubles()
            .into_iter()
            .filter_map(|(label, trouble)| trouble.map(|t| (label, t)))
            .collect();
        match (self.routes.len(), down.as_slice()) {
            (_, []) => None,
            (1, [(_, reason)]) => Some(reason.clone()),
            _ => Some(
                down.iter()
                    .map(|(label, reason)| format!("route {label}: {reason}"))
                    .collect::<Vec<_>>()
                    .join("; "),
            ),
        }
    }

    /// A configuration fault that keeps mail waiting: `/healthz` says 503
    /// and names it for as long as the daemon runs with it.
    pub fn config_fault(&self, reason: impl Into<String>) {
        self.config_faults.lock().unwrap().push(reason.into());
    }

    /// Recipients were left out of an envelope as suppressed.
    pub fn recipients_suppressed(&self, count: usize) {
        self.suppressed.fetch_add(count as u64, Ordering::Relaxed);
    }

    /// A report of this kind was recorded (one per recipient it names).
    pub fn feedback(&self, kind: crate::store::FeedbackKind) {
        let i = crate::store::FeedbackKind::ALL
            .iter()
            .position(|k| *k == kind)
            .unwrap_or(0);
        self.feedback[i].fetch_add(1, Ordering::Relaxed);
    }

    /// A send cap's use as the database counted it just now.
    pub fn cap_use(&self, cap: &crate::store::CapUse) {
        let mut caps = self.caps.lock().expect("not poisoned");
        match caps.iter_mut().find(|c| c.name == cap.name) {
            Some(known) => *known = cap.clone(),
            None => caps.push(cap.clone()),
        }
    }

    /// Each send cap's use, in the order they were first seen.
    pub fn cap_uses(&self) -> Vec<crate::store::CapUse> {
        self.caps.lock().expect("not poisoned").clone()
    }

    /// The configuration faults found at start.
    pub fn config_faults(&self) -> Vec<String> {
        self.config_faults.lock().unwrap().clone()
    }

    /// The counters in Prometheus text exposition format.
    fn render_counters(&self, out: &mut String) {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        out.push_str("# HELP tablemail_mails_total Mails by the outcome written for them.\n");
        out.push_str("# TYPE tablemail_mails_total counter\n");
        for (outcome, counter) in Outcome::ALL.iter().zip(&self.outcomes) {
            let _ = writeln!(
                out,
                "tablemail_mails_total{{outcome=\"{}\"}} {}",
                outcome.as_str(),
                get(counter)
            );
        }
        out.push_str("# HELP tablemail_lock_lost_total Outcomes not written because another worker had taken the row.\n");
        out.push_str("# TYPE tablemail_lock_lost_total counter\n");
        let _ = writeln!(out, "tablemail_lock_lost_total {}", get(&self.lock_lost));
        out.push_str("# HELP tablemail_relay_sent_total Mails each route's relay took.\n");
        out.push_str("# TYPE tablemail_relay_sent_total counter\n");
        for route in &self.routes {
            for relay in [Role::Primary, Role::Fallback] {
                let i = usize::from(relay == Role::Fallback);
                let _ = writeln!(
                    out,
                    "tablemail_relay_sent_total{{route=\"{}\",relay=\"{}\"}} {}",
                    route.label,
                    relay.as_str(),
                    get(&route.sent_through[i])
                );
            }
        }
        out.push_str("# HELP tablemail_attachment_bytes_sent_total Attachment bytes (before encoding) of the mails sent.\n");
        out.push_str("# TYPE tablemail_attachment_bytes_sent_total counter\n");
        let _ = writeln!(
            out,
            "tablemail_attachment_bytes_sent_total {}",
            get(&self.attachment_bytes)
        );
        out.push_str("# HELP tablemail_suppressed_total Recipients left out of envelopes because they are on the suppression list.\n");
        out.push_str("# TYPE tablemail_suppressed_total counter\n");
        let _ = writeln!(out, "tablemail_suppressed_total {}", get(&self.suppressed));
        out.push_str("# HELP tablemail_feedback_total Delivery reports this daemon received, per recipient, by kind.\n");
        out.push_str("# TYPE tablemail_feedback_total counter\n");
        for (kind, counter) in crate::store::FeedbackKind::ALL.iter().zip(&self.feedback) {
            let _ = writeln!(
                out,
                "tablemail_feedback_total{{kind=\"{}\"}} {}",
                kind.as_str(),
                get(counter)
            );
        }
        let caps = self.cap_uses();
        if !caps.is_empty() {
            out.push_str("# HELP tablemail_limit_used Sends a send cap counts in its window now (during warm-up, today's).\n");
            out.push_str("# TYPE tablemail_limit_used gauge\n");
            for cap in &caps {
                let _ = writeln!(
                    out,
                    "tablemail_limit_used{{limit=\"{}\"}} {}",
                    cap.name, cap.used
                );
            }
            out.push_str("# HELP tablemail_limit_max The most sends a send cap allows in its window now (during warm-up, today's).\n");
            out.push_str("# TYPE tablemail_limit_max gauge\n");
            for cap in &caps {
                let _ = writeln!(
                    out,
                    "tablemail_limit_max{{limit=\"{}\"}} {}",
                    cap.name, cap.max
                );
            }
        }
        out.push_str("# HELP tablemail_log_lines_dropped_total Log lines dropped because stdout did not keep up.\n");
        out.push_str("# TYPE tablemail_log_lines_dropped_total counter\n");
        let _ = writeln!(
            out,
            "tablemail_log_lines_dropped_total {}",
            crate::telemetry::lines_dropped()
        );
        out.push_str("# HELP tablemail_send_duration_seconds Time of one SMTP transaction.\n");
        out.push_str("# TYPE tablemail_send_duration_seconds histogram\n");
        let mut cumulative = 0;
        for (i, le) in LATENCY_BUCKETS.iter().enumerate() {
            cumulative += get(&self.latency_buckets[i]);
            let _ = writeln!(
                out,
                "tablemail_send_duration_seconds_bucket{{le=\"{le}\"}} {cumulative}"
            );
        }
        cumulative += get(&self.latency_buckets[LATENCY_BUCKETS.len()]);
        let _ = writeln!(
            out,
            "tablemail_send_duration_seconds_bucket{{le=\"+Inf\"}} {cumulative}"
        );
        let _ = writeln!(
            out,
            "tablemail_send_duration_seconds_sum {}",
            get(&self.latency_sum_us) as f64 / 1e6
        );
        let _ = writeln!(
            out,
            "tablemail_send_duration_seconds_count {}",
            get(&self.latency_count)
        );
    }
}

/// What `/healthz` answers, from the last snapshot (`database`: it answered
/// the last refresh, lately), what the worker knows of the relay, and the
/// configuration faults that stop mail (no sender, AUTH without TLS):
/// healthy while all are fine; the body says why not.
pub fn health(metrics: &Metrics, database: bool) -> (bool, String) {
    let trouble = metrics.relay_trouble();
    let relay = trouble.is_none();
    let mut body = format!(
        "database: {}\nrelay: {}\n",
        if database { "ok" } else { "unreachable" },
        match &trouble {
            None => "ok".to_string(),
            Some(reason) => format!("unavailable: {reason}"),
        }
    );
    let faults = metrics.config_faults();
    for fault in &faults {
        let _ = writeln!(body, "configuration: {fault}");
    }
    (database && relay && faults.is_empty(), body)
}

/// The Prometheus text of `/metrics`: the counters, live, and the queue's
/// gauges from the snapshot (`queue`: the last one the database answered;
/// `database`: it answered lately; `age`: how old the queue's figures are).
pub fn exposition(
    metrics: &Metrics,
    queue: Option<&QueueStats>,
    database: bool,
    age: Option<Duration>,
) -> String {
    let mut out = String::with_capacity(4096);
    metrics.render_counters(&mut out);
    out.push_str(
        "# HELP tablemail_relay_up 1 unless the route's relay was found unavailable and not yet back.\n",
    );
    out.push_str("# TYPE tablemail_relay_up gauge\n");
    for (label, trouble) in metrics.route_troubles() {
        let _ = writeln!(
            out,
            "tablemail_relay_up{{route=\"{label}\"}} {}",
            u8::from(trouble.is_none())
        );
    }
    out.push_str("# HELP tablemail_database_up 1 if the database answered the last refresh of the queue's figures.\n");
    out.push_str("# TYPE tablemail_database_up gauge\n");
    let _ = writeln!(out, "tablemail_database_up {}", u8::from(database));
    if let Some(age) = age {
        out.push_str(
            "# HELP tablemail_snapshot_age_seconds How old the queue's figures below are.\n",
        );
        out.push_str("# TYPE tablemail_snapshot_age_seconds gauge\n");
        let _ = writeln!(
            out,
            "tablemail_snapshot_age_seconds {:.3}",
            age.as_secs_f64()
        );
    }
    if let Some(stats) = queue {
        out.push_str("# HELP tablemail_queue_rows Rows of mail_queue by status.\n");
        out.push_str("# TYPE tablemail_queue_rows gauge\n");
        for status in crate::store::STATUSES {
            let count = stats.count(status);
            let _ = writeln!(out, "tablemail_queue_rows{{status=\"{status}\"}} {count}");
        }
        out.push_str("# HELP tablemail_oldest_due_age_seconds How long the oldest due queued mail has waited.\n");
        out.push_str("# TYPE tablemail_oldest_due_age_seconds gauge\n");
        let _ = writeln!(
            out,
            "tablemail_oldest_due_age_seconds {}",
            stats.oldest_due_age_seconds.unwrap_or(0.0).max(0.0)
        );
        out.push_str("# HELP tablemail_stale_locks Sending rows whose lock is older than worker.lock_timeout.\n");
        out.push_str("# TYPE tablemail_stale_locks gauge\n");
        let _ = writeln!(out, "tablemail_stale_locks {}", stats.stale_locks);
    }
    out
}
