//! The loss curve as a PNG: train and validation loss against tokens seen.

use std::path::Path;

use anyhow::{Context, Result, anyhow};
use plotters::prelude::*;
use serde_json::Value;

/// One point of a curve.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Point {
    /// Tokens consumed when the value was measured.
    pub tokens: f64,
    /// The loss.
    pub loss: f64,
}

/// The curves of a run.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Curves {
    /// Training loss per step.
    pub train: Vec<Point>,
    /// Validation loss per evaluation.
    pub valid: Vec<Point>,
}

impl Curves {
    /// Reads the curves from a JSON-lines log of `megatron train`: lines with `loss` are training
    /// steps, lines with `valid_loss` evaluations; both carry `tokens`.
    pub fn from_log(text: &str) -> Result<Curves> {
        let mut curves = Curves::default();
        for (i, line) in text
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
        {
            let v: Value =
                serde_json::from_str(line).with_context(|| format!("line {}: not JSON", i + 1))?;
            let tokens = v["tokens"]
                .as_f64()
                .ok_or_else(|| anyhow!("line {}: no `tokens`", i + 1))?;
            if let Some(loss) = v["loss"].as_f64() {
                curves.train.push(Point { tokens, loss });
            }
            if let Some(loss) = v["valid_loss"].as_f64() {
                curves.valid.push(Point { tokens, loss });
            }
        }
        Ok(curves)
    }
}

/// The font family the plot's text is drawn in.
const FONT: &str = "sans-serif";

/// Registers DejaVu Sans, embedded in the binary, as [`FONT`] (once): the plot's text needs no
/// system font library and no installed font.
fn register_font() -> Result<()> {
    static REGISTERED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let ok = *REGISTERED.get_or_init(|| {
        plotters::style::register_font(FONT, FontStyle::Normal, dejavu::sans::regular()).is_ok()
    });
    if ok {
        Ok(())
    } else {
        Err(anyhow!("the embedded DejaVu Sans font did not load"))
    }
}

/// Draws the curves into a PNG at `path` (written through a temporary file).
pub fn draw(curves: &Curves, title: &str, path: &Path) -> Result<()> {
    register_font()?;
    let all = curves.train.iter().chain(&curves.valid);
    let max_tokens = all.clone().map(|p| p.tokens).fold(0.0, f64::max).max(1.0);
    let (lo, hi) = all
        .map(|p| p.loss)
        .filter(|l| l.is_finite())
        .fold((f64::MAX, f64::MIN), |(a, b), l| (a.min(l), b.max(l)));
    let (lo, hi) = if lo > hi { (0.0, 1.0) } else { (lo, hi) };
    let pad = ((hi - lo) * 0.05).max(1e-3);
    let tmp = path.with_extension("tmp.png");
    let drawn = (|| -> Result<()> {
        let root = BitMapBackend::new(&tmp, (960, 540)).into_drawing_area();
        root.fill(&WHITE)
            .map_err(|e| anyhow!("drawing {}: {e}", path.display()))?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, (FONT, 22))
            .margin(12)
            .x_label_area_size(44)
            .y_label_area_size(56)
            .build_cartesian_2d(0.0..max_tokens, (lo - pad)..(hi + pad))
            .map_err(|e| anyhow!("drawing {}: {e}", path.display()))?;
        chart
            .configure_mesh()
            .x_desc("tokens")
            .y_desc("loss (nats per token)")
            .x_label_formatter(&|t| format_tokens(*t))
            .draw()
            .map_err(|e| anyhow!("drawing {}: {e}", path.display()))?;
        for (points, color, label) in [
            (&curves.train, BLUE, "train"),
            (&curves.valid, RED, "validation"),
        ] {
            if points.is_empty() {
                continue;
            }
            chart
                .draw_series(LineSeries::new(
                    points.iter().map(|p| (p.tokens, p.loss)),
                    color.stroke_width(2),
                ))
                .map_err(|e| anyhow!("drawing {}: {e}", path.display()))?
                .label(label)
                .legend(move |(x, y)| {
                    PathElement::new([(x, y), (x + 20, y)], color.stroke_width(2))
                });
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(|e| anyhow!("drawing {}: {e}", path.display()))?;
        root.present()
            .map_err(|e| anyhow!("writing {}: {e}", path.display()))
    })()
    .and_then(|()| {
        let target = megatron_core::files::output_path(path)
            .with_context(|| format!("writing {}", path.display()))?;
        std::fs::rename(&tmp, &target).with_context(|| format!("writing {}", path.display()))
    });
    if drawn.is_err() {
        // No half-drawn image is left behind.
        let _ = std::fs::remove_file(&tmp);
    }
    drawn
}

/// `1.5M`, `320k`, `900`.
fn format_tokens(t: f64) -> String {
    if t >= 1e6 {
        format!("{:.1}M", t / 1e6)
    } else if t >= 1e4 {
        format!("{:.0}k", t / 1e3)
    } else if t >= 1e3 {
        format!("{:.1}k", t / 1e3)
    } else {
        format!("{t:.0}")
    }
}
