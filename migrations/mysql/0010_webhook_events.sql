-- Reports from providers' webhooks (DESIGN §14), MySQL / MariaDB flavour:
-- the provider's own id of each event, so that a provider's retry of the
-- same event is recorded once. A unique index admits any number of NULLs:
-- the reports of other sources carry none.
ALTER TABLE mail_feedback
    ADD COLUMN event_key VARCHAR(255) NULL,
    ADD UNIQUE INDEX mail_feedback_event_key_idx (event_key);
