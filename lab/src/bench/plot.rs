//! The PNGs the tools draw (`--plot`, `bench ddp --plot`, `examples/train.rs`):
//! plotters' bitmap backend with an embedded font (DejaVu Sans, subset to
//! ASCII: `font/LICENSE`), so no system font is needed; [`canvas`],
//! [`LABEL`], [`AXIS`] and [`legend`] are the set-up they share. [`draw`]
//! is `--plot FILE.png`: bus bandwidth against size (log x), one line per
//! side.

use std::path::Path;
use std::sync::Once;

use plotters::coord::{CoordTranslate, Shift};
use plotters::prelude::*;
use plotters::style::FontStyle;

const FONT: &[u8] = include_bytes!("font/DejaVuSans-ascii.ttf");

/// Tick labels.
pub const LABEL: (&str, u32) = ("sans-serif", 14);
/// Axis descriptions.
pub const AXIS: (&str, u32) = ("sans-serif", 15);

/// A white canvas of `size` pixels that becomes the PNG at `path` when
/// presented, with the embedded font registered as "sans-serif".
pub fn canvas(path: &Path, size: (u32, u32)) -> Result<DrawingArea<BitMapBackend<'_>, Shift>, String> {
    static FONT_ONCE: Once = Once::new();
    FONT_ONCE.call_once(|| {
        let _ = plotters::style::register_font("sans-serif", FontStyle::Normal, FONT);
    });
    let root = BitMapBackend::new(path, size).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    Ok(root)
}

/// Draws the legend of `chart`'s labelled series at `position`, on a
/// translucent white box.
pub fn legend<'a, CT: CoordTranslate>(
    chart: &mut ChartContext<'a, BitMapBackend<'a>, CT>,
    position: SeriesLabelPosition,
) -> Result<(), String> {
    chart
        .configure_series_labels()
        .position(position)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(LABEL)
        .draw()
        .map_err(|e| e.to_string())
}

/// One line of the plot.
#[derive(Debug, Clone)]
pub struct Series {
    /// Legend text.
    pub label: String,
    /// (bytes, busbw GB/s).
    pub points: Vec<(f64, f64)>,
}

/// `1K`, `64M`, ... for the x axis.
pub fn human_bytes(bytes: f64) -> String {
    let b = bytes.round() as u64;
    for (shift, unit) in [(30, "G"), (20, "M"), (10, "K")] {
        if b >= 1 << shift && b.is_multiple_of(1 << shift) {
            return format!("{}{unit}", b >> shift);
        }
    }
    b.to_string()
}

/// Draws `series` into the PNG at `path`.
pub fn draw(path: &Path, title: &str, series: &[Series]) -> Result<(), String> {
    let points = || {
        series
            .iter()
            .flat_map(|s| s.points.iter())
            .filter(|(x, y)| x.is_finite() && y.is_finite())
    };
    let (xmin, xmax) = points().fold((f64::INFINITY, 0f64), |(lo, hi), &(x, _)| (lo.min(x), hi.max(x)));
    let ymax = points().fold(0f64, |hi, &(_, y)| hi.max(y));
    if !xmin.is_finite() {
        return Err("nothing to plot".into());
    }
    let (xmin, xmax) = (xmin.max(1.0), xmax.max(xmin * 2.0));
    let root = canvas(path, (900, 560))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(60)
        .build_cartesian_2d((xmin..xmax).log_scale(), 0f64..(ymax * 1.1).max(0.01))
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_desc("size (bytes, log scale)")
        .y_desc("busbw (GB/s)")
        .x_label_formatter(&|x| human_bytes(*x))
        .label_style(LABEL)
        .axis_desc_style(AXIS)
        .draw()
        .map_err(|e| e.to_string())?;
    let colors = [
        RGBColor(31, 119, 180),
        RGBColor(44, 160, 44),
        RGBColor(148, 103, 189),
        RGBColor(214, 39, 40),
    ];
    for (i, s) in series.iter().enumerate() {
        let color = colors[i % colors.len()];
        let pts: Vec<(f64, f64)> = s
            .points
            .iter()
            .copied()
            .filter(|(x, y)| x.is_finite() && y.is_finite())
            .collect();
        chart
            .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
            .map_err(|e| e.to_string())?
            .label(s.label.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
        chart
            .draw_series(pts.into_iter().map(|p| Circle::new(p, 3, color.filled())))
            .map_err(|e| e.to_string())?;
    }
    legend(&mut chart, SeriesLabelPosition::UpperLeft)?;
    root.present().map_err(|e| e.to_string())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_labels() {
        assert_eq!(human_bytes(8.0), "8");
        assert_eq!(human_bytes(65536.0), "64K");
        assert_eq!(human_bytes(67108864.0), "64M");
        assert_eq!(human_bytes(1000.0), "1000");
    }
}
