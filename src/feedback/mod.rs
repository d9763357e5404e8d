//! Delivery reports that come back after the relay's 250 (DESIGN §12).

pub mod inbound;
pub mod parse;
