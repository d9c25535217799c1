//! Figures for benchmarks on a noisy machine: the median of repeated (or paired) measurements
//! and its spread, rather than one run.

/// The median of `values` (NaN when there are none).
pub fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        sorted[n / 2]
    } else {
        (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
    }
}

/// The smallest and the largest of `values` (infinities when there are none).
pub fn range(values: &[f64]) -> (f64, f64) {
    values
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(l, h), v| {
            (l.min(*v), h.max(*v))
        })
}

/// A ratio's median with its spread: the range and the median absolute deviation, over
/// `values.len()` of `what` ("pairs", "rounds").
pub fn spread(values: &[f64], what: &str) -> String {
    let m = median(values);
    let deviations: Vec<f64> = values.iter().map(|v| (v - m).abs()).collect();
    let (low, high) = range(values);
    format!(
        "{m:.2}x (range {low:.2}-{high:.2}, median absolute deviation {:.2}, {} {what})",
        median(&deviations),
        values.len()
    )
}
