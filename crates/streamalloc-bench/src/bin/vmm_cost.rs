//! Measures, on CUDA device 0, the host cost of the virtual-memory calls a stitched pool makes
//! ([`VirtualMemory::map`], [`VirtualMemory::map_alias`], [`VirtualMemory::unmap`]) for ranges of 1 to 64 granules,
//! an alias made from one source range or from one range per granule: the figures behind
//! the stitched backing's cost when a warm pass still maps.
//! A measurement to read, not a test: `cargo run --release -p streamalloc-bench --bin vmm_cost`
//! (on the GPU machine, packed by scripts/gpu-test.sh: `.gpu/bin/vmm_cost`).

use std::time::Instant;

use streamalloc::device::cuda::CudaDevice;
use streamalloc::device::VirtualMemory;
use streamalloc::Result;

/// Rounds per size; the best is printed.
const ROUNDS: usize = 5;

/// Microseconds `f` took.
fn micros(f: impl FnOnce() -> Result<()>) -> Result<f64> {
    let start = Instant::now();
    f()?;
    Ok(start.elapsed().as_secs_f64() * 1e6)
}

fn main() -> Result<()> {
    let device = CudaDevice::new(0)?;
    let g = device.map_granularity()?;
    println!("VMM_COST granule_bytes={g}");
    for granules in [1, 4, 16, 64] {
        let size = granules * g;
        let base = device.reserve_address(2 * size)?;
        let (home, alias) = (base, base + size as u64);
        // Best of ROUNDS: (map, alias from one range, alias from one range per granule, unmap
        // of the alias, unmap of the home).
        let mut best = [f64::MAX; 5];
        for _ in 0..ROUNDS {
            let map = micros(|| device.map(home, size))?;
            let one = micros(|| device.map_alias(&[(home, size)], alias))?;
            let unmap_alias = micros(|| device.unmap(alias, size))?;
            let pieces: Vec<(u64, usize)> = (0..granules).map(|i| (home + (i * g) as u64, g)).collect();
            let many = micros(|| device.map_alias(&pieces, alias))?;
            device.unmap(alias, size)?;
            let unmap_home = micros(|| device.unmap(home, size))?;
            for (b, x) in best.iter_mut().zip([map, one, many, unmap_alias, unmap_home]) {
                *b = b.min(x);
            }
        }
        device.free_address(base, 2 * size)?;
        let [map, one, many, unmap_alias, unmap_home] = best;
        println!(
            "VMM_COST granules={granules} map_us={map:.1} alias_one_source_us={one:.1} \
             alias_per_granule_sources_us={many:.1} unmap_alias_us={unmap_alias:.1} unmap_home_us={unmap_home:.1} \
             map_us_per_granule={:.2} alias_us_per_granule={:.2}",
            map / granules as f64,
            one / granules as f64
        );
    }
    Ok(())
}
