-- Send caps shared by every daemon (DESIGN §16). mail_limit has one row per
-- configured cap; SQLite has one writer at a time (BEGIN IMMEDIATE), which
-- serializes reservations. mail_limit_use has one row per cap and claim
-- (its lock): mails, the claim's mails the cap counts, and pending, those
-- whose outcome is not known yet; times are milliseconds since the epoch by
-- the database clock. A reservation counts its mails while sent_ms is NULL
-- (one of them may still go out) and then for one window after sent_ms (when
-- the last was known sent, or the claim was found no longer held). bound is
-- never less than what the cap counts: while bound plus a claim's mails fit
-- under max, a reservation needs no count.
CREATE TABLE mail_limit (
    name  TEXT    PRIMARY KEY,
    bound INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE mail_limit_use (
    limit_name  TEXT    NOT NULL,
    thread_lock TEXT    NOT NULL,
    mails       INTEGER NOT NULL,
    pending     INTEGER NOT NULL,
    reserved_ms INTEGER NOT NULL,
    sent_ms     INTEGER,
    PRIMARY KEY (limit_name, thread_lock)
);
CREATE INDEX mail_limit_use_sent_idx ON mail_limit_use (limit_name, sent_ms);
