//! The small CUDA graph wrapper of [`AsyncPool`](super::AsyncPool): a capture in progress
//! ([`Capture`]) and the graph it made ([`CapturedGraph`]), with what each owes the pool.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use parking_lot::Mutex;

use super::Inner;
use crate::allocation::{Block, BlockOwner};
use crate::device::{Graph, GraphExec, Stream};
use crate::error::{try_each, Result};

#[derive(Default, Clone, Copy, PartialEq, Eq)]
enum Phase {
    #[default]
    Capturing,
    Captured,
    Destroyed,
}

/// What a capture and its graph share with the allocations made during the capture.
#[derive(Default)]
pub(super) struct GraphShared {
    state: Mutex<GraphState>,
}

#[derive(Default)]
struct GraphState {
    phase: Phase,
    /// The capture's own free stream (case 1 frees with recorded streams), if one was needed.
    side_stream: Option<Stream>,
    /// Case 3: memory from outside freed during the capture, freed when it ends.
    deferred: Vec<Block>,
    /// Case 2: graph memory whose `Allocation` was dropped, freed when the graph is destroyed.
    owned: Vec<Block>,
    /// The stream of the graph's last launch.
    last_launch: Option<Stream>,
}

impl GraphShared {
    /// Keeps `block` until the capture ends; gives it back if the capture has ended.
    pub(super) fn defer(&self, block: Block) -> Option<Block> {
        let mut st = self.state.lock();
        if st.phase == Phase::Capturing {
            st.deferred.push(block);
            None
        } else {
            Some(block)
        }
    }
}

/// Graph memory, once its graph has run on `launch`: owned by the launch stream, with the
/// capturing stream as one more user.
fn after_launch(mut block: Block, launch: Stream) -> Block {
    if block.stream != launch {
        let capturing = std::mem::replace(&mut block.stream, launch);
        block.recorded.retain(|s| *s != launch);
        block.recorded.push(capturing);
    }
    block
}

/// Takes back allocations made during a capture (cases 1 and 2 of the
/// [module docs](super#cuda-graph-capture)).
pub(super) struct CaptureOwner {
    inner: Arc<Inner>,
    shared: Arc<GraphShared>,
}

impl CaptureOwner {
    pub(super) fn new(inner: Arc<Inner>, shared: Arc<GraphShared>) -> Self {
        Self { inner, shared }
    }

    /// Case 1: a captured free, after the recorded streams that take part in the capture.
    fn free_in_capture(&self, block: Block) -> Result<()> {
        let device = &self.inner.device;
        let mut users = Vec::new();
        for &s in &block.recorded {
            if device.capture_status(s)? == crate::device::CaptureStatus::Active {
                users.push(s);
            }
        }
        if users.is_empty() {
            return device.free_async(block.ptr, block.stream);
        }
        let side = {
            let mut st = self.shared.state.lock();
            match st.side_stream {
                Some(s) => s,
                None => *st.side_stream.insert(device.create_stream()?),
            }
        };
        self.inner.order_after(side, std::iter::once(block.stream).chain(users))?;
        device.free_async(block.ptr, side)
    }
}

impl BlockOwner for CaptureOwner {
    fn free(&self, block: Block) {
        self.inner.counted(|c| c.stats.on_free(block.size));
        let mut st = self.shared.state.lock();
        let result = match st.phase {
            Phase::Capturing => {
                drop(st);
                self.free_in_capture(block)
            }
            Phase::Captured => {
                st.owned.push(block);
                Ok(())
            }
            Phase::Destroyed => match st.last_launch {
                Some(launch) => {
                    drop(st);
                    self.inner.release_block(after_launch(block, launch))
                }
                // Never launched: the memory never existed.
                None => Ok(()),
            },
        };
        self.inner.keep_error(result);
    }
}

/// A capture begun with [`AsyncPool::begin_capture`](super::AsyncPool::begin_capture). End it
/// with [`Capture::end`]; dropping it ends the capture and throws the graph away.
pub struct Capture {
    inner: Arc<Inner>,
    shared: Arc<GraphShared>,
    stream: Stream,
    ended: bool,
}

impl Capture {
    pub(super) fn new(inner: Arc<Inner>, shared: Arc<GraphShared>, stream: Stream) -> Self {
        Self { inner, shared, stream, ended: false }
    }

    /// The capturing stream.
    pub fn stream(&self) -> Stream {
        self.stream
    }

    /// Ends the capture and instantiates the graph (with auto-free-on-launch). Frees
    /// deferred during the capture are made now, on their owning streams.
    pub fn end(mut self) -> Result<CapturedGraph> {
        let graph = self.stop()?;
        let inner = self.inner.clone();
        match inner.device.instantiate_graph_auto_free(graph) {
            Ok(exec) => {
                Ok(CapturedGraph { inner, shared: self.shared.clone(), graph, exec, destroyed: false })
            }
            Err(e) => {
                self.shared.state.lock().phase = Phase::Destroyed;
                // Already failing; the graph never ran, so a failed destroy only leaks it.
                let _ = inner.device.destroy_graph(graph);
                Err(e)
            }
        }
    }

    /// Joins the side free stream back, ends the capture, forgets it and makes the deferred
    /// frees.
    fn stop(&mut self) -> Result<Graph> {
        self.ended = true;
        let device = &self.inner.device;
        let side = self.shared.state.lock().side_stream.take();
        let joined = side.map_or(Ok(()), |s| self.inner.order_after(self.stream, [s]));
        let graph = device.end_capture(self.stream);
        if let Some(s) = side {
            self.inner.keep_error(device.destroy_stream(s));
        }
        {
            let mut captures = self.inner.captures.lock();
            captures.remove(&self.stream);
            self.inner.capturing.store(captures.len(), Ordering::SeqCst);
        }
        let deferred = {
            let mut st = self.shared.state.lock();
            st.phase = if joined.is_ok() && graph.is_ok() { Phase::Captured } else { Phase::Destroyed };
            std::mem::take(&mut st.deferred)
        };
        for block in deferred {
            let result = self.inner.release_block(block);
            self.inner.keep_error(result);
        }
        let graph = graph?;
        if let Err(e) = joined {
            self.inner.keep_error(device.destroy_graph(graph));
            return Err(e);
        }
        Ok(graph)
    }
}

impl Drop for Capture {
    fn drop(&mut self) {
        if !self.ended {
            if let Ok(graph) = self.stop() {
                self.shared.state.lock().phase = Phase::Destroyed;
                self.inner.keep_error(self.inner.device.destroy_graph(graph));
            }
        }
    }
}

/// A graph captured through [`AsyncPool`](super::AsyncPool) and instantiated. It owns the
/// memory allocated during the capture and not freed in it; destroying it (or dropping it)
/// frees that memory if the graph was ever launched.
pub struct CapturedGraph {
    inner: Arc<Inner>,
    shared: Arc<GraphShared>,
    graph: Graph,
    exec: GraphExec,
    destroyed: bool,
}

impl CapturedGraph {
    /// The captured graph.
    pub fn graph(&self) -> Graph {
        self.graph
    }

    /// The instantiated graph.
    pub fn exec(&self) -> GraphExec {
        self.exec
    }

    /// Launches the graph on `stream`.
    pub fn launch(&self, stream: Stream) -> Result<()> {
        self.inner.device.launch_graph(self.exec, stream)?;
        self.shared.state.lock().last_launch = Some(stream);
        Ok(())
    }

    /// Frees the graph's memory (if it was launched: the driver makes it at launch) after
    /// the last launch, then destroys the graph. Errors are returned here rather than kept.
    pub fn destroy(mut self) -> Result<()> {
        self.teardown()
    }

    fn teardown(&mut self) -> Result<()> {
        self.destroyed = true;
        let (owned, launch) = {
            let mut st = self.shared.state.lock();
            st.phase = Phase::Destroyed;
            (std::mem::take(&mut st.owned), st.last_launch)
        };
        // Freed before the executable graph is destroyed, while it surely still exists.
        let freed = match launch {
            Some(launch) => try_each(owned, |block| self.inner.release_block(after_launch(block, launch))),
            None => Ok(()),
        };
        let exec = self.inner.device.destroy_graph_exec(self.exec);
        let graph = self.inner.device.destroy_graph(self.graph);
        freed.and(exec).and(graph)
    }
}

impl Drop for CapturedGraph {
    fn drop(&mut self) {
        if !self.destroyed {
            let result = self.teardown();
            self.inner.keep_error(result);
        }
    }
}
