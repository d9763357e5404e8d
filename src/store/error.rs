//! What went wrong with the database, typed by what an operator or the
//! worker does about it: wait and retry (unavailable, timeout), run the
//! migrations (schema), or look at the data (a refused write).

use std::time::Duration;

/// What went wrong with the database, by what an operator does about it.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database cannot be reached or dropped the connection: wait and retry.
    #[error("database unavailable: {0}")]
    Unavailable(sqlx::Error),
    /// A call outlived `database.statement_timeout`; its connection was dropped.
    #[error("database did not answer within {}", humantime::format_duration(*.0))]
    Timeout(Duration),
    /// The table is missing or lacks a column: run `tablemail migrate`.
    #[error("database schema: {0} (run `tablemail migrate`)")]
    Schema(sqlx::Error),
    /// A unique or check constraint refused the write.
    #[error("database refused the write: {0}")]
    Conflict(sqlx::Error),
    #[error("database: {0}")]
    Database(sqlx::Error),
    #[error("migration: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    #[error("{0}")]
    Unsupported(String),
}

impl From<sqlx::Error> for StoreError {
    fn from(e: sqlx::Error) -> Self {
        use sqlx::Error as E;
        match &e {
            E::Io(_) | E::Tls(_) | E::PoolTimedOut | E::PoolClosed | E::WorkerCrashed => {
                StoreError::Unavailable(e)
            }
            E::Protocol(_) => StoreError::Unavailable(e),
            E::ColumnNotFound(_) => StoreError::Schema(e),
            E::Database(db) => {
                let code = db.code().unwrap_or_default();
                // SQLite: the file cannot be opened (a missing directory, no
                // permission): nothing to run the statement on.
                if code == "14" && message_is_cant_open(db.message()) {
                    return StoreError::Unavailable(e);
                }
                let message = db.message();
                if db.is_unique_violation() || db.is_check_violation() {
                    StoreError::Conflict(e)
                } else if matches!(code.as_ref(), "42P01" | "42703" | "42S02" | "42S22")
                    || message.starts_with("no such table")
                    || message.starts_with("no such column")
                    || message.contains("has no column named")
                {
                    StoreError::Schema(e)
                } else if matches!(
                    code.as_ref(),
                    "57P01" | "57P02" | "57P03" | "08006" | "08003"
                ) {
                    // Server shutting down, crashed or restarting.
                    StoreError::Unavailable(e)
                } else {
                    StoreError::Database(e)
                }
            }
            _ => StoreError::Database(e),
        }
    }
}

impl StoreError {
    /// The log message for this kind of failure, stable because operators
    /// match on it (the README lists each): the worker retries every kind,
    /// but an operator acts on each differently.
    pub fn summary(&self) -> &'static str {
        match self {
            StoreError::Unavailable(_) | StoreError::Timeout(_) => "database unavailable",
            StoreError::Schema(_) | StoreError::Migrate(_) => {
                "database schema out of date: run tablemail migrate"
            }
            StoreError::Conflict(_) => "database refused the write",
            StoreError::Database(_) | StoreError::Unsupported(_) => "database error",
        }
    }
}

fn message_is_cant_open(message: &str) -> bool {
    message.contains("unable to open database file")
}

pub type Result<T, E = StoreError> = std::result::Result<T, E>;
