//! A claimed row made ready to send: a mail too large by its stored sizes
//! fails before any of it is read; the columns of a large row and its
//! attachments are loaded, one mail at a time per lane, within the daemon's
//! memory budget (the claim brought only the small rows' columns); the
//! message is built, on the blocking pool when it is large or signed.

use std::panic::AssertUnwindSafe;

use tokio::sync::OwnedSemaphorePermit;
use tracing::Instrument;

use crate::{
    mail::{self, MailError, MessageDefaults, PreparedMail},
    smtp::Outgoing,
    store::{Attachment, CapCheck, MailContent, MailSizes, QueuedMail, SuppressionCheck},
    templates::{self, Catalog},
};

use super::{
    outcome::{Attempt, Hold},
    report::{mail_span, panic_text},
    route::RouteId,
    Worker,
};

/// Bodies up to this size (text and HTML together) are built on the lane's
/// own thread when no signature is needed.
const BUILD_IN_PLACE_LIMIT: u64 = 64 * 1024;

/// A claimed row with its message built, or the reason it cannot be.
pub(super) struct Ready {
    pub(super) mail: QueuedMail,
    /// The route it leaves through.
    pub(super) route: RouteId,
    pub(super) prepared: Result<PreparedMail, Attempt>,
    /// The unit of work: every log line about this mail, from its build to
    /// its outcome, is inside it (`mail_id`, `lock`, `attempt`).
    pub(super) span: tracing::Span,
    /// The share of the memory budget its loaded content takes, given back
    /// when the mail is done with.
    _memory: Option<OwnedSemaphorePermit>,
}

impl Ready {
    /// A row that is not tried now.
    pub(super) fn held(mail: QueuedMail, why: Attempt) -> Ready {
        Ready {
            span: mail_span(&mail),
            mail,
            route: 0,
            prepared: Err(why),
            _memory: None,
        }
    }

    pub(super) fn outgoing(&self) -> Option<Outgoing<'_>> {
        self.prepared.as_ref().ok().map(|p| Outgoing {
            id: self.mail.id,
            envelope: &p.envelope,
            content: &p.bytes,
        })
    }
}

/// What the message of a claimed row is built from.
fn draft<'a>(
    mail: &'a QueuedMail,
    content: &'a MailContent,
    attachments: &'a [mail::Attachment<'a>],
) -> mail::Draft<'a> {
    mail::Draft {
        from_name: content.from_name.as_deref(),
        from_address: content.from_address.as_deref(),
        to_address: &content.to_address,
        cc: content.cc.as_deref(),
        bcc: content.bcc.as_deref(),
        reply_to: content.reply_to.as_deref(),
        subject: &content.subject,
        body: content.body.as_deref(),
        body_html: content.body_html.as_deref(),
        headers: content.headers.as_deref(),
        message_id: Some(&mail.message_id),
        attachments,
    }
}

/// Most output of a render done for the whole batch at its claim; a
/// template that writes more is rendered by its mail's own build, within
/// `transport.max_message_size`, so that a batch holds at most this much
/// rendered text a mail before its mails are sent.
const PRERENDER_LIMIT: u64 = 64 * 1024;

/// Fills what a templated row leaves empty (subject, text, HTML) from its
/// template (DESIGN §15); the parts the row has are kept.
fn render(
    content: &mut MailContent,
    catalog: &Catalog,
    defaults: &MessageDefaults,
) -> Result<(), MailError> {
    let Some(name) = content.template.as_deref() else {
        return Ok(());
    };
    let rendered = catalog.render(&templates::Request::filling(
        name,
        content.locale.as_deref(),
        content.template_data.as_deref(),
        (
            &content.subject,
            content.body.as_deref(),
            content.body_html.as_deref(),
        ),
        defaults.max_message_size,
    ))?;
    if let Some(subject) = rendered.subject {
        content.subject = subject;
    }
    if rendered.text.is_some() {
        content.body = rendered.text;
    }
    if rendered.html.is_some() {
        content.body_html = rendered.html;
    }
    Ok(())
}

/// Builds the message of a row whose columns are at hand, rendering its
/// template first if it names one.
fn build(
    mail: &QueuedMail,
    content: &mut MailContent,
    attachments: &[Attachment],
    defaults: &MessageDefaults,
    catalog: Option<&Catalog>,
) -> Result<PreparedMail, MailError> {
    if let Some(catalog) = catalog {
        render(content, catalog, defaults)?;
    }
    let parts: Vec<mail::Attachment<'_>> = attachments
        .iter()
        .map(|a| mail::Attachment {
            filename: &a.filename,
            content_type: &a.content_type,
            content: &a.content,
            content_id: a.content_id.as_deref(),
        })
        .collect();
    mail::prepare(&draft(mail, content, &parts), defaults)
}

/// The least a mail can take once encoded, from its stored sizes alone: a
/// mail over the limit by this count fails before any of it is loaded.
fn least_encoded_size(sizes: &MailSizes) -> u64 {
    let attachments = [sizes.attachment_bytes];
    mail::min_encoded_size(&mail::ColumnSizes {
        body: sizes.bodies,
        attachments: if sizes.attachments > 0 {
            &attachments
        } else {
            &[]
        },
        ..mail::ColumnSizes::default()
    })
}

impl Worker {
    /// Renders the templated rows of a claim whose content came with it, in
    /// one trip to the blocking pool for the whole batch: a trip per mail
    /// cost more than the rendering (a thread woken and put to sleep again
    /// for every mail, two fifths of the daemon's time in a templated
    /// drain). A rendered row no longer names its template. A render that
    /// fails or writes more than [`PRERENDER_LIMIT`] is left as it is, for
    /// the mail's own build to fail it or render it whole.
    pub(super) async fn prerender(&self, mut mails: Vec<QueuedMail>) -> Vec<QueuedMail> {
        if !mails
            .iter()
            .any(|m| m.content.as_ref().is_some_and(|c| c.template.is_some()))
        {
            return mails;
        }
        let catalog = self.templates.catalog();
        let mut defaults = MessageDefaults::clone(&self.defaults);
        defaults.max_message_size = defaults.max_message_size.min(PRERENDER_LIMIT);
        let rendered = tokio::task::spawn_blocking(move || {
            for mail in &mut mails {
                let Some(content) = mail.content.as_mut().filter(|c| c.template.is_some()) else {
                    continue;
                };
                // A failed render leaves the content as it was.
                let ok = std::panic::catch_unwind(AssertUnwindSafe(|| {
                    render(content, &catalog, &defaults).is_ok()
                }));
                if ok.unwrap_or(false) {
                    content.template = None;
                }
            }
            mails
        })
        .await;
        // Panics are caught inside; the pool goes away only with the runtime.
        rendered.expect("the blocking pool outlives the claims")
    }

    /// The envelope as it goes out: the recipients on the suppression list
    /// left out (none left: the mail is suppressed), and the VERP sender
    /// when `bounce.domain` is set.
    fn envelope(
        &self,
        mail: &QueuedMail,
        mut prepared: PreparedMail,
    ) -> Result<PreparedMail, Attempt> {
        if let SuppressionCheck::Checked(left_out) = &mail.suppression {
            if !left_out.is_empty() {
                let keys: Vec<String> = left_out.iter().map(|s| s.address.clone()).collect();
                if !mail::leave_out(&mut prepared, &keys) {
                    return Err(Attempt::Suppressed);
                }
            }
        }
        if let Some(verp) = &self.defaults.bounce {
            mail::set_envelope_sender(&mut prepared, &verp.address(mail.id))
                .map_err(Attempt::Invalid)?;
        }
        Ok(prepared)
    }

    /// Builds a row's message, or finds it cannot be sent. A mail too large
    /// by its stored size fails before any of it is read. The columns of a
    /// large row and every attachment are loaded now, one mail at a time per
    /// lane, within the daemon's memory budget; the claim brought only the
    /// small rows' columns. A DKIM signature (an RSA signature is about a
    /// millisecond of CPU) and a large mail are built on the blocking pool,
    /// so that they never hold up the lanes' network work on the async
    /// threads; a small unsigned mail takes microseconds and is built in
    /// place.
    pub(super) async fn ready(&self, mail: QueuedMail) -> Ready {
        let span = mail_span(&mail);
        let mut ready = self.build(mail).instrument(span.clone()).await;
        ready.span = span;
        ready
    }

    async fn build(&self, mut mail: QueuedMail) -> Ready {
        if mail.expired {
            return Ready::held(mail, Attempt::Expired);
        }
        let least = least_encoded_size(&mail.sizes);
        if least > self.defaults.max_message_size {
            let too_large = MailError::TooLarge {
                size: least as usize,
                max: self.defaults.max_message_size,
            };
            return Ready::held(mail, Attempt::Invalid(too_large));
        }
        let memory = match mail.content.is_none() || mail.sizes.attachments > 0 {
            true => Some(self.memory.take(&mail.sizes).await),
            false => None,
        };
        let content = match mail.content.take() {
            Some(content) => content,
            None => match self.store.load_content(mail.id, mail.lock).await {
                Ok(Some(content)) => content,
                Ok(None) => return Ready::held(mail, Attempt::Held(Hold::LockLost)),
                Err(e) => {
                    tracing::warn!(error = %e, "could not load the mail");
                    return Ready::held(mail, Attempt::Held(Hold::DatabaseUnavailable));
                }
            },
        };
        if let Some((column, at)) = content.not_utf8 {
            return Ready::held(mail, Attempt::Invalid(MailError::NotUtf8 { column, at }));
        }
        // A large row's recipients came only now: its own lookup.
        let mut content = content;
        if mail.suppression == SuppressionCheck::Unchecked {
            mail.content = Some(content);
            self.read_suppression(std::slice::from_mut(&mut mail)).await;
            content = mail.content.take().expect("just put there");
        }
        if mail.suppression == SuppressionCheck::Unavailable {
            return Ready::held(mail, Attempt::Held(Hold::DatabaseUnavailable));
        }
        let from_domain = self.sender_domain(&content);
        let route = match self
            .routes
            .pick(content.route.as_deref(), from_domain.as_deref())
        {
            Ok(route) => route,
            Err(name) => return Ready::held(mail, Attempt::Held(Hold::UnknownRoute(name))),
        };
        // A large row's sender and recipients came only now: its own
        // reservation.
        if mail.caps == CapCheck::Unchecked {
            mail.content = Some(content);
            self.reserve_caps(std::slice::from_mut(&mut mail)).await;
            content = mail.content.take().expect("just put there");
        }
        match &mail.caps {
            CapCheck::Over { cap, wait } => {
                let hold = Hold::OverCap {
                    cap: cap.clone(),
                    wait: *wait,
                };
                return Ready::held(mail, Attempt::Held(hold));
            }
            CapCheck::Unavailable => {
                return Ready::held(mail, Attempt::Held(Hold::DatabaseUnavailable))
            }
            _ => {}
        }
        let attachments = match mail.sizes.attachments {
            0 => Vec::new(),
            _ => match self.store.load_attachments(mail.id).await {
                Ok(attachments) => attachments,
                Err(e) => {
                    tracing::warn!(error = %e, "could not load the attachments");
                    return Ready::held(mail, Attempt::Held(Hold::DatabaseUnavailable));
                }
            },
        };
        // A templated mail is rendered with the catalog of now; a template
        // the catalog lacks while the table could not be read waits.
        let catalog = match &content.template {
            None => None,
            Some(name) => {
                let catalog = self.templates.catalog();
                let wanted = content.locale.as_deref().unwrap_or("");
                if catalog.find(name, wanted).is_none() && self.templates.unavailable() {
                    return Ready::held(mail, Attempt::Held(Hold::DatabaseUnavailable));
                }
                Some(catalog)
            }
        };
        let large = mail.sizes.content + mail.sizes.attachment_bytes >= BUILD_IN_PLACE_LIMIT;
        // Rendering is bounded but may take milliseconds: never in place.
        if self.defaults.dkim.is_none() && !large && catalog.is_none() {
            let mut content = content;
            let prepared = build(&mail, &mut content, &attachments, &self.defaults, None)
                .map_err(Attempt::Invalid)
                .and_then(|p| self.envelope(&mail, p));
            return Ready {
                mail,
                route,
                prepared,
                span: tracing::Span::none(),
                _memory: memory,
            };
        }
        let defaults = self.defaults.clone();
        let built = tokio::task::spawn_blocking(move || {
            let mut content = content;
            let prepared = std::panic::catch_unwind(AssertUnwindSafe(|| {
                build(
                    &mail,
                    &mut content,
                    &attachments,
                    &defaults,
                    catalog.as_deref(),
                )
            }))
            .unwrap_or_else(|panic| Err(MailError::Build(panic_text(&panic))));
            (mail, prepared)
        })
        .await;
        // Panics are caught inside; a build is cancelled only when the runtime
        // itself goes away, and the lanes with it.
        let (mail, prepared) = built.expect("the blocking pool outlives the lanes");
        let prepared = prepared
            .map_err(Attempt::Invalid)
            .and_then(|p| self.envelope(&mail, p));
        Ready {
            mail,
            route,
            prepared,
            span: tracing::Span::none(),
            _memory: memory,
        }
    }
}
