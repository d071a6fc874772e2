//! `metrics.png`: a titled figure of stacked panels over training steps, each with its own
//! title, axis labels and tick values: reward (training mean as a blue line, eval reward as
//! red dots, said in the panel's title so no legend covers the data), mean token entropy,
//! KL to the initial weights, completion length relative to the first steps, and the
//! train − eval reward gap. PPO jobs add the value loss and the explained variance (with the
//! value clip fraction); DPO/IPO jobs (whose reward panel shows `rewards/margins`) add
//! `rewards/accuracies` (with the held-out accuracy) and `rewards/chosen` (with
//! `rewards/rejected`). Drawn with `plotters`' bitmap backend; the text uses DejaVu Sans
//! embedded in the binary (the `dejavu` crate), so no font is needed on the machine. The
//! numbers are in `metrics.jsonl`.

use super::error::{Result, RlError};
use plotters::prelude::*;
use plotters::style::{register_font, FontStyle};
use std::path::Path;
use std::sync::OnceLock;

type Series = Vec<(f64, f64)>;

/// Width and height of `metrics.png` in pixels.
pub const SIZE: (u32, u32) = (1000, 1500);

/// Height in pixels of a figure of `panels` panels: [`SIZE`] holds the five common ones, and
/// each algorithm's extra panel is as tall as one of them.
pub fn height(panels: usize) -> u32 {
    TITLE_BAND + (SIZE.1 - TITLE_BAND) * panels as u32 / 5
}

/// Height of the figure's title band.
const TITLE_BAND: u32 = 60;

/// The font family every label uses: DejaVu Sans, registered once from the embedded bytes.
fn font() -> std::result::Result<&'static str, String> {
    static REGISTERED: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    REGISTERED
        .get_or_init(|| {
            let bytes = dejavu::sans::regular();
            register_font("sans-serif", FontStyle::Normal, bytes)
                .and_then(|_| register_font("sans-serif", FontStyle::Bold, dejavu::sans::bold()))
                .map_err(|_| "the embedded DejaVu Sans font could not be read".to_string())
        })
        .clone()
        .map(|_| "sans-serif")
}

/// One panel: its title, y-axis label, a line series and a dot series with their colours.
struct Panel<'a> {
    title: &'a str,
    y_label: &'a str,
    line: (&'a Series, RGBColor),
    dots: Option<(&'a Series, RGBColor)>,
}

/// Plots the `metrics.jsonl` lines (`kind` train/eval) of a whole run, resumes included.
pub fn write_png(path: &Path, lines: &[serde_json::Value]) -> Result<()> {
    let e = |x: &dyn std::fmt::Display| RlError::Plot { path: path.to_path_buf(), message: x.to_string() };
    let family = font().map_err(|x| e(&x))?;
    let pts = |kind: &str, key: &str| -> Series {
        lines
            .iter()
            .filter(|l| l["kind"] == kind)
            .filter_map(|l| Some((l["step"].as_f64()?, l[key].as_f64()?)))
            .filter(|p| p.1.is_finite())
            .collect()
    };
    let (reward, eval) = (pts("train", "reward"), pts("eval", "eval_reward"));
    let (entropy, kl) = (pts("train", "entropy"), pts("train", "kl_to_initial"));
    let (drift, gap) = (pts("train", "completion_length_drift"), pts("train", "train_eval_reward_gap"));
    let none = Series::new();
    let orange = RGBColor(230, 120, 0);
    let mut panels = vec![
        Panel {
            title: "Reward: training mean (blue line), eval reward (red dots)",
            y_label: "mean reward",
            line: (&reward, BLUE),
            dots: Some((&eval, RED)),
        },
        Panel {
            title: "Mean token entropy of the policy",
            y_label: "entropy (nats / token)",
            line: (&entropy, RGBColor(0, 150, 0)),
            dots: None,
        },
        Panel {
            title: "KL divergence to the initial weights",
            y_label: "KL (k3, nats / token)",
            line: (&kl, MAGENTA),
            dots: None,
        },
        Panel {
            title: "Completion length relative to the first steps",
            y_label: "mean length / first mean",
            line: (&drift, orange),
            dots: None,
        },
        Panel {
            title: "Train − eval reward gap (after each eval)",
            y_label: "train − eval reward",
            line: (&none, BLACK),
            dots: Some((&gap, BLACK)),
        },
    ];
    let (value_loss, explained, clipfrac) =
        (pts("train", "value_loss"), pts("train", "explained_variance"), pts("train", "value_clipfrac"));
    if !value_loss.is_empty() {
        panels.push(Panel {
            title: "PPO value loss",
            y_label: "value loss",
            line: (&value_loss, RGBColor(140, 80, 20)),
            dots: None,
        });
        panels.push(Panel {
            title: "Explained variance (line), value clip fraction (dots)",
            y_label: "fraction",
            line: (&explained, RGBColor(0, 128, 128)),
            dots: Some((&clipfrac, BLACK)),
        });
    }
    let (accuracy, eval_accuracy) = (pts("train", "rewards/accuracies"), pts("eval", "rewards/accuracies"));
    let (chosen, rejected) = (pts("train", "rewards/chosen"), pts("train", "rewards/rejected"));
    if !accuracy.is_empty() {
        panels.push(Panel {
            title: "DPO rewards/accuracies: training (line), held-out (red dots)",
            y_label: "accuracy",
            line: (&accuracy, CYAN),
            dots: Some((&eval_accuracy, RED)),
        });
        panels.push(Panel {
            title: "DPO rewards/chosen (line), rewards/rejected (dots)",
            y_label: "implicit reward",
            line: (&chosen, BLUE),
            dots: Some((&rejected, BLACK)),
        });
    }
    let x_max = lines.iter().filter_map(|l| l["step"].as_f64()).fold(1.0, f64::max);
    let root = BitMapBackend::new(path, (SIZE.0, height(panels.len()))).into_drawing_area();
    root.fill(&WHITE).map_err(|x| e(&x))?;
    let (title, body) = root.split_vertically(TITLE_BAND);
    let steps = lines.iter().filter(|l| l["kind"] == "train").count();
    let heading = format!("Training metrics by step ({steps} steps, from metrics.jsonl)");
    title.titled(&heading, (family, 30).into_font().style(FontStyle::Bold).color(&BLACK)).map_err(|x| e(&x))?;
    for (area, p) in body.split_evenly((panels.len(), 1)).iter().zip(&panels) {
        draw_panel(area, p, x_max, family).map_err(|x| e(&x))?;
    }
    root.present().map_err(|x| e(&x))
}

type Area<'a> = DrawingArea<BitMapBackend<'a>, plotters::coord::Shift>;
type DrawResult = std::result::Result<(), DrawingAreaErrorKind<<BitMapBackend<'static> as DrawingBackend>::ErrorType>>;

fn draw_panel(area: &Area, p: &Panel, x_max: f64, family: &str) -> DrawResult {
    let all = p.line.0.iter().chain(p.dots.iter().flat_map(|d| d.0.iter()));
    let (lo, hi) = all.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), q| (a.min(q.1), b.max(q.1)));
    let (lo, hi) = if lo.is_finite() { (lo, if hi > lo { hi } else { lo + 1.0 }) } else { (0.0, 1.0) };
    let pad = (hi - lo) * 0.08;
    let mut chart = ChartBuilder::on(area)
        .margin(10)
        .margin_right(25)
        .caption(p.title, (family, 22).into_font().style(FontStyle::Bold))
        .x_label_area_size(45)
        .y_label_area_size(85)
        .build_cartesian_2d(0.0..x_max, (lo - pad)..(hi + pad))?;
    chart
        .configure_mesh()
        .x_desc("training step")
        .y_desc(p.y_label)
        .axis_desc_style((family, 17))
        .label_style((family, 15))
        .x_labels((x_max as usize).clamp(2, 10))
        .y_labels(6)
        .x_label_formatter(&|x| if x.fract() == 0.0 { format!("{x:.0}") } else { format!("{x:.1}") })
        .y_label_formatter(&|y| tick(*y, hi - lo))
        .light_line_style(RGBColor(235, 235, 235))
        .draw()?;
    let (line, color) = p.line;
    chart.draw_series(LineSeries::new(line.iter().cloned(), color.stroke_width(2)))?;
    if let Some((dots, color)) = p.dots {
        chart.draw_series(dots.iter().map(|&q| Circle::new(q, 4, color.filled())))?;
    }
    if line.is_empty() && p.dots.is_none_or(|d| d.0.is_empty()) {
        let (w, h) = area.dim_in_pixel();
        let style = (family, 18).into_font().color(&RGBColor(120, 120, 120));
        area.draw_text("no data yet", &style, (w as i32 / 2 - 50, h as i32 / 2))?;
    }
    Ok(())
}

/// A y tick value with as many decimals as the axis range needs.
fn tick(y: f64, range: f64) -> String {
    let decimals = if range >= 50.0 {
        0
    } else if range >= 5.0 {
        1
    } else if range >= 0.5 {
        2
    } else if range >= 0.05 {
        3
    } else {
        4
    };
    if range < 5e-4 {
        format!("{y:.2e}")
    } else {
        format!("{y:.decimals$}")
    }
}
