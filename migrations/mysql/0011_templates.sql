-- Templates in the database (DESIGN §15): subject, text and HTML per name
-- and locale ('' = the default), rendered at send time with a row's
-- template_data. The daemon caches compiled templates until updated_at
-- changes: an UPDATE of a template sets updated_at too.
CREATE TABLE mail_template (
    name       VARCHAR(190) NOT NULL,
    locale     VARCHAR(35)  NOT NULL DEFAULT '',
    subject    TEXT         NOT NULL DEFAULT (''),
    body       LONGTEXT     NULL,
    body_html  LONGTEXT     NULL,
    updated_at DATETIME(6)  NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    PRIMARY KEY (name, locale)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

-- A row that names a template: its data (a JSON object) and the locale
-- wanted; the template fills subject, body and body_html the row leaves
-- empty.
ALTER TABLE mail_queue
    ADD COLUMN template VARCHAR(190) NULL,
    ADD COLUMN template_data JSON NULL,
    ADD COLUMN locale VARCHAR(35) NULL,
    ADD CONSTRAINT mail_queue_template_data_check
        CHECK (template_data IS NULL OR JSON_TYPE(template_data) = 'OBJECT');
