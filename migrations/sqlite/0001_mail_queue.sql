-- tablemail: the mail queue table (DESIGN §1), SQLite flavour.
-- Times are UTC text in SQLite's own format, 'YYYY-MM-DD HH:MM:SS.SSS', which
-- is what datetime('now') and strftime() produce and what sorts correctly.
-- thread_lock holds the batch GUID as text.

CREATE TABLE mail_queue (
    id                 INTEGER PRIMARY KEY AUTOINCREMENT,
    created_at         TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f', 'now')),
    send_at            TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f', 'now')),
    priority           INTEGER NOT NULL DEFAULT 0,
    status             TEXT    NOT NULL DEFAULT 'queued'
        CHECK (status IN ('queued', 'sending', 'sent', 'failed', 'cancelled', 'unknown')),
    attempts_remaining INTEGER NOT NULL DEFAULT 5,
    attempts           INTEGER NOT NULL DEFAULT 0,
    thread_lock        TEXT,
    locked_at          TEXT,
    processed_at       TEXT,
    from_name          TEXT,
    from_address       TEXT,
    to_address         TEXT    NOT NULL,
    cc                 TEXT,
    bcc                TEXT,
    reply_to           TEXT,
    subject            TEXT    NOT NULL DEFAULT '',
    body               TEXT,
    body_html          TEXT,
    headers            TEXT CHECK (headers IS NULL OR json_type(headers) = 'object'),
    message_id         TEXT,
    dedupe_key         TEXT UNIQUE,
    last_error         TEXT,
    CHECK (attempts_remaining >= 0 AND attempts >= 0),
    -- A queued row always has a try left: an exhausted row is failed, not parked.
    CHECK (status <> 'queued' OR attempts_remaining > 0),
    CHECK (status <> 'sending' OR (thread_lock IS NOT NULL AND locked_at IS NOT NULL))
);

-- Claim order of pending rows; partial so finished rows never make it grow.
CREATE INDEX mail_queue_claim_idx ON mail_queue (priority DESC, send_at, id)
    WHERE status = 'queued';

-- Stale-lock sweeps and lock renewal.
CREATE INDEX mail_queue_sending_idx ON mail_queue (locked_at, thread_lock)
    WHERE status = 'sending';

-- Retention deletes of finished rows.
CREATE INDEX mail_queue_finished_idx ON mail_queue (processed_at)
    WHERE status IN ('sent', 'failed', 'cancelled');
