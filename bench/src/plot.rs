//! SVG plots from a results file: output throughput against concurrency (closed loop) and
//! TTFT p90 against request rate (open loop), one line per server.

use std::path::{Path, PathBuf};

use plotters::prelude::*;

use crate::report::Results;
use crate::run::Load;
use crate::{Error, Result};

const COLORS: [RGBColor; 6] = [
    RGBColor(200, 60, 30),
    RGBColor(40, 90, 200),
    RGBColor(40, 150, 60),
    RGBColor(150, 60, 170),
    RGBColor(120, 120, 120),
    RGBColor(220, 150, 20),
];

/// (label, points) for one workload, x from `x`, y from `y`, sorted by x.
fn series(
    results: &Results,
    workload: &str,
    x: impl Fn(&Load) -> Option<f64>,
    y: impl Fn(&crate::stats::Summary) -> f64,
) -> Vec<(String, Vec<(f64, f64)>)> {
    results
        .labels()
        .into_iter()
        .filter_map(|label| {
            let mut pts: Vec<(f64, f64)> = results
                .runs
                .iter()
                .filter(|r| r.label == label && r.workload == workload)
                .filter_map(|r| Some((x(&r.load)?, y(&r.summary))))
                .collect();
            pts.sort_by(|a, b| a.0.total_cmp(&b.0));
            (!pts.is_empty()).then_some((label, pts))
        })
        .collect()
}

fn draw(
    path: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    log_x: bool,
    lines: &[(String, Vec<(f64, f64)>)],
) -> Result<()> {
    let err = |e: &dyn std::fmt::Display| Error::Plot(format!("{}: {e}", path.display()));
    let xs = lines.iter().flat_map(|(_, p)| p.iter().map(|q| q.0));
    let ys = lines.iter().flat_map(|(_, p)| p.iter().map(|q| q.1));
    let (x0, x1) = xs.fold((f64::MAX, f64::MIN), |(a, b), v| (a.min(v), b.max(v)));
    let y1 = ys.fold(0.0f64, f64::max) * 1.1 + 1e-9;
    let root = SVGBackend::new(path, (720, 440)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let tx = |v: f64| if log_x { v.max(1e-9).log2() } else { v };
    let (lo, hi) = (tx(x0), tx(x1));
    let pad = ((hi - lo) * 0.05).max(0.1);
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d((lo - pad)..(hi + pad), 0.0..y1)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc(x_label)
        .y_desc(y_label)
        .x_label_formatter(&|v| {
            if log_x {
                format!("{:.0}", v.exp2())
            } else {
                format!("{v:.2}")
            }
        })
        .draw()
        .map_err(|e| err(&e))?;
    for (i, (label, pts)) in lines.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let pts: Vec<(f64, f64)> = pts.iter().map(|&(x, y)| (tx(x), y)).collect();
        chart
            .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
            .map_err(|e| err(&e))?
            .label(label.as_str())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2))
            });
        chart
            .draw_series(pts.iter().map(|&p| Circle::new(p, 4, color.filled())))
            .map_err(|e| err(&e))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))
}

/// Draws every plot the results allow into `dir`; returns the files written.
pub fn plot(results: &Results, dir: &Path) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).map_err(|e| Error::Io {
        path: dir.display().to_string(),
        source: e,
    })?;
    let mut workloads: Vec<&str> = results.runs.iter().map(|r| r.workload.as_str()).collect();
    workloads.sort();
    workloads.dedup();
    let mut written = Vec::new();
    for w in workloads {
        let slug: String = w
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
            .collect();
        let throughput = series(
            results,
            w,
            |l| match l {
                Load::Concurrency(c) => Some(*c as f64),
                Load::Rate(_) => None,
            },
            |s| s.output_tokens_per_s,
        );
        if !throughput.is_empty() {
            let path = dir.join(format!("throughput-{slug}.svg"));
            draw(
                &path,
                &format!("Output tokens/s vs concurrency ({w})"),
                "concurrent requests",
                "output tokens/s",
                true,
                &throughput,
            )?;
            written.push(path);
        }
        let ttft = series(
            results,
            w,
            |l| match l {
                Load::Rate(r) => Some(*r),
                Load::Concurrency(_) => None,
            },
            |s| s.ttft_s[1],
        );
        if !ttft.is_empty() {
            let path = dir.join(format!("ttft-{slug}.svg"));
            draw(
                &path,
                &format!("TTFT p90 vs request rate ({w})"),
                "requests/s (Poisson arrivals)",
                "TTFT p90, s",
                false,
                &ttft,
            )?;
            written.push(path);
        }
    }
    Ok(written)
}
