//! Send caps at claim time (DESIGN §16): the caps that count each claimed
//! mail reserve room for it in the database, for the whole claim at once;
//! a mail a cap has no room for waits unspent until room frees. After the
//! outcomes are written, a claim's reservation counts one window from when
//! none of its mails is pending any more, and a mail that surely did not go
//! out is given back.

use std::collections::BTreeMap;

use crate::{
    mail,
    store::{BatchLock, CapCheck, CapSettle, MailContent, QueuedMail},
};

use super::{outcome::Attempt, Worker};

/// Whether an attempt surely sent nothing: it never reached the relay, or
/// stopped before "." went out.
pub(super) fn surely_unsent(attempt: &Attempt) -> bool {
    use crate::smtp::Stage;
    match attempt {
        Attempt::Delivered(_) => false,
        Attempt::Failed(e) => e.stage != Stage::AfterDot,
        Attempt::CutOff { stage, .. } => *stage != Stage::AfterDot,
        Attempt::Invalid(_) | Attempt::Expired | Attempt::Held(_) | Attempt::Suppressed => true,
    }
}

impl Worker {
    /// The From domain of a row: its own, else `defaults.from_address`'s.
    pub(super) fn sender_domain(&self, content: &MailContent) -> Option<String> {
        content
            .from_address
            .as_deref()
            .filter(|a| !a.trim().is_empty())
            .and_then(|a| a.trim().trim_end_matches('>').rsplit_once('@'))
            .map(|(_, d)| d.to_string())
            .or_else(|| {
                self.defaults
                    .from_address
                    .as_ref()
                    .map(|a| a.domain().to_string())
            })
    }

    /// Asks the caps about the claimed rows whose content is at hand: one
    /// transaction for the whole claim. Rows no cap counts are left alone;
    /// when the caps cannot be read, the rows they count wait, unspent.
    pub(super) async fn reserve_caps(&self, mails: &mut [QueuedMail]) {
        if self.caps.is_empty() {
            for mail in mails.iter_mut() {
                mail.caps = CapCheck::Uncounted;
            }
            return;
        }
        let mut asked: BTreeMap<usize, Vec<i64>> = BTreeMap::new();
        let mut lock: Option<BatchLock> = None;
        for mail in mails.iter_mut() {
            let Some(content) = &mail.content else {
                continue;
            };
            let from_domain = self.sender_domain(content).map(|d| d.to_ascii_lowercase());
            let Ok(route) = self
                .routes
                .pick(content.route.as_deref(), from_domain.as_deref())
            else {
                // It names a route no configuration has: it waits anyway.
                mail.caps = CapCheck::Uncounted;
                continue;
            };
            let recipients: Vec<String> = if self.caps.needs_recipients() {
                mail::recipient_keys(
                    &content.to_address,
                    content.cc.as_deref(),
                    content.bcc.as_deref(),
                    self.defaults.max_recipients,
                )
                .into_iter()
                .filter_map(|k| k.rsplit_once('@').map(|(_, d)| d.to_string()))
                .collect()
            } else {
                Vec::new()
            };
            let label = self.routes.get(route).label();
            let mut counting = Vec::new();
            for cap in self
                .caps
                .counting(from_domain.as_deref(), label, &recipients)
            {
                asked.entry(cap).or_default().push(mail.id);
                counting.push(self.caps.name(cap).to_string());
            }
            mail.caps = if counting.is_empty() {
                CapCheck::Uncounted
            } else {
                lock = Some(mail.lock);
                CapCheck::Reserved(counting)
            };
        }
        let Some(lock) = lock else { return };
        let requests: Vec<_> = asked
            .into_iter()
            .map(|(cap, ids)| self.caps.request(cap, ids))
            .collect();
        let answers = match self.store.reserve_caps(lock, &requests).await {
            Ok(answers) => answers,
            Err(e) => {
                tracing::warn!(error = %e, "could not reserve room under the send caps: mails wait");
                for mail in mails.iter_mut() {
                    if matches!(mail.caps, CapCheck::Reserved(_)) {
                        mail.caps = CapCheck::Unavailable;
                    }
                }
                return;
            }
        };
        for answer in &answers {
            if answer.counted {
                let cap_use = crate::store::CapUse {
                    name: answer.name.clone(),
                    used: answer.used,
                    max: answer.max,
                };
                self.metrics.cap_use(&cap_use);
                self.caps.observe(&cap_use);
            }
            for id in &answer.turned_away {
                if let Some(mail) = mails.iter_mut().find(|m| m.id == *id) {
                    if matches!(mail.caps, CapCheck::Reserved(_)) {
                        mail.caps = CapCheck::Over {
                            cap: answer.name.clone(),
                            wait: answer.frees_in,
                        };
                    }
                }
            }
        }
    }

    /// After a group of outcomes is written: the mails that may have gone
    /// out are no longer pending in their claims' reservations (which count
    /// one window from now once none is), the others are given back. A
    /// failure here leaves them pending; the next reservation of any daemon
    /// counts them from then on (never less than the truth).
    pub(super) async fn settle_caps(&self, settles: Vec<CapSettle>) {
        if settles.is_empty() {
            return;
        }
        if let Err(e) = self.store.settle_caps(&settles).await {
            tracing::warn!(error = %e, "could not settle send cap reservations: they count until found");
        }
    }

    /// Reads every cap's use for `/metrics` and the crossing log lines.
    pub(super) async fn refresh_caps(&self) {
        if self.caps.is_empty() {
            return;
        }
        match self.store.cap_uses(&self.caps.requests()).await {
            Ok(uses) => {
                for cap_use in &uses {
                    self.metrics.cap_use(cap_use);
                    self.caps.observe(cap_use);
                }
            }
            Err(e) => tracing::debug!(error = %e, "could not read the send caps' use"),
        }
    }
}
