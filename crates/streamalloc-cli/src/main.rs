//! `streamalloc`: replays real allocation traces through streamalloc's allocators and
//! configurations, and compares and draws the results.
//!
//! ```text
//! streamalloc replay TRACE... [--conf CONF]... [--allocator PRESET]... [--device sim|cuda]
//!                    [--capacity SIZE] [--expect-failures] [--json] [--plot OUT.svg]
//!                    [--passes N] [--threads] [--lenient] [--time | --no-time]
//! streamalloc fit TRACE... --capacity SIZE [--conf CONF]... [--allocator PRESET]...
//! streamalloc compare A.json B.json | compare RESULTS.json... --base CONF [--with CONF]...
//! streamalloc plot A.json [B.json...] -o OUT.svg
//! streamalloc import SNAPSHOT.pickle -o TRACE.csv [--gpu N]
//! streamalloc record [-o TRACE.csv] -- COMMAND...
//! streamalloc info
//! ```
//!
//! Errors go to stderr as `error: ...` lines, with exit status 1 (2 for a command line clap
//! cannot parse); a replay whose allocations failed exits with status 1 too, unless
//! `--expect-failures`. Text from the user or a file that an error quotes is an excerpt
//! (`streamalloc_replay::trace::excerpt`: at most 120 bytes, control characters escaped), and
//! no control character of an error reaches the terminal. Output into a closed pipe ends the
//! command quietly.

mod device;
mod import;
mod output;
mod plot;

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};
use streamalloc::facade::{Config, DeviceKind, Facade, ENV_VAR};
use streamalloc_replay::compressed::{self, Compression};
use streamalloc_replay::replay::{check_start, replay, settle, ReplayOptions, ReplayResult, ReplayTarget};
use streamalloc_replay::trace::{
    excerpt, excerpt_within, ParseOptions, Trace, CUT_SHORT, EXCERPT, NOT_TEXT, PICKLE,
};

use crate::device::DeviceChoice;

/// Stream-ordered GPU memory allocators: trace replay, comparison and pictures.
#[derive(Parser)]
#[command(name = "streamalloc", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Replays traces (RMM logging CSV) through configurations and reports footprint and speed.
    ///
    /// Each (trace, configuration) pair gets a fresh allocator stack, built by the facade as
    /// libstreamalloc.so builds it, and starts from the same state: the device's default
    /// pool is trimmed first, and the replay is refused if memory is still in use. Pass 0
    /// samples device memory after every operation (footprint, and the series --plot
    /// draws); then --passes timed passes give the best ns/op. The configurations are the
    /// --allocator presets and --conf strings given, in the order given, else
    /// STREAMALLOC_CONF when set, else every preset (the variable's `trace` key does not
    /// apply). A trace that cannot be read is reported and the others replay; the exit status
    /// is 1 if any failed. With --json the output is one JSON array of result objects (the
    /// fields of `streamalloc_replay::replay::ReplayResult` plus `device`, `config`, the
    /// configuration replayed, and on the simulator `ns_per_op_note`), which `compare` and
    /// `plot` read. On the simulator, ns/op measure the library's CPU cost, not a GPU's.
    ///
    /// Stream rows (`record_stream`, `use`, `wait`; see traces/README.md) replay on every
    /// device: a record_stream is recorded on the allocation, a wait makes one stream wait for
    /// another. On the simulator a trace's time is replayed too (--time, the default for a
    /// trace with `use` or `wait` rows): the clock moves to each row's Time, `use` rows run as
    /// kernels on their streams, and the ordering checker counts early reuses (`violations`).
    /// The output says, for each trace with stream rows, whether its time was replayed.
    ///
    /// --capacity SIZE (or a configuration's `sim_capacity`) sizes the simulator: the output
    /// then says per configuration whether the trace fits, and if not, the first operation
    /// whose allocation failed and by how many bytes at least, else the headroom.
    ///
    /// Exit status: 1 when a trace cannot be read, a replay fails, or an allocation of a
    /// replay fails (unless --expect-failures), after the output; else 0.
    Replay {
        /// Trace files (CSV: Thread,Time,Action,Pointer,Size,Stream; gzip or xz compressed
        /// ones are read as such).
        #[arg(required = true)]
        traces: Vec<PathBuf>,
        /// A configuration, as STREAMALLOC_CONF takes it (e.g.
        /// 'strategy=stream_safe,backing=stitched,growth=16MiB'); repeatable, each row is
        /// labelled by its string, rows in the order --conf and --allocator are given. Its
        /// `device` key does not apply (--device chooses the device), nor `sim_virtual_memory`;
        /// `sim_capacity` sizes the simulator (see --capacity).
        #[arg(long = "conf", short = 'c', value_name = "CONF")]
        confs: Vec<String>,
        // The help lists the library's presets (`Config::presets`), the one registry.
        #[arg(long = "allocator", short = 'a', value_name = "PRESET", help = presets_help())]
        presets: Vec<String>,
        /// Device to replay on (default: cuda when a GPU is found, else sim; sim with
        /// --capacity or a configuration's `sim_capacity`).
        #[arg(long, value_enum)]
        device: Option<DeviceChoice>,
        /// Bytes of the simulator's device (e.g. 80GiB; at least 64MiB): does the trace fit
        /// on a card of this size? Replays on the simulator; a configuration's
        /// `sim_capacity` must agree.
        #[arg(long, value_name = "SIZE", value_parser = capacity_arg)]
        capacity: Option<usize>,
        /// Exit with status 0 even when allocations of the replays failed (by default such a
        /// replay makes the exit status 1).
        #[arg(long)]
        expect_failures: bool,
        /// Print a JSON array of results instead of a table.
        #[arg(long)]
        json: bool,
        /// Draw bytes live and reserved over each trace, per configuration, into this SVG file.
        #[arg(long, value_name = "OUT.svg")]
        plot: Option<PathBuf>,
        /// Timed passes after the measuring pass.
        #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
        passes: u32,
        /// Replay each recorded thread (the Thread column) on a thread of its own; a free of
        /// memory allocated on another thread waits for that allocation.
        #[arg(long)]
        threads: bool,
        /// Skip (and count) frees, record_stream and use rows of pointers the trace never
        /// allocated (or already freed), instead of failing.
        #[arg(long)]
        lenient: bool,
        /// Replay the traces' time on the simulator: the clock moves to each row's Time and
        /// `use` rows run as kernels that the ordering checker sees (default: for traces with
        /// `use` or `wait` rows, on the simulator). A GPU runs no recorded work: refused there.
        #[arg(long, conflicts_with = "no_time")]
        time: bool,
        /// Run the rows back to back, `use` rows skipped (record_stream and wait rows still
        /// replay).
        #[arg(long)]
        no_time: bool,
    },
    /// Does a trace fit on a device of SIZE, and under which configuration? Replays each
    /// trace once on a simulator of that size through every preset (or the --allocator and
    /// --conf given), and names the configuration that fits with the most headroom, or, when
    /// none does, the one that got furthest.
    /// Exit status 1 when a trace fits under no configuration.
    Fit {
        /// Trace files (CSV: Thread,Time,Action,Pointer,Size,Stream; gzip or xz ones too).
        #[arg(required = true)]
        traces: Vec<PathBuf>,
        /// Bytes of the simulated device (e.g. 80GiB; at least 64MiB).
        #[arg(long, value_name = "SIZE", value_parser = capacity_arg)]
        capacity: usize,
        /// A configuration to try, as STREAMALLOC_CONF takes it (repeatable).
        #[arg(long = "conf", short = 'c', value_name = "CONF")]
        confs: Vec<String>,
        #[arg(long = "allocator", short = 'a', value_name = "PRESET", help = presets_help())]
        presets: Vec<String>,
        /// Skip (and count) frees, record_stream and use rows of pointers the trace never
        /// allocated (or already freed), instead of failing.
        #[arg(long)]
        lenient: bool,
    },
    /// Compares saved `replay --json` outputs, row by row, with ratios to a base.
    ///
    /// With --base CONF, each result of a trace (in any of the files) is compared with the
    /// trace's result of configuration CONF (the first found), or only those of the --with
    /// configurations. Without it, two files: each result of B with A's result of the same
    /// configuration and trace. Timings show the median of the timed passes and their
    /// [min, max]; a ratio of medians within the spread of either side is marked `~`.
    Compare {
        /// `replay --json` outputs (without --base: two, A the baseline and B).
        #[arg(required = true)]
        results: Vec<PathBuf>,
        /// The configuration (its label in the results) the others are compared with.
        #[arg(long, value_name = "CONF")]
        base: Option<String>,
        /// A configuration compared with the base (repeatable; default: all the others).
        #[arg(long = "with", value_name = "CONF", requires = "base")]
        with: Vec<String>,
    },
    /// Draws saved `replay --json` outputs side by side (one column per file, one row per
    /// trace, the columns of a row on the same scale) into an SVG file.
    Plot {
        /// `replay --json` outputs.
        #[arg(required = true)]
        results: Vec<PathBuf>,
        /// The SVG file to write.
        #[arg(long, short, value_name = "OUT.svg")]
        output: PathBuf,
    },
    /// Converts a PyTorch memory snapshot (`torch.cuda.memory._dump_snapshot`, after
    /// `_record_memory_history`) into a trace `replay` takes, streams kept.
    Import {
        /// The snapshot (a pickle).
        snapshot: PathBuf,
        /// The trace to write (RMM logging CSV; compressed when its name ends in `.gz` or
        /// `.xz`).
        #[arg(long, short, value_name = "TRACE.csv")]
        output: PathBuf,
        /// The snapshot's device to convert (default: the only one with allocations).
        #[arg(long, value_name = "N")]
        gpu: Option<usize>,
    },
    /// Describes the device (the GPU when CUDA finds one, else the simulator), the presets,
    /// and what STREAMALLOC_CONF does here; exits with status 1 when it is not valid.
    Info,
    /// Runs a program whose GPU allocations go through libstreamalloc.so (e.g. PyTorch after
    /// `streamalloc.torch.enable()`, CuPy after `streamalloc.cupy.enable()`, or a C program
    /// linked to it) with the Trace layer on, and summarizes the trace it wrote. The trace
    /// is written whatever configuration the program passes to the library.
    ///
    /// The trace is written into a new hidden file beside the output, which replaces the
    /// output only when the program wrote a trace: the output is left as it was when nothing
    /// was recorded. A program killed by a signal is said so, and the rows it wrote are kept
    /// (a last row cut short is skipped).
    Record {
        /// Where to write the trace (RMM logging CSV): a new file or a regular file, which is
        /// replaced (its permissions kept). A symbolic link is followed: the file it points to
        /// is replaced and the link kept. Anything else (a directory, a device, a FIFO, a link
        /// to nothing) is refused before the program runs. A name ending in `.gz` or `.xz`
        /// is written compressed.
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
    /// The whole configuration replayed, as `Config::parse` reads it: its `device` (and on
    /// the simulator its `sim_*` keys) those of the device replayed on.
    #[serde(default)]
    config: String,
    /// On the simulator, [`SIM_NS_PER_OP`]: what its ns/op measure.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    ns_per_op_note: Option<String>,
    #[serde(flatten)]
    result: ReplayResult,
}

/// What the ns/op of a replay on the simulator are, said under the table and in each JSON
/// row: the simulator charges no time of a GPU's.
const SIM_NS_PER_OP: &str = "ns/op on the simulator measure the library's CPU cost, not a GPU's";

/// `hypotf`, which plotters' dashed lines call (`f32::hypot`): glibc 2.35 gave it a new symbol
/// version, which alone would make this binary, and the wheel that bundles it, need glibc 2.35;
/// defined here, the binary keeps to the glibc its library needs. Computed in `f64`, where the
/// squares of `f32` arguments cannot overflow or underflow: accurate to `f32`'s precision.
#[allow(unsafe_code)] // `no_mangle`: the one symbol this program defines for C; no unsafe code
#[no_mangle]
pub extern "C" fn hypotf(x: f32, y: f32) -> f32 {
    let (x, y) = (f64::from(x), f64::from(y));
    (x * x + y * y).sqrt() as f32
}

fn main() -> ExitCode {
    // Parsed in two steps: the matches also say where each value of `replay` was typed.
    let matches = Cli::command().get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    let outcome = match cli.command {
        Command::Replay {
            traces,
            confs,
            presets,
            device,
            capacity,
            expect_failures,
            json,
            plot,
            passes,
            threads,
            lenient,
            time,
            no_time,
        } => {
            let time = (time || no_time).then_some(time);
            let options = RunOptions {
                device,
                capacity,
                expect_failures,
                json,
                plot,
                passes: passes as usize,
                threads,
                lenient,
                time,
            };
            let chosen = in_typed_order(matches.subcommand_matches("replay"), presets, confs);
            configurations(&chosen).and_then(|configs| run_replay(&traces, &configs, &options))
        }
        Command::Fit { traces, capacity, confs, presets, lenient } => {
            let chosen = in_typed_order(matches.subcommand_matches("fit"), presets, confs);
            let chosen = if chosen.is_empty() {
                Config::presets().iter().map(|p| Chosen::Preset(p.name.to_owned())).collect()
            } else {
                chosen
            };
            configurations(&chosen).and_then(|configs| fit(&traces, &configs, capacity, lenient))
        }
        Command::Compare { results, base, with } => compare(&results, base.as_deref(), &with),
        Command::Plot { results, output } => plot_saved(&results, &output),
        Command::Import { snapshot, output, gpu } => import_snapshot(&snapshot, &output, gpu),
        Command::Info => info(),
        Command::Record { output, command } => record(&output, &command),
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            warn(&format!("error: {message}"));
            ExitCode::FAILURE
        }
    }
}

/// Writes `text` to stdout. A closed stdout (`... | head -1`) is no error: the rest of the
/// output is not wanted.
fn emit(text: &str) -> Result<(), String> {
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(format!("writing the output: {e}")),
        _ => Ok(()),
    }
}

/// Writes `text` to stderr as one line, its control characters escaped, ignoring a closed
/// stderr.
fn warn(text: &str) {
    let _ = writeln!(std::io::stderr(), "{}", excerpt_within(text, usize::MAX));
}

/// The most bytes shown of an error message that may quote what was given whole: the
/// library's configuration errors quote the value given, JSON errors the string found.
const QUOTING_MESSAGE: usize = 4 * EXCERPT;

/// The message of `e`, one that may quote what was given whole, bounded and escaped (see
/// [`QUOTING_MESSAGE`]).
fn bounded(e: impl std::fmt::Display) -> String {
    excerpt_within(&e.to_string(), QUOTING_MESSAGE)
}

/// The help of `replay --allocator`: the names of the library's presets.
fn presets_help() -> String {
    let names: Vec<&str> = Config::presets().iter().map(|p| p.name).collect();
    format!("A preset configuration by name (repeatable): {}", names.join(", "))
}

/// A configuration named on `replay`'s command line.
enum Chosen {
    /// `--allocator NAME`: a preset.
    Preset(String),
    /// `--conf CONF`: a configuration string.
    Conf(String),
}

/// The `--allocator` and `--conf` values of `replay`, in the order they were typed (as
/// `matches`, `replay`'s, place them; values it does not place come last, presets first).
fn in_typed_order(
    matches: Option<&clap::ArgMatches>,
    presets: Vec<String>,
    confs: Vec<String>,
) -> Vec<Chosen> {
    let at = |id: &str| {
        let typed = matches.and_then(|m| m.indices_of(id)).into_iter().flatten();
        typed.chain(std::iter::repeat(usize::MAX))
    };
    let mut chosen: Vec<(usize, Chosen)> = at("presets")
        .zip(presets.into_iter().map(Chosen::Preset))
        .chain(at("confs").zip(confs.into_iter().map(Chosen::Conf)))
        .collect();
    chosen.sort_by_key(|(index, _)| *index);
    chosen.into_iter().map(|(_, c)| c).collect()
}

/// The configurations to replay, labelled: those `chosen`, in order; with none,
/// `STREAMALLOC_CONF` when set, else every preset.
fn configurations(chosen: &[Chosen]) -> Result<Vec<(String, Config)>, String> {
    let mut configs = Vec::new();
    for choice in chosen {
        configs.push(match choice {
            Chosen::Preset(name) => {
                (name.clone(), Config::preset(name).map_err(|e| format!("--allocator: {}", bounded(e)))?)
            }
            Chosen::Conf(conf) => {
                let config =
                    Config::parse(conf).map_err(|e| format!("--conf '{}': {}", excerpt(conf), bounded(e)))?;
                (conf.trim().to_owned(), config)
            }
        });
    }
    if configs.is_empty() {
        match Config::env_text().map_err(bounded)? {
            Some(text) => {
                let config = Config::parse(&text).map_err(|e| format!("{ENV_VAR}: {}", bounded(e)))?;
                // A trace the variable asks for is the program's, not the replay's to overwrite.
                configs.push((text, Config { trace: None, ..config }));
            }
            None => configs.extend(Config::presets().into_iter().map(|p| (p.name.to_owned(), p.config))),
        }
    }
    Ok(configs)
}

/// Runs `command` with `trace=` a new file beside `output` added to the configuration in
/// force, then moves that file to `output` when the program wrote a trace, and reads it back.
/// The library keeps that trace key whatever configuration the program passes.
fn record(output: &Path, command: &[String]) -> Result<(), String> {
    let mut config = Config::from_env().map_err(bounded)?;
    let target = output::Target::check(output, "the trace")?;
    let pending = output::Pending::create(&target, output, "the trace")?;
    // The path travels in STREAMALLOC_CONF, whose keys are separated by commas.
    if pending.path.to_str().is_none_or(|p| p.contains(',')) {
        return Err(format!(
            "cannot write the trace to {}: its directory must be a UTF-8 path without commas \
             (STREAMALLOC_CONF takes it)",
            output.display()
        ));
    }
    config.trace = Some(pending.path.clone());
    let status = std::process::Command::new(&command[0])
        .args(&command[1..])
        .env(ENV_VAR, config.to_string())
        .status()
        .map_err(|e| format!("cannot run `{}`: {e}", excerpt(&command[0])))?;
    let program = excerpt(&command.join(" "));
    let ended = ending(status);
    // The library creates its trace file at the program's first allocation, over the empty
    // one made here, and always writes the header first.
    if std::fs::metadata(&pending.path).map_or(0, |m| m.len()) == 0 {
        let kept =
            if target.existed { format!("; {} is left as it was", output.display()) } else { String::new() };
        return Err(if status.success() {
            format!(
                "`{program}` wrote no trace to {}: it made no GPU allocation through libstreamalloc.so \
                 (it did not load it, e.g. no streamalloc.torch.enable() before the first CUDA \
                 allocation, or allocated nothing){kept}",
                output.display()
            )
        } else if killed(status) {
            format!(
                "`{program}`: the program was {ended} and wrote no trace to {} (rows the library had not \
                 written out yet are lost){kept}",
                output.display()
            )
        } else {
            format!("`{program}` failed ({ended}) and wrote no trace to {}{kept}", output.display())
        });
    }
    let compression = Compression::of_name(output);
    if compression == Compression::None {
        pending.replace(&target)?;
    } else {
        let packed = output::Pending::create(&target, output, "the trace")?;
        compressed::compress_file(&pending.path, &packed.path, compression)
            .map_err(|e| format!("compressing the trace into {}: {e}", output.display()))?;
        packed.replace(&target)?;
    }
    let trace = load(&target.path, ParseOptions::lenient())?;
    let cut = if trace.skipped_truncated_rows > 0 { "; its last row, cut short, skipped" } else { "" };
    emit(&format!(
        "{}: {} operations, peak live {}, {} streams ({ended}{cut})\n",
        output.display(),
        trace.len(),
        bytes(trace.peak_live),
        trace.streams.len(),
    ))?;
    if status.success() {
        Ok(())
    } else if killed(status) {
        Err(format!("`{program}`: the program was {ended}; the trace it wrote so far is kept"))
    } else {
        Err(format!("`{program}` failed ({ended}); the trace it wrote so far is kept"))
    }
}

/// Whether the program was killed by a signal.
fn killed(status: std::process::ExitStatus) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        status.signal().is_some()
    }
    #[cfg(not(unix))]
    {
        let _ = status;
        false
    }
}

/// How the program ended: `exit status: N`, or `killed by signal N (NAME)`.
fn ending(status: std::process::ExitStatus) -> String {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(n) = status.signal() {
            let mut notes: Vec<String> =
                signal_name(n).map(|name| format!("SIG{name}")).into_iter().collect();
            if status.core_dumped() {
                notes.push("core dumped".into());
            }
            return if notes.is_empty() {
                format!("killed by signal {n}")
            } else {
                format!("killed by signal {n} ({})", notes.join(", "))
            };
        }
    }
    status.to_string()
}

/// The name of signal `n` without its `SIG` (Linux's numbering).
fn signal_name(n: i32) -> Option<&'static str> {
    const NAMES: &str =
        "HUP INT QUIT ILL TRAP ABRT BUS FPE KILL USR1 SEGV USR2 PIPE ALRM TERM STKFLT CHLD CONT \
         STOP TSTP TTIN TTOU URG XCPU XFSZ VTALRM PROF WINCH IO PWR SYS";
    let index = usize::try_from(n).ok()?.checked_sub(1)?;
    cfg!(target_os = "linux").then(|| NAMES.split_whitespace().nth(index)).flatten()
}

/// How `replay` runs, from its flags.
struct RunOptions {
    device: Option<DeviceChoice>,
    /// `--capacity`: bytes of the simulator's device.
    capacity: Option<usize>,
    expect_failures: bool,
    json: bool,
    plot: Option<PathBuf>,
    passes: usize,
    threads: bool,
    lenient: bool,
    /// `--time` (`Some(true)`), `--no-time` (`Some(false)`), or neither.
    time: Option<bool>,
}

/// Whether the time of `trace` is replayed on `opened`, and if not, why not (for a trace
/// whose stream rows make it worth saying, or when `--time`/`--no-time` was given). Asked
/// for (`--time`) on a trace without times, it is: the replay refuses it.
fn time_choice(trace: &Trace, asked: Option<bool>, opened: &device::Opened) -> Result<(), String> {
    match (asked, trace.untimed_line) {
        (Some(false), _) => Err("--no-time".into()),
        _ if opened.simulator.is_none() => Err("on a GPU nothing runs the recorded work".into()),
        (Some(true), _) => Ok(()),
        (None, Some(line)) => Err(format!("the Time of line {line} is not an integer of microseconds")),
        (None, None) if !trace.has_stream_work() => Err("no use or wait rows".into()),
        (None, None) => Ok(()),
    }
}

fn run_replay(paths: &[PathBuf], configs: &[(String, Config)], o: &RunOptions) -> Result<(), String> {
    let parse = if o.lenient { ParseOptions::lenient() } else { ParseOptions::default() };
    let mut traces = Vec::new();
    let mut bad_traces = 0;
    for path in paths {
        match load(path, parse) {
            Ok(trace) => traces.push(trace),
            Err(message) => {
                bad_traces += 1;
                warn(&format!("error: {message}"));
            }
        }
    }
    if let Some(path) = &o.plot {
        // Refused before the replays, not after (a FIFO would block until a reader came).
        output::Target::check(path, "the plot")?;
    }
    let capacity = sim_capacity(o.capacity, configs)?;
    let opened = match (capacity, o.device) {
        (Some(_), Some(DeviceChoice::Cuda)) => {
            return Err("--capacity (or a configuration's sim_capacity) sizes the simulator: it does not \
                        apply with --device cuda"
                .into())
        }
        (Some(bytes), _) => device::open_simulator(bytes),
        (None, choice) => device::open(choice)?,
    };
    if o.time == Some(true) && opened.simulator.is_none() {
        return Err(format!(
            "--time replays a trace's time on the simulator only (--device sim): {} runs none of the \
             recorded work",
            opened.description
        ));
    }
    let idle = settle(opened.device.as_ref()).map_err(|e| format!("measuring the idle device: {e}"))?;
    if !o.json {
        emit(&format!("device: {}\n", opened.description))?;
    }

    let total: u64 =
        traces.iter().map(|t| t.len() as u64).sum::<u64>() * (o.passes as u64 + 1) * configs.len() as u64;
    let bar = if o.json || !std::io::stderr().is_terminal() {
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

    let mut rows = Vec::new();
    let mut failed_runs = 0;
    for trace in &traces {
        for (label, config) in configs {
            bar.set_message(format!("{} / {label}", trace.name));
            let time = time_choice(trace, o.time, &opened).ok().and(opened.simulator.as_deref());
            let options = ReplayOptions {
                passes: o.passes,
                progress: Some(&progress),
                threads: o.threads,
                time,
                ..Default::default()
            };
            match replay_one(trace, label, config, &opened, idle, &options) {
                Ok(result) => rows.push(JsonResult {
                    device: opened.description.clone(),
                    config: replayed(config, &opened).to_string(),
                    ns_per_op_note: opened.sim.is_some().then(|| SIM_NS_PER_OP.to_owned()),
                    result,
                }),
                Err(message) => {
                    failed_runs += 1;
                    bar.suspend(|| {
                        warn(&format!(
                            "error: replaying {} through {}: {message}",
                            trace.name,
                            excerpt(label)
                        ))
                    });
                }
            }
        }
    }
    bar.finish_and_clear();

    if o.json {
        emit(&format!("{}\n", serde_json::to_string_pretty(&rows).map_err(|e| e.to_string())?))?;
    } else {
        let results: Vec<&ReplayResult> = rows.iter().map(|r| &r.result).collect();
        let mut text = table(&results);
        if opened.sim.is_some() && !results.is_empty() {
            text.push_str(&format!("{SIM_NS_PER_OP}\n"));
        }
        for trace in &traces {
            let skipped = trace.skipped_frees + trace.skipped_stream_rows + trace.skipped_truncated_rows;
            if trace.recorded_failures + skipped > 0 {
                let cut =
                    if trace.skipped_truncated_rows > 0 { ", its last row, cut short, skipped" } else { "" };
                let stream_rows = match trace.skipped_stream_rows {
                    0 => String::new(),
                    n => format!(", {n} record_stream and use rows of unknown pointers skipped"),
                };
                text.push_str(&format!(
                    "{}: {} `allocate failure` rows not replayed, {} frees of unknown pointers \
                     skipped{stream_rows}{cut}\n",
                    trace.name, trace.recorded_failures, trace.skipped_frees
                ));
            }
            // Said of traces whose replays ran (a replay refused for want of times says why).
            let ran = results.iter().any(|r| r.trace == trace.name);
            if (trace.has_stream_rows() || o.time.is_some()) && ran {
                text.push_str(&time_note(trace, time_choice(trace, o.time, &opened)));
            }
        }
        for r in results.iter().filter(|r| r.violations > 0) {
            text.push_str(&format!(
                "{} on {}: {} ordering violations (memory handed to a stream while another stream's work \
                 could still use it)\n",
                r.allocator, r.trace, r.violations
            ));
        }
        for r in results.iter().filter(|r| r.failures > 0) {
            text.push_str(&format!(
                "{} on {}: first failure: {}\n",
                r.allocator,
                r.trace,
                r.first_failure.as_deref().unwrap_or("?")
            ));
        }
        if let Some(capacity) = capacity {
            for r in &results {
                text.push_str(&format!("{} on {}: {}\n", r.allocator, r.trace, fit_verdict(r, capacity)));
            }
        }
        emit(&text)?;
    }
    if let Some(path) = &o.plot {
        let panels: Vec<plot::Panel<'_>> = traces
            .iter()
            .map(|t| plot::Panel {
                title: format!("{} on the {}", t.name, short_device(&opened.description)),
                results: rows.iter().map(|r| &r.result).filter(|r| r.trace == t.name).collect(),
            })
            .collect();
        plot::draw(path, &panels, 1)?;
    }
    let mut failures = Vec::new();
    if bad_traces > 0 {
        failures.push(format!("{bad_traces} of {} traces failed to load", paths.len()));
    }
    if failed_runs > 0 {
        failures.push(format!("{failed_runs} of {} replays failed", traces.len() * configs.len()));
    }
    let failing = rows.iter().filter(|r| r.result.failures > 0).count();
    if failing > 0 && !o.expect_failures {
        failures.push(format!(
            "{failing} of {} replays had failed allocations (--expect-failures makes the exit status 0 \
             all the same)",
            traces.len() * configs.len()
        ));
    }
    if failures.is_empty() {
        Ok(())
    } else {
        Err(failures.join("; "))
    }
}

/// A `--capacity` (or `fit`) argument: a size as the `sim_capacity` key takes it.
fn capacity_arg(text: &str) -> Result<usize, String> {
    Config::parse(&format!("sim_capacity={text}")).map(|c| c.sim_capacity).map_err(bounded)
}

/// The simulator's capacity for `configs`: `asked` (`--capacity`), else the `sim_capacity`
/// the configurations set (all the same one), else `None` (the default simulator). A
/// configuration whose `sim_capacity` is not the default is refused when it differs: the
/// configurations of one replay share one simulator.
fn sim_capacity(asked: Option<usize>, configs: &[(String, Config)]) -> Result<Option<usize>, String> {
    let default = Config::default().sim_capacity;
    let set: Vec<(&str, usize)> = configs
        .iter()
        .filter(|(_, c)| c.sim_capacity != default)
        .map(|(label, c)| (label.as_str(), c.sim_capacity))
        .collect();
    let capacity = asked.or(set.first().map(|(_, bytes)| *bytes));
    if let Some(capacity) = capacity {
        if let Some((label, other)) = set.iter().find(|(_, bytes)| *bytes != capacity) {
            let source = if asked.is_some() { "--capacity" } else { "another configuration's sim_capacity" };
            return Err(format!(
                "'{}': sim_capacity={other} differs from {source} ({capacity}): the configurations of one \
                 replay share one simulator; give one size with --capacity",
                excerpt(label)
            ));
        }
    }
    Ok(capacity)
}

/// Whether the replay `r` fit on a device of `capacity` bytes: the headroom, or the first
/// operation that failed and by how much.
fn fit_verdict(r: &ReplayResult, capacity: usize) -> String {
    let size = bytes(capacity);
    match (r.failures, r.first_failure_op) {
        (0, _) => format!(
            "fits in {size}, headroom {} (peak device use {})",
            bytes(capacity.saturating_sub(r.peak_device_used)),
            bytes(r.peak_device_used)
        ),
        (n, op) => {
            let op = op.map_or_else(|| "an operation".to_owned(), |op| format!("operation {op}"));
            let short = match r.first_failure_short {
                None => String::new(),
                Some(0) => {
                    ", though the device had the bytes free (the allocator's limits or fragmentation)".into()
                }
                Some(s) => format!(", at least {} short", bytes(s)),
            };
            format!("does not fit in {size}: {op} failed first{short} ({n} failed allocations)")
        }
    }
}

/// `fit`: replays each trace once through each configuration on a simulator of `capacity`
/// bytes and names, per trace, the configuration that fits with the most headroom.
fn fit(
    paths: &[PathBuf],
    configs: &[(String, Config)],
    capacity: usize,
    lenient: bool,
) -> Result<(), String> {
    sim_capacity(Some(capacity), configs)?;
    let parse = if lenient { ParseOptions::lenient() } else { ParseOptions::default() };
    let opened = device::open_simulator(capacity);
    let idle = settle(opened.device.as_ref()).map_err(|e| format!("measuring the idle device: {e}"))?;
    let mut text = format!("device: {}\n", opened.description);
    let mut unfit = Vec::new();
    for path in paths {
        let trace = load(path, parse)?;
        let mut rows = Vec::new();
        let mut best: Option<(usize, &str)> = None;
        let mut closest: Option<(usize, &str)> = None;
        for (label, config) in configs {
            let time = time_choice(&trace, None, &opened).ok().and(opened.simulator.as_deref());
            let options = ReplayOptions { passes: 1, time, ..Default::default() };
            let verdict = match replay_one(&trace, label, config, &opened, idle, &options) {
                Ok(r) => {
                    if r.failures == 0 {
                        let headroom = capacity.saturating_sub(r.peak_device_used);
                        if best.is_none_or(|(h, _)| headroom > h) {
                            best = Some((headroom, label));
                        }
                    } else {
                        // The one whose first failure came latest in the trace.
                        let op = r.first_failure_op.unwrap_or(0);
                        if closest.is_none_or(|(o, _)| op > o) {
                            closest = Some((op, label));
                        }
                    }
                    fit_verdict(&r, capacity)
                }
                Err(message) => format!("replay failed: {message}"),
            };
            rows.push(vec![label.clone(), verdict]);
        }
        text.push_str(&columns(&["configuration", &trace.name], &rows));
        let size = bytes(capacity);
        match (best, closest) {
            (Some((headroom, label)), _) => text.push_str(&format!(
                "{} fits in {size}; most headroom: {} ({})\n\n",
                trace.name,
                excerpt(label),
                bytes(headroom)
            )),
            (None, closest) => {
                let hint = closest.map_or_else(String::new, |(op, label)| {
                    format!("; furthest: {} (its first failure at operation {op})", excerpt(label))
                });
                text.push_str(&format!(
                    "{} fits in {size} under none of the {} configurations{hint}\n\n",
                    trace.name,
                    configs.len()
                ));
                unfit.push(trace.name.clone());
            }
        }
    }
    emit(&text)?;
    if unfit.is_empty() {
        Ok(())
    } else {
        Err(format!("{} fits in {} under no configuration tried", unfit.join(", "), bytes(capacity)))
    }
}

/// The line under the table that says whether the time of `trace` was replayed (`choice`,
/// from [`time_choice`]).
fn time_note(trace: &Trace, choice: Result<(), String>) -> String {
    let rows =
        format!("{} use, {} wait, {} record_stream rows", trace.uses, trace.waits, trace.record_streams);
    match choice {
        Ok(()) => format!(
            "{}: time replayed on the simulator's clock ({rows}; the ordering checker counts early reuses)\n",
            trace.name
        ),
        Err(why) => format!(
            "{}: time not replayed ({why}): rows back to back ({rows}; use rows skipped)\n",
            trace.name
        ),
    }
}

/// `config` as replayed on `opened`: `--device` chose the device, so its `device` key is
/// that device's kind, and on the simulator its `sim_*` keys are the simulator's settings
/// (elsewhere they do not apply: the defaults).
fn replayed(config: &Config, opened: &device::Opened) -> Config {
    let defaults = Config::default();
    match &opened.sim {
        Some(sim) => Config {
            device: DeviceKind::Sim,
            sim_capacity: sim.capacity,
            sim_virtual_memory: sim.virtual_memory,
            ..config.clone()
        },
        None => Config {
            device: DeviceKind::Cuda,
            sim_capacity: defaults.sim_capacity,
            sim_virtual_memory: defaults.sim_virtual_memory,
            ..config.clone()
        },
    }
}

/// Replays `trace` through a fresh stack of `config` on the opened device, from the idle
/// state; the stack is dropped after it (what a default pool keeps, the next start trims).
fn replay_one(
    trace: &Trace,
    label: &str,
    config: &Config,
    opened: &device::Opened,
    idle: usize,
    options: &ReplayOptions<'_>,
) -> Result<ReplayResult, String> {
    let device = opened.device.as_ref();
    check_start(device, idle, opened.start_slack, &format!("replaying {} through {label}", trace.name))
        .map_err(|e| e.to_string())?;
    let stack =
        Facade::build_stack(config, opened.device.clone()).map_err(|e| format!("building the stack: {e}"))?;
    let result = replay(trace, label, &ReplayTarget::Streams(stack.allocator.clone()), device, options)
        .map_err(|e| e.to_string())?;
    // A trace the configuration asks for that could not be written fails the replay.
    if let (Some(traced), Some(path)) = (&stack.trace, &config.trace) {
        traced.flush().map_err(|e| format!("writing the trace {}: {e}", path.display()))?;
    }
    Ok(result)
}

/// The first words of a device description, for a title.
fn short_device(description: &str) -> &str {
    description.split(['(', ';']).next().unwrap_or(description).trim()
}

/// Parses the trace at `path`; errors name the file, one for a last row cut short says that
/// `--lenient` skips it, and one for a file that is not text (a pickle, most likely a PyTorch
/// memory snapshot) says how `import` converts it, quoting none of its bytes.
fn load(path: &Path, options: ParseOptions) -> Result<Trace, String> {
    let import = || format!("convert it with `streamalloc import {} -o TRACE.csv`", shell_word(path));
    Trace::from_path_with(path, options).map_err(|e| match e {
        streamalloc::Error::Io(msg) => msg,
        streamalloc::Error::Trace { line: 1, ref reason, .. } if reason.starts_with(PICKLE) => {
            format!("{}: {PICKLE}: {}", path.display(), import())
        }
        streamalloc::Error::Trace { line: 1, ref reason, .. } if reason.starts_with(NOT_TEXT) => {
            format!(
                "{}: {reason} (RMM's logging CSV); if it is a PyTorch memory snapshot (a pickle), {}",
                path.display(),
                import()
            )
        }
        streamalloc::Error::Trace { ref reason, .. } if reason.starts_with(CUT_SHORT) => {
            format!("{}: {e} (--lenient skips it)", path.display())
        }
        other => format!("{}: {other}", path.display()),
    })
}

/// `path` as one word of a shell command: as it is when it holds only characters no shell
/// treats specially, else in single quotes.
fn shell_word(path: &Path) -> String {
    let text = path.display().to_string();
    let plain = |c: char| c.is_ascii_alphanumeric() || "/._-+,:@%=".contains(c);
    if !text.is_empty() && text.chars().all(plain) {
        text
    } else {
        format!("'{}'", text.replace('\'', "'\\''"))
    }
}

/// Bytes in binary units, 3 significant digits or so: the one formatting of byte counts in
/// the command's text (the tables of `replay` and `compare`, `record`'s summary).
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

/// Rows under a header, columns padded to their widest cell (first two left-aligned).
fn columns(header: &[&str], rows: &[Vec<String>]) -> String {
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
        format!("{}\n", text.join("  ").trim_end())
    };
    let mut text = line(header.to_vec());
    for row in rows {
        text.push_str(&line(row.iter().map(String::as_str).collect()));
    }
    text
}

fn table(results: &[&ReplayResult]) -> String {
    let header = [
        "configuration",
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
    columns(&header, &rows)
}

/// Reads a `replay --json` output.
fn read_results(path: &Path) -> Result<Vec<JsonResult>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    serde_json::from_str(&text)
        .map_err(|e| format!("{}: not a `streamalloc replay --json` output: {}", path.display(), bounded(e)))
}

/// `b / a`, or `-` when `a` is 0.
fn ratio(a: f64, b: f64) -> String {
    if a == 0.0 {
        "-".into()
    } else {
        format!("{:.3}", b / a)
    }
}

/// The timed passes of `r` in ns/op: median, min and max (the best pass alone for results
/// saved before every pass was).
fn pass_spread(r: &ReplayResult) -> (f64, f64, f64) {
    let mut passes =
        if r.ns_per_op_passes.is_empty() { vec![r.ns_per_op_warm] } else { r.ns_per_op_passes.clone() };
    passes.sort_by(f64::total_cmp);
    let n = passes.len();
    let median = if n % 2 == 1 { passes[n / 2] } else { (passes[n / 2 - 1] + passes[n / 2]) / 2.0 };
    (median, passes[0], passes[n - 1])
}

/// `(max - min) / median` of a spread: 0 for one pass.
fn relative_spread((median, min, max): (f64, f64, f64)) -> f64 {
    if median > 0.0 {
        (max - min) / median
    } else {
        0.0
    }
}

/// Compares saved results (see `Command::Compare`).
fn compare(paths: &[PathBuf], base: Option<&str>, with: &[String]) -> Result<(), String> {
    let files = paths.iter().map(|p| read_results(p)).collect::<Result<Vec<_>, _>>()?;
    let mut text = String::new();
    for (path, rows) in paths.iter().zip(&files) {
        text.push_str(&format!(
            "{}: {} results ({})\n",
            path.display(),
            rows.len(),
            rows.first().map_or("empty", |r| r.device.as_str())
        ));
    }
    // (result, the base it is compared with).
    let mut pairs: Vec<(&ReplayResult, &ReplayResult)> = Vec::new();
    let mut unmatched = Vec::new();
    match base {
        Some(base) => {
            let all: Vec<&ReplayResult> = files.iter().flatten().map(|r| &r.result).collect();
            if !all.iter().any(|r| r.allocator == base) {
                return Err(format!("no result of configuration {} in the files", excerpt(base)));
            }
            for r in &all {
                if r.allocator == base || (!with.is_empty() && !with.contains(&r.allocator)) {
                    continue;
                }
                match all.iter().find(|b| b.allocator == base && b.trace == r.trace) {
                    Some(b) => pairs.push((r, b)),
                    None => unmatched.push(format!(
                        "no {} result for {} on {}\n",
                        excerpt(base),
                        r.allocator,
                        r.trace
                    )),
                }
            }
        }
        None => {
            let [a, b] = files.as_slice() else {
                return Err(format!("compare takes two files without --base, not {}", files.len()));
            };
            for x in a {
                let x = &x.result;
                match b
                    .iter()
                    .map(|y| &y.result)
                    .find(|y| (&y.allocator, &y.trace) == (&x.allocator, &x.trace))
                {
                    Some(y) => pairs.push((y, x)),
                    None => unmatched.push(format!("only in A: {} on {}\n", x.allocator, x.trace)),
                }
            }
            for y in b.iter().map(|y| &y.result) {
                if !a.iter().any(|x| x.result.allocator == y.allocator && x.result.trace == y.trace) {
                    unmatched.push(format!("only in B: {} on {}\n", y.allocator, y.trace));
                }
            }
        }
    }
    let header = [
        "configuration",
        "trace",
        "base",
        "footprint",
        "base",
        "ratio",
        "ns/op median [min, max]",
        "base",
        "ratio",
        "reserved",
        "base",
        "ratio",
        "calls",
        "base",
        "ratio",
    ];
    let spread = |s: (f64, f64, f64)| format!("{:.1} [{:.1}, {:.1}]", s.0, s.1, s.2);
    let mut within = false;
    let rows: Vec<Vec<String>> = pairs
        .iter()
        .map(|(r, b)| {
            let (rs, bs) = (pass_spread(r), pass_spread(b));
            let noise = relative_spread(rs).max(relative_spread(bs));
            let mut time_ratio = ratio(bs.0, rs.0);
            if bs.0 > 0.0 && (rs.0 / bs.0 - 1.0).abs() <= noise {
                time_ratio.push('~');
                within = true;
            }
            let label = if base.is_some() { b.allocator.clone() } else { "A".into() };
            vec![
                r.allocator.clone(),
                r.trace.clone(),
                label,
                format!("{:.3}", r.footprint_ratio),
                format!("{:.3}", b.footprint_ratio),
                ratio(b.footprint_ratio, r.footprint_ratio),
                spread(rs),
                spread(bs),
                time_ratio,
                bytes(r.reserved_peak),
                bytes(b.reserved_peak),
                ratio(b.reserved_peak as f64, r.reserved_peak as f64),
                r.device_calls.to_string(),
                b.device_calls.to_string(),
                ratio(b.device_calls as f64, r.device_calls as f64),
            ]
        })
        .collect();
    text.push_str(&columns(&header, &rows));
    if within {
        text.push_str(
            "~: the ratio of medians is within the spread of the passes ((max - min) / median of either \
             side): no difference shown; replay with more --passes\n",
        );
    }
    for (path, rows) in paths.iter().zip(&files) {
        if let Some(note) = rows.iter().find_map(|r| r.ns_per_op_note.as_deref()) {
            text.push_str(&format!("{}: {}\n", path.display(), excerpt(note)));
        }
    }
    text.extend(unmatched);
    emit(&text)
}

/// Draws saved results: one column per file, one row per trace (in order of appearance).
fn plot_saved(paths: &[PathBuf], output: &Path) -> Result<(), String> {
    let files = paths.iter().map(|p| read_results(p)).collect::<Result<Vec<_>, _>>()?;
    let mut traces: Vec<&str> = Vec::new();
    for r in files.iter().flatten() {
        if !traces.contains(&r.result.trace.as_str()) {
            traces.push(&r.result.trace);
        }
    }
    let mut panels = Vec::new();
    for trace in &traces {
        for (path, rows) in paths.iter().zip(&files) {
            let device = rows.first().map_or("", |r| short_device(&r.device));
            panels.push(plot::Panel {
                title: format!("{}: {trace} on the {device}", path.display()),
                results: rows.iter().map(|r| &r.result).filter(|r| r.trace == *trace).collect(),
            });
        }
    }
    if panels.is_empty() {
        return Err("the result files hold no results".into());
    }
    plot::draw(output, &panels, paths.len())?;
    emit(&format!("{}: {} traces x {} result files\n", output.display(), traces.len(), paths.len()))
}

fn import_snapshot(snapshot: &Path, output: &Path, gpu: Option<usize>) -> Result<(), String> {
    let s = import::import(snapshot, output, gpu, std::io::stderr().is_terminal())?;
    if s.unknown_frees > 0 {
        warn(&format!(
            "warning: {} frees of blocks allocated before recording began were skipped (raise \
             _record_memory_history(max_entries=...) to record them)",
            s.unknown_frees
        ));
    }
    if s.missed_frees > 0 {
        warn(&format!(
            "warning: {} allocations reused the address of a block whose free was not recorded; a free \
             was written before each",
            s.missed_frees
        ));
    }
    if s.untimed > 0 {
        warn(&format!(
            "note: {} entries had no `time_us` (older torch): their time is their index",
            s.untimed
        ));
    }
    let deferred = if s.deferred_frees > 0 {
        format!(
            "{} frees waited for work on other streams: a record_stream and a use row on a stand-in of them \
             (stream {}, or one below for a wait overlapping others) come before each\n",
            s.deferred_frees,
            import::OTHER_STREAMS
        )
    } else {
        String::new()
    };
    emit(&format!(
        "{}: device {} of {}: {} allocations, {} frees, {} streams\n{} allocations still live at the end \
         (allocated and not freed by the dump)\n{deferred}",
        output.display(),
        s.device,
        snapshot.display(),
        s.allocations,
        s.frees,
        s.streams,
        s.live_at_end
    ))
}

/// Describes the device, the presets and what `STREAMALLOC_CONF` does; an invalid
/// `STREAMALLOC_CONF` is an error, after the rest is printed.
fn info() -> Result<(), String> {
    let mut text = String::new();
    let mut invalid = None;
    match device::open_cuda() {
        Ok(_) => device::describe_gpus().iter().for_each(|line| text.push_str(&format!("{line}\n"))),
        Err(why) => {
            text.push_str(&format!("no GPU: {why}\n"));
            text.push_str(&format!(
                "replays run on the {}\n",
                device::describe_simulator(&device::simulator_config())
            ));
            text.push_str(
                "the simulator has no backing memory: it models an address space, in-order streams, events, \
                 the driver's stream-ordered pools, graph capture, and checks that no memory is reused \
                 while work on another stream could still touch it\n",
            );
        }
    }
    let presets: Vec<&str> = Config::presets().iter().map(|p| p.name).collect();
    text.push_str(&format!("presets (replay --allocator NAME): {}\n", presets.join(", ")));
    // What replay and the C ABI (libstreamalloc.so) do with the environment here.
    match Config::env_text() {
        Ok(None) => text.push_str(&format!(
            "{ENV_VAR} is not set: replay runs every preset unless given --conf or --allocator; \
             libstreamalloc.so uses the defaults\n"
        )),
        Ok(Some(conf)) => match Config::parse(&conf) {
            Ok(config) => text.push_str(&format!(
                "{ENV_VAR}={}: replay runs it when given no --conf or --allocator; libstreamalloc.so \
                 builds `{}` unless the program configures it\n",
                excerpt(&conf),
                excerpt_within(&config.to_string(), usize::MAX)
            )),
            Err(e) => {
                text.push_str(&format!(
                    "{ENV_VAR}={} is not valid (the error is below): replay runs only with --conf or \
                     --allocator; libstreamalloc.so fails every call unless the program configures it\n",
                    excerpt(&conf)
                ));
                invalid = Some(format!("{ENV_VAR}={} is not valid: {}", excerpt(&conf), bounded(e)));
            }
        },
        Err(e) => {
            text.push_str(&format!("{ENV_VAR} cannot be read (the error is below)\n"));
            invalid = Some(bounded(e));
        }
    }
    emit(&text)?;
    invalid.map_or(Ok(()), Err)
}
