#![forbid(unsafe_code)]

use std::process::ExitCode;

use clap::Parser;
use tablemail::{cli::Cli, commands, config::Settings, telemetry};

fn main() -> ExitCode {
    let cli = Cli::parse();
    let settings = match Settings::load(cli.config.as_deref()) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("tablemail: {e}");
            return ExitCode::from(commands::EXIT_CONFIG);
        }
    };
    let _logs = telemetry::init(&settings.log);
    let runtime = match commands::runtime() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("tablemail: cannot start: {e}");
            return ExitCode::from(commands::EXIT_RUNTIME);
        }
    };
    runtime.block_on(commands::execute(cli.command, settings))
}
