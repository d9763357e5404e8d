-- Relay-down outcomes (421, refused connection…) a row drew in a row while
-- other mails went through: after worker.relay_down_limit of them, the row
-- spends attempts like any transient failure (DESIGN §2).
ALTER TABLE mail_queue ADD COLUMN relay_down_count INTEGER NOT NULL DEFAULT 0;
