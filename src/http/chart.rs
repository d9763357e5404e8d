//! The overview's chart: mails sent and failed per minute over the last
//! hour, as the shapes of an inline SVG (the template draws them): one
//! stacked bar per minute, sent below and failed above, a scale that ends on
//! a round number, and the time along the bottom. No script, nothing fetched.

use chrono::{DateTime, DurationRound, TimeDelta, Utc};

use crate::store::MinuteCount;

pub const WIDTH: u32 = 1000;
pub const HEIGHT: u32 = 240;
/// Room for the scale on the left, the last time on the right, the times
/// below.
const LEFT: f64 = 44.0;
const RIGHT: f64 = 24.0;
const TOP: f64 = 10.0;
const BOTTOM: f64 = 26.0;

/// One minute's stacked bar.
#[derive(Debug, Clone, PartialEq)]
pub struct Bar {
    pub x: f64,
    pub width: f64,
    /// The sent part: from `sent_y` down to the axis.
    pub sent_y: f64,
    pub sent_height: f64,
    /// The failed part, on top of it.
    pub failed_y: f64,
    pub failed_height: f64,
    /// What a pointer over it says (`12:03 UTC: 120 sent, 2 failed`).
    pub title: String,
}

/// A line across the chart with its value, or a time below it.
#[derive(Debug, Clone, PartialEq)]
pub struct Tick {
    pub x: f64,
    pub y: f64,
    pub label: String,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Chart {
    pub width: u32,
    pub height: u32,
    /// Where the plot area is.
    pub left: f64,
    pub right: f64,
    pub top: f64,
    pub bottom: f64,
    /// Minutes with mails only.
    pub bars: Vec<Bar>,
    pub levels: Vec<Tick>,
    pub times: Vec<Tick>,
    pub sent: i64,
    pub failed: i64,
}

/// SVG coordinates to a tenth of a pixel: shorter pages, the same picture.
fn tenth(v: f64) -> f64 {
    (v * 10.0).round() / 10.0
}

/// A round number at or above `n` (1, 2, 5, 10, 20, 50…), at least 1.
fn round_up(n: i64) -> i64 {
    let mut step = 1;
    loop {
        for m in [1, 2, 5] {
            if step * m >= n {
                return step * m;
            }
        }
        step *= 10;
    }
}

/// The chart of `minutes` over the `span` minutes up to `now`.
pub fn per_minute(minutes: &[MinuteCount], now: DateTime<Utc>, span: u32) -> Chart {
    let span = span.max(1) as i64;
    let this_minute = now.duration_trunc(TimeDelta::minutes(1)).unwrap_or(now);
    let first = this_minute - TimeDelta::minutes(span - 1);
    let plot_width = WIDTH as f64 - LEFT - RIGHT;
    let plot_height = HEIGHT as f64 - TOP - BOTTOM;
    let axis = TOP + plot_height;
    let slot = plot_width / span as f64;
    let shown: Vec<&MinuteCount> = minutes
        .iter()
        .filter(|m| m.minute >= first && m.minute <= this_minute)
        .collect();
    let top = round_up(shown.iter().map(|m| m.sent + m.failed).max().unwrap_or(0));
    let scale = plot_height / top as f64;
    let bars = shown
        .iter()
        .map(|m| {
            let index = (m.minute - first).num_minutes() as f64;
            let sent_height = m.sent as f64 * scale;
            let failed_height = m.failed as f64 * scale;
            Bar {
                x: tenth(LEFT + index * slot + slot * 0.1),
                width: tenth(slot * 0.8),
                sent_y: tenth(axis - sent_height),
                sent_height: tenth(sent_height),
                failed_y: tenth(axis - sent_height - failed_height),
                failed_height: tenth(failed_height),
                title: format!(
                    "{} UTC: {} sent, {} failed",
                    m.minute.format("%H:%M"),
                    m.sent,
                    m.failed
                ),
            }
        })
        .collect();
    let mut values = vec![0, top / 2, top];
    values.dedup();
    let levels = values
        .iter()
        .map(|v| Tick {
            x: LEFT - 6.0,
            y: tenth(axis - *v as f64 * scale),
            label: v.to_string(),
        })
        .collect::<Vec<_>>();
    // Under the first, the last and three minutes between.
    let times = [0, span / 4, span / 2, span * 3 / 4, span - 1]
        .iter()
        .map(|index| Tick {
            x: tenth(LEFT + (*index as f64 + 0.5) * slot),
            y: HEIGHT as f64 - 8.0,
            label: (first + TimeDelta::minutes(*index))
                .format("%H:%M")
                .to_string(),
        })
        .collect();
    Chart {
        width: WIDTH,
        height: HEIGHT,
        left: LEFT,
        right: WIDTH as f64 - RIGHT,
        top: TOP,
        bottom: axis,
        bars,
        levels,
        times,
        sent: shown.iter().map(|m| m.sent).sum(),
        failed: shown.iter().map(|m| m.failed).sum(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(text: &str) -> DateTime<Utc> {
        text.parse().unwrap()
    }

    #[test]
    fn scales_end_on_round_numbers() {
        assert_eq!(
            [0, 1, 2, 3, 7, 10, 11, 180, 5001].map(round_up),
            [1, 1, 2, 5, 10, 10, 20, 200, 10000]
        );
    }

    #[test]
    fn bars_stand_on_the_axis_in_their_minute() {
        let now = at("2026-05-01T12:30:40Z");
        let minutes = vec![
            MinuteCount {
                minute: at("2026-05-01T11:00:00Z"), // over an hour ago
                sent: 999,
                failed: 0,
            },
            MinuteCount {
                minute: at("2026-05-01T11:31:00Z"), // the first minute shown
                sent: 10,
                failed: 0,
            },
            MinuteCount {
                minute: at("2026-05-01T12:30:00Z"), // this minute
                sent: 30,
                failed: 10,
            },
        ];
        let chart = per_minute(&minutes, now, 60);
        assert_eq!((chart.sent, chart.failed), (40, 10));
        assert_eq!(chart.bars.len(), 2);
        let (first, last) = (&chart.bars[0], &chart.bars[1]);
        assert!(first.x < LEFT + 20.0 && last.x > chart.right - 20.0);
        // 40 mails is the top of the scale (50 would be round but 40 fits
        // under 50): the last bar is 40/50 of the plot high.
        let plot = chart.bottom - chart.top;
        assert!((last.sent_height - plot * 30.0 / 50.0).abs() < 0.1);
        assert!((last.failed_height - plot * 10.0 / 50.0).abs() < 0.1);
        assert!((last.sent_y + last.sent_height - chart.bottom).abs() < 0.1);
        assert!((last.failed_y + last.failed_height - last.sent_y).abs() < 0.1);
        assert_eq!(last.title, "12:30 UTC: 30 sent, 10 failed");
        assert_eq!(chart.times.first().unwrap().label, "11:31");
        assert_eq!(chart.times.last().unwrap().label, "12:30");
        assert_eq!(
            chart
                .levels
                .iter()
                .map(|l| l.label.as_str())
                .collect::<Vec<_>>(),
            ["0", "25", "50"]
        );
    }

    #[test]
    fn an_empty_hour_draws_an_empty_chart() {
        let chart = per_minute(&[], at("2026-05-01T12:30:40Z"), 60);
        assert!(chart.bars.is_empty());
        assert_eq!(chart.sent + chart.failed, 0);
        let levels: Vec<_> = chart.levels.iter().map(|l| l.label.as_str()).collect();
        assert_eq!(levels, ["0", "1"]);
    }
}
