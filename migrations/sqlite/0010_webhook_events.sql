-- Reports from providers' webhooks (DESIGN §14), SQLite flavour: the
-- provider's own id of each event, so that a provider's retry of the same
-- event is recorded once. Only webhook reports carry one.
ALTER TABLE mail_feedback ADD COLUMN event_key TEXT;
CREATE UNIQUE INDEX mail_feedback_event_key_idx ON mail_feedback (event_key)
    WHERE event_key IS NOT NULL;
