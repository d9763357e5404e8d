//! Send caps and warm-up (DESIGN §16): which caps count a mail, what each
//! asks of the database, and the log line when a cap's use crosses 90% or
//! reaches its maximum. The counting itself is the database's
//! ([`Store::reserve_caps`](crate::store::Store::reserve_caps)): every
//! daemon on the table shares it.

use std::{collections::HashMap, sync::Mutex, time::Duration};

use crate::{
    config::LimitSettings,
    store::{CapRequest, CapUse, DAY_MS},
};

/// What a cap counts.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Counts {
    /// Mails whose From domain is one of these or below one.
    FromDomain(Vec<String>),
    /// Mails leaving through one of these routes.
    Route(Vec<String>),
    /// Mails with a recipient in one of these domains or below one.
    RecipientDomain(Vec<String>),
}

/// One `[[limits]]` table, ready to match mails.
#[derive(Debug, Clone)]
pub struct Cap {
    pub name: String,
    counts: Counts,
    pub max: u64,
    pub per: Duration,
    /// The first warm-up day's start (UTC midnight, ms) and each day's maximum.
    warmup: Option<(i64, Vec<u64>)>,
}

/// How full a cap was last seen, for the crossing log lines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Level {
    Below,
    Near,
    Full,
}

/// Every configured cap.
#[derive(Debug, Default)]
pub struct Caps {
    caps: Vec<Cap>,
    levels: Mutex<HashMap<String, Level>>,
}

fn normalise(domains: &[String]) -> Vec<String> {
    domains
        .iter()
        .map(|d| d.trim().trim_end_matches('.').to_ascii_lowercase())
        .collect()
}

/// Whether `domain` (lower-case) is one of `domains` or below one.
fn within(domains: &[String], domain: &str) -> bool {
    let domain = domain.trim_end_matches('.');
    domains.iter().any(|d| {
        domain == d
            || domain
                .strip_suffix(d.as_str())
                .is_some_and(|rest| rest.ends_with('.'))
    })
}

impl Caps {
    pub fn new(settings: &[LimitSettings]) -> Caps {
        let caps = settings
            .iter()
            .map(|l| Cap {
                name: l.name.clone(),
                counts: if !l.from_domain.is_empty() {
                    Counts::FromDomain(normalise(&l.from_domain))
                } else if !l.route.is_empty() {
                    Counts::Route(l.route.iter().map(|r| r.trim().to_string()).collect())
                } else {
                    Counts::RecipientDomain(normalise(&l.recipient_domain))
                },
                max: l.max,
                per: l.per,
                warmup: l.warmup_start_date().map(|date| {
                    let days = date.signed_duration_since(chrono::NaiveDate::default());
                    (days.num_days() * DAY_MS, l.warmup.clone())
                }),
            })
            .collect();
        Caps {
            caps,
            levels: Mutex::default(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.caps.is_empty()
    }

    /// Whether a cap counts recipient domains: only then are a mail's
    /// recipients read for the caps.
    pub fn needs_recipients(&self) -> bool {
        self.caps
            .iter()
            .any(|c| matches!(c.counts, Counts::RecipientDomain(_)))
    }

    pub fn iter(&self) -> impl Iterator<Item = &Cap> {
        self.caps.iter()
    }

    /// The caps that count a mail from `from_domain` leaving through
    /// `route` to recipients in `recipient_domains` (all lower-case), by
    /// their place in the configuration.
    pub fn counting<'a>(
        &'a self,
        from_domain: Option<&'a str>,
        route: &'a str,
        recipient_domains: &'a [String],
    ) -> impl Iterator<Item = usize> + 'a {
        self.caps
            .iter()
            .enumerate()
            .filter(move |(_, cap)| match &cap.counts {
                Counts::FromDomain(domains) => from_domain.is_some_and(|d| within(domains, d)),
                Counts::Route(routes) => routes.iter().any(|r| r == route),
                Counts::RecipientDomain(domains) => {
                    recipient_domains.iter().any(|d| within(domains, d))
                }
            })
            .map(|(i, _)| i)
    }

    /// The name of cap `index`.
    pub fn name(&self, index: usize) -> &str {
        &self.caps[index].name
    }

    /// What cap `index` asks of the database for `mails`.
    pub fn request(&self, index: usize, mails: Vec<i64>) -> CapRequest {
        let cap = &self.caps[index];
        CapRequest {
            name: cap.name.clone(),
            max: cap.max,
            per: cap.per,
            warmup: cap.warmup.clone(),
            mails,
        }
    }

    /// Every cap, asking for nothing: to read their use.
    pub fn requests(&self) -> Vec<CapRequest> {
        (0..self.caps.len())
            .map(|i| self.request(i, Vec::new()))
            .collect()
    }

    /// The longest any reservation must be kept: a window, or a warm-up day.
    pub fn longest_window(&self) -> Duration {
        self.caps
            .iter()
            .map(|c| match c.warmup {
                Some(_) => c.per.max(Duration::from_millis(DAY_MS as u64)),
                None => c.per,
            })
            .max()
            .unwrap_or_default()
    }

    /// Logs once per crossing when a cap's use reaches 90% of its maximum,
    /// and when it reaches the maximum; a cap that drops back below may
    /// cross again.
    pub fn observe(&self, cap: &CapUse) {
        let level = if cap.used >= cap.max {
            Level::Full
        } else if cap.used * 10 >= cap.max * 9 {
            Level::Near
        } else {
            Level::Below
        };
        let before = self
            .levels
            .lock()
            .expect("not poisoned")
            .insert(cap.name.clone(), level)
            .unwrap_or(Level::Below);
        if level <= before {
            return;
        }
        match level {
            Level::Full => tracing::warn!(
                limit = %cap.name,
                used = cap.used,
                max = cap.max,
                "send cap reached: mails it counts wait"
            ),
            Level::Near => tracing::info!(
                limit = %cap.name,
                used = cap.used,
                max = cap.max,
                "send cap at 90%"
            ),
            Level::Below => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caps() -> Caps {
        let cap = |name: &str, f: &dyn Fn(&mut LimitSettings)| {
            let mut l = LimitSettings {
                name: name.into(),
                max: 10,
                per: Duration::from_secs(60),
                ..LimitSettings::default()
            };
            f(&mut l);
            l
        };
        Caps::new(&[
            cap("shop", &|l| l.from_domain = vec!["Shop.Example.".into()]),
            cap("eu", &|l| l.route = vec!["eu".into()]),
            cap("gmail", &|l| l.recipient_domain = vec!["gmail.com".into()]),
        ])
    }

    #[test]
    fn a_cap_counts_its_sender_domains_routes_or_recipient_domains() {
        let caps = caps();
        let count = |from: Option<&str>, route: &str, to: &[&str]| {
            let to: Vec<String> = to.iter().map(|s| s.to_string()).collect();
            caps.counting(from, route, &to).collect::<Vec<_>>()
        };
        assert_eq!(count(Some("shop.example"), "default", &[]), [0]);
        assert_eq!(count(Some("eu.shop.example"), "eu", &["x.org"]), [0, 1]);
        assert_eq!(
            count(Some("notshop.example"), "default", &["gmail.com"]),
            [2]
        );
        assert_eq!(count(None, "default", &["a.org", "mail.gmail.com"]), [2]);
        assert!(count(Some("other.example"), "default", &["a.org"]).is_empty());
    }

    #[test]
    fn a_warm_up_starts_at_midnight_of_its_date() {
        let caps = Caps::new(&[LimitSettings {
            name: "new".into(),
            from_domain: vec!["new.example".into()],
            max: 1000,
            per: Duration::from_secs(86400),
            warmup: vec![50, 100],
            warmup_start: Some("1970-01-03".into()),
            ..LimitSettings::default()
        }]);
        assert_eq!(caps.caps[0].warmup, Some((2 * DAY_MS, vec![50, 100])));
        assert_eq!(caps.longest_window(), Duration::from_secs(86400));
    }
}
