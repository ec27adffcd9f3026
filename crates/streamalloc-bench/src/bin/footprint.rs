//! Footprint of StreamSafe over each backing on the simulator: replays every trace given
//! (RMM logging CSV) and prints a markdown table of peak device memory used over peak live
//! bytes in the measuring pass and the pool's peak reserved bytes over them across all passes,
//! device calls of the measuring pass, the simulator's mapping calls (map, map_alias,
//! unmap) and the granules they mapped or unmapped, as `calls/granules`, in each of the first
//! four passes over one allocator (the last three are the warm passes the anchors harness
//! times; on an H200 each granule costs 20-40 microseconds) and, with `--passes N` (N > 3),
//! in the N - 3 passes after them (a repeated workload's long run), and ns per operation
//! (best of the warm passes: CPU figures come from criterion, not from here).
//!
//! Run: `cargo run --release -p streamalloc-bench --bin footprint -- [--passes N] traces/*.csv.xz`

use std::sync::{Arc, Mutex, PoisonError};

use streamalloc::allocators::{BackingKind, BestFitConfig, StreamSafe, StreamSafeConfig};
use streamalloc::device::sim::{SimConfig, SimDevice};
use streamalloc_replay::replay::{replay, ReplayOptions, ReplayTarget};
use streamalloc_replay::trace::Trace;

fn main() -> streamalloc::Result<()> {
    let backings: Vec<BackingKind> = BackingKind::all().collect();
    let names: Vec<&str> = backings.iter().map(|b| b.name()).collect();
    println!("| trace | peak live MiB | {} |", names.join(" | "));
    println!("| --- | --- |{}", " --- |".repeat(backings.len()));
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let mut passes = 3;
    if args.first().is_some_and(|a| a == "--passes") {
        let n = args.get(1).and_then(|n| n.parse().ok()).filter(|&n| n >= 3);
        let Some(n) = n else {
            return Err(streamalloc::Error::InvalidArgument("--passes takes a number of at least 3".into()));
        };
        passes = n;
        args.drain(..2);
    }
    for path in args {
        let trace = Trace::from_path(&path)?;
        let mut cells = Vec::new();
        let mut live = 0;
        for &backing in &backings {
            let sim = SimDevice::new(SimConfig::h200());
            let pool = BestFitConfig { backing, ..Default::default() };
            let alloc = StreamSafe::new(sim.clone(), StreamSafeConfig { pool, ..Default::default() })?;
            let target = ReplayTarget::Streams(Arc::new(alloc));
            // The simulator's mapping calls and granules at the end of each pass.
            let per_pass = Mutex::new(vec![(sim.mapping_calls(), sim.mapped_granules())]);
            let pass_done = |_| {
                per_pass
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push((sim.mapping_calls(), sim.mapped_granules()));
            };
            let options = ReplayOptions { passes, pass_done: Some(&pass_done), ..Default::default() };
            let r = replay(&trace, backing.name(), &target, sim.as_ref(), &options)?;
            live = r.peak_live;
            let per_pass = per_pass.into_inner().unwrap_or_else(PoisonError::into_inner);
            // Mapping calls and granules per pass: "calls/granules" for each of the first four,
            // then the sums over the rest.
            let each: Vec<(u64, u64)> =
                per_pass.windows(2).map(|w| (w[1].0 - w[0].0, w[1].1 - w[0].1)).collect();
            let show = |(calls, granules): (u64, u64)| format!("{calls}/{granules}");
            let later = match each.get(4..) {
                Some(rest) if !rest.is_empty() => {
                    let sum = rest.iter().fold((0, 0), |(c, g), &(dc, dg)| (c + dc, g + dg));
                    format!(", then {} in {} passes", show(sum), rest.len())
                }
                _ => String::new(),
            };
            let maps: Vec<String> = each.iter().take(4).map(|&x| show(x)).collect();
            cells.push(format!(
                "{:.4} (all passes {:.4}, {} calls, maps {}{later}, {:.0} ns{})",
                r.footprint_ratio,
                r.reserved_peak as f64 / r.peak_live.max(1) as f64,
                r.device_calls,
                maps.join(" "),
                r.ns_per_op_warm,
                if r.failures > 0 { format!(", {} FAILED", r.failures) } else { String::new() }
            ));
        }
        let name = path.rsplit('/').next().unwrap_or(&path);
        println!("| {name} | {:.1} | {} |", live as f64 / (1 << 20) as f64, cells.join(" | "));
    }
    Ok(())
}
