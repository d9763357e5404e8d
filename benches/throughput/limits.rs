//! The send caps' cost (DESIGN §16).
//!
//! `--limit-unreached`: the real-mix drain (a burst, statistics not taken)
//! under one cap that counts every mail and is never reached, against the
//! same drain without caps, in pairs, the order alternating from run to
//! run: what reserving room for every claim and settling it with every
//! group commit costs.

use super::{drain, line, spread, Drain, Setup, Shape, CONFIG_ARG};

/// (without, with) the cap, one pair per run.
pub(super) async fn limit_cost(
    setup: &Setup<'_>,
    mails: usize,
    runs: usize,
) -> Vec<(Drain, Drain)> {
    let config = setup.dir.join("limits.toml");
    std::fs::write(
        &config,
        r#"
[[limits]]
name = "never-reached"
from_domain = ["example.com"]
max = 1000000000
per = "24h"
"#,
    )
    .unwrap();
    let mut env = setup.env.to_vec();
    env.push((CONFIG_ARG, config.display().to_string()));
    let with = Setup {
        env: &env,
        ..*setup
    };
    let mut pairs = Vec::new();
    for run in 1..=runs.max(1) {
        let (a, b) = if run % 2 == 1 {
            let a = drain(setup, mails, Shape::Real, false).await;
            (a, drain(&with, mails, Shape::Real, false).await)
        } else {
            let b = drain(&with, mails, Shape::Real, false).await;
            (drain(setup, mails, Shape::Real, false).await, b)
        };
        eprintln!(
            "run {run}: without caps {:.0}/s, with a cap never reached {:.0}/s",
            a.rate, b.rate
        );
        pairs.push((a, b));
    }
    pairs
}

pub(super) fn limit_report(pairs: &[(Drain, Drain)]) {
    println!("the send caps: real-mix drains under one cap never reached against none");
    let ratio = |f: &dyn Fn(&Drain) -> f64| -> Vec<f64> {
        pairs.iter().map(|(a, b)| f(b) / f(a)).collect()
    };
    line(
        "  mails/s, with / without",
        spread(ratio(&|d| d.rate), "x", 3),
    );
    line(
        "  daemon CPU per mail, with / without",
        spread(ratio(&|d| d.cpu_us_per_mail), "x", 3),
    );
    line(
        "  database CPU per mail, with / without",
        spread(ratio(&|d| d.db_cpu_us_per_mail), "x", 3),
    );
}
