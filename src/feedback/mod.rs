//! Delivery reports that come back after the relay's 250 (DESIGN §12):
//! the VERP address that names a mail, the parser of what receivers send,
//! the correlation that ties a report to its mail and recipient with proof,
//! the SMTP listener that takes reports in, and the providers' webhooks
//! that report by HTTP (DESIGN §14).

pub mod inbound;
pub mod parse;
pub mod record;
pub mod verp;
pub mod webhooks;
