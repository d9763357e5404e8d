//! The INSERT of a new mail and its attachments, written once and built at
//! run time for the columns the mail sets (absent ones take the table's
//! defaults), with each backend's placeholders.

use chrono::{DateTime, Utc};
use sqlx::{ColumnIndex, Database, Decode, Executor, Row, Type};

use super::{rows::Bind, Enqueued, NewMail};

/// A value bound into an INSERT.
#[derive(Debug, Clone)]
pub(crate) enum Param<'a> {
    Text(&'a str),
    Int(i32),
    Bool(bool),
    Time(DateTime<Utc>),
    Json(String),
}

/// The columns a new mail sets; absent ones take the table's defaults.
pub(crate) fn insert_columns(mail: &NewMail) -> Vec<(&'static str, Param<'_>)> {
    let mut cols = vec![("to_address", Param::Text(&mail.to_address))];
    let texts = [
        ("subject", &mail.subject),
        ("body", &mail.body),
        ("body_html", &mail.body_html),
        ("cc", &mail.cc),
        ("bcc", &mail.bcc),
        ("reply_to", &mail.reply_to),
        ("from_name", &mail.from_name),
        ("from_address", &mail.from_address),
        ("dedupe_key", &mail.dedupe_key),
        ("message_id", &mail.message_id),
        ("route", &mail.route),
        ("template", &mail.template),
        ("locale", &mail.locale),
    ];
    for (name, value) in texts {
        if let Some(v) = value {
            cols.push((name, Param::Text(v)));
        }
    }
    if let Some(p) = mail.priority {
        cols.push(("priority", Param::Int(p)));
    }
    if let Some(a) = mail.attempts_remaining {
        cols.push(("attempts_remaining", Param::Int(a)));
    }
    if let Some(b) = mail.bypass_suppression {
        cols.push(("bypass_suppression", Param::Bool(b)));
    }
    if let Some(t) = mail.send_at {
        cols.push(("send_at", Param::Time(t)));
    }
    if let Some(h) = &mail.headers {
        cols.push((
            "headers",
            Param::Json(serde_json::Value::Object(h.clone()).to_string()),
        ));
    }
    if let Some(d) = &mail.template_data {
        cols.push((
            "template_data",
            Param::Json(serde_json::Value::Object(d.clone()).to_string()),
        ));
    }
    cols
}

/// `INSERT INTO mail_queue (…) VALUES (…)<tail>` for these columns, each
/// value written by `placeholder(position from 1, value)`, and the query with
/// the values bound in order.
pub(crate) fn insert_query<'a, DB>(
    cols: Vec<(&'static str, Param<'a>)>,
    placeholder: impl Fn(usize, &Param<'_>) -> String,
    tail: &str,
) -> sqlx::query::Query<'a, DB, DB::Arguments>
where
    DB: Database,
    i32: Bind<DB>,
    bool: Bind<DB>,
    DateTime<Utc>: Bind<DB>,
    String: Bind<DB>,
{
    let names: Vec<&str> = cols.iter().map(|(name, _)| *name).collect();
    let marks: Vec<String> = cols
        .iter()
        .enumerate()
        .map(|(i, (_, p))| placeholder(i + 1, p))
        .collect();
    let sql = format!(
        "INSERT INTO mail_queue ({}) VALUES ({}){tail}",
        names.join(", "),
        marks.join(", ")
    );
    let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
    for (_, param) in cols {
        query = match param {
            // Owned: a borrowed `&str` here would tie the generic callers to
            // `'static` (a limit of higher-ranked bounds in async code).
            Param::Text(t) => query.bind(t.to_string()),
            Param::Int(i) => query.bind(i),
            Param::Bool(b) => query.bind(b),
            Param::Time(t) => query.bind(t),
            Param::Json(j) => query.bind(j),
        };
    }
    query
}

/// `enqueue` where the database has `ON CONFLICT (dedupe_key) DO NOTHING
/// RETURNING id` (PostgreSQL, SQLite): each mail and its attachments
/// inserted in turn, in one transaction begun with `begin`; a taken dedupe
/// key returns no row, and the existing row's id is looked up instead.
pub(crate) async fn insert_returning<DB>(
    conn: &mut DB::Connection,
    begin: &'static str,
    mails: Vec<NewMail>,
    placeholder: impl Fn(usize, &Param<'_>) -> String,
    queries: &'static super::shared::Queries,
) -> Result<Vec<Enqueued>, sqlx::Error>
where
    DB: Database,
    DB::Arguments: sqlx::IntoArguments<DB>,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    Option<String>: Bind<DB>,
    i64: Bind<DB>,
    Vec<u8>: Bind<DB>,
    i32: Bind<DB>,
    bool: Bind<DB>,
    DateTime<Utc>: Bind<DB>,
    String: Bind<DB>,
    for<'r> i64: Decode<'r, DB> + Type<DB>,
    usize: ColumnIndex<DB::Row>,
{
    let mut tx = sqlx::Connection::begin_with(conn, sqlx::AssertSqlSafe(begin)).await?;
    let mut out = Vec::with_capacity(mails.len());
    for mail in &mails {
        let query = insert_query::<DB>(
            insert_columns(mail),
            &placeholder,
            " ON CONFLICT (dedupe_key) DO NOTHING RETURNING id",
        );
        let enqueued = match query.fetch_optional(&mut *tx).await? {
            Some(row) => {
                let id = row.try_get(0)?;
                insert_attachments::<DB>(&mut tx, queries.insert_attachment, id, &mail.attachments)
                    .await?;
                Enqueued {
                    id,
                    duplicate: false,
                }
            }
            None => Enqueued {
                id: sqlx::query_scalar(queries.existing_dedupe)
                    .bind(mail.dedupe_key.clone())
                    .fetch_one(&mut *tx)
                    .await?,
                duplicate: true,
            },
        };
        out.push(enqueued);
    }
    tx.commit().await?;
    Ok(out)
}

/// Inserts a new mail's attachments, in order, on `conn` (the transaction
/// that inserted the mail).
pub(crate) async fn insert_attachments<DB>(
    conn: &mut DB::Connection,
    sql: &'static str,
    mail_id: i64,
    attachments: &[super::NewAttachment],
) -> Result<(), sqlx::Error>
where
    DB: Database,
    DB::Arguments: sqlx::IntoArguments<DB>,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    i64: Bind<DB>,
    String: Bind<DB>,
    Option<String>: Bind<DB>,
    Vec<u8>: Bind<DB>,
{
    for a in attachments {
        let content_type = a
            .content_type
            .clone()
            .unwrap_or_else(|| super::DEFAULT_CONTENT_TYPE.to_string());
        sqlx::query(sql)
            .bind(mail_id)
            .bind(a.filename.clone())
            .bind(content_type)
            .bind(a.content.clone())
            .bind(a.content_id.clone())
            .execute(&mut *conn)
            .await?;
    }
    Ok(())
}
