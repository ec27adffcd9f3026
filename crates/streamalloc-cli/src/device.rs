//! Choosing the device a replay runs on, and describing it.

use std::sync::Arc;

use clap::ValueEnum;
use streamalloc::device::cuda::{device_count, driver_version, CudaDevice};
use streamalloc::device::sim::{SimConfig, SimDevice};
use streamalloc::device::{DeviceMemory, DriverPools};
use streamalloc::Device;

/// Which device to replay on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DeviceChoice {
    /// The simulator, sized like an NVIDIA H200.
    Sim,
    /// GPU 0 through the CUDA driver.
    Cuda,
}

/// An opened device and a one-line description of it.
pub struct Opened {
    /// The device.
    pub device: Arc<dyn Device>,
    /// What it is, for the first line of the output.
    pub description: String,
    /// Bytes of device memory use a replay may find above the idle device's at its start
    /// without being refused: 0 on the simulator; on a GPU, what the driver's own use
    /// (streams, events, modules loaded lazily) moves by between replays.
    pub start_slack: usize,
    /// The simulator's settings when the device is the simulator.
    pub sim: Option<SimConfig>,
    /// The simulator when the device is the simulator (whose clock a replay of time moves).
    pub simulator: Option<Arc<SimDevice>>,
}

/// Opens GPU 0 through the CUDA driver, or says why it cannot.
pub fn open_cuda() -> Result<Opened, String> {
    let device = CudaDevice::new(0).map_err(|e| e.to_string())?;
    let memory = device.mem_info().map_err(|e| e.to_string())?;
    let description = format!("CUDA device 0 ({} MiB, {} MiB free)", memory.total >> 20, memory.free >> 20);
    Ok(Opened { device, description, start_slack: 32 << 20, sim: None, simulator: None })
}

/// The CUDA driver's version and device count, then one line per CUDA device: memory and
/// whether it offers stream-ordered pools. A driver that cannot be loaded gives one line
/// saying why.
pub fn describe_gpus() -> Vec<String> {
    let count = match device_count() {
        Ok(n) => n,
        Err(e) => return vec![format!("CUDA: {e}")],
    };
    let driver =
        driver_version().map_or_else(|e| e.to_string(), |(major, minor)| format!("CUDA {major}.{minor}"));
    let mut lines = vec![format!("CUDA driver: {driver}"), format!("CUDA devices: {count}")];
    for ordinal in 0..count {
        lines.push(match CudaDevice::new(ordinal) {
            Ok(device) => {
                let memory = device.mem_info().map_or_else(
                    |e| e.to_string(),
                    |m| format!("{} MiB, {} MiB free", m.total >> 20, m.free >> 20),
                );
                let pools = if device.default_pool().is_ok() { "yes" } else { "no" };
                format!("device {ordinal}: {memory}; stream-ordered pools: {pools}")
            }
            Err(e) => format!("device {ordinal}: {e}"),
        });
    }
    lines
}

/// The simulator the command uses when it has no GPU.
pub fn simulator_config() -> SimConfig {
    SimConfig::h200()
}

/// Describes the simulator configured by `config`.
pub fn describe_simulator(config: &SimConfig) -> String {
    format!(
        "simulator (H200-sized: {} MiB of device memory, {} ns per device call, {} bytes/ns memset)",
        config.capacity >> 20,
        config.tick_ns,
        config.bandwidth_bytes_per_ns
    )
}

/// Opens a simulator of `capacity` bytes (otherwise [`simulator_config`]'s).
pub fn open_simulator(capacity: usize) -> Opened {
    let config = SimConfig { capacity, ..simulator_config() };
    let description = format!("simulator of {} MiB (--capacity), otherwise H200-like", capacity >> 20);
    let simulator = SimDevice::new(config.clone());
    let device: Arc<dyn Device> = simulator.clone();
    Opened { device, description, start_slack: 0, sim: Some(config), simulator: Some(simulator) }
}

/// Opens the device `choice` names; with no choice, CUDA when a GPU is found, else the
/// simulator.
pub fn open(choice: Option<DeviceChoice>) -> Result<Opened, String> {
    let simulator = || {
        let config = simulator_config();
        let description = describe_simulator(&config);
        let simulator = SimDevice::new(config.clone());
        let device: Arc<dyn Device> = simulator.clone();
        Opened { device, description, start_slack: 0, sim: Some(config), simulator: Some(simulator) }
    };
    match choice {
        Some(DeviceChoice::Sim) => Ok(simulator()),
        Some(DeviceChoice::Cuda) => open_cuda().map_err(|e| format!("--device cuda: {e}")),
        None => Ok(open_cuda().unwrap_or_else(|why| {
            let mut opened = simulator();
            opened.description.push_str(&format!("; no GPU: {why}"));
            opened
        })),
    }
}
