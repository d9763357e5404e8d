-- The delivery loop (DESIGN §12), SQLite flavour: what receivers report
-- after the relay's 250, tied to the mail and recipient it concerns, and the
-- addresses that are no longer mailed.

ALTER TABLE mail_queue ADD COLUMN bounced_at TEXT;
ALTER TABLE mail_queue ADD COLUMN bypass_suppression INTEGER NOT NULL DEFAULT 0;
-- The relay's queue id from its reply to "." ("queued as 4XyZ"): a report
-- that names only it still finds its mail, in one index probe.
ALTER TABLE mail_queue ADD COLUMN relay_queue_id TEXT;

-- The statuses bounced (every recipient the mail went to hard-bounced) and
-- suppressed (every recipient was on the suppression list). SQLite cannot
-- alter a CHECK constraint; rebuilding the table would cascade the deletes
-- of its history and attachments. Widening the list of allowed values
-- leaves every stored row valid, so the table's definition is edited in
-- place, as SQLite's documentation allows for such changes; the schema
-- version moves with the CREATE INDEX statements below.
PRAGMA writable_schema = ON;
UPDATE sqlite_schema
SET sql = replace(sql, '''cancelled'', ''unknown'')',
                       '''cancelled'', ''unknown'', ''bounced'', ''suppressed'')')
WHERE type = 'table' AND name = 'mail_queue';
PRAGMA writable_schema = OFF;

CREATE INDEX mail_queue_relay_queue_id_idx ON mail_queue (relay_queue_id)
    WHERE relay_queue_id IS NOT NULL;
CREATE INDEX mail_queue_finished_more_idx ON mail_queue (processed_at)
    WHERE status IN ('bounced', 'suppressed');

ALTER TABLE mail_event ADD COLUMN recipient TEXT;

CREATE TABLE mail_feedback (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    received_at TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f', 'now')),
    source      TEXT    NOT NULL,
    mail_id     INTEGER REFERENCES mail_queue (id) ON DELETE SET NULL,
    recipient   TEXT,
    kind        TEXT    NOT NULL,
    status      TEXT,
    diagnostic  TEXT,
    matched     INTEGER NOT NULL,
    size        INTEGER NOT NULL,
    raw         BLOB
);
CREATE INDEX mail_feedback_received_idx ON mail_feedback (received_at);
CREATE INDEX mail_feedback_mail_idx ON mail_feedback (mail_id);
CREATE INDEX mail_feedback_recipient_idx ON mail_feedback (recipient, received_at)
    WHERE matched;

CREATE TABLE mail_suppression (
    address    TEXT PRIMARY KEY,
    reason     TEXT NOT NULL
        CHECK (reason IN ('hard_bounce', 'soft_bounce', 'complaint', 'manual')),
    detail     TEXT,
    mail_id    INTEGER,
    created_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f', 'now')),
    expires_at TEXT
) WITHOUT ROWID;
