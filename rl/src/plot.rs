//! `metrics.png`: five stacked panels over steps, top to bottom: training reward (blue)
//! with eval reward (red dots), mean token entropy (green), KL to the initial weights
//! (purple), completion-length drift against the first steps (orange), and the gap between
//! training and eval reward (black dots). PPO jobs add two panels: the value loss (brown)
//! and the explained variance (teal) with the value clip fraction (black dots); DPO/IPO jobs
//! (whose reward panel shows `rewards/margins`) add `rewards/accuracies` (cyan) with the
//! held-out accuracy (red dots), and `rewards/chosen` (blue) with `rewards/rejected` (black
//! dots). Drawn with `plotters`' bitmap backend; no text (no font is assumed on the
//! machine), so the panel order above is the legend; the numbers are in `metrics.jsonl`.

use super::error::{Result, RlError};
use plotters::prelude::*;
use std::path::Path;

type Series = Vec<(f64, f64)>;

/// Plots the `metrics.jsonl` lines (`kind` train/eval) of a whole run, resumes included.
pub fn write_png(path: &Path, lines: &[serde_json::Value]) -> Result<()> {
    let e = |x: &dyn std::fmt::Display| RlError::Plot { path: path.to_path_buf(), message: x.to_string() };
    let pts = |kind: &str, key: &str| -> Series {
        lines
            .iter()
            .filter(|l| l["kind"] == kind)
            .filter_map(|l| Some((l["step"].as_f64()?, l[key].as_f64()?)))
            .collect()
    };
    let (reward, eval) = (pts("train", "reward"), pts("eval", "eval_reward"));
    let (entropy, kl) = (pts("train", "entropy"), pts("train", "kl_to_initial"));
    let (drift, gap) = (pts("train", "completion_length_drift"), pts("train", "train_eval_reward_gap"));
    let x_max = reward.iter().chain(&eval).map(|p| p.0).fold(1.0, f64::max);
    let none = Series::new();
    // (series: a line, then dots; line colour; dot colour)
    let mut specs: Vec<(Vec<&Series>, RGBColor, RGBColor)> = vec![
        (vec![&reward, &eval], BLUE, RED),
        (vec![&entropy], GREEN, RED),
        (vec![&kl], MAGENTA, RED),
        (vec![&drift], RGBColor(230, 120, 0), RED),
        (vec![&none, &gap], BLACK, BLACK),
    ];
    let (value_loss, explained, clipfrac) =
        (pts("train", "value_loss"), pts("train", "explained_variance"), pts("train", "value_clipfrac"));
    if !value_loss.is_empty() {
        specs.push((vec![&value_loss], RGBColor(140, 80, 20), BLACK));
        specs.push((vec![&explained, &clipfrac], RGBColor(0, 128, 128), BLACK));
    }
    let (accuracy, eval_accuracy) = (pts("train", "rewards/accuracies"), pts("eval", "rewards/accuracies"));
    let (chosen, rejected) = (pts("train", "rewards/chosen"), pts("train", "rewards/rejected"));
    if !accuracy.is_empty() {
        specs.push((vec![&accuracy, &eval_accuracy], CYAN, RED));
        specs.push((vec![&chosen, &rejected], BLUE, BLACK));
    }
    let root = BitMapBackend::new(path, (900, 250 * specs.len() as u32)).into_drawing_area();
    root.fill(&WHITE).map_err(|x| e(&x))?;
    let panels = root.split_evenly((specs.len(), 1));
    for (area, (series, color, dot)) in panels.iter().zip(specs) {
        let ys = series.iter().flat_map(|s| s.iter().map(|p| p.1)).filter(|y| y.is_finite());
        let (lo, hi) = ys.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), y| (a.min(y), b.max(y)));
        let (lo, hi) = if lo.is_finite() { (lo, if hi > lo { hi } else { lo + 1.0 }) } else { (0.0, 1.0) };
        let pad = (hi - lo) * 0.05;
        let mut chart = ChartBuilder::on(area)
            .margin(12)
            .build_cartesian_2d(0.0..x_max, (lo - pad)..(hi + pad))
            .map_err(|x| e(&x))?;
        chart.plotting_area().fill(&RGBColor(250, 250, 250)).map_err(|x| e(&x))?;
        chart.draw_series(LineSeries::new(series[0].iter().cloned(), color.stroke_width(2))).map_err(|x| e(&x))?;
        if let Some(dots) = series.get(1) {
            chart.draw_series(dots.iter().map(|&p| Circle::new(p, 4, dot.filled()))).map_err(|x| e(&x))?;
        }
        area.draw(&Rectangle::new([(0, 0), (899, 249)], BLACK.stroke_width(1))).map_err(|x| e(&x))?;
    }
    root.present().map_err(|x| e(&x))
}
