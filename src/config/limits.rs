//! `[[limits]]`: send caps shared by every daemon on the table (DESIGN §16).
//! Each counts the mails of some sender domains, routes or recipient
//! domains, and allows at most `max` of them in any window of `per`, with
//! an optional warm-up schedule of daily maxima for a new domain.

use std::time::Duration;

use chrono::NaiveDate;
use serde::Deserialize;

use super::{ConfigError, Result};

/// One `[[limits]]` table.
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct LimitSettings {
    pub name: String,
    /// Mails whose From domain is one of these, or below one.
    pub from_domain: Vec<String>,
    /// Mails leaving through one of these routes (`default`: `transport.*`).
    pub route: Vec<String>,
    /// Mails with at least one recipient (to, cc, bcc) in one of these
    /// domains, or below one.
    pub recipient_domain: Vec<String>,
    /// Sends allowed in any window of `per`.
    pub max: u64,
    #[serde(with = "humantime_serde")]
    pub per: Duration,
    /// Daily maxima, one per day from `warmup_start`; after the list ends,
    /// `max` alone applies.
    pub warmup: Vec<u64>,
    /// `YYYY-MM-DD` (UTC): the first day of `warmup`.
    pub warmup_start: Option<String>,
}

impl LimitSettings {
    /// `warmup_start` as a date; checked by [`validate_limits`].
    pub fn warmup_start_date(&self) -> Option<NaiveDate> {
        self.warmup_start
            .as_deref()
            .and_then(|d| NaiveDate::parse_from_str(d, "%Y-%m-%d").ok())
    }
}

/// Each cap named once (a name `tablemail_limit_used` can carry), counting
/// exactly one kind of thing, with a window and a maximum above zero, and a
/// warm-up schedule that has both its list and its start.
pub fn validate_limits(limits: &[LimitSettings]) -> Result<()> {
    let invalid = |reason: String| ConfigError::Invalid {
        key: "limits",
        reason,
    };
    let mut names = std::collections::HashSet::new();
    for limit in limits {
        let name = &limit.name;
        super::unique_name(name, &mut names, "limits").map_err(invalid)?;
        let kinds = [
            !limit.from_domain.is_empty(),
            !limit.route.is_empty(),
            !limit.recipient_domain.is_empty(),
        ];
        if kinds.iter().filter(|k| **k).count() != 1 {
            return Err(invalid(format!(
                "limit {name}: give exactly one of from_domain, route or recipient_domain (a list)"
            )));
        }
        let lists = [&limit.from_domain, &limit.route, &limit.recipient_domain];
        if lists.iter().any(|l| l.iter().any(|v| v.trim().is_empty())) {
            return Err(invalid(format!("limit {name}: an empty domain or route")));
        }
        if limit.max == 0 || limit.max > i64::MAX as u64 {
            return Err(invalid(format!("limit {name}: max must be at least 1")));
        }
        if limit.per < Duration::from_secs(1) {
            return Err(invalid(format!(
                "limit {name}: per must be at least 1s (e.g. \"1h\", \"24h\")"
            )));
        }
        match (&limit.warmup_start, limit.warmup.is_empty()) {
            (None, true) => {}
            (Some(start), false) => {
                if limit.warmup_start_date().is_none() {
                    return Err(invalid(format!(
                        "limit {name}: warmup_start `{start}` is not a date YYYY-MM-DD"
                    )));
                }
                if limit.warmup.contains(&0) {
                    return Err(invalid(format!(
                        "limit {name}: a warm-up day's maximum must be at least 1"
                    )));
                }
            }
            _ => {
                return Err(invalid(format!(
                    "limit {name}: warmup and warmup_start go together"
                )))
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cap(f: impl FnOnce(&mut LimitSettings)) -> Vec<LimitSettings> {
        let mut l = LimitSettings {
            name: "ses".into(),
            from_domain: vec!["example.com".into()],
            max: 10,
            per: Duration::from_secs(3600),
            ..LimitSettings::default()
        };
        f(&mut l);
        vec![l]
    }

    #[test]
    fn a_cap_counts_one_kind_of_thing_with_a_window_and_a_maximum() {
        assert!(validate_limits(&cap(|_| {})).is_ok());
        let bad: Vec<(Vec<LimitSettings>, &str)> = vec![
            (cap(|l| l.name = "a b".into()), "name"),
            (cap(|l| l.route = vec!["eu".into()]), "exactly one"),
            (cap(|l| l.from_domain.clear()), "exactly one"),
            (cap(|l| l.max = 0), "max"),
            (cap(|l| l.per = Duration::ZERO), "per"),
            (cap(|l| l.warmup = vec![50]), "go together"),
            (
                cap(|l| {
                    l.warmup = vec![50];
                    l.warmup_start = Some("2026-13-01".into())
                }),
                "not a date",
            ),
        ];
        for (limits, says) in bad {
            let e = validate_limits(&limits).unwrap_err().to_string();
            assert!(e.contains(says), "{e}");
        }
        let mut two = cap(|_| {});
        two.extend(cap(|_| {}));
        assert!(validate_limits(&two)
            .unwrap_err()
            .to_string()
            .contains("two"));
    }
}
