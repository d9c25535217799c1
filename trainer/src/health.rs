//! The health check every step passes before it counts: a finite loss and gradient norm,
//! and, when `health.spike_sigma` is set, a loss within that many standard deviations above
//! the mean of the steps before it. The recent losses travel in the checkpoint's state, so a
//! resumed run judges its steps as the uninterrupted run would.

use crate::config::HealthConfig;

/// Why step `step` is bad, or `None` when it is healthy. `recent` holds the losses of the
/// steps before it, oldest first.
pub fn verdict(
    config: &HealthConfig,
    recent: &[f64],
    step: u64,
    loss: f64,
    grad_norm: f64,
) -> Option<String> {
    if !loss.is_finite() {
        return Some(format!("the loss is {loss}"));
    }
    if !grad_norm.is_finite() {
        return Some(format!("the gradient norm is {grad_norm}"));
    }
    if config.spike_sigma <= 0.0
        || step <= config.spike_after_step
        || recent.len() < config.spike_window
    {
        return None;
    }
    let window = &recent[recent.len() - config.spike_window..];
    let n = window.len() as f64;
    let mean = window.iter().sum::<f64>() / n;
    let deviation = (window.iter().map(|l| (l - mean).powi(2)).sum::<f64>() / n).sqrt();
    let limit = mean + config.spike_sigma * deviation;
    (loss > limit).then(|| {
        format!(
            "a loss spike: {loss:.4} is above {limit:.4}, the mean {mean:.4} of the previous {} steps plus health.spike_sigma = {} standard deviations of {deviation:.4}",
            window.len(),
            config.spike_sigma
        )
    })
}

/// Adds a healthy step's loss to `recent`, which keeps the last `spike_window`.
pub fn remember(config: &HealthConfig, recent: &mut Vec<f64>, loss: f64) {
    recent.push(loss);
    if recent.len() > config.spike_window {
        recent.drain(..recent.len() - config.spike_window);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spikes(sigma: f64) -> HealthConfig {
        HealthConfig {
            spike_sigma: sigma,
            spike_window: 4,
            spike_after_step: 10,
            ..HealthConfig::default()
        }
    }

    #[test]
    fn non_finite_figures_are_bad_whatever_the_spike_rule() {
        let off = spikes(0.0);
        assert_eq!(
            verdict(&off, &[], 1, f64::NAN, 1.0).as_deref(),
            Some("the loss is NaN")
        );
        assert_eq!(
            verdict(&off, &[], 1, 2.0, f64::INFINITY).as_deref(),
            Some("the gradient norm is inf")
        );
        assert_eq!(verdict(&off, &[], 1, 2.0, 1.0), None);
    }

    #[test]
    fn a_spike_counts_only_after_its_step_with_a_full_window() {
        let rule = spikes(3.0);
        let recent = [4.0, 4.2, 3.8, 4.0];
        // mean 4.0, deviation about 0.141: the limit is about 4.42.
        assert_eq!(verdict(&rule, &recent, 11, 4.4, 1.0), None);
        let bad = verdict(&rule, &recent, 11, 4.5, 1.0).expect("a spike");
        assert!(
            bad.starts_with("a loss spike: 4.5000 is above 4.4243"),
            "{bad}"
        );
        assert_eq!(
            verdict(&rule, &recent, 10, 9.0, 1.0),
            None,
            "before spike_after_step"
        );
        assert_eq!(
            verdict(&rule, &recent[1..], 11, 9.0, 1.0),
            None,
            "window not full"
        );
        assert_eq!(
            verdict(&spikes(0.0), &recent, 11, 9.0, 1.0),
            None,
            "rule off"
        );
    }

    #[test]
    fn the_window_keeps_the_newest_losses() {
        let rule = spikes(3.0);
        let mut recent = Vec::new();
        for loss in 1..=6 {
            remember(&rule, &mut recent, f64::from(loss));
        }
        assert_eq!(recent, [3.0, 4.0, 5.0, 6.0]);
    }
}
