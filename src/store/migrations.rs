//! The migrations of each backend, embedded at build time (see build.rs), and
//! the migrator that applies them with our own bookkeeping table.

use std::borrow::Cow;

use sqlx::{
    migrate::{Migration, MigrationType, Migrator},
    SqlStr,
};

include!(concat!(env!("OUT_DIR"), "/migrations.rs"));

/// A migrator for one backend's migrations. It records them in
/// `tablemail_migrations`, so an application's own sqlx migrations in the same
/// schema never collide with ours.
pub(crate) fn migrator(files: &'static [(i64, &'static str, &'static str)]) -> Migrator {
    let migrations = files
        .iter()
        .map(|(version, name, sql)| {
            Migration::new(
                *version,
                Cow::Borrowed(*name),
                MigrationType::Simple,
                SqlStr::from_static(sql),
                false,
            )
        })
        .collect();
    let mut migrator = Migrator::with_migrations(migrations);
    migrator.dangerous_set_table_name("tablemail_migrations");
    migrator
}
