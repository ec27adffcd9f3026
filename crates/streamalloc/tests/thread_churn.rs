//! Host memory under thread churn: threads that allocate once and end must leave nothing
//! behind (issue 16). Its own test binary, so that the process's resident memory is this
//! test's alone.

// A test: a failed unwrap or expect is the test failing (clippy.toml allows them in
// `#[test]` functions only, and this file's helpers are not).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use streamalloc::device::Streams;
use streamalloc::facade::{Config, Facade};
use streamalloc::Stream;

/// Resident memory of this process, in bytes (`/proc/self/statm`, pages of 4 KiB).
fn rss() -> usize {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("/proc/self/statm");
    let pages: usize = statm.split_whitespace().nth(1).and_then(|f| f.parse().ok()).expect("resident pages");
    pages * 4096
}

#[test]
fn threads_that_allocated_leave_no_host_memory_behind() {
    for conf in ["strategy=plain,stats=true", "strategy=best_fit", "strategy=stream_safe,limit=1GiB"] {
        let f = Facade::new(Config::parse(&format!("device=sim,sim_capacity=4GiB,{conf}")).unwrap());
        let pointers = f.stack(0).unwrap().allocator.clone();
        let churn = |threads: usize| {
            for _ in 0..threads {
                let p = pointers.clone();
                std::thread::spawn(move || {
                    let ptr = p.allocate_ptr(4096, Stream::DEFAULT).expect("allocation");
                    assert!(p.free_ptr(ptr, Stream::DEFAULT));
                })
                .join()
                .expect("thread");
            }
        };
        churn(1_000);
        std::thread::sleep(Duration::from_millis(10));
        let before = rss();
        churn(10_000);
        let grown = rss().saturating_sub(before);
        eprintln!("{conf}: 10,000 threads grew resident memory by {grown} bytes");
        assert!(grown < 16 << 20, "{conf}: 10,000 short-lived threads grew resident memory by {grown} bytes");
        assert_eq!(f.stats(0).live_allocations, 0);
    }
}

/// Issue 33: streams made, used by pointer (as the C ABI does), retired and destroyed in a
/// loop leave no host memory behind (each stream's pool was kept for good: 17.9 KB a
/// stream).
#[test]
fn streams_that_come_and_go_leave_no_host_memory_behind() {
    let f = Facade::new(Config::parse("device=sim,sim_capacity=4GiB,strategy=stream_safe").unwrap());
    let sim = f.stack(0).unwrap().sim.clone().unwrap();
    let pointers = f.stack(0).unwrap().allocator.clone();
    let churn = |streams: usize| {
        for _ in 0..streams {
            let s = sim.create_stream().expect("stream");
            let ptr = pointers.allocate_ptr(4096, s).expect("allocation");
            let large = pointers.allocate_ptr(3 << 20, s).expect("allocation");
            assert!(pointers.free_ptr(ptr, s));
            assert!(pointers.free_ptr(large, s));
            f.retire_stream(0, s).expect("retire");
            sim.destroy_stream(s).expect("destroy");
        }
    };
    churn(1_000);
    let before = rss();
    churn(20_000);
    let grown = rss().saturating_sub(before);
    eprintln!("20,000 streams grew resident memory by {grown} bytes");
    assert!(grown < 16 << 20, "20,000 streams that came and went grew resident memory by {grown} bytes");
    assert_eq!(f.stats(0).live_allocations, 0);
    assert_eq!(sim.unknown_stream_calls(), 0);
}
