//! GPU tests of sharing mapped memory with another process: a block of a stitched pool
//! exported ([`share_mapped`], `Ipc::export_mapped`) in one process and mapped in another
//! (`fetch_fds`, `Ipc::map_shared`), the two processes a parent and the child it spawned
//! (this test executable again, in the role the environment names). Bytes go both ways, and the
//! receiver's mapping keeps the memory after the exporter freed the block and released its
//! pool. `#[ignore]`d: `scripts/gpu-test.sh` runs them on a GPU machine, where a missing GPU
//! fails them.
//!
//! Both directions are tested: copying a descriptor out of a process needs permission to ptrace
//! it, which Yama's `kernel.yama.ptrace_scope` = 1 gives a parent over its child but not a
//! child over its parent; there the first test fails with that cause named, and the second
//! still shows the sharing itself.
//!
//! An allocation of an exportable driver pool (`Ipc::export_pool_pointer`) is imported the
//! same way (`Ipc::import_pool_pointer`), by a parent from its child.
//!
//! Every wait is bounded: a peer's line is awaited at most [`LIMIT`], then the child is killed.

// A test: a failed unwrap or expect is the test failing (clippy.toml allows them in
// `#[test]` functions only, and this file's helpers are not).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod gpu_common;

use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsFd;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::time::{Duration, Instant};

use gpu_common::gpu;
use streamalloc::allocators::backing::share_mapped;
use streamalloc::allocators::{BackingKind, BestFit, BestFitConfig};
use streamalloc::device::ipc::{fetch_fds, SharedPiece, POOL_POINTER_DATA};
use streamalloc::device::PoolProps;
use streamalloc::Allocator;

/// The environment variable that makes the test executable a child in a role (`exporter` or
/// `receiver`).
const ROLE: &str = "STREAMALLOC_GPU_IPC_ROLE";
/// Longest a process waits for its peer's next line.
const LIMIT: Duration = Duration::from_secs(60);
/// What the child's lines to its parent start with (the test harness prints other lines).
const PREFIX: &str = "IPC ";
const MIB: usize = 1 << 20;

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed)).collect()
}

/// The other process, line by line.
trait Peer {
    fn send(&mut self, line: &str);
    /// The peer's next line (fails the test after [`LIMIT`]).
    fn recv(&mut self) -> String;
}

/// The parent as its child sees it: lines on stdout, lines on stdin.
struct Parent(BufReader<std::io::Stdin>);

impl Peer for Parent {
    fn send(&mut self, line: &str) {
        let mut out = std::io::stdout().lock();
        writeln!(out, "{PREFIX}{line}").and_then(|()| out.flush()).expect("write to the parent");
    }

    /// Reads stdin, which the parent closes (by exiting or killing this process) rather than
    /// leave it waiting past its own bound.
    fn recv(&mut self) -> String {
        let mut line = String::new();
        self.0.read_line(&mut line).expect("read from the parent");
        assert!(!line.is_empty(), "the parent closed the pipe");
        line.trim_end().to_owned()
    }
}

/// A spawned child: lines to its stdin, its prefixed stdout lines from a reader thread.
struct Spawned {
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
}

impl Spawned {
    /// This test executable again, running `test` in `role`.
    fn start(test: &str, role: &str) -> Self {
        let exe = std::env::current_exe().expect("the test executable");
        let mut child = Command::new(exe)
            .args(["--exact", test, "--include-ignored", "--nocapture", "--test-threads=1"])
            .env(ROLE, role)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn the child");
        let stdin = child.stdin.take().expect("the child's stdin");
        let stdout = child.stdout.take().expect("the child's stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(|l| l.ok()) {
                // The child's test harness prints `test NAME ... ` without a newline before the
                // test runs, so the child's first message shares that line: found anywhere in it.
                match line.find(PREFIX).map(|at| &line[at + PREFIX.len()..]) {
                    Some(ours) => {
                        if tx.send(ours.to_owned()).is_err() {
                            break;
                        }
                    }
                    None => eprintln!("child: {line}"),
                }
            }
        });
        Spawned { child, stdin, lines }
    }

    /// Waits (bounded) for the child to exit successfully.
    fn finish(mut self) {
        drop(self.stdin);
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().expect("wait for the child") {
                assert!(status.success(), "the child failed: {status}");
                return;
            }
            if start.elapsed() > LIMIT {
                let _ = self.child.kill();
                panic!("the child did not exit within {LIMIT:?}");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Peer for Spawned {
    fn send(&mut self, line: &str) {
        writeln!(self.stdin, "{line}").and_then(|()| self.stdin.flush()).expect("write to the child");
    }

    fn recv(&mut self) -> String {
        match self.lines.recv_timeout(LIMIT) {
            Ok(line) => line,
            Err(e) => {
                let _ = self.child.kill();
                panic!("no line from the child within {LIMIT:?} ({e}); its stderr is above");
            }
        }
    }
}

/// Allocates a block of a stitched pool, writes a pattern, exports it; then checks what the
/// receiver wrote, frees the block and releases the pool while the receiver still maps it.
fn export(peer: &mut dyn Peer) {
    let dev = gpu();
    let s = dev.create_stream().expect("create_stream");
    let config = BestFitConfig { backing: BackingKind::STITCHED, stream: s, ..Default::default() };
    let pool = BestFit::new(dev.clone(), config).expect("a stitched pool");
    // So that the block starts inside a granule, and ends inside another.
    let pad = pool.allocate(MIB + 4096).expect("allocate");
    let block = pool.allocate(6 * MIB + 512).expect("allocate");
    dev.copy_from_host(block.ptr(), &pattern(block.size(), 1), s).expect("copy_from_host");
    let range = share_mapped(&*dev, block.ptr(), block.size()).expect("share_mapped");
    assert_eq!(range.base % dev.map_granularity().unwrap() as u64, 0);
    let pieces: Vec<String> =
        range.pieces.iter().map(|p| format!("{},{},{},{}", p.fd, p.serial, p.offset, p.len)).collect();
    let offset = block.ptr() - range.base;
    peer.send(&format!("SPEC {} {offset} {} {}", std::process::id(), block.size(), pieces.join(";")));
    assert_eq!(peer.recv(), "WROTE");
    let mut back = vec![0; block.size()];
    dev.copy_to_host(&mut back, block.ptr(), s).expect("copy_to_host");
    assert!(back == pattern(block.size(), 2), "the exporter does not read what the receiver wrote");
    let used = dev.mem_info().unwrap().used();
    drop((pad, block));
    let released = pool.release().expect("release");
    assert!(released >= range.len() as usize, "released {released} bytes");
    eprintln!(
        "exporter: device memory used {used} before the release, {} after",
        dev.mem_info().unwrap().used()
    );
    peer.send("RELEASED");
    assert_eq!(peer.recv(), "KEPT");
}

/// Maps what the exporter's line describes, checks its pattern and writes another; after the
/// exporter released its memory, checks that the mapping still holds what was written.
fn receive(peer: &mut dyn Peer) {
    let spec = peer.recv();
    let fields: Vec<&str> = spec.split(' ').collect();
    let [_, pid, offset, size, pieces] = fields[..] else { panic!("a bad line from the exporter: {spec}") };
    let (pid, offset, size): (u32, u64, usize) =
        (pid.parse().unwrap(), offset.parse().unwrap(), size.parse().unwrap());
    let pieces: Vec<SharedPiece> = pieces
        .split(';')
        .map(|p| {
            let v: Vec<u64> = p.split(',').map(|x| x.parse().unwrap()).collect();
            SharedPiece { fd: v[0] as i32, serial: v[1], offset: v[2], len: v[3] }
        })
        .collect();
    let dev = gpu();
    let fds = fetch_fds(pid, &pieces.iter().map(|p| p.fd).collect::<Vec<_>>())
        .unwrap_or_else(|e| panic!("copying the exporter's descriptors: {e}"));
    let total: u64 = pieces.iter().map(|p| p.len).sum();
    let base = dev.reserve_address(total as usize).expect("reserve_address");
    let mut at = base;
    for (p, fd) in pieces.iter().zip(&fds) {
        dev.map_shared(at, fd.as_fd(), p.offset as usize, p.len as usize).expect("map_shared");
        at += p.len;
    }
    drop(fds);
    let s = dev.create_stream().expect("create_stream");
    let mine = base + offset;
    let mut back = vec![0; size];
    dev.copy_to_host(&mut back, mine, s).expect("copy_to_host");
    assert!(back == pattern(size, 1), "the receiver does not read what the exporter wrote");
    dev.copy_from_host(mine, &pattern(size, 2), s).expect("copy_from_host");
    dev.synchronize().expect("synchronize");
    peer.send("WROTE");
    assert_eq!(peer.recv(), "RELEASED");
    back.fill(0);
    dev.copy_to_host(&mut back, mine, s).expect("copy_to_host after the exporter's release");
    assert!(back == pattern(size, 2), "the memory changed once its exporter released it");
    dev.synchronize().expect("synchronize");
    dev.unmap(base, total as usize).expect("unmap");
    dev.free_address(base, total as usize).expect("free_address");
    peer.send("KEPT");
}

/// Allocates from a pool created exportable, writes a pattern and exports the allocation; once
/// the receiver wrote another and freed its import, checks it, frees and destroys the pool.
fn export_pool(peer: &mut dyn Peer) {
    let dev = gpu();
    let s = dev.create_stream().expect("create_stream");
    let pool = dev.create_pool(PoolProps { max_size: 0, exportable: true }).expect("an exportable pool");
    let size = 3 * MIB + 512;
    let ptr = dev.alloc_async(size, pool, s).expect("alloc_async");
    dev.copy_from_host(ptr, &pattern(size, 1), s).expect("copy_from_host");
    dev.synchronize_stream(s).expect("synchronize_stream");
    let export = dev.export_pool_pointer(ptr, size).expect("export_pool_pointer");
    assert_eq!(dev.export_pool_pointer(ptr, size).expect("again"), export, "exported once");
    let data: Vec<String> = export.data.iter().map(|b| format!("{b:02x}")).collect();
    peer.send(&format!("POOL {} {} {size} {}", std::process::id(), export.fd, data.concat()));
    assert_eq!(peer.recv(), "CLOSED");
    let mut back = vec![0; size];
    dev.copy_to_host(&mut back, ptr, s).expect("copy_to_host");
    assert!(back == pattern(size, 2), "the exporter does not read what the receiver wrote");
    dev.free_async(ptr, s).expect("free_async");
    dev.synchronize_stream(s).expect("synchronize_stream");
    dev.destroy_pool(pool).expect("destroy_pool");
    peer.send("DONE");
}

/// Imports the pool allocation the exporter's line describes, checks its pattern, writes
/// another and frees the import.
fn receive_pool(peer: &mut dyn Peer) {
    let spec = peer.recv();
    let fields: Vec<&str> = spec.split(' ').collect();
    let [_, pid, fd, size, data] = fields[..] else { panic!("a bad line from the exporter: {spec}") };
    let (pid, fd, size): (u32, i32, usize) =
        (pid.parse().unwrap(), fd.parse().unwrap(), size.parse().unwrap());
    let mut bytes = [0u8; POOL_POINTER_DATA];
    for (i, b) in bytes.iter_mut().enumerate() {
        *b = u8::from_str_radix(&data[2 * i..2 * i + 2], 16).unwrap();
    }
    let dev = gpu();
    let fds = fetch_fds(pid, &[fd]).unwrap_or_else(|e| panic!("copying the exporter's descriptor: {e}"));
    let ptr = dev.import_pool_pointer(fds[0].as_fd(), &bytes).expect("import_pool_pointer");
    drop(fds);
    let s = dev.create_stream().expect("create_stream");
    let mut back = vec![0; size];
    dev.copy_to_host(&mut back, ptr, s).expect("copy_to_host");
    assert!(back == pattern(size, 1), "the receiver does not read what the exporter wrote");
    dev.copy_from_host(ptr, &pattern(size, 2), s).expect("copy_from_host");
    dev.synchronize().expect("synchronize");
    dev.free_imported(ptr).expect("free_imported");
    peer.send("CLOSED");
    assert_eq!(peer.recv(), "DONE");
}

/// Runs `parent` here, and the other role in a child spawned to run `test` again; in that
/// child (the environment names its role), runs the role and returns.
fn run(test: &str, parent: fn(&mut dyn Peer), child_role: &str) {
    if let Ok(role) = std::env::var(ROLE) {
        let act = match role.as_str() {
            "exporter" => export,
            "pool_exporter" => export_pool,
            _ => receive,
        };
        return act(&mut Parent(BufReader::new(std::io::stdin())));
    }
    let mut spawned = Spawned::start(test, child_role);
    parent(&mut spawned);
    spawned.finish();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_spawned_child_maps_what_its_parent_exports() {
    run("a_spawned_child_maps_what_its_parent_exports", export, "receiver");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_parent_maps_what_its_spawned_child_exports() {
    run("a_parent_maps_what_its_spawned_child_exports", receive, "exporter");
}

/// The parent imports (it may ptrace its child under any Yama setting).
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_parent_imports_a_pool_allocation_its_spawned_child_exports() {
    run("a_parent_imports_a_pool_allocation_its_spawned_child_exports", receive_pool, "pool_exporter");
}
