//! `megatron models`: the registered model presets.

use super::output::say;
use anyhow::Result;
use megatron::models::presets;

/// Prints every preset with its size.
pub fn run() -> Result<()> {
    for p in presets() {
        let c = (p.config)();
        say!(
            "{:<12} {:>8.1}M  {}",
            p.name,
            c.num_params(1) as f64 / 1e6,
            p.description
        )?;
    }
    Ok(())
}
