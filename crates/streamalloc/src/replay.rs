//! Replays a [`Trace`] through an allocator and measures footprint and speed.
//!
//! The method is the one of the anchors' replay harness (`anchors/replay_common.h`), so
//! figures compare with theirs:
//!
//! * **Pass 0** (untimed) runs every operation and samples the device's memory use
//!   ([`Device::mem_info`]) after each one. Its peak, minus the use measured just before
//!   the pass, is [`ReplayResult::peak_device_used`]; divided by the trace's peak live bytes
//!   it is the [`ReplayResult::footprint_ratio`] (1.0 is a perfect allocator, which no
//!   real one reaches).
//! * **Passes 1..=N** (timed, [`ReplayOptions::passes`], default 3) run the trace again on
//!   the same allocator, so caches are warm; the best pass gives
//!   [`ReplayResult::ns_per_op_warm`].
//!
//! Each pass ends by freeing what is still live and synchronizing the streams the replay
//! uses; both are inside the timing. A failed allocation is counted, not fatal: its slot
//! stays empty and the later free of it is skipped.

use std::sync::Arc;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::allocation::{Allocation, Allocator, StreamAllocator};
use crate::device::{Device, Stream};
use crate::error::{Error, Result};
use crate::trace::{Op, Trace};

/// The allocator under replay.
pub enum ReplayTarget {
    /// An allocator without a stream API: every operation runs on the allocator's own
    /// stream, and the trace's stream indices are ignored.
    Single(Arc<dyn Allocator>),
    /// A stream-aware allocator: the replay creates one stream per recorded stream and
    /// allocates on the stream each operation names.
    Streams(Arc<dyn StreamAllocator>),
}

impl ReplayTarget {
    fn allocate(&self, size: usize, stream: Stream) -> Result<Allocation> {
        match self {
            ReplayTarget::Single(a) => a.allocate(size),
            ReplayTarget::Streams(a) => a.allocate_on(size, stream),
        }
    }

    fn stats(&self) -> crate::Stats {
        match self {
            ReplayTarget::Single(a) => a.stats(),
            ReplayTarget::Streams(a) => a.stats(),
        }
    }
}

/// How to replay.
#[derive(Clone, Copy)]
pub struct ReplayOptions<'a> {
    /// Timed passes after the measuring pass (at least 1).
    pub passes: usize,
    /// Called now and then with the number of operations run since the last call; the
    /// whole replay runs `trace.len() * (passes + 1)` operations.
    pub progress: Option<&'a dyn Fn(u64)>,
}

impl Default for ReplayOptions<'_> {
    fn default() -> Self {
        Self { passes: 3, progress: None }
    }
}

/// What a replay measured. Serializes to the anchors' JSON field names.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReplayResult {
    /// Name of the allocator, as the caller gave it.
    pub allocator: String,
    /// Name of the trace.
    pub trace: String,
    /// Operations in the trace (allocations and frees).
    pub ops: usize,
    /// The trace's peak live bytes.
    pub peak_live: usize,
    /// Peak device memory used during pass 0, minus the use before it.
    pub peak_device_used: usize,
    /// `peak_device_used / peak_live` (0 for a trace with no live bytes).
    pub footprint_ratio: f64,
    /// The allocator's peak reserved bytes ([`Stats::reserved_peak`](crate::Stats)) after
    /// all passes.
    pub reserved_peak: usize,
    /// Device allocations plus device frees made during pass 0.
    pub device_calls: u64,
    /// Best timed pass, in nanoseconds per operation.
    pub ns_per_op_warm: f64,
    /// Most failed allocations in any one pass.
    pub failures: u64,
    /// Timed passes run.
    pub passes: usize,
    /// The first allocation error met, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_failure: Option<String>,
}

/// Streams created for a replay, destroyed on drop (errors ignored: nothing to do then).
struct Streams<'a> {
    device: &'a dyn Device,
    streams: Vec<Stream>,
}

impl Drop for Streams<'_> {
    fn drop(&mut self) {
        for &s in &self.streams {
            let _ = self.device.synchronize_stream(s);
            let _ = self.device.destroy_stream(s);
        }
    }
}

/// How often (in operations) progress is reported.
const PROGRESS_EVERY: usize = 4096;

/// Replays `trace` through `target`, whose memory comes from `device`, and names the
/// result after `allocator`. See the [module docs](self) for the method.
///
/// Errors are those of the device (creating or synchronizing streams, reading memory
/// info), a `passes` of 0 and a hand-built trace whose ops name slots it lacks; allocation failures are counted in the result instead.
pub fn replay(
    trace: &Trace,
    allocator: &str,
    target: &ReplayTarget,
    device: &dyn Device,
    options: &ReplayOptions<'_>,
) -> Result<ReplayResult> {
    if options.passes == 0 {
        return Err(Error::InvalidArgument("replay needs at least one timed pass".into()));
    }
    if let Some(op) = trace.ops.iter().find(|op| match **op {
        Op::Allocate { slot, .. } | Op::Free { slot, .. } => slot >= trace.slots,
    }) {
        return Err(Error::InvalidArgument(format!(
            "trace {}: {op:?} names a slot beyond its {} slots",
            trace.name, trace.slots
        )));
    }
    let mut streams = Streams { device, streams: Vec::new() };
    if let ReplayTarget::Streams(_) = target {
        for _ in 0..trace.streams.len().max(1) {
            streams.streams.push(device.create_stream()?);
        }
    }
    let stream_of = |index: usize| streams.streams.get(index).copied().unwrap_or(Stream::DEFAULT);
    let synchronize = || -> Result<()> {
        device.synchronize_stream(Stream::DEFAULT)?;
        streams.streams.iter().try_for_each(|&s| device.synchronize_stream(s))
    };

    let mut slots: Vec<Option<Allocation>> = Vec::new();
    slots.resize_with(trace.slots, || None);
    let mut failures = 0u64;
    let mut first_failure = None;
    let mut best_ns = f64::INFINITY;
    let mut device_calls = 0;

    synchronize()?;
    let base = device.mem_info()?.used();
    let mut peak = base;
    let calls_before = target.stats();

    for pass in 0..=options.passes {
        let sample = pass == 0;
        let mut pass_failures = 0u64;
        let start = Instant::now();
        for (i, op) in trace.ops.iter().enumerate() {
            match *op {
                Op::Allocate { slot, size, stream } => match target.allocate(size, stream_of(stream)) {
                    Ok(a) => slots[slot] = Some(a),
                    Err(e) => {
                        pass_failures += 1;
                        first_failure.get_or_insert_with(|| e.to_string());
                    }
                },
                Op::Free { slot, .. } => slots[slot] = None,
            }
            if sample {
                peak = peak.max(device.mem_info()?.used());
            }
            if let Some(progress) = options.progress {
                if (i + 1) % PROGRESS_EVERY == 0 {
                    progress(PROGRESS_EVERY as u64);
                }
            }
        }
        slots.iter_mut().for_each(|s| *s = None);
        synchronize()?;
        let elapsed = start.elapsed();
        if let Some(progress) = options.progress {
            progress((trace.ops.len() % PROGRESS_EVERY) as u64);
        }
        failures = failures.max(pass_failures);
        if sample {
            let after = target.stats();
            device_calls = (after.device_allocs + after.device_frees)
                .saturating_sub(calls_before.device_allocs + calls_before.device_frees);
        } else {
            let ns = elapsed.as_nanos() as f64 / trace.ops.len().max(1) as f64;
            best_ns = best_ns.min(ns);
        }
    }

    let peak_device_used = peak.saturating_sub(base);
    Ok(ReplayResult {
        allocator: allocator.to_owned(),
        trace: trace.name.clone(),
        ops: trace.ops.len(),
        peak_live: trace.peak_live,
        peak_device_used,
        footprint_ratio: if trace.peak_live == 0 {
            0.0
        } else {
            peak_device_used as f64 / trace.peak_live as f64
        },
        reserved_peak: target.stats().reserved_peak,
        device_calls,
        ns_per_op_warm: best_ns,
        failures,
        passes: options.passes,
        first_failure,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::allocators::Plain;
    use crate::device::sim::{SimConfig, SimDevice};

    fn trace(text: &str) -> Trace {
        Trace::parse(format!("{}\n{text}", crate::trace::HEADER).as_bytes(), "t").unwrap()
    }

    #[test]
    fn plain_on_the_simulator_measures_footprint_and_calls() {
        let device = SimDevice::new(SimConfig::with_capacity(1 << 30));
        let plain = ReplayTarget::Single(Arc::new(Plain::new(device.clone(), Stream::DEFAULT)));
        // 1000 + 3000 live at the peak; 512-byte granules make it 1024 + 3072.
        let t = trace(
            "0,1,allocate,0x1,1000,0\n0,2,allocate,0x2,3000,0\n0,3,free,0x1,0,0\n0,4,allocate,0x3,10,0\n",
        );
        let r = replay(&t, "plain", &plain, device.as_ref(), &ReplayOptions::default()).unwrap();
        assert_eq!((r.allocator.as_str(), r.trace.as_str(), r.ops, r.peak_live), ("plain", "t", 4, 4000));
        assert_eq!(r.peak_device_used, 4096);
        assert!((r.footprint_ratio - 1.024).abs() < 1e-9);
        // Three device allocations, one free in the trace and two frees of what was left.
        assert_eq!(r.device_calls, 6);
        assert_eq!(r.failures, 0);
        assert!(r.ns_per_op_warm.is_finite() && r.ns_per_op_warm > 0.0);
        assert_eq!(device.mem_info().unwrap().used(), 0, "everything freed at the end");
    }

    #[test]
    fn failures_are_counted_and_their_frees_skipped() {
        let device = SimDevice::new(SimConfig::with_capacity(1 << 20));
        let plain = ReplayTarget::Single(Arc::new(Plain::new(device.clone(), Stream::DEFAULT)));
        let t = trace(
            "0,1,allocate,0x1,4096,0\n0,2,allocate,0x2,2000000,0\n0,3,free,0x2,0,0\n0,4,free,0x1,0,0\n",
        );
        let r = replay(&t, "plain", &plain, device.as_ref(), &ReplayOptions::default()).unwrap();
        assert_eq!(r.failures, 1);
        assert!(r.first_failure.unwrap().contains("out of memory"));
        assert_eq!(r.peak_device_used, 4096);
    }

    #[test]
    fn progress_adds_up_and_zero_passes_is_refused() {
        let device = SimDevice::new(SimConfig::with_capacity(1 << 30));
        let plain = ReplayTarget::Single(Arc::new(Plain::new(device.clone(), Stream::DEFAULT)));
        let rows: String = (0..5000).map(|i| format!("0,{i},allocate,{:#x},256,0\n", i + 1)).collect();
        let t = trace(&rows);
        let done = std::cell::Cell::new(0u64);
        let count = |n: u64| done.set(done.get() + n);
        let options = ReplayOptions { passes: 2, progress: Some(&count) };
        replay(&t, "plain", &plain, device.as_ref(), &options).unwrap();
        assert_eq!(done.get(), 5000 * 3);
        let zero = ReplayOptions { passes: 0, progress: None };
        assert!(matches!(
            replay(&t, "plain", &plain, device.as_ref(), &zero),
            Err(Error::InvalidArgument(_))
        ));
    }

    #[test]
    fn result_round_trips_through_json() {
        let r = ReplayResult {
            allocator: "plain".into(),
            trace: "t.csv".into(),
            ops: 4,
            peak_live: 10,
            peak_device_used: 20,
            footprint_ratio: 2.0,
            reserved_peak: 20,
            device_calls: 4,
            ns_per_op_warm: 12.5,
            failures: 0,
            passes: 3,
            first_failure: None,
        };
        let text = serde_json::to_string(&r).unwrap();
        assert!(!text.contains("first_failure"));
        assert_eq!(serde_json::from_str::<ReplayResult>(&text).unwrap(), r);
    }
}
