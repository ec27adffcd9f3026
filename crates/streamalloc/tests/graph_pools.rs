//! CUDA graphs over private pools on the simulator: a graph captured with its temporaries in a
//! private pool, replayed on another stream while eager work allocates, must never share
//! memory with that eager work (the ordering checker sees the graph's replayed kernels). The
//! negative control captures into the main pool, as the library did before private pools,
//! and the checker catches the eager allocation that overwrites the graph's memory.

// A test: a failed unwrap or expect is the test failing (clippy.toml allows them in
// `#[test]` functions only, and this file's helpers are not).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use streamalloc::adaptors::Pointers;
use streamalloc::allocators::{BestFitConfig, StreamSafe, StreamSafeConfig};
use streamalloc::device::sim::{SimConfig, SimDevice};
use streamalloc::device::{CaptureStatus, DeviceTestExt, Graphs, Streams};
use streamalloc::facade::private_pools::{PrivatePools, Routed};
use streamalloc::Stream;

const TEMP: usize = 256 << 20;

struct Setup {
    sim: Arc<SimDevice>,
    main: Pointers<StreamSafe>,
    pools: PrivatePools,
    capture: Stream,
    replay: Stream,
}

fn setup() -> Setup {
    let sim = SimDevice::new(SimConfig::with_capacity(16 << 30));
    let main = StreamSafe::new(sim.clone(), StreamSafeConfig::default()).unwrap();
    let main = Pointers::new(main, sim.clone(), std::time::Duration::from_secs(10));
    let pools = PrivatePools::new(sim.clone(), BestFitConfig::default(), false);
    let (capture, replay) = (sim.create_stream().unwrap(), sim.create_stream().unwrap());
    Setup { sim, main, pools, capture, replay }
}

/// Captures a graph on `capture` whose temporary is allocated, written and freed inside the
/// capture, taking memory from the private pool when `private`, else from the main pool;
/// then replays it on `replay` and, while it runs, allocates eagerly on `capture` (the
/// capture stream, whose main pool holds what the capture freed). The checker's findings.
fn graph_then_eager(s: &Setup, private: bool) -> usize {
    let sim = s.sim.clone();
    // PyTorch's filter: the allocation's stream is capturing.
    let filter = Arc::new(move |x: Stream| sim.capture_status(x).is_ok_and(|c| c == CaptureStatus::Active));
    s.sim.begin_capture(s.capture).unwrap();
    if private {
        s.pools.begin((0, 1), filter).unwrap();
    }
    let temp = match s.pools.allocate(TEMP, s.capture).unwrap() {
        Routed::Pool(ptr) => ptr,
        Routed::Main { .. } => s.main.allocate_ptr(TEMP, s.capture).unwrap(),
    };
    s.sim.memset_async(temp, 7, TEMP, s.capture).unwrap();
    assert!(s.pools.free(temp, s.capture) || s.main.free_ptr(temp, s.capture));
    let graph = s.sim.end_capture(s.capture).unwrap();
    if private {
        s.pools.end((0, 1));
    }
    let exec = s.sim.instantiate_graph(graph).unwrap();
    s.sim.launch_graph(exec, s.replay).unwrap();
    let eager = s.main.allocate_ptr(TEMP, s.capture).unwrap();
    s.sim.check_handout(eager, TEMP, s.capture)
}

#[test]
fn a_replayed_graph_keeps_its_private_memory_from_eager_work() {
    let s = setup();
    assert_eq!(graph_then_eager(&s, true), 0, "{:?}", s.sim.violations());
}

#[test]
fn negative_control_a_graph_in_the_main_pool_is_overwritten() {
    let s = setup();
    assert!(graph_then_eager(&s, false) > 0, "the checker no longer sees the graph's replayed kernels");
}
