-- The index on thread_lock alone goes: no statement of the hot path looks a
-- row up by its lock (the claim, the group commit and lock renewal go by id;
-- the shutdown's release of a batch not yet started finds its rows through
-- the sending index, among the rows in flight), and every claim and every
-- outcome rewrote an entry of it (DESIGN §1 lists the indexes: the pending
-- rows in claim order, the sending rows for stale-lock sweeps, retention and
-- the unique dedupe key).
DROP INDEX mail_queue_lock_idx ON mail_queue;
