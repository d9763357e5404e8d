-- Send caps shared by every daemon (DESIGN §16). mail_limit has one row per
-- configured cap: a daemon locks it (SELECT ... FOR UPDATE) to reserve, so
-- reservations for one cap are serialized across daemons. mail_limit_use has
-- one row per cap and claim (its lock): mails, the claim's mails the cap
-- counts, and pending, those whose outcome is not known yet; times are
-- milliseconds since the epoch by the database clock. A reservation counts
-- its mails while sent_ms is NULL (one of them may still go out) and then
-- for one window after sent_ms (when the last was known sent, or the claim
-- was found no longer held). bound is never less than what the cap counts:
-- while bound plus a claim's mails fit under max, a reservation needs no
-- count.
CREATE TABLE mail_limit (
    name  text   PRIMARY KEY,
    bound bigint NOT NULL DEFAULT 0
);
CREATE TABLE mail_limit_use (
    limit_name  text   NOT NULL,
    thread_lock text   NOT NULL,
    mails       bigint NOT NULL,
    pending     bigint NOT NULL,
    reserved_ms bigint NOT NULL,
    sent_ms     bigint,
    PRIMARY KEY (limit_name, thread_lock)
);
CREATE INDEX mail_limit_use_sent_idx ON mail_limit_use (limit_name, sent_ms);
