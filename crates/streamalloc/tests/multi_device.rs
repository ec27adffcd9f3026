//! Several devices on the simulator: the facade keeps one stack per device and never mixes
//! them, statistics are per device, an `AsyncPool`'s memory may be copied to a peer only once
//! the peer was granted access to its pool, and every strategy accepts frees from another
//! thread. The same rules on two real GPUs: tests/gpu_multi.rs.

// A test: a failed unwrap or expect is the test failing (clippy.toml allows them in
// `#[test]` functions only, and this file's helpers are not).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use streamalloc::allocators::{AsyncPool, AsyncPoolConfig, PoolMode, ReuseFlags};
use streamalloc::device::sim::{SimConfig, SimDevice};
use streamalloc::device::{DeviceMemory, DeviceTestExt, DriverPools, Streams};
use streamalloc::facade::{Config, Facade};
use streamalloc::{Allocation, Allocator, Device, Error, Stream};

const MIB: usize = 1 << 20;
const STRATEGIES: [&str; 4] = ["plain", "best_fit", "stream_safe", "async"];

fn sim(conf: &str) -> Facade {
    Facade::new(Config::parse(&format!("device=sim,sim_capacity=1GiB,{conf}")).unwrap())
}

#[test]
fn each_device_has_its_own_stack_and_stats() {
    for strategy in STRATEGIES {
        let f = sim(&format!("strategy={strategy}"));
        let (d0, d1) = (f.stack(0).unwrap().device.clone(), f.stack(1).unwrap().device.clone());
        assert_eq!((d0.ordinal(), d1.ordinal()), (0, 1), "{strategy}");
        assert!(!Arc::ptr_eq(f.allocator(0).unwrap(), f.allocator(1).unwrap()), "{strategy}");
        let a = f.allocate(3 * MIB, 0, Stream::DEFAULT).unwrap();
        let b = f.allocate(5 * MIB, 1, Stream::DEFAULT).unwrap();
        let c = f.allocate(MIB, 1, Stream::DEFAULT).unwrap();
        assert_eq!((a.device(), b.device(), c.device()), (0, 1, 1), "{strategy}");
        assert_eq!(f.allocator(0).unwrap().device(), 0);
        assert_eq!(f.allocator(1).unwrap().device(), 1);
        // Each device's memory comes from that device only.
        assert!(d0.mem_info().unwrap().used() >= 3 * MIB, "{strategy}");
        assert!(d1.mem_info().unwrap().used() >= 6 * MIB, "{strategy}");
        let (s0, s1) = (f.stats(0), f.stats(1));
        assert_eq!((s0.allocated, s1.allocated), (3 * MIB, 6 * MIB), "{strategy}");
        assert_eq!((s0.total_allocations, s1.total_allocations), (1, 2), "{strategy}");
        let g = f.global_stats();
        assert_eq!(g.allocated, s0.allocated + s1.allocated, "{strategy}");
        assert_eq!(g.total_allocations, 3, "{strategy}");
        assert_eq!(g.reserved, s0.reserved + s1.reserved, "{strategy}");
        // Freeing on one device leaves the other's figures alone.
        drop(b);
        assert_eq!((f.stats(0).allocated, f.stats(1).allocated), (3 * MIB, MIB), "{strategy}");
        drop((a, c));
        assert_eq!(f.global_stats().allocated, 0, "{strategy}");
        assert_eq!(f.devices_in_use(), vec![0, 1]);
    }
}

/// An AsyncPool on its own pool of `device`.
fn owned_pool(device: Arc<dyn Device>) -> AsyncPool {
    let mode = PoolMode::Owned {
        release_threshold: 0,
        reuse: ReuseFlags::default(),
        max_size: 0,
        exportable: false,
    };
    AsyncPool::new(device, AsyncPoolConfig { mode, ..Default::default() })
}

#[test]
fn peer_copy_needs_access_to_the_pool() {
    let sim_device = |ordinal| SimDevice::new(SimConfig { ordinal, ..SimConfig::with_capacity(1 << 30) });
    let (d0, d1) = (sim_device(0), sim_device(1));
    let pool = owned_pool(d0.clone());
    let s = d0.create_stream().unwrap();
    let src = pool.allocate(MIB).unwrap();
    let dst = d1.alloc(MIB).unwrap();
    let raw = pool.pool().unwrap();
    assert!(d0.pool_access(raw, 0).unwrap(), "the owner always has access");
    assert!(!d0.pool_access(raw, 1).unwrap());

    // Before the grant: a clear error that names the pool and both devices.
    let err = d0.copy_peer(dst, 1, src.ptr(), MIB, s).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err:?}");
    assert!(msg.contains(&format!("pool {:#x}", raw.raw())) && msg.contains("device 1 access"), "{msg}");
    // An interior pointer of the allocation is pool memory too.
    assert!(d0.copy_peer(dst, 1, src.ptr() + 4096, 4096, s).is_err());

    // After: the copy is a use of the source on the stream.
    pool.grant_peer_access(1).unwrap();
    assert!(d0.pool_access(raw, 1).unwrap());
    let before = d0.stream_ready_at(s).unwrap();
    d0.copy_peer(dst, 1, src.ptr(), MIB, s).unwrap();
    assert!(d0.stream_ready_at(s).unwrap() > before, "the copy runs on the stream");
    d0.synchronize_stream(s).unwrap();

    // Revoked: an error again. The owner's own access cannot be revoked.
    pool.revoke_peer_access(1).unwrap();
    assert!(!d0.pool_access(raw, 1).unwrap());
    assert!(d0.copy_peer(dst, 1, src.ptr(), MIB, s).is_err());
    assert!(d0.set_pool_access(raw, 0, false).is_err());
    // Memory that is not from a pool needs no grant, and a copy to the own device none either.
    let plain = d0.alloc(MIB).unwrap();
    d0.copy_peer(dst, 1, plain, MIB, s).unwrap();
    d0.copy_peer(plain, 0, src.ptr(), MIB, s).unwrap();
    d0.synchronize_stream(s).unwrap();
    d0.free(plain).unwrap();
    // Another device's pool keeps its own access list.
    let other = owned_pool(d1.clone());
    other.grant_peer_access(0).unwrap();
    assert!(d1.pool_access(other.pool().unwrap(), 0).unwrap());
    assert!(!d0.pool_access(raw, 1).unwrap());
    drop((src, other));
    d1.free(dst).unwrap();
    assert!(d0.violations().is_empty());
}

#[test]
fn the_facade_async_pool_grants_on_the_default_pool() {
    let f = sim("strategy=async");
    let d0 = f.stack(0).unwrap().sim.clone().unwrap();
    let pool = AsyncPool::new(d0.clone(), AsyncPoolConfig::default());
    let a = f.allocate(MIB, 0, Stream::DEFAULT).unwrap();
    let on_1 = f.allocate(MIB, 1, Stream::DEFAULT).unwrap();
    let dst = on_1.ptr();
    assert!(d0.copy_peer(dst, 1, a.ptr(), MIB, Stream::DEFAULT).is_err());
    // Access is a property of the (shared) default pool: a grant by one allocator holds for
    // memory another allocator took from that pool.
    pool.grant_peer_access(1).unwrap();
    d0.copy_peer(dst, 1, a.ptr(), MIB, Stream::DEFAULT).unwrap();
    // A view of the same pool may grant and revoke too.
    let view = AsyncPool::new(
        d0.clone(),
        AsyncPoolConfig { mode: PoolMode::View(pool.pool().unwrap()), ..Default::default() },
    );
    view.revoke_peer_access(1).unwrap();
    assert!(d0.copy_peer(dst, 1, a.ptr(), MIB, Stream::DEFAULT).is_err());
}

#[test]
fn frees_from_another_thread_work_for_every_strategy() {
    for strategy in STRATEGIES {
        let f = sim(&format!("strategy={strategy}"));
        let streams: Vec<Stream> =
            (0..2).map(|d| f.stack(d).unwrap().device.create_stream().unwrap()).collect();
        let mut held: Vec<Allocation> = Vec::new();
        for (d, &own) in streams.iter().enumerate() {
            for (i, size) in [4096, MIB, 3 * MIB + 17].into_iter().enumerate() {
                let stream = if i % 2 == 0 { Stream::DEFAULT } else { own };
                held.push(f.allocate(size, d, stream).unwrap());
            }
        }
        assert!(f.stats(0).allocated > 0 && f.stats(1).allocated > 0, "{strategy}");
        // The other thread uses device 1 first (on CUDA that makes its context current), then
        // frees everything, device 0's memory included.
        let f = Arc::new(f);
        let g = f.clone();
        std::thread::spawn(move || {
            let d1 = g.stack(1).unwrap().device.clone();
            d1.mem_info().unwrap();
            drop(held);
            // The thread's device still works for new allocations.
            drop(g.allocate(MIB, 1, Stream::DEFAULT).unwrap());
        })
        .join()
        .unwrap();
        for (d, s) in streams.iter().enumerate() {
            f.stack(d).unwrap().device.synchronize_stream(*s).unwrap();
        }
        for d in 0..2 {
            let st = f.stats(d);
            assert_eq!((st.allocated, st.total_frees), (0, st.total_allocations), "{strategy} device {d}");
        }
        assert_eq!(f.global_stats().allocated, 0, "{strategy}");
        f.release_all().unwrap();
        for d in 0..2 {
            assert_eq!(f.stats(d).reserved, 0, "{strategy} device {d} keeps memory after release");
        }
    }
}

#[test]
fn mapped_memory_is_copied_to_a_peer_only_once_peer_access_is_enabled() {
    let f = sim("strategy=stream_safe,backing=stitched");
    let d0 = f.stack(0).unwrap().sim.clone().unwrap();
    let d1 = f.stack(1).unwrap().sim.clone().unwrap();
    let dst = d1.alloc(64 * MIB).unwrap();
    // Mapped before the call.
    let before = f.allocate(24 * MIB, 0, Stream::DEFAULT).unwrap();
    let err = d0.copy_peer(dst, 1, before.ptr(), before.size(), Stream::DEFAULT).unwrap_err();
    assert!(
        matches!(&err, Error::InvalidArgument(m) if m.contains("does not grant device 1 access")),
        "{err:?}"
    );
    f.enable_peer_access(0, 1).unwrap();
    f.enable_peer_access(0, 1).unwrap();
    f.enable_peer_access(0, 0).unwrap();
    d0.copy_peer(dst, 1, before.ptr(), before.size(), Stream::DEFAULT).unwrap();
    // Mapped after it: a fresh growth, and one stitched from the granules `before` held.
    let after = f.allocate(8 * MIB, 0, Stream::DEFAULT).unwrap();
    drop(before);
    let stitched = f.allocate(40 * MIB, 0, Stream::DEFAULT).unwrap();
    for x in [&after, &stitched] {
        d0.copy_peer(dst, 1, x.ptr(), x.size(), Stream::DEFAULT).unwrap();
    }
    // The other direction was not enabled.
    let back = f.allocate(4 * MIB, 1, Stream::DEFAULT).unwrap();
    assert!(d1.copy_peer(stitched.ptr(), 0, back.ptr(), back.size(), Stream::DEFAULT).is_err());
    drop((after, stitched, back));
    d1.free(dst).unwrap();
}
