//! Table-driven tests: one table per family of report, each row a report
//! written for these tests in the shape its server sends (`testdata/`, or
//! inline for the small edge cases), with the report read from it. Every row
//! is also read with CRLF line ends and must read the same.

use super::*;

/// Every fixture, for the property tests to mutate and splice.
pub(super) const FIXTURES: &[&[u8]] = &[
    include_bytes!("testdata/arf_abuse.eml"),
    include_bytes!("testdata/arf_redacted.eml"),
    include_bytes!("testdata/autoreply_outlook.eml"),
    include_bytes!("testdata/autoreply_rfc3834.eml"),
    include_bytes!("testdata/dsn_mixed.eml"),
    include_bytes!("testdata/exchange2003.eml"),
    include_bytes!("testdata/exchange_text.eml"),
    include_bytes!("testdata/exim_delay.eml"),
    include_bytes!("testdata/exim_dsn.eml"),
    include_bytes!("testdata/exim_text.eml"),
    include_bytes!("testdata/generic.eml"),
    include_bytes!("testdata/global_dsn.eml"),
    include_bytes!("testdata/gmail_dsn.eml"),
    include_bytes!("testdata/gmail_text.eml"),
    include_bytes!("testdata/office365_dsn.eml"),
    include_bytes!("testdata/office365_text.eml"),
    include_bytes!("testdata/postfix_delayed.eml"),
    include_bytes!("testdata/postfix_dsn.eml"),
    include_bytes!("testdata/postfix_text.eml"),
    include_bytes!("testdata/qmail.eml"),
    include_bytes!("testdata/sendmail_dsn.eml"),
    include_bytes!("testdata/sendmail_text.eml"),
    include_bytes!("testdata/ses_dsn.eml"),
    include_bytes!("testdata/yahoo.eml"),
];

/// What one item says: recipient, kind, status, diagnostic.
type ItemView<'a> = (Option<&'a str>, Kind, Option<&'a str>, Option<&'a str>);
type WantItem = ItemView<'static>;

/// One row: a report and what it should read as.
struct Case {
    name: &'static str,
    raw: &'static [u8],
    form: Form,
    items: &'static [WantItem],
    message_id: Option<&'static str>,
    queue_ids: &'static [&'static str],
}

fn check(cases: &[Case]) {
    for case in cases {
        let report = parse_report(case.raw);
        assert_eq!(report.form, case.form, "{}: form", case.name);
        let got: Vec<ItemView<'_>> = report
            .items
            .iter()
            .map(|i| {
                (
                    i.recipient.as_deref(),
                    i.kind,
                    i.status.as_deref(),
                    i.diagnostic.as_deref(),
                )
            })
            .collect();
        assert_eq!(got, case.items, "{}: items", case.name);
        assert_eq!(
            report.original_message_id.as_deref(),
            case.message_id,
            "{}: original_message_id",
            case.name
        );
        assert_eq!(
            report.relay_queue_ids, case.queue_ids,
            "{}: relay_queue_ids",
            case.name
        );

        let crlf = to_crlf(case.raw);
        assert_eq!(parse_report(&crlf), report, "{}: read with CRLF", case.name);
    }
}

/// `raw` with every LF that has no CR before it made CRLF.
pub(super) fn to_crlf(raw: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(raw.len() + raw.len() / 16);
    let mut prev = 0;
    for &b in raw {
        if b == b'\n' && prev != b'\r' {
            out.push(b'\r');
        }
        out.push(b);
        prev = b;
    }
    out
}

use Kind::{AutoReply as Auto, Complaint, Delayed, HardBounce as Hard, SoftBounce as Soft};

#[test]
fn postfix() {
    check(&[
        Case {
            name: "postfix DSN, Final-Recipient before Original-Recipient",
            raw: include_bytes!("testdata/postfix_dsn.eml"),
            form: Form::Dsn,
            items: &[(
                Some("kim.lee@example.org"),
                Hard,
                Some("5.1.1"),
                Some("550 5.1.1 <Kim.Lee@example.org>: Recipient address rejected: User unknown in virtual mailbox table"),
            )],
            message_id: Some("<order-1042.a81f@mail.example.com>"),
            queue_ids: &["3D1F02B2A4E"],
        },
        Case {
            name: "postfix delay warning",
            raw: include_bytes!("testdata/postfix_delayed.eml"),
            form: Form::Dsn,
            items: &[(
                Some("slow@example.net"),
                Delayed,
                Some("4.4.1"),
                Some("connect to mx.example.net[203.0.113.9]:25: Connection timed out"),
            )],
            message_id: Some("<welcome-88@mail.example.com>"),
            queue_ids: &["A11B22C33D"],
        },
        Case {
            name: "postfix text only, expanded alias and a full mailbox",
            raw: include_bytes!("testdata/postfix_text.eml"),
            form: Form::NonStandard("postfix"),
            items: &[
                (
                    Some("gone@example.org"),
                    Hard,
                    Some("5.1.1"),
                    Some("host mx.example.org[192.0.2.80] said: 550 5.1.1 <gone@example.org>... User unknown (in reply to RCPT TO command)"),
                ),
                (
                    Some("full@example.org"),
                    Soft,
                    Some("4.2.2"),
                    Some("host mx.example.org[192.0.2.80] said: 452 4.2.2 <full@example.org>: Mailbox full (in reply to RCPT TO command)"),
                ),
            ],
            message_id: Some("<20250303163958.9F1C3E0@old.example.com>"),
            queue_ids: &[],
        },
    ]);
    let report = parse_report(include_bytes!("testdata/postfix_dsn.eml"));
    assert_eq!(report.addressed_to, ["bounces+4f2a9c@mail.example.com"]);
    assert_eq!(
        report.from.as_deref(),
        Some("mailer-daemon@relay1.example.com")
    );
    assert_eq!(
        report.original_sender.as_deref(),
        Some("bounces+4f2a9c@mail.example.com")
    );
}

#[test]
fn exim() {
    check(&[
        Case {
            name: "exim classic text, user unknown and over quota",
            raw: include_bytes!("testdata/exim_text.eml"),
            form: Form::NonStandard("exim"),
            items: &[
                (
                    Some("ann@example.org"),
                    Hard,
                    Some("5.1.1"),
                    Some("host mx.example.org [192.0.2.44] SMTP error from remote mail server after RCPT TO:<ann@example.org>: 550 5.1.1 <ann@example.org>: No such user here"),
                ),
                (
                    Some("bob@example.org"),
                    Soft,
                    Some("5.2.2"),
                    Some("host mx.example.org [192.0.2.44] SMTP error from remote mail server after end of data: 552 5.2.2 bob@example.org mailbox is over quota"),
                ),
            ],
            message_id: Some("<invoice-77.c0ffee@mail.example.com>"),
            queue_ids: &[],
        },
        Case {
            name: "exim delay warning",
            raw: include_bytes!("testdata/exim_delay.eml"),
            form: Form::NonStandard("exim"),
            items: &[(
                Some("late@example.org"),
                Delayed,
                Some("4.7.1"),
                Some("host mx.example.org [192.0.2.44] Delay reason: SMTP error from remote mail server after RCPT TO:<late@example.org>: 451 4.7.1 Greylisted, please try again later"),
            )],
            message_id: None,
            queue_ids: &[],
        },
        Case {
            name: "exim DSN, Action first, Status 5.0.0",
            raw: include_bytes!("testdata/exim_dsn.eml"),
            form: Form::Dsn,
            items: &[(
                Some("zed@example.org"),
                Hard,
                Some("5.0.0"),
                Some("550 Requested action not taken: mailbox unavailable"),
            )],
            message_id: Some("<receipt-5@mail.example.com>"),
            queue_ids: &[],
        },
        Case {
            name: "exim bounce whose paragraphs are unreadable: X-Failed-Recipients",
            raw: b"From: Mail Delivery System <Mailer-Daemon@smtp.example.net>\n\
                X-Failed-Recipients: Lost@Example.org\n\
                Subject: Mail delivery failed: returning message to sender\n\n\
                This message was created automatically by mail delivery software.\n\n\
                (the rest was cut off)\n",
            form: Form::NonStandard("exim"),
            items: &[(Some("lost@example.org"), Soft, None, None)],
            message_id: None,
            queue_ids: &[],
        },
    ]);
}

#[test]
fn qmail_and_yahoo() {
    check(&[
        Case {
            name: "qmail-send, local and remote failures",
            raw: include_bytes!("testdata/qmail.eml"),
            form: Form::NonStandard("qmail"),
            items: &[
                (
                    Some("nobody@example.net"),
                    Hard,
                    Some("5.1.1"),
                    Some("Sorry, no mailbox here by that name. (#5.1.1)"),
                ),
                (
                    Some("remote@example.org"),
                    Hard,
                    Some("5.1.1"),
                    Some("192.0.2.61 does not like recipient. Remote host said: 550 5.1.1 <remote@example.org>: Recipient address rejected: User unknown Giving up on 192.0.2.61."),
                ),
            ],
            message_id: Some("<reset-31337@mail.example.com>"),
            queue_ids: &[],
        },
        Case {
            name: "yahoo, 554 with no enhanced code",
            raw: include_bytes!("testdata/yahoo.eml"),
            form: Form::NonStandard("yahoo"),
            items: &[(
                Some("closed@yahoo.example"),
                Hard,
                Some("554"),
                Some("Remote host said: 554 delivery error: dd This user doesn't have a yahoo.example account (closed@yahoo.example) [0] - mta1001.mail.bf1.yahoo.example [RCPT_TO]"),
            )],
            message_id: Some("<ship-9@mail.example.com>"),
            queue_ids: &[],
        },
    ]);
}

#[test]
fn sendmail() {
    check(&[
        Case {
            name: "sendmail DSN, RFC822 in capitals, angle brackets, Status comment",
            raw: include_bytes!("testdata/sendmail_dsn.eml"),
            form: Form::Dsn,
            items: &[(
                Some("prof@example.edu"),
                Hard,
                Some("5.1.1"),
                Some("550 5.1.1 <prof@example.edu>... User unknown"),
            )],
            message_id: Some("<course-2@mail.example.com>"),
            queue_ids: &[],
        },
        Case {
            name: "sendmail text, reason from the transcript",
            raw: include_bytes!("testdata/sendmail_text.eml"),
            form: Form::NonStandard("sendmail"),
            items: &[(
                Some("alumni@legacy.example.edu"),
                Hard,
                Some("5.1.1"),
                Some("550 5.1.1 <alumni@legacy.example.edu>... User unknown"),
            )],
            message_id: Some("<reunion-1999@mail.example.com>"),
            queue_ids: &[],
        },
    ]);
}

#[test]
fn exchange_and_office365() {
    check(&[
        Case {
            name: "exchange 2010 NDR text, quoted-printable",
            raw: include_bytes!("testdata/exchange_text.eml"),
            form: Form::NonStandard("exchange"),
            items: &[(
                Some("pat.doe@corp.example"),
                Hard,
                Some("5.1.1"),
                Some("550 5.1.1 RESOLVER.ADR.RecipNotFound; not found The e-mail address you entered couldn't be found. Please check the recipient's e-mail address and try to resend the message. If the problem continues, please contact your helpdesk."),
            )],
            message_id: Some("<notes-12@mail.example.com>"),
            queue_ids: &[],
        },
        Case {
            name: "office 365 with its DSN part",
            raw: include_bytes!("testdata/office365_dsn.eml"),
            form: Form::Dsn,
            items: &[(
                Some("left.company@tenant.example"),
                Hard,
                Some("5.1.10"),
                Some("550 5.1.10 RESOLVER.ADR.RecipientNotFound; Recipient not found by SMTP address lookup"),
            )],
            message_id: Some("<q1-report@mail.example.com>"),
            queue_ids: &[],
        },
        Case {
            name: "office 365, HTML only",
            raw: include_bytes!("testdata/office365_text.eml"),
            form: Form::NonStandard("exchange"),
            items: &[(
                Some("mover@tenant.example"),
                Hard,
                Some("5.1.10"),
                Some("550 5.1.10 RESOLVER.ADR.RecipientNotFound; Recipient not found by SMTP address lookup"),
            )],
            message_id: Some("<hello-3@mail.example.com>"),
            queue_ids: &[],
        },
        Case {
            name: "exchange 2003",
            raw: include_bytes!("testdata/exchange2003.eml"),
            form: Form::NonStandard("exchange"),
            items: &[(
                Some("buyer@old-exchange.example"),
                Hard,
                Some("5.1.1"),
                Some("The e-mail account does not exist at the organization this message was sent to. Check the e-mail address, or contact the recipient directly to find out the correct address. <mx.old-exchange.example #5.1.1 smtp;550 5.1.1 Benutzer unbekannt>"),
            )],
            message_id: None,
            queue_ids: &[],
        },
    ]);
}

#[test]
fn gmail() {
    check(&[
        Case {
            name: "gmail DSN, multi-line Diagnostic-Code",
            raw: include_bytes!("testdata/gmail_dsn.eml"),
            form: Form::Dsn,
            items: &[(
                Some("typo@gmail.example"),
                Hard,
                Some("5.1.1"),
                Some("550-5.1.1 The email account that you tried to reach does not exist. Please try double-checking the recipient's email address for typos or unnecessary spaces. For more information, go to https://support.example/mail/?p=NoSuchUser 5b1f17b1804b1-43cf0a5a1b2si12345f8f.123 - gsmtp"),
            )],
            message_id: Some("<promo-77@mail.example.com>"),
            queue_ids: &[],
        },
        Case {
            name: "gmail older text",
            raw: include_bytes!("testdata/gmail_text.eml"),
            form: Form::NonStandard("gmail"),
            items: &[(
                Some("old.friend@example.org"),
                Hard,
                Some("5.1.1"),
                Some("Google tried to deliver your message, but it was rejected by the server for the recipient domain example.org by mx.example.org. [192.0.2.3]. The error that the other server returned was: 550 5.1.1 <old.friend@example.org>: Recipient address rejected: User unknown in local recipient table"),
            )],
            message_id: Some("<catalog-44@mail.example.com>"),
            queue_ids: &[],
        },
    ]);
}

#[test]
fn standard_dsns() {
    check(&[
        Case {
            name: "amazon SES, base64 delivery-status",
            raw: include_bytes!("testdata/ses_dsn.eml"),
            form: Form::Dsn,
            items: &[(
                Some("nope@example.org"),
                Hard,
                Some("5.1.1"),
                Some("550 5.1.1 user unknown"),
            )],
            message_id: Some("<0100019581aaaaaa-11111111@email.amazonses.example>"),
            queue_ids: &[],
        },
        Case {
            name: "global delivery status, utf-8 addresses",
            raw: include_bytes!("testdata/global_dsn.eml"),
            form: Form::Dsn,
            items: &[(
                Some("jörg@bücher.example"),
                Hard,
                Some("5.1.1"),
                Some("550 5.1.1 Benutzer „jörg“ unbekannt"),
            )],
            message_id: Some("<bestellung-8@mail.example.com>"),
            queue_ids: &["B0B1"],
        },
        Case {
            name: "mixed outcomes: full, expired, relayed, junk, no action, no gap",
            raw: include_bytes!("testdata/dsn_mixed.eml"),
            form: Form::Dsn,
            items: &[
                (
                    Some("full@example.net"),
                    Soft,
                    Some("5.2.2"),
                    Some("552 5.2.2 Mailbox full"),
                ),
                (
                    Some("temp@example.net"),
                    Soft,
                    Some("4.4.7"),
                    Some("421 4.4.7 Message expired"),
                ),
                (
                    Some("ok@example.net"),
                    Kind::Unknown,
                    Some("2.0.0"),
                    Some("250 2.0.0 Ok: queued as 9AB12CD34E"),
                ),
                (None, Hard, Some("5.1.3"), None),
                (
                    Some("noaction@example.net"),
                    Hard,
                    Some("5.7.1"),
                    Some("550 5.7.1 Rejected by policy — see https://policy.example.net/"),
                ),
                (Some("nogap@example.net"), Delayed, Some("4.0.0"), None),
            ],
            message_id: None,
            queue_ids: &["9AB12CD34E"],
        },
        Case {
            name: "delivered, expanded: nothing to act on",
            raw: b"Content-Type: multipart/report; report-type=delivery-status; boundary=b\n\n\
                --b\nContent-Type: message/delivery-status\n\n\
                Reporting-MTA: dns; mx.example.net\n\n\
                Final-Recipient: rfc822; list@example.net\nAction: expanded\nStatus: 2.0.0\n\n\
                Final-Recipient: rfc822; a@example.net\nAction: delivered\nStatus: 2.0.0\n--b--\n",
            form: Form::Dsn,
            items: &[
                (Some("list@example.net"), Kind::Unknown, Some("2.0.0"), None),
                (Some("a@example.net"), Kind::Unknown, Some("2.0.0"), None),
            ],
            message_id: None,
            queue_ids: &[],
        },
        Case {
            name: "folded Final-Recipient, reason in X-Supplementary-Info",
            raw:
                b"Content-Type: multipart/report; report-type=delivery-status; boundary=\"=_b\"\n\n\
                --=_b\nContent-Type: message/delivery-status\n\n\
                Reporting-MTA: dns; EX01.corp.example\n\n\
                Final-recipient: RFC822;\n Folded@Example.net\nAction: failed\nStatus: 5.1.1\n\
                X-Supplementary-Info: <mx.example.net #5.1.1 smtp;550 5.1.1 User unknown>\n\
                X-Display-Name: Folded\n--=_b--\n",
            form: Form::Dsn,
            items: &[(
                Some("folded@example.net"),
                Hard,
                Some("5.1.1"),
                Some("<mx.example.net #5.1.1 smtp;550 5.1.1 User unknown>"),
            )],
            message_id: None,
            queue_ids: &[],
        },
        Case {
            name: "no Action, 4.x.x in a delay notice; Original-Recipient not rfc822",
            raw: b"Subject: Delivery Status Notification (Delay)\n\
                Content-Type: multipart/report; report-type=delivery-status; boundary=b\n\n\
                --b\nContent-Type: message/delivery-status\n\n\
                Original-Recipient: x400; /G=a/S=b/\nFinal-Recipient: rfc822;<Slow@Example.NET>\n\
                Status: 4.4.1 (no answer from host)\n--b--\n",
            form: Form::Dsn,
            items: &[(Some("slow@example.net"), Delayed, Some("4.4.1"), None)],
            message_id: None,
            queue_ids: &[],
        },
    ]);
}

#[test]
fn arf() {
    check(&[
        Case {
            name: "abuse with Original-Rcpt-To",
            raw: include_bytes!("testdata/arf_abuse.eml"),
            form: Form::Arf,
            items: &[(Some("reader@feedback.example"), Complaint, None, Some("abuse"))],
            message_id: Some("<news-2025-03@mail.example.com>"),
            queue_ids: &[],
        },
        Case {
            name: "other, recipient from the original's single To",
            raw: include_bytes!("testdata/arf_redacted.eml"),
            form: Form::Arf,
            items: &[(Some("subscriber@isp.example"), Complaint, None, Some("other"))],
            message_id: Some("<deals-51@mail.example.com>"),
            queue_ids: &[],
        },
        Case {
            name: "not-spam is no complaint; redacted To gives no recipient",
            raw: b"Content-Type: multipart/report; report-type=feedback-report; boundary=f\n\n\
                --f\nContent-Type: message/feedback-report\n\nFeedback-Type: not-spam\nVersion: 1\n\n\
                --f\nContent-Type: message/rfc822\n\nTo: xxxxxxxx\nMessage-ID: <ns-1@mail.example.com>\n\nhi\n--f--\n",
            form: Form::Arf,
            items: &[(None, Kind::Unknown, None, Some("not-spam"))],
            message_id: Some("<ns-1@mail.example.com>"),
            queue_ids: &[],
        },
    ]);
    let report = parse_report(include_bytes!("testdata/arf_abuse.eml"));
    assert_eq!(
        report.original_sender.as_deref(),
        Some("bounces+kk13@mail.example.com")
    );
}

#[test]
fn auto_replies() {
    check(&[
        Case {
            name: "RFC 3834 vacation",
            raw: include_bytes!("testdata/autoreply_rfc3834.eml"),
            form: Form::AutoReply,
            items: &[(Some("alice@example.org"), Auto, None, Some("Re: Your order has shipped"))],
            message_id: Some("<shipped-600@mail.example.com>"),
            queue_ids: &[],
        },
        Case {
            name: "outlook, encoded German subject, base64 body",
            raw: include_bytes!("testdata/autoreply_outlook.eml"),
            form: Form::AutoReply,
            items: &[(
                Some("bert@firma.example"),
                Auto,
                None,
                Some("Automatische Antwort: Ihre Rechnung"),
            )],
            message_id: Some("<rechnung-1@mail.example.com>"),
            queue_ids: &[],
        },
        Case {
            name: "X-Autoreply",
            raw: b"From: c@example.org\nX-Autoreply: yes\nSubject: Away\n\nAway.\n",
            form: Form::AutoReply,
            items: &[(Some("c@example.org"), Auto, None, Some("Away"))],
            message_id: None,
            queue_ids: &[],
        },
        Case {
            name: "Precedence: auto_reply",
            raw: b"From: d@example.org\nPrecedence: auto_reply\nSubject: Thanks\n\nThanks.\n",
            form: Form::AutoReply,
            items: &[(Some("d@example.org"), Auto, None, Some("Thanks"))],
            message_id: None,
            queue_ids: &[],
        },
        Case {
            name: "sent with a null sender, subject echoing a bounce's",
            raw: b"Return-Path: <>\nFrom: g@example.org\nAuto-Submitted: auto-replied\n\
                Subject: Automatic reply: Undeliverable parcel\nIn-Reply-To: <parcel-1@mail.example.com>\n\n\
                Out until 5.3.25; contact h@example.org.\n",
            form: Form::AutoReply,
            items: &[(
                Some("g@example.org"),
                Auto,
                None,
                Some("Automatic reply: Undeliverable parcel"),
            )],
            message_id: Some("<parcel-1@mail.example.com>"),
            queue_ids: &[],
        },
        Case {
            name: "Auto-Submitted: no is a person",
            raw: b"From: e@example.org\nAuto-Submitted: no\nSubject: Re: hi\n\nHi back.\n",
            form: Form::Unknown,
            items: &[],
            message_id: None,
            queue_ids: &[],
        },
        Case {
            name: "X-Auto-Response-Suppress without an out-of-office subject",
            raw: b"From: f@example.org\nX-Auto-Response-Suppress: All\nSubject: Meeting\n\nSee you.\n",
            form: Form::Unknown,
            items: &[],
            message_id: None,
            queue_ids: &[],
        },
    ]);
}

#[test]
fn generic_and_unknown() {
    check(&[
        Case {
            name: "postmaster, address next to a reply code",
            raw: include_bytes!("testdata/generic.eml"),
            form: Form::NonStandard("generic"),
            items: &[(
                Some("vanished@smallisp.example"),
                Hard,
                Some("550"),
                Some("Recipient: <vanished@smallisp.example> Reason: 550 Requested action not taken: mailbox unavailable"),
            )],
            message_id: None,
            queue_ids: &[],
        },
        Case {
            name: "null Return-Path, code on the next line, copy ignored",
            raw: b"Return-Path: <>\nFrom: daemon@mx.example.net\nSubject: Notice\n\n\
                Delivery to <Who@Example.net> failed:\n  5.1.1 unknown\n\n\
                Received: from x\nTo: other@example.net\nSubject: 550 5.1.1\nMessage-ID: <g-1@mail.example.com>\n",
            form: Form::NonStandard("generic"),
            items: &[(
                Some("who@example.net"),
                Hard,
                Some("5.1.1"),
                Some("Delivery to <Who@Example.net> failed: 5.1.1 unknown"),
            )],
            message_id: Some("<g-1@mail.example.com>"),
            queue_ids: &[],
        },
        Case {
            name: "Message-ID folded onto the next line; an empty one is skipped",
            raw: b"From: MAILER-DAEMON@mx.example.net\nSubject: failure notice\n\n\
                <gone@example.net>: 550 no such user\n\n\
                --- Below this line is a copy of the message.\n\n\
                Message-ID:\nFrom: orders@example.com\nMessage-Id:\n <f-2@mail.example.com>\n",
            form: Form::NonStandard("generic"),
            items: &[(
                Some("gone@example.net"),
                Hard,
                Some("550"),
                Some("<gone@example.net>: 550 no such user"),
            )],
            message_id: Some("<f-2@mail.example.com>"),
            queue_ids: &[],
        },
        Case {
            name: "a bounce auto-submitted is not an auto-reply",
            raw: b"From: MAILER-DAEMON@mx.example.net\nAuto-Submitted: auto-replied\nSubject: failure\n\nSomething went wrong.\n",
            form: Form::Unknown,
            items: &[],
            message_id: None,
            queue_ids: &[],
        },
        Case {
            name: "an ordinary message",
            raw: b"From: Person <p@example.org>\nTo: orders@example.com\nSubject: Question about 550 items\nMessage-ID: <q@example.org>\n\nDo you ship 550 items to a@example.net? Error 5.1.1\n",
            form: Form::Unknown,
            items: &[],
            message_id: None,
            queue_ids: &[],
        },
        Case {
            name: "nothing at all",
            raw: b"",
            form: Form::Unknown,
            items: &[],
            message_id: None,
            queue_ids: &[],
        },
    ]);
}

#[test]
fn as_str() {
    let kinds = [
        (Kind::HardBounce, "hard_bounce"),
        (Kind::SoftBounce, "soft_bounce"),
        (Kind::Delayed, "delayed"),
        (Kind::Complaint, "complaint"),
        (Kind::AutoReply, "auto_reply"),
        (Kind::Unknown, "unknown"),
    ];
    for (kind, s) in kinds {
        assert_eq!(kind.as_str(), s);
    }
    assert_eq!(Form::NonStandard("exim").as_str(), "exim");
    assert_eq!(Form::Dsn.as_str(), "dsn");
}

#[test]
fn addressed_to_in_order() {
    let report = parse_report(
        b"Delivered-To: Bounces+A@Mail.Example.com\nX-Original-To: bounces+b@mail.example.com\n\
          To: Shop <bounces+a@mail.example.com>, c@mail.example.com\nFrom: x@example.org\n\nhi\n",
    );
    assert_eq!(
        report.addressed_to,
        [
            "bounces+a@mail.example.com",
            "bounces+b@mail.example.com",
            "c@mail.example.com"
        ]
    );
}

#[test]
fn mbox_from_line_is_skipped() {
    let mut raw = b"From MAILER-DAEMON  Tue Mar  4 09:12:44 2025\n".to_vec();
    raw.extend_from_slice(include_bytes!("testdata/postfix_dsn.eml"));
    assert_eq!(
        parse_report(&raw),
        parse_report(include_bytes!("testdata/postfix_dsn.eml"))
    );
}
