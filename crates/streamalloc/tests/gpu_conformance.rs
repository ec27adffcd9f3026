//! The conformance suite on a CUDA GPU. Every test here is `#[ignore]`d: CI has no GPU;
//! scripts/gpu-test.sh runs them with `--ignored` on the GPU machine.

// A test: a failed unwrap or expect is the test failing (clippy.toml allows them in
// `#[test]` functions only, and this file's helpers are not).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod conformance;

use conformance::{
    async_pool, async_pool_by_pointer, best_fit, best_fit_segments, best_fit_stitched, plain, stream_safe,
    stream_safe_by_pointer, stream_safe_segments, stream_safe_stitched,
};

conformance_tests!(gpu plain_on_gpu, plain);
conformance_tests!(gpu best_fit_on_gpu, best_fit);
conformance_tests!(gpu stream_safe_on_gpu, stream_safe);
conformance_tests!(gpu best_fit_segments_on_gpu, best_fit_segments);
conformance_tests!(gpu stream_safe_segments_on_gpu, stream_safe_segments);
conformance_tests!(gpu best_fit_stitched_on_gpu, best_fit_stitched);
conformance_tests!(gpu stream_safe_stitched_on_gpu, stream_safe_stitched);
conformance_tests!(gpu async_pool_on_gpu, async_pool);
conformance_tests!(gpu stream_safe_by_pointer_on_gpu, stream_safe_by_pointer);
conformance_tests!(gpu async_pool_by_pointer_on_gpu, async_pool_by_pointer);

#[test]
#[ignore = "needs a CUDA GPU: run by scripts/gpu-test.sh"]
fn every_registered_strategy_conforms_on_gpu() {
    conformance::every_registered_strategy(conformance::cuda_device);
}
