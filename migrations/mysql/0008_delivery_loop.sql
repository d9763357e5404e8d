-- The delivery loop (DESIGN §12), MySQL / MariaDB flavour: what receivers
-- report after the relay's 250, tied to the mail and recipient it concerns,
-- and the addresses that are no longer mailed.

-- bounced: every recipient the mail went to hard-bounced; suppressed: every
-- recipient was on the suppression list, so the mail never left. The new
-- statuses are finished ones: finished_status (migration 0007) already
-- counts them for retention.
ALTER TABLE mail_queue
    ADD COLUMN bounced_at DATETIME(6) NULL,
    ADD COLUMN bypass_suppression BOOLEAN NOT NULL DEFAULT FALSE,
    -- The relay's queue id from its reply to "." ("queued as 4XyZ"): a
    -- report that names only it still finds its mail, in one index probe.
    ADD COLUMN relay_queue_id VARCHAR(255) NULL,
    DROP CONSTRAINT mail_queue_status_check,
    ADD CONSTRAINT mail_queue_status_check
        CHECK (status IN ('queued', 'sending', 'sent', 'failed', 'cancelled', 'unknown',
                          'bounced', 'suppressed')),
    ADD INDEX mail_queue_relay_queue_id_idx (relay_queue_id);

-- The recipient a history row speaks of: reports and suppression are per
-- recipient.
ALTER TABLE mail_event ADD COLUMN recipient TEXT NULL;

-- Every report received, matched or not.
CREATE TABLE mail_feedback (
    id          BIGINT       NOT NULL AUTO_INCREMENT PRIMARY KEY,
    received_at DATETIME(6)  NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    source      VARCHAR(16)  NOT NULL,
    mail_id     BIGINT       NULL,
    recipient   VARCHAR(320) NULL,
    kind        VARCHAR(16)  NOT NULL,
    status      VARCHAR(32)  NULL,
    diagnostic  TEXT         NULL,
    matched     BOOLEAN      NOT NULL,
    size        INT          NOT NULL,
    raw         LONGBLOB     NULL,
    INDEX mail_feedback_received_idx (received_at),
    INDEX mail_feedback_mail_idx (mail_id),
    INDEX mail_feedback_recipient_idx (recipient, matched, received_at),
    CONSTRAINT mail_feedback_mail_fk FOREIGN KEY (mail_id)
        REFERENCES mail_queue (id) ON DELETE SET NULL
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

-- Addresses no mail goes to: lower-cased, the domain as A-labels.
CREATE TABLE mail_suppression (
    address    VARCHAR(320) NOT NULL PRIMARY KEY,
    reason     VARCHAR(16)  NOT NULL,
    detail     TEXT         NULL,
    mail_id    BIGINT       NULL,
    created_at DATETIME(6)  NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    expires_at DATETIME(6)  NULL,
    CONSTRAINT mail_suppression_reason_check
        CHECK (reason IN ('hard_bounce', 'soft_bounce', 'complaint', 'manual'))
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
