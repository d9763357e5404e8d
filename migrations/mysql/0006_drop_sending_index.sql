-- The sending index (status, locked_at) goes. Here, without partial indexes,
-- status leads every index, so each claim and each outcome moved the row's
-- entry in it as well as in the pending and the retention index: a third of
-- the index work of every status change. The rows it found, those being sent,
-- are found as well by the status prefix of the pending index and of the
-- retention index: the stale-lock sweep, the count of stale locks and the
-- release of a batch at shutdown read the rows in flight, and no others,
-- through either of them (DESIGN §1: the pending rows in claim order, the
-- sending rows for stale-lock sweeps, retention and the unique dedupe key).
DROP INDEX mail_queue_sending_idx ON mail_queue;
