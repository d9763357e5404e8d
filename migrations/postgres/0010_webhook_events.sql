-- Reports from providers' webhooks (DESIGN §14): the provider's own id of
-- each event, so that a provider's retry of the same event is recorded once.
-- Only webhook reports carry one: the index holds those rows alone.
ALTER TABLE mail_feedback ADD COLUMN event_key text;
CREATE UNIQUE INDEX mail_feedback_event_key_idx ON mail_feedback (event_key)
    WHERE event_key IS NOT NULL;
