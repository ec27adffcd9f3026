//! GPU tests of the pinned host pool (issue 36) on CUDA device 0: `cuMemHostAlloc` memory that
//! the host writes and the device copies, reuse only after a recorded stream's work, the
//! driver refusing a free of memory it did not pin. `#[ignore]`d: `scripts/gpu-test.sh` runs
//! them on a GPU machine, where a missing GPU fails them (never a silent pass).

// A test: a failed unwrap or expect is the test failing (clippy.toml allows them in
// `#[test]` functions only, and this file's helpers are not).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod gpu_common;

use std::sync::atomic::Ordering;
use std::sync::Arc;

use gpu_common::{all, block_stream, gpu};
use streamalloc::allocators::{PinnedHost, PinnedHostConfig};
use streamalloc::Device;

const MIB: usize = 1 << 20;

#[test]
#[ignore = "needs a CUDA GPU"]
fn pinned_blocks_are_copied_from_and_reused_after_the_copy() {
    let gpu = gpu();
    let device: Arc<dyn Device> = gpu.clone();
    let pool = PinnedHost::new(device.clone(), PinnedHostConfig::default()).unwrap();
    let stream = device.create_stream().unwrap();
    let mut staging = pool.allocate(3 * MIB).unwrap();
    // SAFETY: the buffer is 3 MiB of pinned host memory the pool handed out and nothing else
    // uses; the slice ends before the buffer is dropped.
    #[allow(unsafe_code)] // host memory seen as bytes: what a test of pinned memory checks
    let bytes = unsafe { std::slice::from_raw_parts_mut(staging.as_mut_ptr(), staging.size()) };
    bytes.fill(0x5a);
    let target = device.alloc(3 * MIB).unwrap();
    gpu.copy_from_host(target, bytes, stream).unwrap();
    let mut back = vec![0u8; 3 * MIB];
    gpu.copy_to_host(&mut back, target, stream).unwrap();
    assert!(all(&back, 0x5a), "the device got the pinned bytes");
    // Used on a stream that a host function holds: the block waits for it.
    let go = block_stream(&gpu, stream);
    staging.record_stream(&device, stream).unwrap();
    let first = staging.ptr();
    drop(staging);
    assert_eq!(pool.stats().pending_release, 4 * MIB);
    let other = pool.allocate(3 * MIB).unwrap();
    assert_ne!(other.ptr(), first, "handed out while its stream is still held");
    go.store(true, Ordering::Release);
    device.synchronize_stream(stream).unwrap();
    let again = pool.allocate(3 * MIB).unwrap();
    assert_eq!(again.ptr(), first, "handed out again once the stream's work is done");
    drop((other, again));
    assert_eq!(pool.release().unwrap(), 8 * MIB);
    assert_eq!((pool.stats().reserved, pool.stats().device_frees), (0, 2));
    assert!(device.host_free(0xdead_0000).is_err(), "the driver refuses what it did not pin");
    device.free(target).unwrap();
    device.destroy_stream(stream).unwrap();
}
