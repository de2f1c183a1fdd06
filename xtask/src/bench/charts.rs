//! One SVG bar chart per measure: the routes side by side, each bar the
//! median, with a whisker from the min to the max run.

use std::path::Path;

use anyhow::{Context, Result};
use plotters::{
    coord::{
        ranged1d::{SegmentValue, SegmentedCoord},
        types::{RangedCoordf64, RangedCoordi32},
    },
    prelude::*,
    style::text_anchor,
};

use super::{Measure, REPETITIONS, Route, Series, report::number};

const SIZE: (u32, u32) = (720, 420);

fn color(route: Route) -> RGBColor {
    match route {
        Route::Direct => RGBColor(140, 140, 140),
        Route::Socklb => RGBColor(31, 119, 180),
        Route::Sockmap => RGBColor(148, 103, 189),
        Route::Haproxy => RGBColor(255, 127, 14),
        Route::Nginx => RGBColor(44, 160, 44),
    }
}

pub fn draw_all(out: &Path, series: &[Series]) -> Result<()> {
    for measured in series {
        let path = out.join(format!("{}.svg", measured.measure.key()));
        draw(&path, measured).with_context(|| format!("drawing {}", path.display()))?;
    }
    println!("bench: wrote {} charts in {}", series.len(), out.display());
    Ok(())
}

fn draw(path: &Path, measured: &Series) -> Result<()> {
    let measure: Measure = measured.measure;
    let bars: Vec<(Route, Option<super::Summary>)> = Route::ALL
        .iter()
        .map(|route| (*route, measured.summary(*route)))
        .collect();
    let top = bars
        .iter()
        .filter_map(|(_, summary)| summary.map(|summary| summary.max))
        .fold(0.0_f64, f64::max);
    let top = if top > 0.0 { top * 1.18 } else { 1.0 };

    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE)?;
    let count = bars.len() as i32;
    let mut chart = ChartBuilder::on(&root)
        .caption(measure.title(), ("sans-serif", 16))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(80)
        .build_cartesian_2d((0..count - 1).into_segmented(), 0.0..top)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(bars.len())
        .x_label_formatter(&|value| match value {
            SegmentValue::CenterOf(index) => Route::ALL
                .get(*index as usize)
                .map_or(String::new(), |route| route.name().to_string()),
            _ => String::new(),
        })
        .y_desc(format!(
            "{}{}",
            measure.unit(),
            if measure.higher_is_better() {
                " (higher is better)"
            } else {
                " (lower is better)"
            }
        ))
        .y_label_formatter(&axis_number)
        .max_light_lines(2)
        .label_style(("sans-serif", 13))
        .draw()?;

    draw_bars(&mut chart, &bars)?;
    root.draw(&Text::new(
        format!("bars: median of {REPETITIONS} runs; whiskers: min and max",),
        (SIZE.0 as i32 - 290, SIZE.1 as i32 - 16),
        ("sans-serif", 11).into_font().color(&RGBColor(90, 90, 90)),
    ))?;
    root.present()?;
    Ok(())
}

/// An axis label: the number, without trailing zeros.
fn axis_number(value: &f64) -> String {
    let shown = number(*value);
    if shown.contains('.') {
        shown
            .trim_end_matches('0')
            .trim_end_matches('.')
            .to_string()
    } else {
        shown
    }
}

/// The chart's area, over the routes (segments) and the measure's values.
type Chart<'a, 'b> =
    ChartContext<'a, SVGBackend<'b>, Cartesian2d<SegmentedCoord<RangedCoordi32>, RangedCoordf64>>;

/// Each route's bar (the median), with its whisker (min to max) and label;
/// "n/a" for a route without figures.
fn draw_bars(chart: &mut Chart<'_, '_>, bars: &[(Route, Option<super::Summary>)]) -> Result<()> {
    let whisker = BLACK.stroke_width(2);
    let label_style = TextStyle::from(("sans-serif", 13)).pos(text_anchor::Pos::new(
        text_anchor::HPos::Center,
        text_anchor::VPos::Bottom,
    ));
    for (index, (route, summary)) in bars.iter().enumerate() {
        let index = index as i32;
        let Some(summary) = summary else {
            chart.draw_series(std::iter::once(
                EmptyElement::at((SegmentValue::CenterOf(index), 0.0))
                    + Text::new("n/a", (0, -6), label_style.clone()),
            ))?;
            continue;
        };
        let mut bar = Rectangle::new(
            [
                (SegmentValue::Exact(index), 0.0),
                (SegmentValue::Exact(index + 1), summary.median),
            ],
            color(*route).filled(),
        );
        bar.set_margin(0, 0, 22, 22);
        chart.draw_series(std::iter::once(bar))?;
        let center = SegmentValue::CenterOf(index);
        chart.draw_series(std::iter::once(PathElement::new(
            vec![(center.clone(), summary.min), (center.clone(), summary.max)],
            whisker,
        )))?;
        for end in [summary.min, summary.max] {
            chart.draw_series(std::iter::once(
                EmptyElement::at((center.clone(), end))
                    + PathElement::new(vec![(-10, 0), (10, 0)], whisker),
            ))?;
        }
        chart.draw_series(std::iter::once(
            EmptyElement::at((center.clone(), summary.max))
                + Text::new(number(summary.median), (0, -6), label_style.clone()),
        ))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_bars_whiskers_and_a_missing_route() {
        let measured = Series {
            measure: Measure::CpuPer10k,
            samples: vec![
                (Route::Socklb, vec![0.01, 0.012, 0.011]),
                (Route::Haproxy, vec![0.3, 0.35, 0.33]),
                (Route::Nginx, vec![0.31, 0.32, 0.3]),
            ],
        };
        let path = std::env::temp_dir().join(format!("socklb-chart-{}.svg", std::process::id()));
        draw(&path, &measured).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        for words in ["direct", "socklb", "HAProxy", "nginx", "n/a", "0.3300"] {
            assert!(svg.contains(words), "{words} missing from the chart");
        }
    }
}
