//! The send caps' cost (DESIGN §16).
//!
//! `--limit-unreached`: the real-mix drain (a burst, statistics not taken)
//! under one cap that counts every mail and is never reached, against the
//! same drain without caps, in pairs, the order alternating from run to
//! run: what reserving room for every claim and settling it with every
//! group commit costs.

use super::{paired, paired_report, Drain, Setup, Shape, Side, CONFIG_ARG};

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
    paired(
        Side {
            name: "without caps",
            setup,
            shape: Shape::Real,
        },
        Side {
            name: "with a cap never reached",
            setup: &with,
            shape: Shape::Real,
        },
        mails,
        runs,
    )
    .await
}

pub(super) fn limit_report(pairs: &[(Drain, Drain)]) {
    paired_report(
        "the send caps: real-mix drains under one cap never reached against none",
        "with / without",
        pairs,
    );
}
