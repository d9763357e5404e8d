-- History, attachments and running daemons (DESIGN §7, §8, §9), SQLite
-- flavour: times as UTC text like mail_queue's, GUIDs as text. The daemon's
-- connections run with foreign_keys on, so attachments and history go with
-- their mail.

-- The relay's reply to "." of the attempt that sent the mail.
ALTER TABLE mail_queue ADD COLUMN relay_reply TEXT;
-- When an operator last put the mail back to queued: expiry counts from the
-- later of this and created_at.
ALTER TABLE mail_queue ADD COLUMN retried_at TEXT;

CREATE TABLE mail_attachment (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    mail_id      INTEGER NOT NULL REFERENCES mail_queue (id) ON DELETE CASCADE,
    filename     TEXT    NOT NULL,
    content_type TEXT    NOT NULL DEFAULT 'application/octet-stream',
    content      BLOB    NOT NULL,
    content_id   TEXT
);
CREATE INDEX mail_attachment_mail_idx ON mail_attachment (mail_id, id);

CREATE TABLE mail_event (
    id        INTEGER PRIMARY KEY AUTOINCREMENT,
    mail_id   INTEGER NOT NULL REFERENCES mail_queue (id) ON DELETE CASCADE,
    at        TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f', 'now')),
    attempt   INTEGER NOT NULL,
    outcome   TEXT    NOT NULL,
    stage     TEXT,
    smtp_code INTEGER,
    detail    TEXT
);
CREATE INDEX mail_event_mail_idx ON mail_event (mail_id, id);
CREATE INDEX mail_event_at_idx ON mail_event (at);

CREATE TABLE tablemail_daemon (
    id         TEXT    PRIMARY KEY,
    host       TEXT    NOT NULL,
    pid        INTEGER NOT NULL,
    version    TEXT    NOT NULL,
    started_at TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f', 'now')),
    last_seen  TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f', 'now')),
    in_flight  INTEGER NOT NULL DEFAULT 0,
    sent       INTEGER NOT NULL DEFAULT 0
);

CREATE TABLE tablemail_minute (
    minute    TEXT    NOT NULL,
    daemon_id TEXT    NOT NULL,
    sent      INTEGER NOT NULL DEFAULT 0,
    failed    INTEGER NOT NULL DEFAULT 0,
    attachment_bytes INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (minute, daemon_id)
);
