#![forbid(unsafe_code)]

use std::process::ExitCode;

use clap::Parser;
use tablemail::{cli::Cli, commands, config::Settings, telemetry};

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let settings = match Settings::load(cli.config.as_deref()) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("tablemail: {e}");
            return ExitCode::from(commands::EXIT_CONFIG);
        }
    };
    let _logs = telemetry::init(&settings.log);
    commands::execute(cli.command, settings).await
}
