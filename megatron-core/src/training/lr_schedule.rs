//! The learning-rate schedule: linear warmup, then decay to a minimum (Megatron-LM's
//! `OptimizerParamScheduler`).

use std::str::FromStr;

/// How the learning rate decays after warmup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecayStyle {
    /// Stays at the peak.
    Constant,
    /// Linear from the peak to the minimum.
    Linear,
    /// Half a cosine from the peak to the minimum.
    Cosine,
}

impl FromStr for DecayStyle {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "constant" => Ok(DecayStyle::Constant),
            "linear" => Ok(DecayStyle::Linear),
            "cosine" => Ok(DecayStyle::Cosine),
            other => Err(format!(
                "unknown decay style `{other}` (constant, linear, cosine)"
            )),
        }
    }
}

/// Learning rate as a function of the step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LrSchedule {
    /// Peak learning rate.
    pub max_lr: f64,
    /// Learning rate at the end of the decay.
    pub min_lr: f64,
    /// Steps of linear warmup from 0.
    pub warmup_steps: u64,
    /// Step at which the decay ends (the minimum holds after it).
    pub decay_steps: u64,
    /// Shape of the decay.
    pub style: DecayStyle,
}

impl LrSchedule {
    /// The learning rate of the update made at 0-based step `step`. As in Megatron-LM the warmup
    /// counts the update being made, so the first update uses `max_lr / warmup_steps`.
    pub fn lr(&self, step: u64) -> f64 {
        let n = step + 1;
        if self.warmup_steps > 0 && n <= self.warmup_steps {
            return self.max_lr * n as f64 / self.warmup_steps as f64;
        }
        if self.style == DecayStyle::Constant {
            return self.max_lr;
        }
        if n >= self.decay_steps {
            return self.min_lr;
        }
        let span = self.decay_steps.saturating_sub(self.warmup_steps).max(1) as f64;
        let ratio = (n - self.warmup_steps) as f64 / span;
        let coeff = match self.style {
            DecayStyle::Linear => 1.0 - ratio,
            DecayStyle::Cosine => 0.5 * (std::f64::consts::PI * ratio).cos() + 0.5,
            DecayStyle::Constant => 1.0,
        };
        self.min_lr + coeff * (self.max_lr - self.min_lr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_then_cosine_to_the_minimum() {
        let s = LrSchedule {
            max_lr: 1e-3,
            min_lr: 1e-4,
            warmup_steps: 10,
            decay_steps: 110,
            style: DecayStyle::Cosine,
        };
        assert!((s.lr(0) - 1e-4).abs() < 1e-12);
        assert!((s.lr(9) - 1e-3).abs() < 1e-12);
        assert!((s.lr(59) - 5.5e-4).abs() < 1e-9, "{}", s.lr(59));
        assert_eq!(s.lr(109), 1e-4);
        assert_eq!(s.lr(500), 1e-4);
        assert!((1..109).all(|t| s.lr(t + 9) >= s.lr(t + 10)));
        let lin = LrSchedule {
            style: DecayStyle::Linear,
            ..s
        };
        assert!((lin.lr(59) - 5.5e-4).abs() < 1e-9);
        assert_eq!(
            LrSchedule {
                style: DecayStyle::Constant,
                ..s
            }
            .lr(100),
            1e-3
        );
        assert!("cosine".parse::<DecayStyle>().is_ok() && "exp".parse::<DecayStyle>().is_err());
    }
}
