-- tablemail: the mail queue table (DESIGN §1), MySQL 8 / MariaDB 10.6+ flavour.
-- Times are DATETIME(6) in UTC: defaults use UTC_TIMESTAMP(6), whatever the
-- session time zone. thread_lock holds the batch GUID as text.

CREATE TABLE mail_queue (
    id                 BIGINT      NOT NULL AUTO_INCREMENT PRIMARY KEY,
    created_at         DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    send_at            DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    priority           INT         NOT NULL DEFAULT 0,
    status             VARCHAR(16) NOT NULL DEFAULT 'queued',
    attempts_remaining INT         NOT NULL DEFAULT 5,
    attempts           INT         NOT NULL DEFAULT 0,
    thread_lock        CHAR(36)    NULL,
    locked_at          DATETIME(6) NULL,
    processed_at       DATETIME(6) NULL,
    from_name          TEXT        NULL,
    from_address       TEXT        NULL,
    to_address         TEXT        NOT NULL,
    cc                 TEXT        NULL,
    bcc                TEXT        NULL,
    reply_to           TEXT        NULL,
    subject            TEXT        NOT NULL DEFAULT (''),
    body               LONGTEXT    NULL,
    body_html          LONGTEXT    NULL,
    headers            JSON        NULL,
    message_id         VARCHAR(255) NULL,
    dedupe_key         VARCHAR(255) NULL,
    last_error         TEXT        NULL,
    CONSTRAINT mail_queue_status_check
        CHECK (status IN ('queued', 'sending', 'sent', 'failed', 'cancelled', 'unknown')),
    CONSTRAINT mail_queue_attempts_check
        CHECK (attempts_remaining >= 0 AND attempts >= 0),
    -- A queued row always has a try left: an exhausted row is failed, not parked.
    CONSTRAINT mail_queue_queued_has_attempts_check
        CHECK (status <> 'queued' OR attempts_remaining > 0),
    CONSTRAINT mail_queue_headers_check
        CHECK (headers IS NULL OR JSON_TYPE(headers) = 'OBJECT'),
    CONSTRAINT mail_queue_dedupe_key_key UNIQUE (dedupe_key),
    -- No partial indexes here: status leads each index instead. The claim
    -- order needs descending-index support (MySQL 8, MariaDB 10.8+) to avoid a
    -- sort; older MariaDB gives the same order, sorted.
    INDEX mail_queue_claim_idx (status, priority DESC, send_at, id),
    INDEX mail_queue_sending_idx (status, locked_at),
    INDEX mail_queue_lock_idx (thread_lock),
    INDEX mail_queue_finished_idx (status, processed_at)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
