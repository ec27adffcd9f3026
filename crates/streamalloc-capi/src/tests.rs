//! Bad input at the boundary: every case returns a status or a null with the last error set,
//! and never unwinds or aborts. All tests share the process-wide state, on the simulator.

use std::ffi::CStr;
use std::ptr;

use super::*;
use crate::status::{abi, status};
use StreamallocStatus::*;

const CONF: &CStr = c"device=sim,strategy=plain,sim_capacity=16GiB";

fn setup() {
    // SAFETY: a NUL-terminated literal.
    assert_eq!(unsafe { streamalloc_configure(CONF.as_ptr()) }, STREAMALLOC_OK, "{}", last_error());
}

fn last_error() -> String {
    // SAFETY: the library's string, valid until the next call on this thread.
    unsafe { CStr::from_ptr(streamalloc_last_error()) }.to_string_lossy().into_owned()
}

fn allocate(size: usize, device: c_int) -> (StreamallocStatus, *mut c_void) {
    let mut p = ptr::dangling_mut::<c_void>();
    // SAFETY: `p` is a valid place for a pointer.
    let s = unsafe { streamalloc_allocate(size, device, ptr::null_mut(), &mut p) };
    (s, p)
}

#[test]
fn sizes() {
    setup();
    assert_eq!(allocate(0, 0), (STREAMALLOC_OK, ptr::null_mut()));
    assert!(streamalloc_malloc(0, 0, ptr::null_mut()).is_null());
    assert!(streamalloc_malloc(-1, 0, ptr::null_mut()).is_null());
    assert!(last_error().contains("negative size -1"), "{}", last_error());
    assert!(streamalloc_malloc(isize::MIN, 0, ptr::null_mut()).is_null());
    for absurd in [usize::MAX, usize::MAX - 255, isize::MAX as usize + 1] {
        assert_eq!(allocate(absurd, 0), (STREAMALLOC_INVALID_ARGUMENT, ptr::null_mut()));
        assert!(last_error().contains("larger than any allocation"), "{}", last_error());
        assert!(streamalloc_cupy_malloc(ptr::null_mut(), absurd, 0).is_null());
    }
    assert_eq!(allocate(1 << 50, 0), (STREAMALLOC_OUT_OF_MEMORY, ptr::null_mut()));
    assert!(last_error().contains("out of memory on device 0"), "{}", last_error());
}

#[test]
fn devices() {
    setup();
    for device in [-1, c_int::MIN, 64, 1000, c_int::MAX] {
        assert_eq!(allocate(256, device), (STREAMALLOC_INVALID_ARGUMENT, ptr::null_mut()));
        assert!(last_error().contains(&format!("device {device} ")), "{}", last_error());
        assert!(streamalloc_malloc(256, device, ptr::null_mut()).is_null());
        assert!(streamalloc_cupy_malloc(ptr::null_mut(), 256, device).is_null());
        let mut released = 0;
        // SAFETY: valid out-pointers.
        unsafe {
            assert_eq!(streamalloc_release(device, &mut released), STREAMALLOC_INVALID_ARGUMENT);
            assert_eq!(streamalloc_stats(device, &mut Stats::default()), STREAMALLOC_INVALID_ARGUMENT);
        }
    }
    // Zero size still checks the device.
    assert_eq!(allocate(0, -1).0, STREAMALLOC_INVALID_ARGUMENT);
}

#[test]
fn peer_access() {
    setup();
    assert_eq!(streamalloc_enable_peer_access(0, 1), STREAMALLOC_OK, "{}", last_error());
    assert_eq!(streamalloc_enable_peer_access(0, 0), STREAMALLOC_OK, "{}", last_error());
    assert_eq!(streamalloc_enable_peer_access(-1, 0), STREAMALLOC_INVALID_ARGUMENT);
    assert!(last_error().contains("device -1"), "{}", last_error());
    assert_eq!(streamalloc_enable_peer_access(0, 4096), STREAMALLOC_INVALID_ARGUMENT);
}

#[test]
fn pointers() {
    setup();
    // SAFETY: null out-pointers are the bad input under test.
    unsafe {
        assert_eq!(
            streamalloc_allocate(256, 0, ptr::null_mut(), ptr::null_mut()),
            STREAMALLOC_INVALID_ARGUMENT
        );
        assert_eq!(streamalloc_stats(0, ptr::null_mut()), STREAMALLOC_INVALID_ARGUMENT);
        assert_eq!(streamalloc_release(0, ptr::null_mut()), STREAMALLOC_OK);
        assert_eq!(streamalloc_configure(ptr::null()), STREAMALLOC_INVALID_ARGUMENT);
    }
    let foreign = 0xdead_0000 as *mut c_void;
    assert_eq!(streamalloc_deallocate(foreign), STREAMALLOC_INVALID_ARGUMENT);
    assert!(last_error().contains("0xdead0000 is not a live streamalloc allocation"), "{}", last_error());
    assert_eq!(streamalloc_record_stream(foreign, ptr::null_mut()), STREAMALLOC_INVALID_ARGUMENT);
    streamalloc_free(foreign, 1, 0, ptr::null_mut());
    streamalloc_cupy_free(ptr::null_mut(), foreign, 0);
    assert!(last_error().contains("not a live"));
    assert_eq!(streamalloc_deallocate(ptr::null_mut()), STREAMALLOC_OK);
    assert_eq!(streamalloc_record_stream(ptr::null_mut(), ptr::null_mut()), STREAMALLOC_OK);
    streamalloc_free(ptr::null_mut(), 0, 0, ptr::null_mut());
}

#[test]
fn double_free_through_every_face() {
    setup();
    // A device of its own: a pointer freed here must not be handed to a test running beside.
    let (s, p) = allocate(4096, 5);
    assert_eq!(s, STREAMALLOC_OK);
    assert_eq!(streamalloc_deallocate(p), STREAMALLOC_OK);
    assert_eq!(streamalloc_deallocate(p), STREAMALLOC_INVALID_ARGUMENT);
    let t = streamalloc_malloc(4096, 5, ptr::null_mut());
    assert!(!t.is_null());
    streamalloc_free(t, 4096, 5, ptr::null_mut());
    streamalloc_free(t, 4096, 5, ptr::null_mut());
    let c = streamalloc_cupy_malloc(ptr::null_mut(), 4096, 5);
    assert!(!c.is_null());
    streamalloc_cupy_free(ptr::null_mut(), c, 5);
    streamalloc_cupy_free(ptr::null_mut(), c, 5);
    assert!(last_error().contains("not a live"));
}

#[test]
fn configuration() {
    setup();
    // SAFETY: NUL-terminated literals.
    unsafe {
        assert_eq!(streamalloc_configure(c"strategy=plain,device=sim".as_ptr()), STREAMALLOC_CONFIG_ERROR);
        assert!(last_error().contains("already configured"), "{}", last_error());
        assert_eq!(streamalloc_configure(c"strategy=warp".as_ptr()), STREAMALLOC_CONFIG_ERROR);
        assert!(last_error().contains("strategy=warp"), "{}", last_error());
        assert_eq!(streamalloc_configure(c"trace=\xff".as_ptr()), STREAMALLOC_CONFIG_ERROR);
        assert!(last_error().contains("UTF-8"), "{}", last_error());
    }
}

#[test]
fn stats_and_release() {
    setup();
    let (_, p) = allocate(1000, 3);
    let mut s = Stats::default();
    // SAFETY: valid out-pointers.
    unsafe {
        assert_eq!(streamalloc_stats(3, &mut s), STREAMALLOC_OK);
        assert_eq!((s.allocated, s.live_allocations), (1000, 1));
        assert_eq!(streamalloc_deallocate(p), STREAMALLOC_OK);
        assert_eq!(streamalloc_stats(3, &mut s), STREAMALLOC_OK);
        assert_eq!((s.allocated, s.live_allocations, s.total_frees), (0, 0, 1));
        let mut released = usize::MAX;
        assert_eq!(streamalloc_release(3, &mut released), STREAMALLOC_OK);
        assert_ne!(released, usize::MAX);
        assert_eq!(streamalloc_release(9, &mut released), STREAMALLOC_OK);
        assert_eq!(released, 0);
    }
}

#[test]
fn errors_and_panics_stay_on_this_side() {
    assert_eq!(status(|| Err(Error::Unsupported("x".into()))), STREAMALLOC_UNSUPPORTED);
    assert_eq!(last_error(), "unsupported: x");
    assert_eq!(status(|| panic!("boom")), STREAMALLOC_INTERNAL);
    assert!(last_error().contains("a bug in streamalloc): boom"), "{}", last_error());
    assert_eq!(abi("test", 7, || -> core_alloc::Result<i32> { panic!("{}", "bang") }), 7);
    assert!(last_error().contains("bang"));
    assert_eq!(status(|| Err(Error::InvalidArgument("nul \0 inside".into()))), STREAMALLOC_INVALID_ARGUMENT);
    assert_eq!(last_error(), "invalid argument: nul   inside");
    // The last error is per thread.
    std::thread::spawn(|| assert_eq!(last_error(), "")).join().unwrap();
}

#[test]
fn threads_share_the_map() {
    setup();
    let handles: Vec<_> = (0..8)
        .map(|t| {
            std::thread::spawn(move || {
                let mut live = Vec::new();
                for i in 0..2000usize {
                    let p = streamalloc_malloc((256 * (1 + (i + t) % 5)) as ssize_t, 1, ptr::null_mut());
                    assert!(!p.is_null());
                    live.push(p as usize);
                    if i % 3 == 0 {
                        let q = live.swap_remove(i % live.len()) as *mut c_void;
                        assert_eq!(streamalloc_deallocate(q), STREAMALLOC_OK);
                    }
                }
                for p in live {
                    streamalloc_free(p as *mut c_void, 0, 1, ptr::null_mut());
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    let mut s = Stats::default();
    // SAFETY: a valid out-pointer.
    assert_eq!(unsafe { streamalloc_stats(1, &mut s) }, STREAMALLOC_OK);
    assert_eq!((s.allocated, s.live_allocations, s.total_allocations), (0, 0, 16_000));
}

#[test]
fn a_pointer_allocated_on_one_thread_is_found_from_another() {
    setup();
    let ptrs: Vec<usize> = std::thread::spawn(|| {
        (0..50).map(|i| streamalloc_malloc(4096 + i, 2, ptr::null_mut()) as usize).collect()
    })
    .join()
    .unwrap();
    // The allocating thread is gone; its allocations are still found and freed from here.
    for (i, &p) in ptrs.iter().enumerate() {
        assert_ne!(p, 0);
        if i % 2 == 0 {
            assert_eq!(streamalloc_record_stream(p as *mut c_void, ptr::null_mut()), STREAMALLOC_OK);
        }
        assert_eq!(streamalloc_deallocate(p as *mut c_void), STREAMALLOC_OK);
        assert_eq!(streamalloc_deallocate(p as *mut c_void), STREAMALLOC_INVALID_ARGUMENT, "double free");
    }
}

#[test]
fn record_stream_on_an_unknown_stream_fails_at_that_call() {
    setup();
    let (s, p) = allocate(4096, 6);
    assert_eq!(s, STREAMALLOC_OK);
    let bogus = 0x1234 as *mut c_void;
    assert_eq!(streamalloc_record_stream(p, bogus), STREAMALLOC_INVALID_ARGUMENT);
    assert!(last_error().contains("stream 0x1234"), "{}", last_error());
    assert_eq!(streamalloc_deallocate(p), STREAMALLOC_OK);
    let mut st = Stats::default();
    // SAFETY: a valid out-pointer.
    assert_eq!(unsafe { streamalloc_stats(6, &mut st) }, STREAMALLOC_OK);
    assert_eq!((st.allocated, st.pending_release, st.live_allocations), (0, 0, 0), "nothing kept back");
    let (s, q) = allocate(4096, 6);
    assert_eq!(s, STREAMALLOC_OK, "the next allocation does not report it: {}", last_error());
    assert_eq!(streamalloc_deallocate(q), STREAMALLOC_OK);
}

#[test]
fn a_guessed_stream_id_reaches_no_stream_on_the_simulator() {
    setup();
    for guess in [1usize, 2, 3, 4, 0x10] {
        assert!(streamalloc_malloc(256, 0, guess as *mut c_void).is_null(), "stream {guess}");
        assert!(last_error().contains("is not a simulated stream"), "{}", last_error());
    }
}

#[test]
fn simulated_streams_through_c() {
    setup();
    let device = 7;
    let mut s = ptr::null_mut();
    // SAFETY: valid out-pointers.
    unsafe {
        assert_eq!(streamalloc_sim_create_stream(device, &mut s), STREAMALLOC_OK, "{}", last_error());
        assert_eq!(streamalloc_sim_create_stream(device, ptr::null_mut()), STREAMALLOC_INVALID_ARGUMENT);
    }
    assert!(s as usize > 0xffff, "a handle, not a small id: {s:?}");
    let p = streamalloc_malloc(4096, device, s);
    assert!(!p.is_null(), "{}", last_error());
    assert_eq!(streamalloc_sim_use(device, p, 4096, ptr::null_mut(), 1_000_000), STREAMALLOC_OK);
    assert_eq!(streamalloc_record_stream(p, ptr::null_mut()), STREAMALLOC_OK);
    streamalloc_free(p, 4096, device, s);
    assert_eq!(streamalloc_sim_advance(device, 10), STREAMALLOC_OK);
    assert_eq!(streamalloc_sim_synchronize(device, s), STREAMALLOC_OK);
    let q = streamalloc_malloc(4096, device, s);
    assert!(!q.is_null());
    streamalloc_free(q, 4096, device, s);
    let mut violations = u64::MAX;
    // SAFETY: a valid out-pointer.
    assert_eq!(unsafe { streamalloc_sim_violations(device, &mut violations) }, STREAMALLOC_OK);
    assert_eq!(violations, 0);
    assert_eq!(streamalloc_sim_destroy_stream(device, s), STREAMALLOC_OK);
    assert!(streamalloc_malloc(4096, device, s).is_null(), "a destroyed stream's handle is refused");
    assert_eq!(streamalloc_sim_destroy_stream(device, s), STREAMALLOC_INVALID_ARGUMENT);
    assert_eq!(streamalloc_sim_use(device, q, 1, 0x1234 as *mut c_void, 1), STREAMALLOC_INVALID_ARGUMENT);
}

#[test]
fn peaks_reset_and_retries_are_reported() {
    setup();
    let device = 8;
    let (_, p) = allocate(3 << 20, device);
    assert_eq!(streamalloc_deallocate(p), STREAMALLOC_OK);
    let mut s = Stats { retries: u64::MAX, ..Stats::default() };
    // SAFETY: valid out-pointers.
    unsafe {
        assert_eq!(streamalloc_stats(device, &mut s), STREAMALLOC_OK);
        assert_eq!((s.allocated, s.allocated_peak, s.retries), (0, 3 << 20, 0));
        assert_eq!(streamalloc_reset_peak_stats(device), STREAMALLOC_OK);
        assert_eq!(streamalloc_stats(device, &mut s), STREAMALLOC_OK);
    }
    assert_eq!((s.allocated_peak, s.reserved_peak), (s.allocated, s.reserved));
    assert_eq!(streamalloc_reset_peak_stats(-1), STREAMALLOC_INVALID_ARGUMENT);
    assert_eq!(streamalloc_reset_peak_stats(20), STREAMALLOC_OK, "a device not used yet");
}

/// Issue 19: our own broken invariants reached C as STREAMALLOC_INVALID_ARGUMENT.
#[test]
fn internal_errors_are_reported_as_internal_not_as_the_callers_fault() {
    let e = core_alloc::Error::Internal("StreamSafe lost a pool it made".into());
    assert_eq!(status(|| Err(e.clone())), STREAMALLOC_INTERNAL);
    let held = core_alloc::Error::HeldBack { count: 1, first: Box::new(e) };
    assert_eq!(status(|| Err(held)), STREAMALLOC_INTERNAL);
}

use crate::sim::STREAMALLOC_SIM_MAX_TIME_NS as MAX_TIME_NS;

/// The simulator of `device` behind the C functions.
fn simulator_of(device: c_int) -> std::sync::Arc<core_alloc::device::sim::SimDevice> {
    State::get().unwrap().stack(device).unwrap().sim.clone().unwrap()
}

/// Issue 33: `streamalloc_sim_advance` and `streamalloc_sim_use` took any time: the clock
/// wrapped (`now += ns`), and so did a stream's end of work; a range past the end of the
/// address space overflowed. Each is refused past the documented maximum, the clock unmoved.
#[test]
fn the_simulated_clock_never_wraps() {
    setup();
    let device = 12;
    let mut s = ptr::null_mut();
    // SAFETY: a valid out-pointer.
    assert_eq!(unsafe { streamalloc_sim_create_stream(device, &mut s) }, STREAMALLOC_OK);
    let p = streamalloc_malloc(4096, device, s);
    assert!(!p.is_null(), "{}", last_error());
    let sim = simulator_of(device);
    assert_eq!(streamalloc_sim_advance(device, 1_000), STREAMALLOC_OK);
    for ns in [u64::MAX, u64::MAX - 1_000, 1 << 63, MAX_TIME_NS + 1] {
        let before = sim.now();
        assert_eq!(streamalloc_sim_advance(device, ns), STREAMALLOC_INVALID_ARGUMENT, "advance by {ns}");
        assert!(last_error().contains("maximum"), "{}", last_error());
        assert!(sim.now() >= before && sim.now() < before + 1_000, "advance by {ns}: the clock moved");
        assert_eq!(streamalloc_sim_use(device, p, 4096, s, ns), STREAMALLOC_INVALID_ARGUMENT, "use for {ns}");
        assert!(last_error().contains("maximum"), "{}", last_error());
    }
    let ready = sim.stream_ready_at(simulated(s)).unwrap();
    assert!(ready < 1 << 40, "no refused kernel moved the stream: {ready}");
    // A range that wraps the address space.
    assert_eq!(streamalloc_sim_use(device, p, usize::MAX, s, 1), STREAMALLOC_INVALID_ARGUMENT);
    // Up to the maximum is fine, and the clock stays there.
    assert_eq!(streamalloc_sim_use(device, p, 4096, s, 1_000), STREAMALLOC_OK, "{}", last_error());
    assert_eq!(streamalloc_sim_synchronize(device, s), STREAMALLOC_OK);
    streamalloc_free(p, 4096, device, s);
    let left = MAX_TIME_NS - sim.now();
    assert_eq!(streamalloc_sim_advance(device, left - 1_000), STREAMALLOC_OK, "{}", last_error());
    assert!(sim.now() > MAX_TIME_NS - 1_000);
    assert_eq!(streamalloc_sim_advance(device, 1_000), STREAMALLOC_INVALID_ARGUMENT);
    assert_eq!(streamalloc_sim_synchronize(device, s), STREAMALLOC_OK, "{}", last_error());
    let q = streamalloc_malloc(4096, device, s);
    assert!(!q.is_null(), "the device still works at the end of time: {}", last_error());
    streamalloc_free(q, 4096, device, s);
    assert!(sim.now() <= MAX_TIME_NS);
}

/// The simulator's stream behind a C handle.
fn simulated(handle: *mut c_void) -> core_alloc::Stream {
    State::get().unwrap().sim_streams().get(handle as u64).unwrap().1
}

/// Issue 33: a stream handle of device 1 named, on device 0, the stream of device 0 that
/// happens to have the same simulator id: recorded on device 0's memory, or used for a kernel
/// over it. A handle is its device's only.
#[test]
fn a_stream_handle_of_one_device_is_no_stream_of_another() {
    setup();
    let (d0, d1) = (10, 11);
    let (mut s0, mut s1) = (ptr::null_mut(), ptr::null_mut());
    // SAFETY: valid out-pointers.
    unsafe {
        assert_eq!(streamalloc_sim_create_stream(d0, &mut s0), STREAMALLOC_OK);
        assert_eq!(streamalloc_sim_create_stream(d1, &mut s1), STREAMALLOC_OK);
    }
    assert_eq!(simulated(s0), simulated(s1), "the two simulators number their streams alike");
    let p = streamalloc_malloc(4096, d0, s0);
    assert!(!p.is_null(), "{}", last_error());
    assert_eq!(streamalloc_record_stream(p, s1), STREAMALLOC_INVALID_ARGUMENT, "recorded a stream of {d1}");
    assert!(last_error().contains(&format!("device {d1}")), "{}", last_error());
    assert_eq!(streamalloc_sim_use(d1, p, 4096, s1, 1_000), STREAMALLOC_INVALID_ARGUMENT, "a kernel of {d1}");
    assert!(last_error().contains(&format!("device {d1}")), "{}", last_error());
    assert_eq!(streamalloc_sim_use(d0, p, 4096, s1, 1_000), STREAMALLOC_INVALID_ARGUMENT);
    assert_eq!(streamalloc_record_stream(p, s0), STREAMALLOC_OK, "{}", last_error());
    assert_eq!(streamalloc_record_stream(p, ptr::null_mut()), STREAMALLOC_OK, "{}", last_error());
    // As a free's owner it is only a hint, and a wrong one.
    streamalloc_free(p, 4096, d0, s1);
    let mut st = Stats::default();
    // SAFETY: a valid out-pointer.
    assert_eq!(unsafe { streamalloc_stats(d0, &mut st) }, STREAMALLOC_OK);
    assert_eq!(st.live_allocations, 0, "freed");
    let mut violations = u64::MAX;
    // SAFETY: a valid out-pointer.
    assert_eq!(unsafe { streamalloc_sim_violations(d0, &mut violations) }, STREAMALLOC_OK);
    assert_eq!(violations, 0);
}

/// The IPC functions at the boundary (the process-wide state is `strategy=plain`: nothing is
/// mapped, so nothing is exported; `ipc.rs` tests a mapped configuration).
#[test]
fn ipc_refuses_bad_arguments_with_a_status() {
    setup();
    let p = streamalloc_malloc(4096, 0, ptr::null_mut());
    assert!(!p.is_null(), "{}", last_error());
    let (mut written, mut offset) = (usize::MAX, usize::MAX);
    let mut buf = [0u8; 64];
    // SAFETY: valid out-pointers and a buffer of the length given, or nulls the calls refuse.
    unsafe {
        let mut export = |written: *mut usize, offset: *mut usize| {
            streamalloc_ipc_export(p, 4096, buf.as_mut_ptr(), 64, written, offset)
        };
        assert_eq!(export(ptr::null_mut(), &mut offset), STREAMALLOC_INVALID_ARGUMENT);
        assert_eq!(export(&mut written, ptr::null_mut()), STREAMALLOC_INVALID_ARGUMENT);
        assert_eq!(export(&mut written, &mut offset), STREAMALLOC_INVALID_ARGUMENT);
        assert!(last_error().contains("cudaIpcGetMemHandle"), "{}", last_error());
        let null =
            streamalloc_ipc_export(ptr::null_mut(), 4096, ptr::null_mut(), 0, &mut written, &mut offset);
        assert_eq!(null, STREAMALLOC_INVALID_ARGUMENT);
        let mut out = ptr::dangling_mut::<c_void>();
        assert_eq!(streamalloc_ipc_open(ptr::null(), 0, 0, &mut out), STREAMALLOC_INVALID_ARGUMENT);
        assert_eq!(streamalloc_ipc_open(buf.as_ptr(), 2, 0, ptr::null_mut()), STREAMALLOC_INVALID_ARGUMENT);
        assert_eq!(streamalloc_ipc_open(buf.as_ptr(), buf.len(), 0, &mut out), STREAMALLOC_INVALID_ARGUMENT);
        assert!(last_error().contains("not a handle of mapped memory"), "{}", last_error());
    }
    assert_eq!((written, offset), (usize::MAX, usize::MAX), "nothing written on failure");
    assert_eq!(streamalloc_ipc_close(p), STREAMALLOC_INVALID_ARGUMENT, "an allocation, not an opened range");
    assert!(last_error().contains("not a range streamalloc_ipc_open mapped"), "{}", last_error());
    assert_eq!(streamalloc_deallocate(p), STREAMALLOC_OK, "the allocation is untouched");
}

/// The pinned host pool at the boundary, on a simulated device of its own: bad input refused
/// with a status, real memory, every handout checked, reuse only after the recorded stream's
/// copy, and the checker catching a copy nobody recorded.
#[test]
fn pinned_host_memory_through_the_c_abi() {
    const D: c_int = 9;
    setup();
    let alloc = |size: usize, device: c_int| {
        let mut p = ptr::dangling_mut::<c_void>();
        // SAFETY: `p` is a valid place for a pointer.
        let s = unsafe { streamalloc_host_alloc(size, device, &mut p) };
        (s, p)
    };
    // SAFETY: a null out-pointer is the bad input under test.
    assert_eq!(unsafe { streamalloc_host_alloc(4096, D, ptr::null_mut()) }, STREAMALLOC_INVALID_ARGUMENT);
    assert_eq!(alloc(4096, -1), (STREAMALLOC_INVALID_ARGUMENT, ptr::null_mut()));
    assert_eq!(alloc(usize::MAX, D), (STREAMALLOC_INVALID_ARGUMENT, ptr::null_mut()));
    assert_eq!(alloc(0, D), (STREAMALLOC_OK, ptr::null_mut()));
    let (s, p) = alloc(1 << 20, D);
    assert_eq!(s, STREAMALLOC_OK, "{}", last_error());
    // SAFETY: 1 MiB of host memory the pool handed out and nothing else uses.
    unsafe { ptr::write_bytes(p.cast::<u8>(), 0xab, 1 << 20) };
    let mut stream = ptr::null_mut();
    // SAFETY: `stream` is a valid place for a stream handle.
    assert_eq!(unsafe { streamalloc_sim_create_stream(D, &mut stream) }, STREAMALLOC_OK);
    assert_eq!(streamalloc_sim_use_host(D, p, 1 << 20, stream, 1_000_000), STREAMALLOC_OK);
    assert_eq!(streamalloc_sim_use_host(0, p, 1 << 20, ptr::null_mut(), 1), STREAMALLOC_INVALID_ARGUMENT);
    assert!(last_error().contains("checked on device 9"), "{}", last_error());
    assert_eq!(streamalloc_host_record_stream(p, D, stream), STREAMALLOC_OK, "{}", last_error());
    assert_eq!(
        streamalloc_host_record_stream(p.wrapping_byte_add(64), D, stream),
        STREAMALLOC_INVALID_ARGUMENT
    );
    assert!(last_error().contains("not a live pinned allocation"), "{}", last_error());
    assert_eq!(streamalloc_host_record_stream(p, D, 0xbad0 as CudaStream), STREAMALLOC_INVALID_ARGUMENT);
    // Issue 52: a record refused for its stream is told apart from a block that is not the
    // pool's (the torch backend gave both to torch's previous allocator, dropping the record).
    assert!(streamalloc_host_is_live(p), "refused for its stream, the block is still the pool's");
    assert!(!streamalloc_host_is_live(p.wrapping_byte_add(64)));
    assert_eq!(streamalloc_host_record_stream(ptr::null_mut(), D, stream), STREAMALLOC_OK);
    assert_eq!(streamalloc_host_free(p), STREAMALLOC_OK);
    assert!(!streamalloc_host_is_live(p), "freed");
    assert_eq!(streamalloc_host_free(p), STREAMALLOC_INVALID_ARGUMENT, "freed twice");
    assert_eq!(streamalloc_host_free(ptr::null_mut()), STREAMALLOC_OK);
    // The copy still reads the block: another one comes, then, once the copy is done, it.
    let (_, q) = alloc(1 << 20, D);
    assert_ne!(q, p);
    assert_eq!(streamalloc_sim_synchronize(D, stream), STREAMALLOC_OK);
    let (_, r) = alloc(1 << 20, D);
    assert_eq!(r, p);
    let mut stats = Stats::default();
    // SAFETY: a valid out-pointer.
    assert_eq!(unsafe { streamalloc_host_stats(&mut stats) }, STREAMALLOC_OK);
    assert_eq!((stats.allocated, stats.reserved, stats.device_allocs), (2 << 20, 2 << 20, 2));
    assert_eq!((stats.total_allocations, stats.total_frees, stats.failures), (3, 1, 1));
    let mut violations = u64::MAX;
    // SAFETY: a valid out-pointer.
    assert_eq!(unsafe { streamalloc_sim_violations(D, &mut violations) }, STREAMALLOC_OK);
    assert_eq!(violations, 0);
    // A copy nobody recorded: the next handout of the block is an early reuse.
    assert_eq!(streamalloc_sim_use_host(D, r, 1 << 20, stream, 1_000_000), STREAMALLOC_OK);
    assert_eq!(streamalloc_host_free(r), STREAMALLOC_OK);
    assert_eq!(alloc(1 << 20, D), (STREAMALLOC_OK, r));
    // SAFETY: a valid out-pointer.
    assert_eq!(unsafe { streamalloc_sim_violations(D, &mut violations) }, STREAMALLOC_OK);
    assert_eq!(violations, 1);
    assert_eq!(streamalloc_sim_synchronize(D, stream), STREAMALLOC_OK);
    assert_eq!((streamalloc_host_free(q), streamalloc_host_free(r)), (STREAMALLOC_OK, STREAMALLOC_OK));
    let mut released = 0;
    // SAFETY: valid out-pointers.
    unsafe {
        assert_eq!(streamalloc_host_release(&mut released), STREAMALLOC_OK);
        assert_eq!(released, 2 << 20);
        assert_eq!(streamalloc_host_reset_peak_stats(), STREAMALLOC_OK);
        assert_eq!(streamalloc_host_stats(&mut stats), STREAMALLOC_OK);
        assert_eq!(streamalloc_host_stats(ptr::null_mut()), STREAMALLOC_INVALID_ARGUMENT);
    }
    assert_eq!((stats.reserved, stats.reserved_peak, stats.device_frees), (0, 0, 2));
}
