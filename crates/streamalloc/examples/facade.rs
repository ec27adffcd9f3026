//! The configured stack per device, as the C ABI builds it: a strategy with a hard limit, a
//! retry on out-of-memory and statistics, from the same string as `STREAMALLOC_CONF`.
//!
//! Run: `cargo run -p streamalloc --example facade` (on the simulator), or
//! `STREAMALLOC_CONF=strategy=stream_safe,limit=0.5 cargo run -p streamalloc --example facade -- env`
//! to read the configuration from the environment.

use streamalloc::facade::{Config, Facade};
use streamalloc::{Error, Result, Stream};

fn main() -> Result<()> {
    let config = match std::env::args().nth(1).as_deref() {
        Some("env") => Config::from_env()?,
        _ => Config::parse(
            "strategy=stream_safe,device=sim,sim_capacity=1GiB,limit=256MiB,retry_timeout=100ms,stats=true",
        )?,
    };
    let facade = Facade::new(config);
    let a = facade.allocate(100 << 20, 0, Stream::DEFAULT)?;
    let b = facade.allocate(100 << 20, 0, Stream::DEFAULT)?;
    // Over the limit: the error carries the figures (out of device memory would be
    // `Error::OutOfMemory`, with what is allocated, cached and free).
    match facade.allocate(100 << 20, 0, Stream::DEFAULT) {
        Err(e @ Error::LimitExceeded { .. }) => println!("refused as expected: {e}"),
        Err(e) => return Err(e),
        Ok(_) => println!("the configured stack had room for a third buffer"),
    }
    drop((a, b));
    let stats = facade.stats(0);
    println!("allocated {} bytes now, peak {} bytes", stats.allocated, stats.allocated_peak);
    Ok(())
}
