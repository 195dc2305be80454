//! `curves.png`: loss and accuracy against step, training and held-out, drawn with plotters'
//! bitmap backend. Text is drawn from a built-in 8x8 bitmap font (font8x8), so no system font
//! library is needed.

use std::path::Path;

use anyhow::{anyhow, Result};
use font8x8::{UnicodeFonts, BASIC_FONTS};
use plotters::coord::Shift;
use plotters::prelude::*;

use crate::train::Metric;

const W: u32 = 1100;
const H: u32 = 440;
/// Text scale: each font pixel is a SCALE x SCALE square.
const SCALE: i32 = 2;
const TRAIN: RGBColor = RGBColor(31, 119, 180);
const EVAL: RGBColor = RGBColor(214, 39, 40);
const CHANCE: RGBColor = RGBColor(150, 150, 150);
const GRID: RGBColor = RGBColor(225, 225, 225);

type Area<'a> = DrawingArea<BitMapBackend<'a>, Shift>;

fn err<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow!("plot: {e:?}")
}

/// Text width in pixels.
fn text_width(s: &str) -> i32 {
    s.chars().count() as i32 * 8 * SCALE
}

/// Draw `s` with its top-left corner at `(x, y)` of `area`.
fn text(area: &Area, s: &str, x: i32, y: i32, color: &RGBColor) -> Result<()> {
    for (i, c) in s.chars().enumerate() {
        let glyph = BASIC_FONTS.get(c).unwrap_or([0; 8]);
        for (row, bits) in glyph.iter().enumerate() {
            for col in 0..8 {
                if bits >> col & 1 == 1 {
                    let px = x + (i as i32 * 8 + col) * SCALE;
                    let py = y + row as i32 * SCALE;
                    for dy in 0..SCALE {
                        for dx in 0..SCALE {
                            area.draw_pixel((px + dx, py + dy), color).map_err(err)?;
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

/// Round tick positions covering `[lo, hi]`, about `n` of them.
fn ticks(lo: f64, hi: f64, n: usize) -> Vec<f64> {
    let span = (hi - lo).max(1e-12);
    let raw = span / n as f64;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag);
    let mut v = Vec::new();
    let mut t = (lo / step).ceil() * step;
    while t <= hi + 1e-9 * span {
        v.push(t);
        t += step;
    }
    v
}

fn label(v: f64, step: f64) -> String {
    if step >= 1.0 && v.abs() < 1e6 {
        format!("{v:.0}")
    } else if step >= 0.1 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

struct Panel<'a> {
    title: &'a str,
    train: Vec<(f64, f64)>,
    eval: Vec<(f64, f64)>,
    y_range: (f64, f64),
    chance: Option<f64>,
    percent: bool,
}

fn panel(area: &Area, p: &Panel, x_max: f64) -> Result<()> {
    let (ml, mr, mt, mb) = (80, 40, 40, 56);
    let (w, h) = area.dim_in_pixel();
    let (w, h) = (w as i32, h as i32);
    let (x0, x1, y0, y1) = (ml, w - mr, mt, h - mb);
    let (ylo, yhi) = p.y_range;
    let px = |x: f64| x0 + ((x / x_max) * (x1 - x0) as f64).round() as i32;
    let py = |y: f64| y1 - (((y - ylo) / (yhi - ylo)) * (y1 - y0) as f64).round() as i32;
    let black = RGBColor(0, 0, 0);
    // grid and tick labels
    let yt = ticks(ylo, yhi, 5);
    let ystep = if yt.len() > 1 { yt[1] - yt[0] } else { 1.0 };
    for &t in &yt {
        let y = py(t);
        area.draw(&PathElement::new(vec![(x0, y), (x1, y)], GRID))
            .map_err(err)?;
        let s = if p.percent {
            format!("{}%", label(100.0 * t, 100.0 * ystep))
        } else {
            label(t, ystep)
        };
        text(area, &s, x0 - 6 - text_width(&s), y - 4 * SCALE, &black)?;
    }
    let xt = ticks(0.0, x_max, 5);
    for &t in &xt {
        let x = px(t);
        area.draw(&PathElement::new(vec![(x, y0), (x, y1)], GRID))
            .map_err(err)?;
        let s = label(t, 1.0);
        let lx = (x - text_width(&s) / 2).min(w - text_width(&s) - 2);
        text(area, &s, lx, y1 + 8, &black)?;
    }
    // axes
    area.draw(&PathElement::new(vec![(x0, y0), (x0, y1), (x1, y1)], black))
        .map_err(err)?;
    text(area, p.title, x0, 10, &black)?;
    let s = "step";
    text(area, s, x1 - text_width(s), y1 + 8 + 9 * SCALE, &black)?;
    // chance line
    if let Some(c) = p.chance {
        let y = py(c);
        area.draw(&PathElement::new(
            vec![(x0, y), (x1, y)],
            CHANCE.stroke_width(1),
        ))
        .map_err(err)?;
        text(
            area,
            "chance",
            x1 - text_width("chance") - 4,
            y - 9 * SCALE,
            &CHANCE,
        )?;
    }
    // curves
    let clamp = |y: f64| y.clamp(ylo, yhi);
    let line = |pts: &[(f64, f64)], color: RGBColor| -> Result<()> {
        if pts.len() >= 2 {
            area.draw(&PathElement::new(
                pts.iter()
                    .map(|&(x, y)| (px(x), py(clamp(y))))
                    .collect::<Vec<_>>(),
                color.stroke_width(2),
            ))
            .map_err(err)?;
        }
        for &(x, y) in pts {
            if color == EVAL {
                area.draw(&Circle::new((px(x), py(clamp(y))), 3, color.filled()))
                    .map_err(err)?;
            }
        }
        Ok(())
    };
    line(&p.train, TRAIN)?;
    line(&p.eval, EVAL)?;
    // legend, top right
    let names = [("train", TRAIN), ("held-out", EVAL)];
    let width: i32 = names.iter().map(|(n, _)| 30 + text_width(n) + 20).sum();
    let mut x = (x1 - width + 20).max(x0 + text_width(p.title) + 24);
    for (name, color) in names {
        area.draw(&PathElement::new(
            vec![(x, 10 + 4 * SCALE), (x + 24, 10 + 4 * SCALE)],
            color.stroke_width(3),
        ))
        .map_err(err)?;
        text(area, name, x + 30, 10, &color)?;
        x += 30 + text_width(name) + 20;
    }
    Ok(())
}

/// Write the loss and accuracy curves of `metrics` to `path`, atomically: drawn into
/// `<path>.tmp-<pid>.png` beside it (the encoder picks PNG by the extension), then written to
/// `path` through [`gdn::io::write_atomic`] (the one writer: symlinks, devices, temp cleanup).
pub fn write_curves(path: &Path, metrics: &[Metric], chance: Option<f64>) -> Result<()> {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".tmp-{}.png", std::process::id()));
    let tmp = path.with_file_name(name);
    let r = draw_curves(&tmp, metrics, chance).and_then(|()| {
        let png = std::fs::read(&tmp)?;
        gdn::io::write_atomic(path, &png)?;
        Ok(())
    });
    let _ = std::fs::remove_file(&tmp);
    r
}

fn draw_curves(path: &Path, metrics: &[Metric], chance: Option<f64>) -> Result<()> {
    let pick = |kind: &str, f: fn(&Metric) -> f64| -> Vec<(f64, f64)> {
        metrics
            .iter()
            .filter(|m| m.kind == kind)
            .map(|m| (m.step as f64, f(m)))
            .collect()
    };
    let x_max = metrics.iter().map(|m| m.step).max().unwrap_or(1).max(1) as f64;
    let loss_max = metrics
        .iter()
        .map(|m| m.loss)
        .filter(|l| l.is_finite())
        .fold(0.0f64, f64::max)
        .max(1e-3);
    let root = BitMapBackend::new(path, (W, H)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let halves = root.split_evenly((1, 2));
    panel(
        &halves[0],
        &Panel {
            title: "loss",
            train: pick("train", |m| m.loss),
            eval: pick("eval", |m| m.loss),
            y_range: (0.0, loss_max * 1.05),
            chance: None,
            percent: false,
        },
        x_max,
    )?;
    panel(
        &halves[1],
        &Panel {
            title: "accuracy",
            train: pick("train", |m| m.accuracy),
            eval: pick("eval", |m| m.accuracy),
            y_range: (0.0, 1.0),
            chance,
            percent: true,
        },
        x_max,
    )?;
    root.present().map_err(err)?;
    Ok(())
}
