//! `--routes`: what routing costs (DESIGN §13). The real-mix drain, half
//! its mails from `shop.example` and half from `support.example`, through
//! two routes (one per domain, each its own connections and relay gate,
//! both to the same sink) against the same mails through the default route
//! alone, in pairs whose order alternates.

use super::{drain, line, spread, Drain, Setup, Shape};

/// (one route, two routes), one pair per run.
pub(super) async fn route_cost(
    setup: &Setup<'_>,
    mails: usize,
    runs: usize,
) -> Vec<(Drain, Drain)> {
    let one = Setup {
        split_from: true,
        two_routes: false,
        ..*setup
    };
    let two = Setup {
        split_from: true,
        two_routes: true,
        ..*setup
    };
    let mut pairs = Vec::new();
    for run in 1..=runs.max(1) {
        let (a, b) = if run % 2 == 1 {
            let a = drain(&one, mails, Shape::Real, false).await;
            (a, drain(&two, mails, Shape::Real, false).await)
        } else {
            let b = drain(&two, mails, Shape::Real, false).await;
            (drain(&one, mails, Shape::Real, false).await, b)
        };
        eprintln!(
            "run {run}: one route {:.0}/s, two routes {:.0}/s",
            a.rate, b.rate
        );
        pairs.push((a, b));
    }
    pairs
}

pub(super) fn report(pairs: &[(Drain, Drain)]) {
    println!("routes: the real mix from two domains, through two routes against one");
    let ratio = |f: &dyn Fn(&Drain) -> f64| -> Vec<f64> {
        pairs.iter().map(|(a, b)| f(b) / f(a)).collect()
    };
    line(
        "  mails/s, two routes / one",
        spread(ratio(&|d| d.rate), "x", 3),
    );
    line(
        "  daemon CPU per mail, two routes / one",
        spread(ratio(&|d| d.cpu_us_per_mail), "x", 3),
    );
}
