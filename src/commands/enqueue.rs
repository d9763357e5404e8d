//! `tablemail enqueue`: one mail from flags, or many as JSON lines; each is
//! checked the way the worker will build it, so what could never be sent is
//! refused (exit 2) before anything is inserted.

use std::io::BufRead;

use chrono::{DateTime, Utc};

use crate::{
    cli::EnqueueArgs,
    config::Settings,
    mail,
    store::{NewAttachment, NewMail},
};

use super::{connect, message_defaults, CommandError, Result};

/// The type of a file by its extension, for `--attach` without `;type=`.
fn content_type_of(path: &std::path::Path) -> &'static str {
    let extension = path
        .extension()
        .and_then(|e| e.to_str())
        .unwrap_or_default()
        .to_ascii_lowercase();
    match extension.as_str() {
        "pdf" => "application/pdf",
        "png" => "image/png",
        "jpg" | "jpeg" => "image/jpeg",
        "gif" => "image/gif",
        "webp" => "image/webp",
        "svg" => "image/svg+xml",
        "txt" => "text/plain",
        "csv" => "text/csv",
        "htm" | "html" => "text/html",
        "ics" => "text/calendar",
        "json" => "application/json",
        "xml" => "application/xml",
        "zip" => "application/zip",
        "gz" => "application/gzip",
        "doc" => "application/msword",
        "docx" => "application/vnd.openxmlformats-officedocument.wordprocessingml.document",
        "xls" => "application/vnd.ms-excel",
        "xlsx" => "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet",
        "odt" => "application/vnd.oasis.opendocument.text",
        _ => crate::store::DEFAULT_CONTENT_TYPE,
    }
}

/// A file given on the command line as an attachment: `PATH` or
/// `PATH;type=TYPE`, inline when it has a content id.
fn attachment_from_file(spec: &str, content_id: Option<String>) -> Result<NewAttachment> {
    let (path, content_type) = match spec.rsplit_once(";type=") {
        Some((path, t)) => (path, Some(t.to_string())),
        None => (spec, None),
    };
    let path = std::path::Path::new(path);
    let content =
        std::fs::read(path).map_err(|e| CommandError::Usage(format!("{}: {e}", path.display())))?;
    let filename = path
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| CommandError::Usage(format!("{}: no file name", path.display())))?
        .to_string();
    Ok(NewAttachment {
        content_type: Some(content_type.unwrap_or_else(|| content_type_of(path).to_string())),
        filename,
        content,
        content_id,
    })
}

/// Turns the flags of `enqueue` into one mail.
fn mail_from_flags(args: EnqueueArgs) -> Result<NewMail> {
    let mut attachments = Vec::new();
    for spec in &args.attach {
        attachments.push(attachment_from_file(spec, None)?);
    }
    for spec in &args.inline {
        let (cid, path) = spec
            .split_once('=')
            .ok_or_else(|| CommandError::Usage(format!("--inline `{spec}`: expected CID=PATH")))?;
        attachments.push(attachment_from_file(path, Some(cid.to_string()))?);
    }
    let send_at = args.send_at.as_deref().map(parse_send_at).transpose()?;
    let mut headers = serde_json::Map::new();
    for h in &args.header {
        let (name, value) = h
            .split_once(':')
            .ok_or_else(|| CommandError::Usage(format!("--header `{h}`: expected NAME:VALUE")))?;
        headers.insert(
            name.trim().to_string(),
            serde_json::Value::String(value.trim_start().to_string()),
        );
    }
    let template_data = match &args.data {
        None => None,
        Some(data) => Some(super::templates::parse_data(data)?),
    };
    Ok(NewMail {
        template: args.template,
        template_data,
        locale: args.locale,
        to_address: args.to.unwrap_or_default(),
        subject: args.subject,
        body: args.body,
        body_html: args.html,
        cc: args.cc,
        bcc: args.bcc,
        reply_to: args.reply_to,
        from_name: args.from_name,
        from_address: args.from,
        priority: args.priority,
        send_at,
        dedupe_key: args.dedupe_key,
        route: args.route,
        headers: (!headers.is_empty()).then_some(headers),
        attachments,
        ..NewMail::default()
    })
}

/// An RFC 3339 time, or a delay from now such as `10m`.
fn parse_send_at(s: &str) -> Result<DateTime<Utc>> {
    if let Ok(t) = DateTime::parse_from_rfc3339(s) {
        return Ok(t.with_timezone(&Utc));
    }
    let delay = humantime::parse_duration(s).map_err(|_| {
        CommandError::Usage(format!(
            "--send-at `{s}`: expected an RFC 3339 time or a delay such as 10m"
        ))
    })?;
    let delay = chrono::Duration::from_std(delay)
        .map_err(|_| CommandError::Usage(format!("--send-at `{s}`: too far away")))?;
    Ok(Utc::now() + delay)
}

/// Refuses a mail the worker could never send: the same checks and the same
/// message builder the worker runs on the claimed row.
fn check(
    new: &NewMail,
    defaults: &mail::MessageDefaults,
) -> std::result::Result<(), mail::MailError> {
    if new.attempts_remaining.is_some_and(|a| a < 1) {
        return Err(mail::MailError::Field(
            "attempts_remaining must be at least 1".into(),
        ));
    }
    if let Some(id) = &new.message_id {
        mail::check_message_id(id)?;
    }
    let headers = new
        .headers
        .as_ref()
        .map(|h| serde_json::Value::Object(h.clone()).to_string());
    let draft = mail::Draft {
        from_name: new.from_name.as_deref(),
        from_address: new.from_address.as_deref(),
        to_address: &new.to_address,
        cc: new.cc.as_deref(),
        bcc: new.bcc.as_deref(),
        reply_to: new.reply_to.as_deref(),
        subject: new.subject.as_deref().unwrap_or_default(),
        body: new.body.as_deref(),
        body_html: new.body_html.as_deref(),
        headers: headers.as_deref(),
        message_id: new.message_id.as_deref(),
        attachments: &new
            .attachments
            .iter()
            .map(|a| mail::Attachment {
                filename: &a.filename,
                content_type: a
                    .content_type
                    .as_deref()
                    .unwrap_or(crate::store::DEFAULT_CONTENT_TYPE),
                content: &a.content,
                content_id: a.content_id.as_deref(),
            })
            .collect::<Vec<_>>(),
    };
    mail::prepare(&draft, defaults).map(|_| ())
}

pub(super) async fn enqueue(settings: &Settings, args: EnqueueArgs) -> Result<()> {
    let defaults = message_defaults(settings)?;
    let mails = if args.jsonl {
        let mut mails = Vec::new();
        for (n, line) in std::io::stdin().lock().lines().enumerate() {
            let line = line.map_err(|e| CommandError::Runtime(format!("stdin: {e}")))?;
            if line.trim().is_empty() {
                continue;
            }
            let mail: NewMail = serde_json::from_str(&line)
                .map_err(|e| CommandError::Usage(format!("line {}: {e}", n + 1)))?;
            check(&mail, &defaults)
                .map_err(|e| CommandError::Usage(format!("line {}: {e}", n + 1)))?;
            mails.push(mail);
        }
        mails
    } else {
        let mail = mail_from_flags(args)?;
        check(&mail, &defaults).map_err(|e| CommandError::Usage(e.to_string()))?;
        vec![mail]
    };
    let store = connect(settings).await?;
    if mails.iter().any(|m| m.template.is_some()) {
        check_templates(&store, &mails, &defaults).await?;
    }
    let results = store.enqueue(&mails).await?;
    for (mail, r) in mails.iter().zip(&results) {
        println!("{}", r.id);
        if r.duplicate {
            eprintln!(
                "tablemail: dedupe_key {:?} exists already as mail {}; nothing inserted",
                mail.dedupe_key.as_deref().unwrap_or_default(),
                r.id
            );
        }
    }
    Ok(())
}

/// Renders the templated mails as the daemon will: a template that does not
/// exist or fails with this data is refused before anything is inserted.
async fn check_templates(
    store: &std::sync::Arc<dyn crate::store::Store>,
    mails: &[NewMail],
    defaults: &mail::MessageDefaults,
) -> Result<()> {
    let catalog = crate::templates::Catalog::from_rows(&store.templates().await?);
    for (n, new) in mails.iter().enumerate() {
        let Some(name) = new.template.as_deref() else {
            continue;
        };
        let data = new
            .template_data
            .as_ref()
            .map(|d| serde_json::Value::Object(d.clone()).to_string());
        let request = crate::templates::Request::filling(
            name,
            new.locale.as_deref(),
            data.as_deref(),
            (
                new.subject.as_deref().unwrap_or_default(),
                new.body.as_deref(),
                new.body_html.as_deref(),
            ),
            defaults.max_message_size,
        );
        catalog.render(&request).map_err(|e| match mails.len() {
            1 => CommandError::Usage(e.to_string()),
            _ => CommandError::Usage(format!("mail {}: {e}", n + 1)),
        })?;
    }
    Ok(())
}
