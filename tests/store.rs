//! The Store contract, the same for every backend: claim order and size,
//! scheduling, the attempt spent at claim, fencing, lock renewal, stale-lock
//! release, dedupe, status counts, retry, cancel and purge.

mod support;

use std::time::Duration;

use support::*;
use tablemail::store::{
    Backend, BatchLock, Claim, FinalAction, Finalize, NewAttachment, NewMail, QueuedMail,
    RetrySelection,
};

for_each_backend!(
    claims_by_priority_then_send_at_then_id,
    claims_only_due_rows_and_spends_the_attempt,
    claims_never_overlap,
    fencing_protects_the_new_owner,
    a_group_commit_writes_only_the_rows_still_its_own,
    renewal_keeps_locks_fresh,
    stale_locks_are_released,
    the_sweep_spares_the_locks_this_process_holds,
    finalize_writes_each_outcome,
    deferrals_refund_and_count_relay_down_outcomes,
    dedupe_reports_the_existing_row,
    status_counts_and_ages,
    retry_cancel_and_purge,
    large_rows_are_claimed_without_their_content,
    a_row_at_the_inline_limit_comes_whole_and_one_octet_over_does_not,
    attachments_are_loaded_in_order_and_go_with_their_mail,
    errors_say_what_to_do,
    a_large_group_commit_writes_every_outcome,
    a_group_commit_retried_after_a_lost_answer_finds_what_it_wrote,
    a_claim_whose_answer_was_lost_is_put_back_unspent,
    claims_and_outcomes_of_every_size_take_each_row_once,
);

/// On the backends with a server (PostgreSQL, MariaDB) only: the backends
/// that fail over to a replica (SQLite gives each claim's Message-IDs a random
/// part of its own) and that lock rows (SQLite's writer holds the whole
/// database).
mod servers {
    use super::*;

    crate::for_each_backend!(
        postgres, mysql;
        a_lost_first_claim_gives_the_same_message_id_again,
        a_claim_passes_over_rows_another_transaction_holds,
        outcomes_and_renewals_pass_by_rows_another_batch_holds,
    );
}

/// On the backends that lock rows (PostgreSQL, MariaDB): see
/// `the_claim_takes_the_next_rows`.
async fn a_claim_passes_over_rows_another_transaction_holds(db: TestDb) {
    match db.backend {
        Backend::Postgres => {
            let holder = postgres_holder(&db).await;
            the_claim_takes_the_next_rows(db, holder, "").await;
        }
        Backend::Mysql => {
            let holder = mysql_holder(&db).await;
            the_claim_takes_the_next_rows(db, holder, MYSQL_BY_ID).await;
        }
        Backend::Sqlite => unreachable!("SQLite's writer holds the whole database"),
    }
}

/// Another transaction holds the first eight rows of the queue (an
/// operator's UPDATE, another daemon's claim in flight): a claim of ten
/// takes the ten after them, a claim of one the next (eight times its
/// batch past the held rows), and a claim once they are let go takes
/// the eight and the last row.
async fn the_claim_takes_the_next_rows<C>(db: TestDb, mut holder: C, by_id: &str)
where
    for<'c> &'c mut C: sqlx::Executor<'c>,
{
    use sqlx::Executor;
    let mails: Vec<NewMail> = (0..20)
        .map(|i| mail(&format!("u{i}@example.com"), "x"))
        .collect();
    let ids: Vec<i64> = db
        .store
        .enqueue(&mails)
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.id)
        .collect();
    hold(&mut holder, by_id, &ids[..8]).await;
    let ids_of = |batch: Vec<QueuedMail>| {
        let mut ids: Vec<i64> = batch.iter().map(|m| m.id).collect();
        ids.sort_unstable();
        ids
    };
    assert_eq!(
        ids_of(claimed(&db, 10).await),
        ids[8..18],
        "the ten after the held rows"
    );
    assert_eq!(ids_of(claimed(&db, 1).await), ids[18..19], "the next one");
    holder.execute("ROLLBACK").await.unwrap();
    let mut rest = ids[..8].to_vec();
    rest.push(ids[19]);
    assert_eq!(
        ids_of(claimed(&db, 10).await),
        rest,
        "the held rows once let go, and the last"
    );
}

/// On the backends that lock rows (PostgreSQL, MariaDB): another batch's
/// rows held by a transaction in flight (its own outcomes, a renewal) are
/// none of this batch's business, however small the table: not of its
/// outcomes, its renewals, nor of a sweep of stale locks. See
/// `none_of_them_waits`.
async fn outcomes_and_renewals_pass_by_rows_another_batch_holds(db: TestDb) {
    match db.backend {
        Backend::Postgres => {
            let holder = postgres_holder(&db).await;
            none_of_them_waits(db, holder, "").await;
        }
        Backend::Mysql => {
            let holder = mysql_holder(&db).await;
            none_of_them_waits(db, holder, MYSQL_BY_ID).await;
        }
        Backend::Sqlite => unreachable!("SQLite's writer holds the whole database"),
    }
}

/// Two batches of two on a table of four rows (where InnoDB would rather
/// find the rows in flight through the status index than by id); the
/// other batch's rows are held while this one renews its locks and
/// writes its outcomes, and again while a third batch's stale locks are
/// swept: none of them may wait for those rows or touch them.
async fn none_of_them_waits<C>(db: TestDb, mut holder: C, by_id: &str)
where
    for<'c> &'c mut C: sqlx::Executor<'c>,
{
    use sqlx::Executor;
    for i in 0..4 {
        db.enqueue(mail(&format!("u{i}@example.com"), "x")).await;
    }
    let ours = claimed(&db, 2).await;
    let theirs = claimed(&db, 2).await;
    let theirs_ids: Vec<i64> = theirs.iter().map(|m| m.id).collect();
    hold(&mut holder, by_id, &theirs_ids).await;

    let limit = Duration::from_secs(10);
    let held_locks: Vec<(i64, BatchLock)> = ours.iter().map(|m| (m.id, m.lock)).collect();
    let renewed = tokio::time::timeout(limit, db.store.renew_locks(&held_locks))
        .await
        .expect("the renewal waited on the other batch's rows")
        .unwrap();
    assert_eq!(renewed, 2);
    let outcomes: Vec<Finalize> = ours
        .iter()
        .map(|m| finalize(m, FinalAction::Sent))
        .collect();
    let mut written = tokio::time::timeout(limit, db.store.finalize(&outcomes))
        .await
        .expect("the outcomes waited on the other batch's rows")
        .unwrap();
    written.sort_unstable();
    let mut our_ids: Vec<i64> = ours.iter().map(|m| m.id).collect();
    our_ids.sort_unstable();
    assert_eq!(written, our_ids);
    holder.execute("ROLLBACK").await.unwrap();

    for m in &ours {
        assert_eq!(db.row(m.id).await.status, "sent");
    }
    for m in &theirs {
        assert_eq!(
            db.row(m.id).await.status,
            "sending",
            "the other batch's row"
        );
    }

    // The same for the stale-lock sweep: the other batch's rows held
    // again, a third batch gone stale is released without waiting.
    for i in 4..6 {
        db.enqueue(mail(&format!("u{i}@example.com"), "x")).await;
    }
    let stale = claimed(&db, 2).await;
    let mut stale_ids: Vec<i64> = stale.iter().map(|m| m.id).collect();
    stale_ids.sort_unstable();
    let listed = id_list(&stale_ids);
    db.exec(&format!(
        "UPDATE mail_queue SET locked_at = {} WHERE id IN ({listed})",
        db.minus("locked_at", 3600)
    ))
    .await;
    hold(&mut holder, by_id, &theirs_ids).await;
    let released = tokio::time::timeout(
        limit,
        db.store.release_stale_locks(Duration::from_secs(60), &[]),
    )
    .await
    .expect("the sweep waited on the other batch's rows")
    .unwrap();
    holder.execute("ROLLBACK").await.unwrap();
    let mut released: Vec<i64> = released.iter().map(|r| r.id).collect();
    released.sort_unstable();
    assert_eq!(released, stale_ids);
    for m in &theirs {
        assert_eq!(
            db.row(m.id).await.status,
            "sending",
            "the other batch's row"
        );
    }
}

/// A second PostgreSQL connection that locks rows as an application would.
async fn postgres_holder(db: &TestDb) -> sqlx::PgConnection {
    use sqlx::Connection;
    sqlx::PgConnection::connect(&db.url).await.unwrap()
}

/// How the MariaDB holder locks rows: through the primary key (on a table
/// this small InnoDB would rather scan a secondary index).
const MYSQL_BY_ID: &str = " FORCE INDEX (PRIMARY)";

/// A second MariaDB connection that locks rows by id as an application
/// would, keeping the locks of the matching rows only (READ COMMITTED).
async fn mysql_holder(db: &TestDb) -> sqlx::MySqlConnection {
    use sqlx::{Connection, Executor};
    let mut holder = sqlx::MySqlConnection::connect(&db.url).await.unwrap();
    holder
        .execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
        .await
        .unwrap();
    holder
}

/// `ids` as an SQL list, `1, 2, 3`.
fn id_list(ids: &[i64]) -> String {
    ids.iter()
        .map(i64::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Begins a transaction on `holder` that locks the rows `ids` (`by_id`:
/// the backend's index hint, if any), until its ROLLBACK.
async fn hold<C>(holder: &mut C, by_id: &str, ids: &[i64])
where
    for<'c> &'c mut C: sqlx::Executor<'c>,
{
    use sqlx::Executor;
    let sql = format!(
        "SELECT id FROM mail_queue{by_id} WHERE id IN ({}) FOR UPDATE",
        id_list(ids)
    );
    holder.execute("BEGIN").await.unwrap();
    holder.execute(sqlx::AssertSqlSafe(sql)).await.unwrap();
}

fn claim(limit: usize) -> Claim<'static> {
    Claim {
        lock: BatchLock::generate(),
        limit,
        max_age: Duration::from_secs(86400),
        message_id_domain: "test.example",
        inline_limit: 32 * 1024,
    }
}

async fn claimed(db: &TestDb, limit: usize) -> Vec<QueuedMail> {
    db.store.claim_batch(&claim(limit)).await.unwrap()
}

fn finalize(m: &QueuedMail, action: FinalAction) -> Finalize {
    Finalize {
        id: m.id,
        lock: m.lock,
        action,
        relay_reply: None,
        event: None,
    }
}

async fn claims_by_priority_then_send_at_then_id(db: TestDb) {
    let past = |mins: i64| Some(chrono::Utc::now() - chrono::Duration::minutes(mins));
    let specs = [
        (0, past(1)),
        (5, past(1)),
        (5, past(10)),
        (9, past(1)),
        (0, past(30)),
        (5, past(10)),
    ];
    let mut ids = Vec::new();
    for (priority, send_at) in specs {
        let mut m = mail("a@example.com", "x");
        m.priority = Some(priority);
        m.send_at = send_at;
        ids.push(db.enqueue(m).await);
    }
    let mut order = Vec::new();
    loop {
        let batch = claimed(&db, 1).await;
        if batch.is_empty() {
            break;
        }
        order.push(batch[0].id);
    }
    assert_eq!(order, [ids[3], ids[2], ids[5], ids[1], ids[4], ids[0]]);
}

async fn claims_only_due_rows_and_spends_the_attempt(db: TestDb) {
    let due = db.enqueue(mail("a@example.com", "due")).await;
    let mut later = mail("b@example.com", "later");
    later.send_at = Some(chrono::Utc::now() + chrono::Duration::minutes(5));
    let later = db.enqueue(later).await;
    let batch = claimed(&db, 10).await;
    assert_eq!(batch.len(), 1);
    let m = &batch[0];
    assert_eq!(m.id, due);
    assert_eq!((m.attempts, m.attempts_remaining), (1, 4));
    assert!(m.message_id.starts_with('<') && m.message_id.ends_with("@test.example>"));
    let row = db.row(due).await;
    assert_eq!(
        (row.status.as_str(), row.attempts, row.attempts_remaining),
        ("sending", 1, 4)
    );
    assert!(row.locked);
    assert_eq!(row.message_id.as_deref(), Some(m.message_id.as_str()));
    let row = db.row(later).await;
    assert_eq!((row.status.as_str(), row.attempts), ("queued", 0));
    assert!(
        claimed(&db, 10).await.is_empty(),
        "a sending row is not claimed again"
    );
}

async fn claims_never_overlap(db: TestDb) {
    let mails: Vec<NewMail> = (0..500)
        .map(|i| mail(&format!("u{i}@example.com"), "x"))
        .collect();
    db.store.enqueue(&mails).await.unwrap();
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let store = db.store.clone();
        tasks.push(tokio::spawn(async move {
            let mut mine = Vec::new();
            loop {
                let batch = store.claim_batch(&claim(7)).await.unwrap();
                assert!(batch.len() <= 7, "a claim took more than its limit");
                if batch.is_empty() {
                    return mine;
                }
                mine.extend(batch.into_iter().map(|m| m.id));
            }
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    let total = all.len();
    all.sort();
    all.dedup();
    assert_eq!(total, 500, "every row claimed");
    assert_eq!(all.len(), 500, "no row claimed twice");
}

async fn fencing_protects_the_new_owner(db: TestDb) {
    let id = db.enqueue(mail("a@example.com", "x")).await;
    let old = claimed(&db, 1).await.remove(0);
    // The old owner looks dead: its lock goes stale and another worker claims.
    db.exec(&format!(
        "UPDATE mail_queue SET locked_at = {} WHERE id = {id}",
        db.minus("locked_at", 3600)
    ))
    .await;
    assert_eq!(
        db.store
            .release_stale_locks(Duration::from_secs(60), &[])
            .await
            .unwrap()
            .len(),
        1
    );
    let new = claimed(&db, 1).await.remove(0);
    assert_ne!(old.lock, new.lock);

    let written = db
        .store
        .finalize(&[finalize(
            &old,
            FinalAction::Failed {
                error: "old owner".into(),
                relay_down: false,
            },
        )])
        .await
        .unwrap();
    assert!(written.is_empty(), "the old owner overwrote the new one");
    let row = db.row(id).await;
    assert_eq!((row.status.as_str(), row.attempts), ("sending", 2));

    let written = db
        .store
        .finalize(&[finalize(&new, FinalAction::Sent)])
        .await
        .unwrap();
    assert_eq!(written, [id]);
    let row = db.row(id).await;
    assert_eq!(row.status, "sent");
    assert_eq!(row.last_error, None);
}

/// One batch of three, the middle row taken away (its lock gone stale,
/// released and claimed by another worker): the batch's outcomes, written
/// together, land on the two rows it still holds and leave the third to its
/// new owner.
async fn a_group_commit_writes_only_the_rows_still_its_own(db: TestDb) {
    for i in 0..3 {
        db.enqueue(mail(&format!("u{i}@example.com"), "x")).await;
    }
    let mut batch = claimed(&db, 3).await;
    batch.sort_by_key(|m| m.id);
    let taken = batch[1].id;
    db.exec(&format!(
        "UPDATE mail_queue SET locked_at = {} WHERE id = {taken}",
        db.minus("locked_at", 3600)
    ))
    .await;
    let released = db
        .store
        .release_stale_locks(Duration::from_secs(60), &[])
        .await
        .unwrap();
    assert_eq!(released.len(), 1);
    let new = claimed(&db, 1).await.remove(0);
    assert_eq!(new.id, taken);

    let outcomes: Vec<Finalize> = batch
        .iter()
        .map(|m| finalize(m, FinalAction::Sent))
        .collect();
    let mut written = db.store.finalize(&outcomes).await.unwrap();
    written.sort_unstable();
    assert_eq!(written, [batch[0].id, batch[2].id]);
    assert_eq!(db.row(batch[0].id).await.status, "sent");
    assert_eq!(db.row(batch[2].id).await.status, "sent");
    let row = db.row(taken).await;
    assert_eq!((row.status.as_str(), row.attempts), ("sending", 2));
    let written = db
        .store
        .finalize(&[finalize(&new, FinalAction::Sent)])
        .await
        .unwrap();
    assert_eq!(written, [taken], "the new owner's outcome");
}

async fn renewal_keeps_locks_fresh(db: TestDb) {
    db.enqueue(mail("a@example.com", "x")).await;
    db.enqueue(mail("b@example.com", "y")).await;
    let a = claimed(&db, 1).await.remove(0);
    let b = claimed(&db, 1).await.remove(0);
    db.exec(&format!(
        "UPDATE mail_queue SET locked_at = {}",
        db.minus("locked_at", 3600)
    ))
    .await;
    assert_eq!(db.store.renew_locks(&[(a.id, a.lock)]).await.unwrap(), 1);
    let released = db
        .store
        .release_stale_locks(Duration::from_secs(60), &[])
        .await
        .unwrap();
    assert_eq!(released.len(), 1);
    assert_eq!(
        released[0].id, b.id,
        "only the row that was not renewed goes"
    );
    assert_eq!(db.row(a.id).await.status, "sending");
}

async fn stale_locks_are_released(db: TestDb) {
    let requeue = db.enqueue(mail("a@example.com", "x")).await;
    let mut last = mail("b@example.com", "last try");
    last.attempts_remaining = Some(1);
    let exhausted = db.enqueue(last).await;
    claimed(&db, 10).await;
    assert!(db
        .store
        .release_stale_locks(Duration::from_secs(60), &[])
        .await
        .unwrap()
        .is_empty());
    db.exec(&format!(
        "UPDATE mail_queue SET locked_at = {}",
        db.minus("locked_at", 120)
    ))
    .await;
    let mut released = db
        .store
        .release_stale_locks(Duration::from_secs(60), &[])
        .await
        .unwrap();
    released.sort_by_key(|r| r.id);
    assert_eq!(released.len(), 2);
    assert!(released[0].requeued && !released[1].requeued);
    let row = db.row(requeue).await;
    assert_eq!(
        (row.status.as_str(), row.attempts, row.attempts_remaining),
        ("queued", 1, 4)
    );
    assert!(!row.locked);
    let row = db.row(exhausted).await;
    assert_eq!((row.status.as_str(), row.attempts_remaining), ("failed", 0));
    assert!(row.last_error.unwrap().starts_with("lock expired"));
}

async fn the_sweep_spares_the_locks_this_process_holds(db: TestDb) {
    db.enqueue(mail("a@example.com", "x")).await;
    db.enqueue(mail("b@example.com", "y")).await;
    let ours = claimed(&db, 1).await.remove(0);
    let theirs = claimed(&db, 1).await.remove(0);
    // Both look stale (say this process's renewals have been failing).
    db.exec(&format!(
        "UPDATE mail_queue SET locked_at = {}",
        db.minus("locked_at", 3600)
    ))
    .await;
    let released = db
        .store
        .release_stale_locks(Duration::from_secs(60), &[ours.lock])
        .await
        .unwrap();
    assert_eq!(released.len(), 1);
    assert_eq!(released[0].id, theirs.id);
    assert_eq!(db.row(ours.id).await.status, "sending");
    assert_eq!(db.row(theirs.id).await.status, "queued");
}

async fn deferrals_refund_and_count_relay_down_outcomes(db: TestDb) {
    let id = db.enqueue(mail("a@example.com", "x")).await;
    let defer = |counted| FinalAction::Defer {
        delay: Duration::from_secs(600),
        error: "RCPT TO: 421 4.7.0 later".into(),
        counted,
    };
    let mut before = 0;
    for (counted, after) in [(true, 1), (true, 2), (false, 2)] {
        db.make_due().await;
        let m = claimed(&db, 1).await.remove(0);
        assert_eq!(m.relay_down_count, before, "the claim returns the count");
        let written = db.store.finalize(&[finalize(&m, defer(counted))]).await;
        assert_eq!(written.unwrap(), [id]);
        let row = db.row(id).await;
        assert_eq!(
            (row.status.as_str(), row.attempts, row.attempts_remaining),
            ("queued", 0, 5),
            "a deferral spends nothing"
        );
        assert!(row.scheduled && row.processed && !row.locked);
        assert_eq!(row.relay_down_count, after);
        assert_eq!(row.last_error.as_deref(), Some("RCPT TO: 421 4.7.0 later"));
        before = after;
    }
    // Past the limit, the attempt is spent and the count goes on; a success
    // ends the run.
    db.make_due().await;
    let m = claimed(&db, 1).await.remove(0);
    let spend = FinalAction::Retry {
        delay: Duration::ZERO,
        error: "RCPT TO: 421 4.7.0 later".into(),
        relay_down: true,
    };
    db.store.finalize(&[finalize(&m, spend)]).await.unwrap();
    let row = db.row(id).await;
    assert_eq!((row.attempts, row.relay_down_count), (1, 3));
    db.make_due().await;
    let m = claimed(&db, 1).await.remove(0);
    db.store
        .finalize(&[finalize(&m, FinalAction::Sent)])
        .await
        .unwrap();
    let row = db.row(id).await;
    assert_eq!((row.status.as_str(), row.relay_down_count), ("sent", 0));
}

async fn finalize_writes_each_outcome(db: TestDb) {
    for i in 0..5 {
        db.enqueue(mail(&format!("u{i}@example.com"), "x")).await;
    }
    let batch = claimed(&db, 5).await;
    let writes = vec![
        finalize(&batch[0], FinalAction::Sent),
        finalize(
            &batch[1],
            FinalAction::Retry {
                delay: Duration::from_secs(600),
                error: "RCPT TO: 451 later".into(),
                relay_down: false,
            },
        ),
        finalize(
            &batch[2],
            FinalAction::Failed {
                error: "RCPT TO: 550 no".into(),
                relay_down: false,
            },
        ),
        finalize(
            &batch[3],
            FinalAction::Unknown {
                error: "no reply after end of data".into(),
            },
        ),
        finalize(&batch[4], FinalAction::Release),
    ];
    let mut written = db.store.finalize(&writes).await.unwrap();
    written.sort();
    let mut expected: Vec<i64> = batch.iter().map(|m| m.id).collect();
    expected.sort();
    assert_eq!(written, expected);
    let rows: std::collections::HashMap<i64, RowState> =
        db.rows().await.into_iter().map(|r| (r.id, r)).collect();
    let r = &rows[&batch[0].id];
    assert_eq!(
        (r.status.as_str(), r.attempts, r.locked, r.processed),
        ("sent", 1, false, true)
    );
    let r = &rows[&batch[1].id];
    assert_eq!(
        (r.status.as_str(), r.attempts, r.scheduled),
        ("queued", 1, true)
    );
    assert_eq!(r.last_error.as_deref(), Some("RCPT TO: 451 later"));
    let r = &rows[&batch[2].id];
    assert_eq!((r.status.as_str(), r.attempts_remaining), ("failed", 4));
    let r = &rows[&batch[3].id];
    assert_eq!(r.status, "unknown");
    let r = &rows[&batch[4].id];
    assert_eq!(
        (
            r.status.as_str(),
            r.attempts,
            r.attempts_remaining,
            r.scheduled
        ),
        ("queued", 0, 5, false)
    );
    assert!(!r.processed);
}

async fn dedupe_reports_the_existing_row(db: TestDb) {
    let mut m = mail("a@example.com", "x");
    m.dedupe_key = Some("k".into());
    let mut other = mail("b@example.com", "y");
    other.dedupe_key = Some("other".into());
    let first = db.store.enqueue(&[m.clone(), other]).await.unwrap();
    let again = db.store.enqueue(&[m]).await.unwrap();
    assert_eq!(again[0].id, first[0].id);
    assert!(again[0].duplicate && !first[0].duplicate);
    assert_eq!(db.scalar_i64("SELECT count(*) FROM mail_queue").await, 2);
}

async fn status_counts_and_ages(db: TestDb) {
    for i in 0..4 {
        db.enqueue(mail(&format!("u{i}@example.com"), "x")).await;
    }
    let batch = claimed(&db, 2).await;
    db.store
        .finalize(&[
            finalize(&batch[0], FinalAction::Sent),
            finalize(
                &batch[1],
                FinalAction::Failed {
                    error: "RCPT TO: 550 nobody".into(),
                    relay_down: false,
                },
            ),
        ])
        .await
        .unwrap();
    claimed(&db, 1).await;
    db.exec(&format!(
        "UPDATE mail_queue SET locked_at = {} WHERE status = 'sending'",
        db.minus(db.now(), 600)
    ))
    .await;
    db.exec(&format!(
        "UPDATE mail_queue SET send_at = {} WHERE status = 'queued'",
        db.minus(db.now(), 90)
    ))
    .await;
    // The rates come from what the daemons report, not from the rows
    // (retention may have deleted them).
    db.store
        .heartbeat(&tablemail::store::DaemonBeat {
            id: uuid::Uuid::new_v4(),
            host: "test.example".into(),
            pid: 1,
            version: "0".into(),
            in_flight: 0,
            sent_total: 3,
            sent_since: 3,
            failed_since: 1,
            attachment_bytes_since: 0,
        })
        .await
        .unwrap();
    let stats = db.store.stats(Duration::from_secs(300)).await.unwrap();
    let count = |s: &str| stats.count(s);
    assert_eq!(
        (
            count("queued"),
            count("sending"),
            count("sent"),
            count("failed")
        ),
        (1, 1, 1, 1)
    );
    let age = stats.oldest_due_age_seconds.unwrap();
    assert!((89.0..200.0).contains(&age), "{age}");
    assert_eq!(stats.stale_locks, 1);
    assert_eq!(
        (stats.sent_last_1m, stats.sent_last_5m, stats.sent_last_15m),
        (3, 3, 3)
    );
    assert_eq!(stats.recent_failures.len(), 1);
    assert_eq!(
        stats.recent_failures[0].last_error.as_deref(),
        Some("RCPT TO: 550 nobody")
    );
}

async fn retry_cancel_and_purge(db: TestDb) {
    for i in 0..4 {
        db.enqueue(mail(&format!("u{i}@example.com"), "x")).await;
    }
    let batch = claimed(&db, 3).await;
    db.store
        .finalize(&[
            finalize(
                &batch[0],
                FinalAction::Failed {
                    error: "550".into(),
                    relay_down: false,
                },
            ),
            finalize(
                &batch[1],
                FinalAction::Unknown {
                    error: "lost".into(),
                },
            ),
            finalize(&batch[2], FinalAction::Sent),
        ])
        .await
        .unwrap();
    let queued = db
        .scalar_i64("SELECT id FROM mail_queue WHERE status = 'queued'")
        .await;

    assert_eq!(
        db.store
            .retry(RetrySelection::Id(batch[2].id), 5)
            .await
            .unwrap(),
        0,
        "sent stays sent"
    );
    assert_eq!(
        db.store
            .retry(RetrySelection::Id(batch[0].id), 5)
            .await
            .unwrap(),
        1
    );
    let row = db.row(batch[0].id).await;
    assert_eq!((row.status.as_str(), row.attempts_remaining), ("queued", 5));
    assert_eq!(
        db.store.retry(RetrySelection::AllFailed, 3).await.unwrap(),
        1
    );
    assert_eq!(db.row(batch[1].id).await.status, "queued");

    assert_eq!(db.store.cancel(queued).await.unwrap(), 1);
    assert_eq!(db.row(queued).await.status, "cancelled");
    assert_eq!(
        db.store.cancel(batch[2].id).await.unwrap(),
        0,
        "only queued rows"
    );

    // Retention: nothing is old enough; then everything finished is.
    assert_eq!(
        db.store
            .purge(Duration::from_secs(3600), Duration::from_secs(3600), 100)
            .await
            .unwrap(),
        0
    );
    db.exec(&format!(
        "UPDATE mail_queue SET processed_at = {} WHERE processed_at IS NOT NULL",
        db.minus(db.now(), 7200)
    ))
    .await;
    assert_eq!(
        db.store
            .purge(Duration::from_secs(3600), Duration::from_secs(86400), 100)
            .await
            .unwrap(),
        1
    );
    assert_eq!(
        db.scalar_i64("SELECT count(*) FROM mail_queue WHERE status = 'sent'")
            .await,
        0
    );
    assert_eq!(
        db.store
            .purge(Duration::ZERO, Duration::ZERO, 100)
            .await
            .unwrap(),
        1,
        "the cancelled row"
    );
    assert_eq!(db.scalar_i64("SELECT count(*) FROM mail_queue").await, 2);
}

/// PostgreSQL without autovacuum (as on this machine) or with a table it has
/// not reached yet: the daemon vacuums the dead rows that slow every claim,
/// if its role owns the table, and says so if it does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_dead_rows_are_vacuumed_by_the_owner_only() {
    use tablemail::store::Maintenance;
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    let mails: Vec<NewMail> = (0..12_000)
        .map(|i| mail(&format!("u{i}@example.com"), "x"))
        .collect();
    db.store.enqueue(&mails).await.unwrap();
    db.exec("DELETE FROM mail_queue").await;
    let dead =
        || db.scalar_i64("SELECT n_dead_tup FROM pg_stat_user_tables WHERE relname = 'mail_queue'");
    eventually(
        "the statistics to count the dead rows",
        Duration::from_secs(20),
        || async { dead().await >= 12_000 },
    )
    .await;

    // A role that may claim and delete, but does not own the table.
    let role = format!("tm_limited_{}", uuid::Uuid::new_v4().simple());
    db.exec(&format!("CREATE ROLE {role} LOGIN")).await;
    db.exec(&format!(
        "GRANT SELECT, UPDATE, DELETE ON mail_queue TO {role}"
    ))
    .await;
    let url = db.url.replacen("postgres@", &format!("{role}@"), 1);
    let limited = tablemail::store::connect(&url, 2).await.unwrap();
    let found = limited.maintain().await;
    drop(limited);
    db.exec(&format!("DROP OWNED BY {role}")).await;
    db.exec(&format!("DROP ROLE {role}")).await;
    assert!(
        matches!(found, Ok(Some(Maintenance::CannotVacuum { dead_rows })) if dead_rows >= 12_000),
        "{found:?}"
    );

    let done = db.store.maintain().await.unwrap();
    assert!(
        matches!(done, Some(Maintenance::Vacuumed { dead_rows, .. }) if dead_rows >= 12_000),
        "{done:?}"
    );
    assert_eq!(dead().await, 0);
    assert_eq!(
        db.store.maintain().await.unwrap(),
        None,
        "nothing left to do"
    );
}

/// A backlog that arrived in a burst, before any ANALYZE saw it: the planner
/// believes a few dozen rows are queued and, left to itself, would fetch the
/// whole burst and sort it on every claim. The claim reads the pending index
/// in order and stops at its batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_burst_the_statistics_have_not_seen_is_claimed_from_the_head_of_the_index() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    db.exec(
        "INSERT INTO mail_queue (to_address, subject, body) \
         SELECT 'u' || g || '@example.com', 'Burst ' || g, repeat(repeat('x', 70) || E'\\r\\n', 29) \
         FROM generate_series(1, 20000) AS g",
    )
    .await;
    let plan = db
        .strings(
            "EXPLAIN SELECT id FROM mail_queue WHERE status = 'queued' AND send_at <= now() \
             ORDER BY priority DESC, send_at, id LIMIT 100 FOR UPDATE SKIP LOCKED",
        )
        .await
        .join("\n");
    assert!(
        plan.contains("Sort"),
        "precondition: without fresh statistics the planner would sort the burst:\n{plan}"
    );

    let mails = claimed(&db, 100).await;
    assert_eq!(
        mails.iter().map(|m| m.id).collect::<Vec<_>>(),
        (1..=100).collect::<Vec<i64>>(),
        "the head of the queue"
    );
    let read = || {
        db.scalar_i64(
            "SELECT idx_tup_read FROM pg_stat_user_indexes WHERE indexrelname = 'mail_queue_claim_idx'",
        )
    };
    eventually(
        "the statistics to count the claim's index reads",
        Duration::from_secs(20),
        || async { read().await > 0 },
    )
    .await;
    let entries = read().await;
    assert!(
        entries <= 1_000,
        "the claim read {entries} entries of the pending index for 100 rows of 20,000"
    );
}

/// The bodies of a mail of a few KB (a text part and an HTML alternative)
/// are compressed until its row fits 1 KB, so that the claim's and the
/// outcome's new versions of the row are small: a mail whose bodies compress
/// that far stays whole in its row, and one whose bodies do not goes out of
/// line. Both come back from the claim as they went in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_bodies_of_a_few_kb_are_compressed_until_the_row_fits_1_kb() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    let line = "1 × Roggenbrot „Schwarzwälder“ (750 g) ............ 4,95 €\n";
    let text = format!("Sehr geehrte Frau Müller,\n\n{}Grüße\n", line.repeat(20));
    let html = format!("<html><body><table>{}</table></body></html>", {
        format!("<tr><td style=\"padding: 4px\">{line}</td></tr>").repeat(20)
    });
    // Hardly compressible: a digest chain, 24 KB of hex.
    let mut noise = String::new();
    let mut state = 0x9e37_79b9_7f4a_7c15_u64;
    while noise.len() < 24 * 1024 {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        noise.push_str(&format!("{state:016x}"));
    }
    let small = db
        .enqueue(NewMail {
            body: Some(text.clone()),
            body_html: Some(html.clone()),
            ..mail("small@example.com", "Ihre Bestellung")
        })
        .await;
    db.enqueue(NewMail {
        body: Some(noise.clone()),
        body_html: Some(html.clone()),
        ..mail("large@example.com", "Ihre Bestellung")
    })
    .await;
    assert!(text.len() + html.len() > 3_000, "precondition: a few KB");

    let row_bytes = db
        .scalar_i64(&format!(
            "SELECT pg_column_size(m.*)::int8 FROM mail_queue AS m WHERE id = {small}"
        ))
        .await;
    assert!(
        row_bytes <= 1_024,
        "the row of {} octets of bodies takes {row_bytes} octets",
        text.len() + html.len()
    );
    let methods = db
        .strings(&format!(
            "SELECT pg_column_compression(body) || ' ' || pg_column_compression(body_html) \
             FROM mail_queue WHERE id = {small}"
        ))
        .await;
    assert_eq!(methods, ["lz4 lz4"]);
    let toast = db
        .strings("SELECT reltoastrelid::regclass::text FROM pg_class WHERE relname = 'mail_queue'")
        .await;
    let chunks = db
        .scalar_i64(&format!("SELECT count(*) FROM {}", toast[0]))
        .await;
    assert!(chunks > 0, "the large mail's body out of line");

    let mut mails = claimed(&db, 10).await;
    mails.sort_by_key(|m| m.id);
    let bodies: Vec<_> = mails
        .iter()
        .map(|m| {
            let c = m.content.as_ref().expect("within the inline limit");
            (c.body.clone(), c.body_html.clone())
        })
        .collect();
    assert_eq!(
        bodies,
        [(Some(text), Some(html.clone())), (Some(noise), Some(html))]
    );
}

/// The claim is planned once per connection and the plan kept: one made
/// while the table held a single analyzed row must still read the head of
/// the pending index and fetch the picked rows through the primary key once
/// a burst has grown the table, not scan it whole (for each picked row, as a
/// join planned on a table of one row would).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_claim_planned_on_a_tiny_table_stays_on_the_indexes_after_a_burst() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    let first = db.enqueue(mail("first@example.com", "first")).await;
    db.exec("ANALYZE mail_queue").await;
    let batch = claimed(&db, 100).await;
    assert_eq!(batch.iter().map(|m| m.id).collect::<Vec<_>>(), [first]);
    db.exec(
        "INSERT INTO mail_queue (to_address, subject, body) \
         SELECT 'u' || g || '@example.com', 'Burst ' || g, 'Hello' \
         FROM generate_series(1, 20000) AS g",
    )
    .await;
    let counters = || async {
        let n = |sql: &'static str| db.scalar_i64(sql);
        (
            n("SELECT seq_scan FROM pg_stat_user_tables WHERE relname = 'mail_queue'").await,
            n("SELECT idx_tup_read FROM pg_stat_user_indexes \
               WHERE indexrelname = 'mail_queue_claim_idx'")
            .await,
            n("SELECT idx_tup_read FROM pg_stat_user_indexes \
               WHERE indexrelname = 'mail_queue_pkey'")
            .await,
        )
    };
    // Every earlier statement's counts are in before the claim is counted.
    eventually(
        "the statistics to count the first claim",
        Duration::from_secs(20),
        || async { counters().await.1 > 0 },
    )
    .await;
    let (seq_before, claim_before, pkey_before) = counters().await;

    let mails = claimed(&db, 100).await;
    let mut ids: Vec<i64> = mails.iter().map(|m| m.id).collect();
    ids.sort_unstable();
    assert_eq!(
        ids,
        (first + 1..=first + 100).collect::<Vec<i64>>(),
        "the head of the burst"
    );
    eventually(
        "the statistics to count the second claim",
        Duration::from_secs(20),
        || async { counters().await.1 > claim_before },
    )
    .await;
    let (seq, claim_reads, pkey_reads) = counters().await;
    assert_eq!(seq, seq_before, "the claim scanned the table whole");
    assert!(
        claim_reads - claim_before <= 1_000,
        "the claim read {} entries of the pending index for 100 rows of 20,000",
        claim_reads - claim_before
    );
    assert!(
        pkey_reads - pkey_before <= 1_000,
        "the claim read {} entries of the primary key for 100 rows of 20,000",
        pkey_reads - pkey_before
    );
}

/// MariaDB has no partial indexes: status leads the pending index, and every
/// status change moves the row's entry in it. The table keeps that index,
/// the retention index (finished rows only, by a generated column), the
/// unique key and the relay queue id's, no index of its own for the rows in
/// flight: they are found
/// through the pending index's status prefix, and a stale-lock sweep among
/// 20,000 finished rows reads the five rows being sent, not the table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_the_stale_lock_sweep_reads_the_rows_in_flight_only() {
    let Some(db) = TestDb::mysql().await else {
        return;
    };
    let mut indexes = db
        .strings(
            "SELECT DISTINCT INDEX_NAME FROM information_schema.STATISTICS \
             WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'mail_queue'",
        )
        .await;
    indexes.sort();
    assert_eq!(
        indexes,
        [
            "PRIMARY",
            "mail_queue_claim_idx",
            "mail_queue_dedupe_key_key",
            "mail_queue_finished_idx",
            // The relay's queue id: written once, by the outcome that sends
            // the row (a claim leaves it alone).
            "mail_queue_relay_queue_id_idx"
        ],
        "the indexes a claim and an outcome write"
    );

    for i in 0..5 {
        db.enqueue(mail(&format!("u{i}@example.com"), "x")).await;
    }
    let held = claimed(&db, 5).await;
    assert_eq!(held.len(), 5);
    db.exec(
        "INSERT INTO mail_queue (to_address, subject, body, status, processed_at) \
         SELECT CONCAT('f', seq, '@example.com'), 's', 'b', 'sent', UTC_TIMESTAMP(6) \
         FROM seq_1_to_20000",
    )
    .await;
    db.exec(&format!(
        "UPDATE mail_queue SET locked_at = {} WHERE id IN ({}, {})",
        db.minus("locked_at", 120),
        held[0].id,
        held[1].id
    ))
    .await;
    db.exec_script("ANALYZE TABLE mail_queue").await;

    let (released, read) = mysql_rows_read(
        &db,
        db.store.release_stale_locks(Duration::from_secs(60), &[]),
    )
    .await;
    let released = released.unwrap();

    let mut ids: Vec<i64> = released.iter().map(|r| r.id).collect();
    ids.sort_unstable();
    assert_eq!(ids, [held[0].id, held[1].id]);
    assert_eq!(db.count("status = 'sending'").await, 3);
    assert!(
        read <= 50,
        "the sweep read {read} rows of a table of 20,005 with 5 in flight"
    );
}

/// The rows of `mail_queue` the server read while `work` ran, counted by
/// MariaDB's user statistics: a switch of the server's, on only for the
/// reading and for one test at a time.
async fn mysql_rows_read<T>(db: &TestDb, work: impl std::future::Future<Output = T>) -> (T, i64) {
    static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    let _one = ONE_AT_A_TIME.lock().await;
    let was_on = db
        .scalar_i64("SELECT CAST(@@global.userstat AS SIGNED)")
        .await;
    db.exec("SET GLOBAL userstat = 1").await;
    let rows_read = || {
        db.scalar_i64(
            "SELECT CAST(COALESCE((SELECT ROWS_READ FROM information_schema.TABLE_STATISTICS \
             WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'mail_queue'), 0) AS SIGNED)",
        )
    };
    let before = rows_read().await;
    let out = work.await;
    let read = rows_read().await - before;
    if was_on == 0 {
        db.exec("SET GLOBAL userstat = 0").await;
    }
    (out, read)
}

/// MariaDB has no partial indexes; its retention index holds finished rows
/// only by its key, the row's status once finished and NULL before (a
/// generated column, migration 0007, so that claims never move a row's
/// entry in it), and the column stays out of the table's visible columns.
/// A purge of 50 old sent rows beside 20,000 recent sent rows and 20,000
/// queued ones reads the rows it deletes, not every sent row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_retention_reads_the_rows_it_deletes() {
    let Some(db) = TestDb::mysql().await else {
        return;
    };
    for (status, processed_at, rows) in [
        ("sent", "UTC_TIMESTAMP(6) - INTERVAL 10 DAY", 50),
        ("sent", "UTC_TIMESTAMP(6)", 20_000),
        ("queued", "NULL", 20_000),
    ] {
        db.exec(&format!(
            "INSERT INTO mail_queue (to_address, subject, body, status, processed_at) \
             SELECT CONCAT('r', seq, '@example.com'), 's', 'b', '{status}', {processed_at} \
             FROM seq_1_to_{rows}"
        ))
        .await;
    }
    db.exec_script("ANALYZE TABLE mail_queue").await;

    let (purged, read) = mysql_rows_read(
        &db,
        db.store.purge(
            Duration::from_secs(7 * 86_400),
            Duration::from_secs(30 * 86_400),
            1000,
        ),
    )
    .await;
    assert_eq!(purged.unwrap(), 50);
    assert_eq!(db.count("status = 'sent'").await, 20_000);
    assert_eq!(db.count("status = 'queued'").await, 20_000);
    assert!(
        (50..=200).contains(&read),
        "the purge read {read} rows to delete 50 of 40,050"
    );

    let visible = db
        .strings(
            "SELECT COLUMN_NAME FROM information_schema.COLUMNS \
             WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'mail_queue' \
               AND EXTRA NOT LIKE '%INVISIBLE%'",
        )
        .await;
    assert!(!visible.iter().any(|c| c == "finished_status"));
    assert_eq!(visible.len(), 33, "the table's columns: {visible:?}");
}

/// Retention beside a claim on MariaDB: the first queued row is being stamped
/// by a claim's transaction (status, lock), and its old entry in the
/// retention index is the one that ends the range of the failed rows. The
/// purge deletes the old failed rows at once, without waiting for that row:
/// a purge that did (walking the index locking) drew a deadlock with the
/// claim, which holds the row and then wants the entry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_a_purge_does_not_wait_for_a_row_a_claim_is_stamping() {
    use sqlx::{Connection, Executor};
    let Some(db) = TestDb::mysql().await else {
        return;
    };
    db.exec(
        "INSERT INTO mail_queue (to_address, subject, body, status, processed_at) \
         SELECT CONCAT('f', seq, '@example.com'), 's', 'b', 'failed', \
                UTC_TIMESTAMP(6) - INTERVAL 40 DAY FROM seq_1_to_3",
    )
    .await;
    for i in 0..5 {
        db.enqueue(mail(&format!("q{i}@example.com"), "x")).await;
    }
    let first = db
        .scalar_i64("SELECT MIN(id) FROM mail_queue WHERE status = 'queued'")
        .await;
    let mut claim = sqlx::MySqlConnection::connect(&db.url).await.unwrap();
    claim
        .execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
        .await
        .unwrap();
    claim.execute("BEGIN").await.unwrap();
    claim
        .execute(sqlx::AssertSqlSafe(format!(
            "UPDATE mail_queue SET status = 'sending', thread_lock = UUID(), \
             locked_at = UTC_TIMESTAMP(6), attempts = attempts + 1, \
             attempts_remaining = attempts_remaining - 1 WHERE id = {first}"
        )))
        .await
        .unwrap();

    let purged = tokio::time::timeout(
        Duration::from_secs(10),
        db.store.purge(
            Duration::from_secs(7 * 86_400),
            Duration::from_secs(30 * 86_400),
            1000,
        ),
    )
    .await;
    claim.execute("ROLLBACK").await.unwrap();
    let purged = purged.expect("the purge waited for the claim's row");
    assert_eq!(purged.unwrap(), 3);
    assert_eq!(db.count("status = 'failed'").await, 0);
    assert_eq!(db.count("status = 'queued'").await, 5);
}

/// The inline limit counts the octets of a row's text columns together: a
/// row of exactly the limit comes with its columns, a row one octet over
/// without them (to be read when sent).
async fn a_row_at_the_inline_limit_comes_whole_and_one_octet_over_does_not(db: TestDb) {
    let row = |to: &str, body_octets: usize| {
        let mut m = mail(to, "s");
        // "ü" is two octets: the limit counts octets, not characters.
        m.body = Some(format!(
            "{}{}",
            "ü".repeat(10),
            "x".repeat(body_octets - 20)
        ));
        m
    };
    // 14 (address) + 1 (subject) + 85 (body) = 100 octets; then 101.
    let at = db.enqueue(row("at@example.com", 85)).await;
    let over = db.enqueue(row("ov@example.com", 86)).await;
    let batch = db
        .store
        .claim_batch(&Claim {
            inline_limit: 100,
            ..claim(10)
        })
        .await
        .unwrap();
    let by_id = |id| batch.iter().find(|m| m.id == id).unwrap();
    let (a, o) = (by_id(at), by_id(over));
    assert_eq!((a.sizes.content, o.sizes.content), (100, 101));
    let content = a
        .content
        .as_ref()
        .expect("a row of exactly the limit comes whole");
    assert_eq!(content.body.as_deref().map(str::len), Some(85));
    assert_eq!(content.to_address, "at@example.com");
    assert_eq!(content.subject, "s");
    assert!(
        o.content.is_none(),
        "a row one octet over comes without its columns"
    );
    let loaded = db.store.load_content(o.id, o.lock).await.unwrap().unwrap();
    assert_eq!(loaded.body.map(|b| b.len()), Some(86));
}

/// A claim brings the columns of a small row; a large one comes with its
/// sizes only, and its columns are loaded by the lock that holds it.
async fn large_rows_are_claimed_without_their_content(db: TestDb) {
    let mut small = mail("small@example.com", "small");
    small.body = Some("Hello".into());
    let small = db.enqueue(small).await;
    let mut large = mail("large@example.com", "large");
    large.body = Some("x".repeat(40_000));
    large.body_html = Some(format!("<p>{}</p>", "ü".repeat(10_000)));
    let large = db.enqueue(large).await;
    let batch = claimed(&db, 10).await;
    let by_id = |id| batch.iter().find(|m| m.id == id).unwrap();
    let s = by_id(small);
    let content = s.content.as_ref().expect("a small row comes whole");
    assert_eq!(content.body.as_deref(), Some("Hello"));
    assert_eq!(content.to_address, "small@example.com");
    let l = by_id(large);
    assert!(l.content.is_none(), "a large row comes without its columns");
    assert_eq!(l.sizes.bodies, 40_000 + 7 + 20_000);
    assert!(l.sizes.content > l.sizes.bodies, "{:?}", l.sizes);
    let loaded = db.store.load_content(l.id, l.lock).await.unwrap().unwrap();
    assert_eq!(loaded.body.unwrap().len(), 40_000);
    assert_eq!(loaded.to_address, "large@example.com");
    assert!(
        db.store
            .load_content(l.id, BatchLock::generate())
            .await
            .unwrap()
            .is_none(),
        "another lock reads nothing"
    );
}

async fn attachments_are_loaded_in_order_and_go_with_their_mail(db: TestDb) {
    // Every byte value, and a part larger than a page.
    let binary: Vec<u8> = (0..=255u8).cycle().take(70_000).collect();
    let mut m = mail("a@example.com", "invoice");
    m.attachments = vec![
        NewAttachment {
            filename: "Rechnung Müller.pdf".into(),
            content_type: Some("application/pdf".into()),
            content: binary.clone(),
            content_id: None,
        },
        NewAttachment {
            filename: "logo.png".into(),
            content_type: None,
            content: vec![0x89, b'P', b'N', b'G'],
            content_id: Some("logo".into()),
        },
    ];
    let id = db.enqueue(m).await;
    let plain = db.enqueue(mail("b@example.com", "plain")).await;
    let batch = claimed(&db, 10).await;
    let with = batch.iter().find(|m| m.id == id).unwrap();
    assert_eq!(with.sizes.attachments, 2);
    assert_eq!(with.sizes.attachment_bytes, 70_004);
    let without = batch.iter().find(|m| m.id == plain).unwrap();
    assert_eq!(
        (without.sizes.attachments, without.sizes.attachment_bytes),
        (0, 0)
    );
    let parts = db.store.load_attachments(id).await.unwrap();
    assert_eq!(parts.len(), 2);
    assert_eq!(parts[0].filename, "Rechnung Müller.pdf");
    assert_eq!(parts[0].content, binary, "bytes as they were inserted");
    assert_eq!(parts[1].content_type, "application/octet-stream");
    assert_eq!(parts[1].content_id.as_deref(), Some("logo"));
    // Retention deletes the mail and its attachments with it.
    let writes: Vec<Finalize> = batch
        .iter()
        .map(|m| finalize(m, FinalAction::Sent))
        .collect();
    db.store.finalize(&writes).await.unwrap();
    let attachment_rows = "SELECT count(*) FROM mail_attachment";
    assert_eq!(db.scalar_i64(attachment_rows).await, 2);
    db.exec(&format!(
        "UPDATE mail_queue SET processed_at = {}",
        db.minus(db.now(), 60)
    ))
    .await;
    db.store
        .purge(Duration::ZERO, Duration::ZERO, 100)
        .await
        .unwrap();
    assert_eq!(db.count("true").await, 0);
    assert_eq!(
        db.scalar_i64(attachment_rows).await,
        0,
        "no attachment left behind"
    );
}

/// What goes wrong is typed by what to do about it: wait (unavailable),
/// migrate (schema), look at the data (a refused write).
async fn errors_say_what_to_do(db: TestDb) {
    use tablemail::store::StoreError;
    let mut zero = mail("a@example.com", "no attempt");
    zero.attempts_remaining = Some(0);
    let refused = db.store.enqueue(&[zero]).await.unwrap_err();
    assert!(matches!(refused, StoreError::Conflict(_)), "{refused:?}");
    assert_eq!(refused.summary(), "database refused the write");
    db.exec("DROP TABLE mail_event").await;
    let missing = db
        .store
        .failure_groups(Duration::from_secs(60))
        .await
        .unwrap_err();
    assert!(matches!(missing, StoreError::Schema(_)), "{missing:?}");
    assert!(
        missing.to_string().contains("tablemail migrate"),
        "{missing}"
    );
    let unreachable = match db.backend {
        tablemail::store::Backend::Postgres => {
            "postgres://postgres@127.0.0.1:1/nothing".to_string()
        }
        tablemail::store::Backend::Mysql => "mysql://root@127.0.0.1:1/nothing".to_string(),
        tablemail::store::Backend::Sqlite => "sqlite:///nonexistent-directory/x.db".to_string(),
    };
    let mut options = tablemail::store::ConnectOptions::new(1);
    options.statement_timeout = Duration::from_secs(2);
    let store = tablemail::store::connect_with(&unreachable, options)
        .await
        .unwrap();
    let down = store.ping().await.unwrap_err();
    assert!(
        matches!(down, StoreError::Unavailable(_) | StoreError::Timeout(_)),
        "{down:?}"
    );
    assert_eq!(down.summary(), "database unavailable");
}

/// Claims of every size from 1 to 33 rows (the lists of ids some backends
/// write are padded to a few lengths with an id again), each followed by its
/// outcomes, every other one a retry an hour later with a history row: each
/// claim takes exactly its rows, no row twice, and each outcome and history
/// row is written once.
async fn claims_and_outcomes_of_every_size_take_each_row_once(db: TestDb) {
    use tablemail::store::{Event, EventOutcome};
    let total: usize = (1..=33).sum();
    let mails: Vec<NewMail> = (0..total)
        .map(|i| mail(&format!("u{i}@example.com"), "x"))
        .collect();
    db.store.enqueue(&mails).await.unwrap();
    let mut seen = std::collections::HashSet::new();
    let (mut sent, mut retried) = (0, 0);
    for k in 1..=33 {
        let batch = claimed(&db, k).await;
        assert_eq!(batch.len(), k, "a claim of {k}");
        for m in &batch {
            assert!(seen.insert(m.id), "row {} claimed twice", m.id);
        }
        assert_eq!(db.count("status = 'sending'").await, k as i64);
        let writes: Vec<Finalize> = batch
            .iter()
            .enumerate()
            .map(|(i, m)| {
                if i % 2 == 1 {
                    return finalize(m, FinalAction::Sent);
                }
                let retry = FinalAction::Retry {
                    delay: Duration::from_secs(3600),
                    error: "RCPT TO: 451 4.3.0 busy".into(),
                    relay_down: false,
                };
                let mut w = finalize(m, retry);
                w.event = Some(Event {
                    attempt: m.attempts,
                    outcome: EventOutcome::Retry,
                    stage: Some("rcpt"),
                    smtp_code: Some(451),
                    detail: None,
                });
                w
            })
            .collect();
        let mut written = db.store.finalize(&writes).await.unwrap();
        written.sort_unstable();
        let mut ids: Vec<i64> = batch.iter().map(|m| m.id).collect();
        ids.sort_unstable();
        assert_eq!(written, ids, "the outcomes of a claim of {k}");
        retried += (k as i64 + 1) / 2;
        sent += k as i64 / 2;
        assert_eq!(db.count("status = 'sent'").await, sent);
        assert_eq!(db.count("status = 'queued'").await, total as i64 - sent);
        assert_eq!(db.count("status = 'sending'").await, 0);
    }
    assert_eq!(seen.len(), total);
    assert!(
        claimed(&db, 10).await.is_empty(),
        "the retries are an hour away"
    );
    assert_eq!(
        db.scalar_i64("SELECT count(*) FROM mail_event WHERE outcome = 'retry'")
            .await,
        retried
    );
    assert_eq!(
        db.scalar_i64("SELECT count(DISTINCT mail_id) FROM mail_event")
            .await,
        retried
    );
}

/// A group commit larger than one statement carries (it goes in several,
/// in one transaction) writes every outcome and every history row.
async fn a_large_group_commit_writes_every_outcome(db: TestDb) {
    use tablemail::store::{Event, EventOutcome};
    let mails: Vec<NewMail> = (0..300)
        .map(|i| mail(&format!("u{i}@example.com"), "x"))
        .collect();
    db.store.enqueue(&mails).await.unwrap();
    let batch = claimed(&db, 300).await;
    assert_eq!(batch.len(), 300);
    let writes: Vec<Finalize> = batch
        .iter()
        .enumerate()
        .map(|(i, m)| {
            if i % 2 == 0 {
                let mut w = finalize(m, FinalAction::Sent);
                w.relay_reply = Some(format!("250 2.0.0 Ok: queued as {:0>40}", m.id));
                w
            } else {
                let mut w = finalize(
                    m,
                    FinalAction::Retry {
                        delay: Duration::from_secs(60),
                        error: format!("RCPT TO: 451 4.3.0 {}", "busy ".repeat(20)),
                        relay_down: false,
                    },
                );
                w.event = Some(Event {
                    attempt: m.attempts,
                    outcome: EventOutcome::Retry,
                    stage: Some("rcpt"),
                    smtp_code: Some(451),
                    detail: None,
                });
                w
            }
        })
        .collect();
    let written = db.store.finalize(&writes).await.unwrap();
    assert_eq!(written.len(), 300);
    assert_eq!(
        db.count("status = 'sent' AND relay_reply IS NOT NULL")
            .await,
        150
    );
    assert_eq!(db.count("status = 'queued'").await, 150);
    assert_eq!(
        db.scalar_i64("SELECT count(*) FROM mail_event WHERE outcome = 'retry'")
            .await,
        150
    );
}

/// A first claim lost with an asynchronous primary's last commits leaves the
/// row as the application inserted it (queued, no Message-ID) although its
/// mail may have gone out; claimed anew, it gets the same Message-ID, so the
/// two copies can be matched.
async fn a_lost_first_claim_gives_the_same_message_id_again(db: TestDb) {
    let a = db.enqueue(mail("a@example.com", "first")).await;
    let b = db.enqueue(mail("b@example.com", "second")).await;
    let first = claimed(&db, 10).await;
    let id_of = |batch: &[QueuedMail], row: i64| {
        batch
            .iter()
            .find(|m| m.id == row)
            .map(|m| m.message_id.clone())
            .expect("claimed")
    };
    let (a_first, b_first) = (id_of(&first, a), id_of(&first, b));
    assert_ne!(a_first, b_first);
    // A hash of the row (16 hex digits or more), then the row's id.
    let local = a_first.trim_start_matches('<').split('@').next().unwrap();
    let (hash, id) = local.split_once('.').expect("hash.id");
    assert!(
        hash.len() >= 16 && hash.bytes().all(|c| c.is_ascii_hexdigit()),
        "{a_first}"
    );
    assert_eq!(id, a.to_string(), "{a_first}");
    db.exec(&format!(
        "UPDATE mail_queue SET status = 'queued', thread_lock = NULL, locked_at = NULL, \
         attempts = 0, attempts_remaining = 5, message_id = NULL WHERE id IN ({a}, {b})"
    ))
    .await;
    let again = claimed(&db, 10).await;
    assert_eq!(again.len(), 2);
    assert_eq!(id_of(&again, a), a_first);
    assert_eq!(id_of(&again, b), b_first);
}

/// A group commit whose answer was lost is tried again; the fenced statement
/// then finds none of the rows it wrote the first time (they are unlocked),
/// and `unlocked_rows` says they are in the state it gave them, while a row
/// another worker holds is not among them.
async fn a_group_commit_retried_after_a_lost_answer_finds_what_it_wrote(db: TestDb) {
    for i in 0..3 {
        db.enqueue(mail(&format!("r{i}@example.com"), "x")).await;
    }
    let batch = claimed(&db, 3).await;
    let (mine, theirs) = batch.split_at(2);
    let writes: Vec<Finalize> = mine
        .iter()
        .map(|m| finalize(m, FinalAction::Sent))
        .collect();
    let first = db.store.finalize(&writes).await.unwrap();
    assert_eq!(first.len(), 2);
    // The retry of the same group: nothing left for it to write.
    assert!(db.store.finalize(&writes).await.unwrap().is_empty());
    let ids: Vec<i64> = batch.iter().map(|m| m.id).collect();
    let mut unlocked = db.store.unlocked_rows(&ids).await.unwrap();
    unlocked.sort_by_key(|u| u.id);
    let expected: Vec<(i64, &str)> = mine.iter().map(|m| (m.id, "sent")).collect();
    assert_eq!(
        unlocked
            .iter()
            .map(|u| (u.id, u.status.as_str()))
            .collect::<Vec<_>>(),
        expected
    );
    assert!(!unlocked.iter().any(|u| u.id == theirs[0].id));
    assert!(db.store.unlocked_rows(&[]).await.unwrap().is_empty());
}

/// A claim whose answer never reached the daemon may have committed: its
/// rows are `sending` under a lock nobody holds. Released by that lock, they
/// are queued again with their attempt refunded; rows of other locks, and
/// rows already finished, stay as they are.
async fn a_claim_whose_answer_was_lost_is_put_back_unspent(db: TestDb) {
    let a = db.enqueue(mail("a@example.com", "lost claim")).await;
    let b = db.enqueue(mail("b@example.com", "lost claim")).await;
    let lost = claim(2);
    let batch = db.store.claim_batch(&lost).await.unwrap();
    assert_eq!(batch.len(), 2);
    let c = db.enqueue(mail("c@example.com", "held elsewhere")).await;
    let other = claimed(&db, 10).await;
    assert_eq!(other.iter().map(|m| m.id).collect::<Vec<_>>(), [c]);

    assert_eq!(db.store.release_claim(lost.lock).await.unwrap(), 2);
    for id in [a, b] {
        let row = db.row(id).await;
        assert_eq!(
            (
                row.status.as_str(),
                row.attempts,
                row.attempts_remaining,
                row.locked
            ),
            ("queued", 0, 5, false),
            "row {id}"
        );
    }
    let row = db.row(c).await;
    assert_eq!((row.status.as_str(), row.locked), ("sending", true));
    assert_eq!(db.store.release_claim(lost.lock).await.unwrap(), 0);
    // Claimed again, they go out under the Message-IDs they were given.
    let again = claimed(&db, 10).await;
    let mut ids: Vec<i64> = again.iter().map(|m| m.id).collect();
    ids.sort_unstable();
    assert_eq!(ids, [a, b]);
    for m in &again {
        let first = batch.iter().find(|f| f.id == m.id).unwrap();
        assert_eq!(m.message_id, first.message_id);
    }
}
