-- History, attachments and running daemons (DESIGN §7, §8, §9), MySQL /
-- MariaDB flavour: times as UTC DATETIME(6), GUIDs as CHAR(36). An attachment
-- travels in one packet: max_allowed_packet must exceed the largest one
-- (README, "Attachments").

-- The relay's reply to "." of the attempt that sent the mail.
ALTER TABLE mail_queue ADD COLUMN relay_reply TEXT NULL;
-- When an operator last put the mail back to queued: expiry counts from the
-- later of this and created_at.
ALTER TABLE mail_queue ADD COLUMN retried_at DATETIME(6) NULL;

CREATE TABLE mail_attachment (
    id           BIGINT       NOT NULL AUTO_INCREMENT PRIMARY KEY,
    mail_id      BIGINT       NOT NULL,
    filename     TEXT         NOT NULL,
    content_type VARCHAR(255) NOT NULL DEFAULT 'application/octet-stream',
    content      LONGBLOB     NOT NULL,
    content_id   VARCHAR(255) NULL,
    INDEX mail_attachment_mail_idx (mail_id, id),
    CONSTRAINT mail_attachment_mail_fk FOREIGN KEY (mail_id)
        REFERENCES mail_queue (id) ON DELETE CASCADE
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

CREATE TABLE mail_event (
    id        BIGINT      NOT NULL AUTO_INCREMENT PRIMARY KEY,
    mail_id   BIGINT      NOT NULL,
    at        DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    attempt   INT         NOT NULL,
    outcome   VARCHAR(16) NOT NULL,
    stage     VARCHAR(16) NULL,
    smtp_code INT         NULL,
    detail    TEXT        NULL,
    INDEX mail_event_mail_idx (mail_id, id),
    INDEX mail_event_at_idx (at),
    CONSTRAINT mail_event_mail_fk FOREIGN KEY (mail_id)
        REFERENCES mail_queue (id) ON DELETE CASCADE
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

CREATE TABLE tablemail_daemon (
    id         CHAR(36)     NOT NULL PRIMARY KEY,
    host       VARCHAR(255) NOT NULL,
    pid        INT          NOT NULL,
    version    VARCHAR(64)  NOT NULL,
    started_at DATETIME(6)  NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    last_seen  DATETIME(6)  NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    in_flight  INT          NOT NULL DEFAULT 0,
    sent       BIGINT       NOT NULL DEFAULT 0
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

CREATE TABLE tablemail_minute (
    minute    DATETIME(6) NOT NULL,
    daemon_id CHAR(36)    NOT NULL,
    sent      BIGINT      NOT NULL DEFAULT 0,
    failed    BIGINT      NOT NULL DEFAULT 0,
    attachment_bytes BIGINT      NOT NULL DEFAULT 0,
    PRIMARY KEY (minute, daemon_id)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
