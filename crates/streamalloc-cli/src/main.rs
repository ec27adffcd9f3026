//! `streamalloc`: replays real allocation traces through streamalloc's allocators and
//! compares the results.
//!
//! ```text
//! streamalloc replay TRACE... [--allocator NAME]... [--device sim|cuda] [--json] [--passes N]
//! streamalloc compare A.json B.json
//! streamalloc info
//! ```
//!
//! Errors go to stderr as one `error: ...` line, with exit status 1 (2 for a command line
//! clap cannot parse).

mod allocators;
mod device;

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};
use streamalloc::facade::{Config, ENV_VAR};
use streamalloc::replay::{replay, ReplayOptions, ReplayResult};
use streamalloc::trace::{ParseOptions, Trace};

use crate::device::DeviceChoice;

/// Stream-ordered GPU memory allocators: trace replay and comparison.
#[derive(Parser)]
#[command(name = "streamalloc", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Replays traces (RMM logging CSV) through allocators and reports footprint and speed.
    ///
    /// Each (trace, allocator) pair gets a fresh allocator. Pass 0 samples device memory
    /// after every operation (footprint); then --passes timed passes give the best ns/op.
    /// With --json the output is one JSON array of result objects (the fields of
    /// `streamalloc::replay::ReplayResult` plus `device`), which `compare` reads.
    Replay {
        /// Trace files (CSV: Thread,Time,Action,Pointer,Size,Stream).
        #[arg(required = true)]
        traces: Vec<PathBuf>,
        /// Allocator to replay through (repeatable; default: all known allocators).
        #[arg(long = "allocator", short = 'a', value_name = "NAME")]
        allocators: Vec<String>,
        /// Device to replay on (default: cuda when a GPU is found, else sim).
        #[arg(long, value_enum)]
        device: Option<DeviceChoice>,
        /// Print a JSON array of results instead of a table.
        #[arg(long)]
        json: bool,
        /// Timed passes after the measuring pass.
        #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
        passes: u32,
        /// Skip (and count) frees of pointers the trace never allocated, instead of failing.
        #[arg(long)]
        lenient: bool,
    },
    /// Shows two saved `replay --json` outputs side by side, with B/A ratios.
    Compare {
        /// The baseline (`replay --json` output).
        a: PathBuf,
        /// The result compared with it.
        b: PathBuf,
    },
    /// Describes the device: the GPU when CUDA finds one, else the simulator.
    Info,
    /// Runs a program whose GPU allocations go through libstreamalloc.so (e.g. PyTorch after
    /// `streamalloc.torch.enable()`, CuPy after `streamalloc.cupy.enable()`, or a C program
    /// linked to it) with the Trace layer on, and summarizes the trace it wrote.
    Record {
        /// Where to write the trace (RMM logging CSV).
        #[arg(long, short, default_value = "streamalloc-trace.csv")]
        output: PathBuf,
        /// The program and its arguments.
        #[arg(trailing_var_arg = true, required = true, value_name = "COMMAND")]
        command: Vec<String>,
    },
}

/// One result as `replay --json` prints it.
#[derive(Serialize, Deserialize)]
struct JsonResult {
    /// The device description of the run.
    #[serde(default)]
    device: String,
    #[serde(flatten)]
    result: ReplayResult,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let outcome = match cli.command {
        Command::Replay { traces, allocators, device, json, passes, lenient } => {
            run_replay(&traces, &allocators, device, json, passes as usize, lenient)
        }
        Command::Compare { a, b } => compare(&a, &b),
        Command::Info => {
            info();
            Ok(())
        }
        Command::Record { output, command } => record(&output, &command),
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("error: {message}");
            ExitCode::FAILURE
        }
    }
}

/// Runs `command` with `trace=output` added to the configuration in force, then reads the
/// trace back.
fn record(output: &Path, command: &[String]) -> Result<(), String> {
    let mut config = Config::from_env().map_err(|e| e.to_string())?;
    config.trace = Some(output.to_path_buf());
    let _ = std::fs::remove_file(output);
    let status = std::process::Command::new(&command[0])
        .args(&command[1..])
        .env(ENV_VAR, config.to_string())
        .status()
        .map_err(|e| format!("cannot run `{}`: {e}", command[0]))?;
    if !output.exists() {
        return Err(format!(
            "`{}` wrote no trace to {}: did it load libstreamalloc.so (e.g. streamalloc.torch.enable())?",
            command.join(" "),
            output.display()
        ));
    }
    let trace = Trace::from_path_with(output, ParseOptions { skip_unknown_frees: true })
        .map_err(|e| e.to_string())?;
    println!(
        "{}: {} operations, peak live {} bytes, {} streams ({})",
        output.display(),
        trace.len(),
        trace.peak_live,
        trace.streams.len(),
        status
    );
    if status.success() {
        Ok(())
    } else {
        Err(format!("`{}` failed: {status}", command.join(" ")))
    }
}

fn run_replay(
    paths: &[PathBuf],
    names: &[String],
    device: Option<DeviceChoice>,
    json: bool,
    passes: usize,
    lenient: bool,
) -> Result<(), String> {
    let names: Vec<String> = if names.is_empty() {
        allocators::names().into_iter().map(String::from).collect()
    } else {
        names.to_vec()
    };
    let makers = names.iter().map(|n| allocators::lookup(n)).collect::<Result<Vec<_>, _>>()?;
    let options = ParseOptions { skip_unknown_frees: lenient };
    let traces = paths.iter().map(|p| load(p, options)).collect::<Result<Vec<_>, _>>()?;
    let opened = device::open(device)?;
    if !json {
        println!("device: {}", opened.description);
    }

    let total: u64 =
        traces.iter().map(|t| t.len() as u64).sum::<u64>() * (passes as u64 + 1) * names.len() as u64;
    let bar = if json || !std::io::stderr().is_terminal() {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(total)
    };
    bar.set_style(
        ProgressStyle::with_template("{msg:30} [{bar:40}] {percent:>3}% {eta}")
            .map_err(|e| e.to_string())?
            .progress_chars("=> "),
    );
    let progress = |n: u64| bar.inc(n);

    let mut results = Vec::new();
    for trace in &traces {
        for (name, make) in names.iter().zip(&makers) {
            bar.set_message(format!("{} / {name}", trace.name));
            let target =
                make(opened.device.clone()).map_err(|e| format!("creating allocator {name}: {e}"))?;
            let replay_options = ReplayOptions { passes, progress: Some(&progress) };
            let result = replay(trace, name, &target, opened.device.as_ref(), &replay_options)
                .map_err(|e| format!("replaying {} through {name}: {e}", trace.name))?;
            results.push(result);
        }
    }
    bar.finish_and_clear();

    if json {
        let rows: Vec<JsonResult> = results
            .into_iter()
            .map(|result| JsonResult { device: opened.description.clone(), result })
            .collect();
        println!("{}", serde_json::to_string_pretty(&rows).map_err(|e| e.to_string())?);
    } else {
        print_table(&results);
        for trace in &traces {
            if trace.recorded_failures + trace.skipped_frees > 0 {
                println!(
                    "{}: {} `allocate failure` rows not replayed, {} frees of unknown pointers skipped",
                    trace.name, trace.recorded_failures, trace.skipped_frees
                );
            }
        }
        for r in results.iter().filter(|r| r.failures > 0) {
            println!(
                "{} on {}: first failure: {}",
                r.allocator,
                r.trace,
                r.first_failure.as_deref().unwrap_or("?")
            );
        }
    }
    Ok(())
}

/// Parses the trace at `path`; errors name the file.
fn load(path: &Path, options: ParseOptions) -> Result<Trace, String> {
    Trace::from_path_with(path, options).map_err(|e| match e {
        streamalloc::Error::Io(msg) => msg,
        other => format!("{}: {other}", path.display()),
    })
}

/// Bytes in binary units, 3 significant digits or so.
fn bytes(n: usize) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = n as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{value:.2} {}", UNITS[unit])
    }
}

/// Prints rows under a header, columns padded to their widest cell (first two left-aligned).
fn print_columns(header: &[&str], rows: &[Vec<String>]) {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.len());
        }
    }
    let line = |cells: Vec<&str>| {
        let text: Vec<String> = cells
            .iter()
            .zip(&widths)
            .enumerate()
            .map(|(i, (c, w))| if i < 2 { format!("{c:<w$}") } else { format!("{c:>w$}") })
            .collect();
        println!("{}", text.join("  ").trim_end());
    };
    line(header.to_vec());
    for row in rows {
        line(row.iter().map(String::as_str).collect());
    }
}

fn print_table(results: &[ReplayResult]) {
    let header = [
        "allocator",
        "trace",
        "ops",
        "peak live",
        "peak reserved",
        "footprint",
        "device calls",
        "ns/op",
        "failures",
    ];
    let rows: Vec<Vec<String>> = results
        .iter()
        .map(|r| {
            vec![
                r.allocator.clone(),
                r.trace.clone(),
                r.ops.to_string(),
                bytes(r.peak_live),
                bytes(r.reserved_peak),
                format!("{:.3}", r.footprint_ratio),
                r.device_calls.to_string(),
                format!("{:.1}", r.ns_per_op_warm),
                r.failures.to_string(),
            ]
        })
        .collect();
    print_columns(&header, &rows);
}

/// Reads a `replay --json` output.
fn read_results(path: &Path) -> Result<Vec<JsonResult>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    serde_json::from_str(&text)
        .map_err(|e| format!("{}: not a `streamalloc replay --json` output: {e}", path.display()))
}

/// `b / a`, or `-` when `a` is 0.
fn ratio(a: f64, b: f64) -> String {
    if a == 0.0 {
        "-".into()
    } else {
        format!("{:.3}", b / a)
    }
}

fn compare(a_path: &Path, b_path: &Path) -> Result<(), String> {
    let a = read_results(a_path)?;
    let b = read_results(b_path)?;
    println!("A: {} ({})", a_path.display(), a.first().map_or("empty", |r| r.device.as_str()));
    println!("B: {} ({})", b_path.display(), b.first().map_or("empty", |r| r.device.as_str()));
    let header = [
        "allocator",
        "trace",
        "footprint A",
        "footprint B",
        "B/A",
        "ns/op A",
        "ns/op B",
        "B/A",
        "reserved A",
        "reserved B",
        "B/A",
        "calls A",
        "calls B",
        "B/A",
    ];
    let mut rows = Vec::new();
    let mut unmatched = Vec::new();
    for x in &a {
        let (x, key) = (&x.result, (&x.result.allocator, &x.result.trace));
        let Some(y) = b.iter().map(|y| &y.result).find(|y| (&y.allocator, &y.trace) == key) else {
            unmatched.push(format!("only in A: {} on {}", x.allocator, x.trace));
            continue;
        };
        rows.push(vec![
            x.allocator.clone(),
            x.trace.clone(),
            format!("{:.3}", x.footprint_ratio),
            format!("{:.3}", y.footprint_ratio),
            ratio(x.footprint_ratio, y.footprint_ratio),
            format!("{:.1}", x.ns_per_op_warm),
            format!("{:.1}", y.ns_per_op_warm),
            ratio(x.ns_per_op_warm, y.ns_per_op_warm),
            bytes(x.reserved_peak),
            bytes(y.reserved_peak),
            ratio(x.reserved_peak as f64, y.reserved_peak as f64),
            x.device_calls.to_string(),
            y.device_calls.to_string(),
            ratio(x.device_calls as f64, y.device_calls as f64),
        ]);
    }
    for y in &b {
        let y = &y.result;
        if !a.iter().any(|x| x.result.allocator == y.allocator && x.result.trace == y.trace) {
            unmatched.push(format!("only in B: {} on {}", y.allocator, y.trace));
        }
    }
    print_columns(&header, &rows);
    for line in unmatched {
        println!("{line}");
    }
    Ok(())
}

fn info() {
    match device::open_cuda() {
        Ok(_) => device::describe_gpus().iter().for_each(|line| println!("{line}")),
        Err(why) => {
            println!("no GPU: {why}");
            println!("replays run on the {}", device::describe_simulator(&device::simulator_config()));
            println!(
                "the simulator has no backing memory: it models an address space, in-order streams, events, \
                 the driver's stream-ordered pools, graph capture, and checks that no memory is reused \
                 while work on another stream could still touch it"
            );
        }
    }
    println!("allocators: {}", allocators::names().join(", "));
    // What the C ABI (libstreamalloc.so) would build in this environment.
    match Config::from_env() {
        Ok(config) => println!("{ENV_VAR} in force: {config}"),
        Err(e) => println!("{ENV_VAR} is not valid: {e}"),
    }
}
