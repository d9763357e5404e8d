//! `--routes`: what routing costs (DESIGN §13). The real-mix drain, half
//! its mails from `shop.example` and half from `support.example`, through
//! two routes (one per domain, each its own connections and relay gate,
//! both to the same sink) against the same mails through the default route
//! alone, in pairs whose order alternates.

use super::{paired, paired_report, Drain, Setup, Shape, Side};

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
    paired(
        Side {
            name: "one route",
            setup: &one,
            shape: Shape::Real,
        },
        Side {
            name: "two routes",
            setup: &two,
            shape: Shape::Real,
        },
        mails,
        runs,
    )
    .await
}

pub(super) fn report(pairs: &[(Drain, Drain)]) {
    paired_report(
        "routes: the real mix from two domains, through two routes against one",
        "two routes / one",
        pairs,
    );
}
