-- Templates in the database (DESIGN §15): subject, text and HTML per name
-- and locale ('' = the default), rendered at send time with a row's
-- template_data. The daemon caches compiled templates until updated_at
-- changes: an UPDATE of a template sets updated_at too.
CREATE TABLE mail_template (
    name       text        NOT NULL,
    locale     text        NOT NULL DEFAULT '',
    subject    text        NOT NULL DEFAULT '',
    body       text,
    body_html  text,
    updated_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT mail_template_pkey PRIMARY KEY (name, locale)
);

-- A row that names a template: its data (a JSON object) and the locale
-- wanted; the template fills subject, body and body_html the row leaves
-- empty.
ALTER TABLE mail_queue
    ADD COLUMN template text,
    ADD COLUMN template_data jsonb
        CONSTRAINT mail_queue_template_data_check
        CHECK (template_data IS NULL OR jsonb_typeof(template_data) = 'object'),
    ADD COLUMN locale text;
