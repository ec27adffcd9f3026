//! Parsing speed of the largest sample trace (gpt2_generate.csv.xz, 161k rows), from memory
//! (decompressed first).

// A benchmark: a failed unwrap or expect stops it, as it should.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use streamalloc_replay::trace::Trace;

fn parse(c: &mut Criterion) {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../traces/gpt2_generate.csv.xz");
    let mut bytes = Vec::new();
    std::io::Read::read_to_end(
        &mut streamalloc_replay::compressed::open(path.as_ref())
            .expect("the sample trace is in the repository"),
        &mut bytes,
    )
    .expect("the sample trace decompresses");
    let mut group = c.benchmark_group("parse");
    group.throughput(Throughput::Bytes(bytes.len() as u64));
    group.sample_size(20);
    group.bench_function("gpt2_generate.csv", |b| {
        b.iter(|| Trace::parse(bytes.as_slice(), "gpt2_generate.csv").expect("the sample trace parses"))
    });
    group.finish();
}

criterion_group!(benches, parse);
criterion_main!(benches);
