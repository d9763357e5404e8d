//! DESIGN §2 row by row: each test is one line of the table.
use super::*;
use crate::smtp::{failure_label, Reply};

fn policy() -> Policy {
    Policy {
        ambiguous: Ambiguous::Resend,
        retry_base: Duration::from_secs(60),
        retry_max: Duration::from_secs(3600),
        relay_down_limit: 3,
    }
}

fn row(attempts_remaining: i32) -> Row {
    Row {
        attempts: 5 - attempts_remaining,
        attempts_remaining,
        relay_down_count: 0,
    }
}

fn replied(stage: Stage, code: u16, text: &str) -> Attempt {
    Attempt::Failed(SendError::replied(
        stage,
        Reply {
            code,
            text: text.into(),
        },
    ))
}

fn broke(stage: Stage) -> Attempt {
    Attempt::Failed(SendError::broke(stage, "connection reset"))
}

fn decide_alone(attempt: &Attempt, row: Row) -> Decision {
    decide(attempt, row, RelayView::default(), &policy(), 0.5)
}

fn action_name(a: &FinalAction) -> &'static str {
    match a {
        FinalAction::Sent => "sent",
        FinalAction::Retry { .. } => "retry",
        FinalAction::Failed { .. } => "failed",
        FinalAction::Unknown { .. } => "unknown",
        FinalAction::Release => "release",
        FinalAction::Defer { .. } => "defer",
        FinalAction::Suppressed { .. } => "suppressed",
    }
}

/// DESIGN §2's table: each case with the row's final state.
#[test]
fn the_failure_table() {
    let down = RelaySignal::Down {
        needs_operator: false,
    };
    let operator = RelaySignal::Down {
        needs_operator: true,
    };
    let cases: Vec<(&str, Attempt, &str, RelaySignal)> = vec![
        (
            "250",
            Attempt::Delivered(Delivered {
                relay: Default::default(),
                code: 250,
                reply: "ok".into(),
            }),
            "sent",
            RelaySignal::WentThrough,
        ),
        ("connection refused", broke(Stage::Connect), "release", down),
        ("greeting timeout", broke(Stage::Greeting), "release", down),
        ("TLS failure", broke(Stage::Tls), "release", operator),
        (
            "AUTH rejected",
            replied(Stage::Auth, 535, "5.7.8 no"),
            "release",
            operator,
        ),
        (
            "AUTH 454",
            replied(Stage::Auth, 454, "4.7.0 later"),
            "release",
            down,
        ),
        (
            "421 greeting",
            replied(Stage::Greeting, 421, "busy"),
            "release",
            down,
        ),
        (
            "4xx greeting",
            replied(Stage::Greeting, 450, "busy"),
            "release",
            down,
        ),
        (
            "554 greeting",
            replied(Stage::Greeting, 554, "no service"),
            "release",
            down,
        ),
        (
            "451 MAIL",
            replied(Stage::MailFrom, 451, "later"),
            "retry",
            RelaySignal::Quiet,
        ),
        (
            "450 RCPT",
            replied(Stage::RcptTo, 450, "later"),
            "retry",
            RelaySignal::Quiet,
        ),
        (
            "451 DATA",
            replied(Stage::Data, 451, "later"),
            "retry",
            RelaySignal::Quiet,
        ),
        (
            "451 after dot",
            replied(Stage::AfterDot, 451, "later"),
            "retry",
            RelaySignal::Quiet,
        ),
        (
            "drop at RCPT",
            broke(Stage::RcptTo),
            "retry",
            RelaySignal::Quiet,
        ),
        (
            "drop in the body",
            broke(Stage::Body),
            "retry",
            RelaySignal::Quiet,
        ),
        (
            "550 RCPT",
            replied(Stage::RcptTo, 550, "unknown"),
            "failed",
            RelaySignal::Quiet,
        ),
        (
            "554 after dot",
            replied(Stage::AfterDot, 554, "spam"),
            "failed",
            RelaySignal::Quiet,
        ),
        (
            "500 MAIL",
            replied(Stage::MailFrom, 500, "no"),
            "failed",
            RelaySignal::Quiet,
        ),
        (
            "drop after dot",
            broke(Stage::AfterDot),
            "retry",
            RelaySignal::Quiet,
        ),
        (
            "refused by tablemail: the relay lacks SMTPUTF8",
            Attempt::Failed(SendError::refused_here(Stage::MailFrom, "needs SMTPUTF8")),
            "failed",
            RelaySignal::Quiet,
        ),
        (
            "invalid address",
            Attempt::Invalid(MailError::NoRecipient),
            "failed",
            RelaySignal::Quiet,
        ),
        ("expired", Attempt::Expired, "failed", RelaySignal::Quiet),
        (
            "every recipient suppressed",
            Attempt::Suppressed,
            "suppressed",
            RelaySignal::Quiet,
        ),
        (
            "relay paused",
            Attempt::Held(Hold::RelayPaused),
            "release",
            RelaySignal::Quiet,
        ),
    ];
    for (what, attempt, expected, signal) in cases {
        let d = decide_alone(&attempt, row(4));
        assert_eq!(action_name(&d.action), expected, "{what}");
        assert_eq!(d.relay, signal, "{what}");
    }
}

#[test]
fn a_mail_with_every_recipient_suppressed_ends_unspent() {
    // Even on its last attempt: nothing was tried, so nothing is spent.
    let d = decide_alone(&Attempt::Suppressed, row(0));
    assert_eq!(d.logged, Logged::Suppressed);
    let columns = d.action.columns();
    assert_eq!(columns.status, "suppressed");
    assert!(columns.refund && columns.processed, "{columns:?}");
}

#[test]
fn transient_failures_fail_when_no_attempt_remains() {
    let d = decide_alone(&replied(Stage::RcptTo, 451, "later"), row(0));
    assert!(matches!(d.action, FinalAction::Failed { .. }), "{d:?}");
    let d = decide_alone(&replied(Stage::RcptTo, 451, "later"), row(2));
    match d.action {
        // Third try: 1m doubled twice.
        FinalAction::Retry { delay, error, .. } => {
            assert_eq!(delay, Duration::from_secs(240));
            assert_eq!(error, "RCPT TO: 451 later");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_lost_reply_after_the_dot_is_resent_or_held() {
    let d = decide_alone(&broke(Stage::AfterDot), row(4));
    assert!(matches!(d.action, FinalAction::Retry { .. }));
    assert_eq!(d.logged, Logged::Ambiguous);
    let hold = Policy {
        ambiguous: Ambiguous::Hold,
        ..policy()
    };
    let d = decide(
        &broke(Stage::AfterDot),
        row(4),
        RelayView::default(),
        &hold,
        0.5,
    );
    assert!(matches!(d.action, FinalAction::Unknown { .. }));
    // The last attempt's reply was lost: unknown, whatever the setting.
    let d = decide_alone(&broke(Stage::AfterDot), row(0));
    assert!(matches!(d.action, FinalAction::Unknown { .. }));
}

#[test]
fn a_send_cut_off_is_judged_by_the_stage_it_reached() {
    for stage in [Stage::Connect, Stage::RcptTo, Stage::Data, Stage::Body] {
        let cut = Attempt::CutOff {
            stage,
            by: CutOff::Shutdown,
        };
        assert_eq!(
            decide_alone(&cut, row(4)).action,
            FinalAction::Release,
            "{stage:?}"
        );
    }
    let after_dot = Attempt::CutOff {
        stage: Stage::AfterDot,
        by: CutOff::Shutdown,
    };
    let d = decide_alone(&after_dot, row(4));
    assert!(matches!(d.action, FinalAction::Retry { .. }), "{d:?}");
    assert_eq!(d.logged, Logged::Ambiguous);
    let hold = Policy {
        ambiguous: Ambiguous::Hold,
        ..policy()
    };
    let d = decide(&after_dot, row(4), RelayView::default(), &hold, 0.5);
    assert!(matches!(d.action, FinalAction::Unknown { .. }), "{d:?}");
    // A crash before "." spends the attempt: a poison row cannot loop.
    let crash = Attempt::CutOff {
        stage: Stage::Body,
        by: CutOff::Crash,
    };
    assert!(matches!(
        decide_alone(&crash, row(4)).action,
        FinalAction::Retry { .. }
    ));
    assert!(matches!(
        decide_alone(&crash, row(0)).action,
        FinalAction::Failed { .. }
    ));
}

#[test]
fn one_row_that_keeps_drawing_421_is_deferred_then_spends() {
    let others = RelayView {
        others_went_through: true,
        refusals_in_a_row: 0,
    };
    let refusal = replied(Stage::RcptTo, 421, "4.7.0 try later");
    for count in 0..3 {
        let r = Row {
            relay_down_count: count,
            ..row(4)
        };
        let d = decide(&refusal, r, others, &policy(), 0.5);
        match &d.action {
            FinalAction::Defer {
                delay,
                counted: true,
                error,
            } => {
                assert_eq!(*delay, Duration::from_secs(60) * (1 << count));
                assert!(error.starts_with("RCPT TO: 421 4.7.0"), "{error}");
            }
            other => panic!("deferral {count}: {other:?}"),
        }
        assert_eq!(d.relay, RelaySignal::Quiet, "others go through: no pause");
    }
    let r = Row {
        relay_down_count: 3,
        ..row(4)
    };
    let d = decide(&refusal, r, others, &policy(), 0.5);
    assert!(
        matches!(
            d.action,
            FinalAction::Retry {
                relay_down: true,
                ..
            }
        ),
        "{d:?}"
    );
    let r = Row {
        relay_down_count: 5,
        ..row(0)
    };
    let d = decide(&refusal, r, others, &policy(), 0.5);
    assert!(matches!(d.action, FinalAction::Failed { .. }), "{d:?}");
}

#[test]
fn refusals_of_several_mails_in_a_row_pause_the_relay() {
    let refusal = replied(Stage::MailFrom, 421, "4.3.2 too busy");
    let first = decide(&refusal, row(4), RelayView::default(), &policy(), 0.5);
    assert!(
        matches!(first.action, FinalAction::Defer { counted: false, .. }),
        "the first is moved out of the way, not blamed: {first:?}"
    );
    assert_eq!(first.relay, RelaySignal::Quiet);
    let view = RelayView {
        others_went_through: false,
        refusals_in_a_row: 1,
    };
    let second = decide(&refusal, row(4), view, &policy(), 0.5);
    assert_eq!(second.action, FinalAction::Release);
    assert_eq!(
        second.relay,
        RelaySignal::Down {
            needs_operator: false
        }
    );
    // A refused connection is never one row's fault.
    let view = RelayView {
        others_went_through: true,
        refusals_in_a_row: 0,
    };
    let d = decide(&broke(Stage::Connect), row(4), view, &policy(), 0.5);
    assert_eq!(d.action, FinalAction::Release);
}

#[test]
fn a_configuration_fault_never_burns_a_mail() {
    let d = decide_alone(&Attempt::Invalid(MailError::NoSender), row(0));
    assert!(
        matches!(d.action, FinalAction::Defer { counted: false, .. }),
        "{d:?}"
    );
    assert_eq!(d.relay, RelaySignal::ConfigFault);
}

#[test]
fn throttled_domains_defer_without_spending() {
    let held = Attempt::Held(Hold::DomainThrottled {
        domain: "example.org".into(),
        wait: Duration::from_secs(2),
    });
    match decide_alone(&held, row(4)).action {
        FinalAction::Defer {
            delay,
            counted: false,
            error,
        } => {
            assert_eq!(delay, Duration::from_secs(2));
            assert_eq!(error, "deferred: example.org asked to slow down");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn the_label_reads_the_key_a_failure_stores() {
    let e = SendError::replied(
        Stage::RcptTo,
        Reply {
            code: 550,
            text: "unknown".into(),
        },
    );
    let attempt = Attempt::Failed(e);
    assert_eq!(failure_label(stage_key(&attempt), Some(550)), "RCPT TO 550");
    let refused = Attempt::Failed(SendError::refused_here(Stage::MailFrom, "no SMTPUTF8"));
    assert_eq!(
        failure_label(stage_key(&refused), None),
        "refused by tablemail"
    );
    // A route's troubles are named as such, not as a missing sender or a
    // domain's throttling.
    let unknown = Attempt::Held(Hold::UnknownRoute("billing".into()));
    assert_eq!(
        failure_label(stage_key(&unknown), None),
        "route not configured"
    );
    let paused = Attempt::Held(Hold::RoutePaused {
        route: "support".into(),
        wait: Duration::from_secs(1),
    });
    assert_eq!(failure_label(stage_key(&paused), None), "route unavailable");
}

#[test]
fn every_attempt_but_a_sent_or_untried_one_leaves_history() {
    let failed = |stage, code: Option<u16>| {
        Attempt::Failed(match code {
            Some(code) => SendError::replied(
                stage,
                Reply {
                    code,
                    text: "x".into(),
                },
            ),
            None => SendError::broke(stage, "reset"),
        })
    };
    let retry = FinalAction::Retry {
        delay: Duration::from_secs(60),
        error: "x".into(),
        relay_down: false,
    };
    type Row = Option<(EventOutcome, Option<&'static str>)>;
    let cases: Vec<(Attempt, FinalAction, Row)> = vec![
        (
            failed(Stage::RcptTo, Some(451)),
            retry.clone(),
            Some((EventOutcome::Retry, Some("rcpt"))),
        ),
        (
            failed(Stage::Connect, None),
            FinalAction::Release,
            Some((EventOutcome::Released, Some("connect"))),
        ),
        (
            Attempt::Held(Hold::ShuttingDown),
            FinalAction::Release,
            None,
        ),
        (Attempt::Held(Hold::RelayPaused), FinalAction::Release, None),
        (
            Attempt::Held(Hold::DomainThrottled {
                domain: "example.org".into(),
                wait: Duration::from_secs(1),
            }),
            FinalAction::Defer {
                delay: Duration::from_secs(1),
                error: "x".into(),
                counted: false,
            },
            Some((EventOutcome::Deferred, Some("throttle"))),
        ),
        (
            Attempt::Expired,
            FinalAction::Failed {
                error: "expired".into(),
                relay_down: false,
            },
            Some((EventOutcome::Failed, Some("queue"))),
        ),
        // Each recipient left out has its own row already.
        (
            Attempt::Suppressed,
            FinalAction::Suppressed { error: "x".into() },
            None,
        ),
        (
            Attempt::CutOff {
                stage: Stage::AfterDot,
                by: CutOff::Shutdown,
            },
            FinalAction::Unknown { error: "x".into() },
            Some((EventOutcome::Unknown, Some("dot"))),
        ),
    ];
    for (attempt, action, expected) in cases {
        assert_eq!(
            history(&attempt, &action),
            expected,
            "{attempt:?} {action:?}"
        );
    }
    let delivered = Attempt::Delivered(crate::smtp::Delivered {
        code: 250,
        reply: "250 ok".into(),
        relay: crate::smtp::Role::Primary,
    });
    assert_eq!(history(&delivered, &FinalAction::Sent), None);
}
