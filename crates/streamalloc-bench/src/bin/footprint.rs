//! Footprint of StreamSafe over each backing on the simulator: replays every trace given
//! (RMM logging CSV) and prints a markdown table of peak device memory used over peak live
//! bytes, device calls and ns per operation (one timed pass: CPU figures come from
//! criterion, not from here).
//!
//! Run: `cargo run --release -p streamalloc-bench --bin footprint -- traces/*.csv traces/synthetic/*.csv`

use std::sync::Arc;

use streamalloc::allocators::{BackingKind, BestFitConfig, StreamSafe, StreamSafeConfig};
use streamalloc::device::sim::{SimConfig, SimDevice};
use streamalloc_replay::replay::{replay, ReplayOptions, ReplayTarget};
use streamalloc_replay::trace::Trace;

fn main() -> streamalloc::Result<()> {
    let backings = [
        ("chunks", BackingKind::Chunks),
        ("segments", BackingKind::Segments),
        ("stitched", BackingKind::Stitched),
    ];
    println!("| trace | peak live MiB | {} |", backings.map(|(n, _)| n).join(" | "));
    println!("| --- | --- |{}", " --- |".repeat(backings.len()));
    for path in std::env::args().skip(1) {
        let trace = Trace::from_path(&path)?;
        let mut cells = Vec::new();
        let mut live = 0;
        for (name, backing) in backings {
            let sim = SimDevice::new(SimConfig::h200());
            let pool = BestFitConfig { backing, ..Default::default() };
            let alloc = StreamSafe::new(sim.clone(), StreamSafeConfig { pool, ..Default::default() })?;
            let target = ReplayTarget::Streams(Arc::new(alloc));
            let r = replay(
                &trace,
                name,
                &target,
                sim.as_ref(),
                &ReplayOptions { passes: 1, ..Default::default() },
            )?;
            live = r.peak_live;
            cells.push(format!(
                "{:.3} ({} calls, {:.0} ns{})",
                r.footprint_ratio,
                r.device_calls,
                r.ns_per_op_warm,
                if r.failures > 0 { format!(", {} FAILED", r.failures) } else { String::new() }
            ));
        }
        let name = path.rsplit('/').next().unwrap_or(&path);
        println!("| {name} | {:.1} | {} |", live as f64 / (1 << 20) as f64, cells.join(" | "));
    }
    Ok(())
}
