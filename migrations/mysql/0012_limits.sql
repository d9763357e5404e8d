-- Send caps shared by every daemon (DESIGN §16). mail_limit has one row per
-- configured cap: a daemon locks it (SELECT ... FOR UPDATE) to reserve, so
-- reservations for one cap are serialized across daemons. mail_limit_use has
-- one row per mail a cap counted, under the claim's lock; times are
-- milliseconds since the epoch by the database clock. A reservation counts
-- while sent_ms is NULL (its mail may still go out) and then for one window
-- after sent_ms (when it was known sent, or found no longer held). bound is
-- never less than what the cap counts: while bound plus a claim's mails fit
-- under max, a reservation needs no count.
CREATE TABLE mail_limit (
    name  VARCHAR(64) NOT NULL PRIMARY KEY,
    bound BIGINT      NOT NULL DEFAULT 0
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
CREATE TABLE mail_limit_use (
    limit_name  VARCHAR(64) NOT NULL,
    mail_id     BIGINT      NOT NULL,
    thread_lock CHAR(36)    NOT NULL,
    reserved_ms BIGINT      NOT NULL,
    sent_ms     BIGINT      NULL,
    PRIMARY KEY (mail_id, limit_name, thread_lock),
    INDEX mail_limit_use_sent_idx (limit_name, sent_ms)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
