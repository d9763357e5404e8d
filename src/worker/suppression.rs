//! The suppression list at send time (DESIGN §12): the recipients of a
//! whole claim are looked up at once, and those on the list are left out of
//! their mail's envelope, each with a `suppressed` history row. A row with
//! `bypass_suppression` goes to everyone; a mail left with nobody ends
//! `suppressed` without a session and without spending its attempt.

use std::collections::HashMap;

use crate::{
    mail,
    store::{QueuedMail, RecipientEvent, Suppressed, SuppressionCheck},
};

use super::Worker;

impl Worker {
    /// Reads the suppression list for the rows whose recipients are at
    /// hand (those whose content came with the claim): one indexed lookup
    /// for all of them. A row whose list cannot be read waits, unspent.
    pub(super) async fn read_suppression(&self, mails: &mut [QueuedMail]) {
        let max = self.defaults.max_recipients;
        let keys: Vec<Option<Vec<String>>> = mails
            .iter()
            .map(|m| {
                m.content.as_ref().map(|c| {
                    mail::recipient_keys(&c.to_address, c.cc.as_deref(), c.bcc.as_deref(), max)
                })
            })
            .collect();
        let mut all: Vec<String> = keys.iter().flatten().flatten().cloned().collect();
        all.sort_unstable();
        all.dedup();
        let found = match self.store.suppressed_among(&all).await {
            Ok(found) => found,
            Err(e) => {
                tracing::warn!(error = %e, "could not read the suppression list: mails wait");
                for (mail, keys) in mails.iter_mut().zip(&keys) {
                    if keys.is_some() {
                        mail.suppression = SuppressionCheck::Unavailable;
                    }
                }
                return;
            }
        };
        let reasons: HashMap<&str, &str> = found
            .iter()
            .map(|s| (s.address.as_str(), s.reason.as_str()))
            .collect();
        let mut hit = Vec::new();
        for (i, (mail, keys)) in mails.iter_mut().zip(&keys).enumerate() {
            let Some(keys) = keys else { continue };
            let left_out: Vec<Suppressed> = keys
                .iter()
                .filter_map(|k| {
                    reasons.get(k.as_str()).map(|reason| Suppressed {
                        address: k.clone(),
                        reason: reason.to_string(),
                    })
                })
                .collect();
            if !left_out.is_empty() {
                hit.push(i);
            }
            mail.suppression = SuppressionCheck::Checked(left_out);
        }
        if !hit.is_empty() {
            self.settle_suppressed(mails, &hit).await;
        }
    }

    /// The rows that met the list: those that bypass it keep every
    /// recipient; for the others, a history row per recipient left out.
    async fn settle_suppressed(&self, mails: &mut [QueuedMail], hit: &[usize]) {
        let ids: Vec<i64> = hit.iter().map(|&i| mails[i].id).collect();
        let bypassing = match self.store.bypassing_suppression(&ids).await {
            Ok(bypassing) => bypassing,
            Err(e) => return self.suppression_unavailable(mails, hit, &e),
        };
        let mut events = Vec::new();
        for &i in hit {
            let mail = &mut mails[i];
            if bypassing.contains(&mail.id) {
                mail.suppression = SuppressionCheck::Checked(Vec::new());
                continue;
            }
            if let SuppressionCheck::Checked(left_out) = &mail.suppression {
                events.extend(left_out.iter().map(|s| RecipientEvent {
                    mail_id: mail.id,
                    attempt: mail.attempts,
                    outcome: "suppressed",
                    recipient: s.address.clone(),
                    detail: format!("left out: on the suppression list ({})", s.reason),
                }));
            }
        }
        if let Err(e) = self.store.add_recipient_events(&events).await {
            return self.suppression_unavailable(mails, hit, &e);
        }
        self.metrics.recipients_suppressed(events.len());
    }

    fn suppression_unavailable(
        &self,
        mails: &mut [QueuedMail],
        hit: &[usize],
        e: &crate::store::StoreError,
    ) {
        tracing::warn!(error = %e, "could not record suppressed recipients: mails wait");
        for &i in hit {
            mails[i].suppression = SuppressionCheck::Unavailable;
        }
    }
}
