//! Two CUDA GPUs: the facade's per-device stacks and statistics, an `AsyncPool` allocation of
//! GPU 0 copied to GPU 1 (refused before the peer is granted access to the pool, byte-exact
//! after) and written by GPU 1, memory mapped by `backing=stitched` (before and after
//! `Facade::enable_peer_access`, fresh and stitched) written by GPU 1 and copied to it, and
//! frees from a thread whose current context is the other GPU, for every strategy. Every
//! test is `#[ignore]`d and fails (never passes) with fewer than two GPUs: run them on a
//! machine with two by lab/multi-gpu.sh. The simulator's version of these rules:
//! tests/multi_device.rs.

// A test: a failed unwrap or expect is the test failing (clippy.toml allows them in
// `#[test]` functions only, and this file's helpers are not).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use streamalloc::allocators::{AsyncPool, AsyncPoolConfig, PoolMode, ReuseFlags};
use streamalloc::device::cuda::{device_count, CudaDevice};
use streamalloc::device::DeviceTestExt;
use streamalloc::facade::{Config, Facade};
use streamalloc::{Allocation, DevicePtr, Error, Stream, StreamAllocator};

const MIB: usize = 1 << 20;
const STRATEGIES: [&str; 4] = ["plain", "best_fit", "stream_safe", "async"];
const WHY: &str = "needs two CUDA GPUs: run on a machine with two GPUs by lab/multi-gpu.sh";

/// CUDA devices 0 and 1. Fails when there are fewer than two.
fn two_gpus() -> (Arc<dyn DeviceTestExt>, Arc<dyn DeviceTestExt>) {
    let n = device_count().unwrap_or_else(|e| panic!("{WHY}; no usable CUDA driver here: {e}"));
    assert!(n >= 2, "{WHY}; {n} CUDA device(s) visible");
    let open = |i| -> Arc<dyn DeviceTestExt> {
        CudaDevice::new(i).unwrap_or_else(|e| panic!("CUDA device {i}: {e}"))
    };
    (open(0), open(1))
}

fn facade(strategy: &str) -> Facade {
    two_gpus();
    Facade::new(Config::parse(&format!("device=cuda,strategy={strategy}")).unwrap())
}

fn read(device: &Arc<dyn DeviceTestExt>, ptr: DevicePtr, len: usize) -> Vec<u8> {
    let mut host = vec![0u8; len];
    device.copy_to_host(&mut host, ptr, Stream::DEFAULT).expect("copy to host");
    host
}

fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i.wrapping_mul(31) ^ (i >> 11)) as u8).collect()
}

fn print_stats(f: &Facade, strategy: &str) {
    for d in 0..2 {
        println!("{strategy} device {d}: {:?}", f.stats(d));
    }
    println!("{strategy} global: {:?}", f.global_stats());
}

#[test]
#[ignore = "needs two CUDA GPUs: run on a machine with two GPUs by lab/multi-gpu.sh"]
fn the_facade_keeps_a_stack_per_gpu() {
    for strategy in STRATEGIES {
        let f = facade(strategy);
        let ordinals = (f.stack(0).unwrap().device.ordinal(), f.stack(1).unwrap().device.ordinal());
        assert_eq!(ordinals, (0, 1));
        // The same GPUs, on the same primary contexts, with the test helpers.
        let (d0, d1) = two_gpus();
        let a = f.allocate(64 * MIB, 0, Stream::DEFAULT).unwrap();
        let b = f.allocate(32 * MIB, 1, Stream::DEFAULT).unwrap();
        let c = f.allocate(MIB + 3, 1, Stream::DEFAULT).unwrap();
        assert_eq!((a.device(), b.device(), c.device()), (0, 1, 1), "{strategy}");
        // Each allocation is memory of its own GPU: that GPU writes and reads it back.
        d0.memset_async(a.ptr(), 0xA0, a.size(), Stream::DEFAULT).unwrap();
        d1.memset_async(b.ptr(), 0xB1, b.size(), Stream::DEFAULT).unwrap();
        assert!(read(&d0, a.ptr(), a.size()).iter().all(|x| *x == 0xA0), "{strategy}");
        assert!(read(&d1, b.ptr(), b.size()).iter().all(|x| *x == 0xB1), "{strategy}");
        let (s0, s1) = (f.stats(0), f.stats(1));
        assert_eq!((s0.allocated, s1.allocated), (64 * MIB, 33 * MIB + 3), "{strategy}");
        assert_eq!((s0.total_allocations, s1.total_allocations), (1, 2), "{strategy}");
        let g = f.global_stats();
        assert_eq!((g.allocated, g.total_allocations), (97 * MIB + 3, 3), "{strategy}");
        print_stats(&f, strategy);
        drop(b);
        assert_eq!((f.stats(0).allocated, f.stats(1).allocated), (64 * MIB, MIB + 3), "{strategy}");
        drop((a, c));
        for d in [&d0, &d1] {
            d.synchronize_stream(Stream::DEFAULT).unwrap();
        }
        assert_eq!(f.global_stats().allocated, 0, "{strategy}");
        f.release_all().unwrap();
    }
}

#[test]
#[ignore = "needs two CUDA GPUs: run on a machine with two GPUs by lab/multi-gpu.sh"]
fn peer_copy_of_pool_memory_needs_access() {
    let (d0, d1) = two_gpus();
    // An owned pool: access granted here is not seen by other users of the default pool.
    let mode = PoolMode::Owned {
        release_threshold: 0,
        reuse: ReuseFlags::default(),
        max_size: 0,
        exportable: false,
    };
    let pool = AsyncPool::new(d0.clone(), AsyncPoolConfig { mode, ..Default::default() });
    let raw = pool.pool().unwrap();
    const N: usize = 48 * MIB + 512;
    let (s0, s1) = (d0.create_stream().unwrap(), d1.create_stream().unwrap());
    let src = pool.allocate_on(N, s0).unwrap();
    let data = pattern(N);
    d0.copy_from_host(src.ptr(), &data, s0).unwrap();
    let dst = d1.alloc(N).unwrap();
    d1.memset_async(dst, 0, N, Stream::DEFAULT).unwrap();
    d1.synchronize_stream(Stream::DEFAULT).unwrap();
    assert!(d0.pool_access(raw, 0).unwrap(), "the owner has access");
    assert!(!d0.pool_access(raw, 1).unwrap(), "a new pool grants no peer access");

    let err = d0.copy_peer(dst, 1, src.ptr(), N, s0).unwrap_err();
    println!("before the grant: {err}");
    assert!(
        matches!(&err, Error::InvalidArgument(m) if m.contains("does not grant device 1 access")),
        "{err:?}"
    );
    assert!(read(&d1, dst, N).iter().all(|x| *x == 0), "nothing was copied");

    pool.grant_peer_access(1).unwrap();
    assert!(d0.pool_access(raw, 1).unwrap());
    d0.copy_peer(dst, 1, src.ptr(), N, s0).unwrap();
    d0.synchronize_stream(s0).unwrap();
    assert!(read(&d1, dst, N) == data, "GPU 1 received other bytes than GPU 0's pattern");

    // A kernel of GPU 1 (a memset) writes GPU 0's pool memory; GPU 0 reads it.
    d1.memset_async(src.ptr(), 0x5A, N, s1).unwrap();
    d1.synchronize_stream(s1).unwrap();
    assert!(read(&d0, src.ptr(), N).iter().all(|x| *x == 0x5A), "GPU 1's write to GPU 0's pool memory");
    // And the reverse copy, issued on GPU 1 into GPU 0's pool memory.
    d1.copy_peer(src.ptr(), 0, dst, N, s1).unwrap();
    d1.synchronize_stream(s1).unwrap();
    assert!(read(&d0, src.ptr(), N) == data, "GPU 0 received other bytes than GPU 1's copy");

    pool.revoke_peer_access(1).unwrap();
    assert!(!d0.pool_access(raw, 1).unwrap());
    assert!(d0.copy_peer(dst, 1, src.ptr(), N, s0).is_err(), "a copy after the revoke");
    drop(src);
    d0.synchronize_stream(s0).unwrap();
    d1.free(dst).unwrap();
    d0.destroy_stream(s0).unwrap();
    d1.destroy_stream(s1).unwrap();
}

#[test]
#[ignore = "needs two CUDA GPUs: run on a machine with two GPUs by lab/multi-gpu.sh"]
fn mapped_memory_is_usable_by_a_peer_once_peer_access_is_enabled() {
    let (d0, d1) = two_gpus();
    // The stack a facade builds for device 0, built on `d0` itself: a device instance knows
    // the mappings it made, and its peer copies check them.
    let config = Config::parse("device=cuda,strategy=stream_safe,backing=stitched").unwrap();
    let stack = Facade::build_stack(&config, d0.clone()).unwrap();
    let allocate = |n| stack.allocator.allocate_on(n, Stream::DEFAULT).unwrap();
    const N: usize = 24 * MIB + 512;
    let s1 = d1.create_stream().unwrap();
    let dst = d1.alloc(4 * N).unwrap();
    // Mapped before the call: refused, GPU 1 not being granted access to it.
    let before = allocate(N);
    let err = d0.copy_peer(dst, 1, before.ptr(), N, Stream::DEFAULT).unwrap_err();
    println!("before the call: {err}");
    assert!(
        matches!(&err, Error::InvalidArgument(m) if m.contains("does not grant device 1 access")),
        "{err:?}"
    );
    stack.device.grant_mapped_access(1).unwrap(); // what Facade::enable_peer_access(0, 1) does
                                                  // Mapped after it: a fresh growth, and one stitched from the granules `before` held.
    let after = allocate(8 * MIB);
    let keep = allocate(N);
    let stitched_from = before.ptr();
    drop(before);
    let stitched = allocate(3 * N);
    println!("before at {stitched_from:#x}, stitched block at {:#x}", stitched.ptr());
    for (name, x) in
        [("kept (mapped before the call)", &keep), ("mapped after", &after), ("stitched", &stitched)]
    {
        // A kernel of GPU 1 (a memset) writes GPU 0's mapped memory; GPU 0 reads it.
        d1.memset_async(x.ptr(), 0x5A, x.size(), s1).unwrap();
        d1.synchronize_stream(s1).unwrap();
        assert!(read(&d0, x.ptr(), x.size()).iter().all(|b| *b == 0x5A), "GPU 1's write to {name} memory");
        // And GPU 0's bytes copied to GPU 1.
        let data = pattern(x.size());
        d0.copy_from_host(x.ptr(), &data, Stream::DEFAULT).unwrap();
        d0.copy_peer(dst, 1, x.ptr(), x.size(), Stream::DEFAULT).unwrap();
        d0.synchronize_stream(Stream::DEFAULT).unwrap();
        assert!(read(&d1, dst, x.size()) == data, "GPU 1 received other bytes than {name} memory held");
    }
    drop((after, keep, stitched));
    d1.free(dst).unwrap();
    d1.destroy_stream(s1).unwrap();
}

/// Frees `held` on a new thread whose current CUDA context is `other`'s (a thread without a
/// current context keeps the one of the first device it calls), then allocates on `other`.
fn free_on_thread_of(f: &Arc<Facade>, other: usize, held: Vec<Allocation>) {
    let f = f.clone();
    std::thread::spawn(move || {
        f.stack(other).unwrap().device.mem_info().unwrap();
        drop(held);
        let a = f.allocate(MIB, other, Stream::DEFAULT).unwrap();
        assert_eq!(a.device(), other);
    })
    .join()
    .unwrap();
}

#[test]
#[ignore = "needs two CUDA GPUs: run on a machine with two GPUs by lab/multi-gpu.sh"]
fn frees_from_a_thread_on_the_other_gpu() {
    for strategy in STRATEGIES {
        let f = Arc::new(facade(strategy));
        // The facade's GPUs, on the same primary contexts, with the test helpers.
        let devices: Vec<Arc<dyn DeviceTestExt>> = <[_; 2]>::from(two_gpus()).into();
        let streams: Vec<Stream> = devices.iter().map(|d| d.create_stream().unwrap()).collect();
        let mut held: [Vec<Allocation>; 2] = Default::default();
        for (d, dev) in devices.iter().enumerate() {
            for (i, size) in [4096, 8 * MIB, 40 * MIB + 17].into_iter().enumerate() {
                let stream = if i % 2 == 0 { Stream::DEFAULT } else { streams[d] };
                let a = f.allocator(d).unwrap().allocate_on(size, stream).unwrap();
                dev.memset_async(a.ptr(), 0x11, size, stream).unwrap();
                held[d].push(a);
            }
        }
        let [on_0, on_1] = held;
        free_on_thread_of(&f, 1, on_0);
        free_on_thread_of(&f, 0, on_1);
        for (dev, s) in devices.iter().zip(&streams) {
            dev.synchronize_stream(*s).unwrap();
            dev.synchronize_stream(Stream::DEFAULT).unwrap();
        }
        print_stats(&f, strategy);
        for d in 0..2 {
            let st = f.stats(d);
            assert_eq!(st.allocated, 0, "{strategy} device {d}");
            assert_eq!(st.total_frees, st.total_allocations, "{strategy} device {d}");
            assert_eq!(st.failures, 0, "{strategy} device {d}");
        }
        f.release_all().unwrap();
    }
}
