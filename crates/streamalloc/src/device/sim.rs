//! A simulated device.
