//! The CUDA driver API through `cudarc`, loaded at run time.
