//! `--plot FILE.png`: bus bandwidth against size (log x), one line per side,
//! drawn with plotters' bitmap backend and an embedded font (DejaVu Sans,
//! subset to ASCII: `font/LICENSE`), so no system font is needed.

use std::path::Path;
use std::sync::Once;

use plotters::prelude::*;
use plotters::style::FontStyle;

const FONT: &[u8] = include_bytes!("font/DejaVuSans-ascii.ttf");

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

/// Makes the embedded font plotters' "sans-serif" (once per process).
pub fn register_font() {
    static FONT_ONCE: Once = Once::new();
    FONT_ONCE.call_once(|| {
        let _ = plotters::style::register_font("sans-serif", FontStyle::Normal, FONT);
    });
}

/// Draws `series` into the PNG at `path`.
pub fn draw(path: &Path, title: &str, series: &[Series]) -> Result<(), String> {
    register_font();
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
    let root = BitMapBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
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
        .label_style(("sans-serif", 14))
        .axis_desc_style(("sans-serif", 15))
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
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 14))
        .draw()
        .map_err(|e| e.to_string())?;
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
