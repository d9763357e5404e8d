-- Templates in the database (DESIGN §15): subject, text and HTML per name
-- and locale ('' = the default), rendered at send time with a row's
-- template_data. The daemon caches compiled templates until updated_at
-- changes: an UPDATE of a template sets updated_at too.
CREATE TABLE mail_template (
    name       TEXT NOT NULL,
    locale     TEXT NOT NULL DEFAULT '',
    subject    TEXT NOT NULL DEFAULT '',
    body       TEXT,
    body_html  TEXT,
    updated_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f', 'now')),
    PRIMARY KEY (name, locale)
);

-- A row that names a template: its data (a JSON object) and the locale
-- wanted; the template fills subject, body and body_html the row leaves
-- empty.
ALTER TABLE mail_queue ADD COLUMN template TEXT;
ALTER TABLE mail_queue ADD COLUMN template_data TEXT
    CHECK (template_data IS NULL OR json_type(template_data) = 'object');
ALTER TABLE mail_queue ADD COLUMN locale TEXT;
