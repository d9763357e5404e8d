//! Delivery reports that come back after the relay's 250 (DESIGN §12):
//! the VERP address that names a mail, the parser of what receivers send,
//! the correlation that ties a report to its mail and recipient with proof,
//! and the SMTP listener that takes reports in.

pub mod inbound;
pub mod parse;
pub mod record;
pub mod verp;
