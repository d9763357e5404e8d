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
    name  VARCHAR(64) NOT NULL PRIMARY KEY,
    bound BIGINT      NOT NULL DEFAULT 0
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
CREATE TABLE mail_limit_use (
    limit_name  VARCHAR(64) NOT NULL,
    thread_lock CHAR(36)    NOT NULL,
    mails       BIGINT      NOT NULL,
    pending     BIGINT      NOT NULL,
    reserved_ms BIGINT      NOT NULL,
    sent_ms     BIGINT      NULL,
    PRIMARY KEY (limit_name, thread_lock),
    INDEX mail_limit_use_sent_idx (limit_name, sent_ms)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
