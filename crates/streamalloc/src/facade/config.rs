//! The typed configuration, and the one place that reads `STREAMALLOC_CONF`.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use super::strategies::{self, StrategySpec};
use crate::allocators::BackingKind;
use crate::error::{Error, Result};
use crate::policy::best_fit::Classes;
use crate::text::excerpt;

/// The environment variable [`Config::from_env`] reads.
pub const ENV_VAR: &str = "STREAMALLOC_CONF";

/// Which allocator serves each device: an entry of the registry of strategies
/// ([`STRATEGIES`](super::strategies::STRATEGIES)).
#[derive(Clone, Copy)]
pub struct Strategy(&'static StrategySpec);

impl Strategy {
    /// [`Plain`](crate::allocators::Plain): no caching.
    pub const PLAIN: Strategy = Strategy(&strategies::PLAIN);
    /// [`BestFit`](crate::allocators::BestFit): one caching pool, made usable from any stream
    /// by [`SingleStream`](crate::adaptors::SingleStream).
    pub const BEST_FIT: Strategy = Strategy(&strategies::BEST_FIT);
    /// [`StreamSafe`](crate::allocators::StreamSafe): a caching pool per stream.
    pub const STREAM_SAFE: Strategy = Strategy(&strategies::STREAM_SAFE);
    /// [`AsyncPool`](crate::allocators::AsyncPool): the driver's stream-ordered pool.
    pub const ASYNC: Strategy = Strategy(&strategies::ASYNC);

    /// Every strategy of the registry, in its order.
    pub fn all() -> impl Iterator<Item = Strategy> {
        strategies::STRATEGIES.iter().map(|spec| Strategy(spec))
    }

    /// The name used in configuration strings.
    pub fn name(self) -> &'static str {
        self.0.name
    }

    /// What the registry says of it.
    pub fn spec(self) -> &'static StrategySpec {
        self.0
    }
}

impl PartialEq for Strategy {
    fn eq(&self, other: &Self) -> bool {
        self.0.name == other.0.name
    }
}

impl Eq for Strategy {}

impl fmt::Debug for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0.name)
    }
}

impl FromStr for Strategy {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Strategy::all().find(|strategy| strategy.name() == s).ok_or_else(|| {
            let names: Vec<&str> = Strategy::all().map(Strategy::name).collect();
            Error::Config(format!("strategy={}: expected one of {}", excerpt(s), names.join(", ")))
        })
    }
}

/// Which device implementation the facade opens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceKind {
    /// The CUDA driver, loaded at run time.
    Cuda,
    /// The simulator (for tests and for machines without a GPU).
    Sim,
}

/// Which stream-ordered pool the `async` strategy allocates from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolChoice {
    /// The device's default pool, shared with every library in the process.
    Default,
    /// A pool the allocator creates and owns.
    Owned,
    /// A pool the allocator creates and owns, whose memory other processes can import (IPC:
    /// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`); CUDA graphs cannot capture its
    /// allocations (the driver's graph memory does not support IPC).
    Ipc,
}

/// A byte limit: absolute, or a fraction of the device's memory.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LimitSpec {
    /// This many bytes.
    Bytes(usize),
    /// This fraction (0 < f <= 1) of the device's total memory.
    Fraction(f64),
}

impl LimitSpec {
    /// The limit in bytes on a device of `total` bytes.
    pub fn bytes(self, total: usize) -> usize {
        match self {
            LimitSpec::Bytes(n) => n,
            LimitSpec::Fraction(f) => (total as f64 * f) as usize,
        }
    }
}

/// Everything the facade needs to build an allocator stack. Built in code, or parsed from a
/// `key=value,key=value` string (see [`Config::parse`] and the README's table of keys).
///
/// # Examples
///
/// ```
/// use streamalloc::facade::{Config, Strategy};
///
/// let config = Config::parse("strategy=async,device=sim,limit=0.9")?;
/// assert_eq!(config.strategy, Strategy::ASYNC);
/// // Unknown keys are errors that name the key.
/// assert!(Config::parse("stratgy=async").unwrap_err().to_string().contains("stratgy"));
/// # Ok::<(), streamalloc::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// `strategy`: which allocator serves each device. Default `stream_safe`.
    pub strategy: Strategy,
    /// `device`: `cuda` or `sim`. Default `cuda`.
    pub device: DeviceKind,
    /// `sim_capacity`: bytes of a simulated device. Default 143,771 MiB (an H200).
    pub sim_capacity: usize,
    /// `sim_virtual_memory`: whether a simulated device supports virtual memory management
    /// (as a device without it, `false` makes the `stitched` and `segments` backings fall back
    /// to chunks). Default
    /// `true`.
    pub sim_virtual_memory: bool,
    /// `growth`: bytes a caching pool grows by for large requests. Default 32 MiB.
    pub growth: usize,
    /// `backing`: what the caching pools (`best_fit`, `stream_safe`) are backed with, by
    /// name ([`backing`](crate::allocators::backing)): `stitched`, stitched virtual-memory
    /// ranges (address space mapped as the pools grow, the memory of free granules mapped
    /// again to pay for a growth that would raise the peak); `segments`, PyTorch's expandable
    /// segments (one reservation per size class, mapped from its start); `chunks`, chunks of
    /// plain allocations. The first two need a device with virtual memory management, and
    /// fall back to chunks elsewhere. Stitched ranges keep the footprint closest to the peak
    /// live bytes when shapes vary (see DESIGN.md, Note [stitched by default]). The retired key
    /// `expandable` is an error naming these. Default `stitched`.
    pub backing: BackingKind,
    /// `pool`: `default`, `owned` or `ipc` (owned, and shareable with other processes), for
    /// `async`. Default `default`.
    pub pool: PoolChoice,
    /// `release_threshold`: bytes the `async` strategy's pool keeps reserved at
    /// synchronizations (`max` for all), set at first use (on the default pool too, as
    /// PyTorch's cudaMallocAsync backend does). Default `max`.
    pub release_threshold: u64,
    /// `throttle`: for `async`, the share of device memory allocated plus pending release
    /// above which allocating streams wait for pending frees. Default 0.8.
    pub throttle: f64,
    /// `trim_floor`: bytes `release` leaves reserved in a pool. Default 0.
    pub trim_floor: usize,
    /// `limit`: a byte limit (`40GiB`) or a fraction of device memory (`0.9`). Default none.
    pub limit: Option<LimitSpec>,
    /// `retry_timeout`: on out-of-memory, how long to wait for frees before failing
    /// (`500ms`, `2s`); adds the Retry layer. Default none (allocators still make their own
    /// one release-and-retry).
    pub retry_timeout: Option<Duration>,
    /// `wait_timeout`: the longest an allocation waits for work on the device (other streams'
    /// kernels still using cached memory) before the caches it returns can go back to the
    /// driver; past it, the allocation fails with an out-of-memory error saying what it waited
    /// for; and the longest [`Facade::retire_stream`](super::Facade::retire_stream) waits for
    /// a retired stream's work, under every strategy. Default 2 s: far longer than any kernel
    /// of a healthy step, short enough that a hung stream shows as an error instead of a hang.
    pub wait_timeout: Duration,
    /// `stats`: `true` adds per-stream statistics. Default `false`.
    pub stats: bool,
    /// `trace`: write every allocation and free to this CSV file (device N > 0 writes to
    /// `PATH.N`). Default none.
    pub trace: Option<PathBuf>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            strategy: Strategy::STREAM_SAFE,
            device: DeviceKind::Cuda,
            sim_capacity: 143_771 << 20,
            sim_virtual_memory: true,
            growth: 32 << 20,
            backing: BackingKind::STITCHED,
            pool: PoolChoice::Default,
            release_threshold: u64::MAX,
            throttle: 0.8,
            trim_floor: 0,
            limit: None,
            retry_timeout: None,
            wait_timeout: DEFAULT_WAIT_TIMEOUT,
            stats: false,
            trace: None,
        }
    }
}

/// The default [`Config::wait_timeout`].
pub const DEFAULT_WAIT_TIMEOUT: Duration = Duration::from_secs(2);

/// The keys [`Config::parse`] accepts, with what each takes.
pub const KEYS: &[(&str, &str)] = &[
    ("strategy", "the name of a strategy (facade::STRATEGIES)"),
    ("device", "cuda | sim"),
    ("sim_capacity", "a size from 64MiB to 1TiB, e.g. 80GiB"),
    ("sim_virtual_memory", "true | false"),
    ("growth", "a size above 1MiB that is a multiple of 256 bytes, e.g. 20MiB"),
    ("backing", "the name of a backing (allocators::backing::BACKINGS)"),
    ("pool", "default | owned | ipc"),
    ("release_threshold", "a size, or max"),
    ("throttle", "a ratio in (0, 1], or 1 to turn it off"),
    ("trim_floor", "a size"),
    ("limit", "a size with a unit (40GiB), a plain byte count of at least 1MiB (1048576), or a fraction of device memory in (0, 1] written with a point (0.9, 1.0)"),
    ("retry_timeout", "a duration: 500ms, 2s, 0"),
    ("wait_timeout", "a duration of at most 1 day (86400s): 500ms, 2s, 0"),
    ("stats", "true | false"),
    ("trace", "a file path"),
];

/// The error of the retired key `expandable`, which meant the stitched backing while
/// PyTorch's expandable segments are `backing=segments`.
const RETIRED_EXPANDABLE: &str = "`expandable` is retired: name the pools' backing with `backing=`: \
     backing=stitched (what expandable=true chose), backing=segments (PyTorch's expandable segments) or \
     backing=chunks (what expandable=false chose)";

/// The strategies that take `key`, if only some do (those whose entry lists it).
fn strategies_taking(key: &str) -> Option<Vec<Strategy>> {
    let takers: Vec<Strategy> = Strategy::all().filter(|s| s.spec().keys.contains(&key)).collect();
    (!takers.is_empty()).then_some(takers)
}

impl Strategy {
    /// Whether this strategy takes the configuration key `key`.
    pub fn takes(self, key: &str) -> bool {
        strategies_taking(key).is_none_or(|strategies| strategies.contains(&self))
    }
}

impl Config {
    /// Parses `key=value` pairs separated by commas (whitespace around them is ignored) on
    /// top of the defaults. Unknown keys, bad values and keys the chosen strategy does not
    /// take (`backing` under `strategy=async`) are errors naming the key and what it
    /// accepts or which strategies take it.
    ///
    /// ```
    /// use streamalloc::facade::{Config, Strategy};
    ///
    /// let c = Config::parse("strategy=async,release_threshold=8GiB")?;
    /// assert_eq!(c.strategy, Strategy::ASYNC);
    /// let e = Config::parse("strategy=async,backing=chunks").unwrap_err();
    /// assert!(e.to_string().contains("taken by best_fit, stream_safe"), "{e}");
    /// # Ok::<(), streamalloc::Error>(())
    /// ```
    pub fn parse(s: &str) -> Result<Self> {
        let mut c = Config::default();
        let mut seen: Vec<&str> = Vec::new();
        for pair in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (key, value) = pair.split_once('=').map(|(k, v)| (k.trim(), v.trim())).ok_or_else(|| {
                Error::Config(format!("`{}` is not key=value{}", excerpt(pair), torch_hint(pair)))
            })?;
            if key == "expandable" {
                return Err(Error::Config(RETIRED_EXPANDABLE.to_string()));
            }
            let accepted = KEYS.iter().find(|(k, _)| *k == key).map(|(_, a)| *a).ok_or_else(|| {
                let known: Vec<&str> = KEYS.iter().map(|(k, _)| *k).collect();
                Error::Config(format!("unknown key `{}`; known keys: {}", excerpt(key), known.join(", ")))
            })?;
            if seen.contains(&key) {
                return Err(Error::Config(format!("`{key}` is given twice; give each key once")));
            }
            seen.push(key);
            let bad = || Error::Config(format!("{key}={}: expected {accepted}", excerpt(value)));
            match key {
                "strategy" => c.strategy = value.parse()?,
                "device" => {
                    c.device = match value {
                        "cuda" => DeviceKind::Cuda,
                        "sim" => DeviceKind::Sim,
                        _ => return Err(bad()),
                    }
                }
                "sim_capacity" => {
                    c.sim_capacity = parse_size(value)
                        .filter(|n| (MIN_SIM_CAPACITY..=MAX_SIM_CAPACITY).contains(n))
                        .ok_or_else(bad)?
                }
                "sim_virtual_memory" => c.sim_virtual_memory = value.parse().map_err(|_| bad())?,
                "growth" => {
                    // What BestFit accepts as its chunk size for large requests.
                    let classes = |n: usize| Classes { growth: n as u64, ..Classes::default() };
                    c.growth = parse_size(value).filter(|n| classes(*n).validate().is_ok()).ok_or_else(bad)?
                }
                "pool" => {
                    c.pool = match value {
                        "default" => PoolChoice::Default,
                        "owned" => PoolChoice::Owned,
                        "ipc" => PoolChoice::Ipc,
                        _ => return Err(bad()),
                    }
                }
                "release_threshold" => {
                    c.release_threshold =
                        if value == "max" { u64::MAX } else { parse_size(value).ok_or_else(bad)? as u64 }
                }
                "throttle" => {
                    c.throttle =
                        value.parse::<f64>().ok().filter(|r| *r > 0.0 && *r <= 1.0).ok_or_else(bad)?
                }
                "trim_floor" => c.trim_floor = parse_size(value).ok_or_else(bad)?,
                "limit" => c.limit = Some(parse_limit(value).ok_or_else(bad)?),
                "retry_timeout" => c.retry_timeout = Some(parse_duration(value).ok_or_else(bad)?),
                "wait_timeout" => {
                    c.wait_timeout =
                        parse_duration(value).filter(|d| *d <= MAX_WAIT_TIMEOUT).ok_or_else(bad)?
                }
                "stats" => c.stats = value.parse().map_err(|_| bad())?,
                "backing" => {
                    c.backing = BackingKind::named(value).ok_or_else(|| {
                        let names: Vec<&str> = BackingKind::all().map(BackingKind::name).collect();
                        Error::Config(format!(
                            "backing={}: expected one of {}",
                            excerpt(value),
                            names.join(", ")
                        ))
                    })?
                }
                "trace" if !value.is_empty() => c.trace = Some(PathBuf::from(value)),
                _ => return Err(bad()),
            }
        }
        for key in seen {
            if let Some(strategies) = strategies_taking(key).filter(|s| !s.contains(&c.strategy)) {
                let names: Vec<&str> = strategies.iter().map(|s| s.name()).collect();
                return Err(Error::Config(format!(
                    "`{key}` does not apply to strategy={}; it is taken by {}",
                    c.strategy.name(),
                    names.join(", ")
                )));
            }
        }
        Ok(c)
    }

    /// The configuration from the environment variable [`ENV_VAR`] (the defaults when it is
    /// unset or empty).
    pub fn from_env() -> Result<Self> {
        match Self::env_text()? {
            Some(s) => Self::parse_env_text(&s),
            None => Ok(Self::default()),
        }
    }

    /// This configuration, given by a program, with the `trace` key of [`ENV_VAR`] when it
    /// names none: a trace asked for from outside (as `streamalloc record` does) is written
    /// whatever configuration the program passes. A bad [`ENV_VAR`] adds nothing.
    pub fn with_env_trace(mut self) -> Self {
        if self.trace.is_none() {
            if let Ok(Config { trace: Some(path), .. }) = Config::from_env() {
                self.trace = Some(path);
            }
        }
        self
    }

    /// [`Config::parse`] of the text of [`ENV_VAR`]; its errors name the variable once, after
    /// the one `configuration:` prefix.
    fn parse_env_text(s: &str) -> Result<Self> {
        Self::parse(s).map_err(|e| match e {
            Error::Config(m) => Error::Config(format!("{ENV_VAR}: {m}")),
            e => e,
        })
    }

    /// The text of the environment variable [`ENV_VAR`], trimmed; `None` when it is unset or
    /// blank. The only place in the crate that reads the environment.
    pub fn env_text() -> Result<Option<String>> {
        match std::env::var(ENV_VAR) {
            Ok(s) if s.trim().is_empty() => Ok(None),
            Ok(s) => Ok(Some(s.trim().to_owned())),
            Err(std::env::VarError::NotPresent) => Ok(None),
            Err(e) => Err(Error::Config(format!("{ENV_VAR}: {e}"))),
        }
    }
}

impl Config {
    /// The value of `key` ([`KEYS`]) as [`Config::parse`] reads it, or `None` where it is
    /// unset (an optional key) or not written back.
    fn value_of(&self, key: &str) -> Option<String> {
        Some(match key {
            "strategy" => self.strategy.name().to_string(),
            "device" => match self.device {
                DeviceKind::Cuda => "cuda",
                DeviceKind::Sim => "sim",
            }
            .to_string(),
            "sim_capacity" => self.sim_capacity.to_string(),
            "sim_virtual_memory" => self.sim_virtual_memory.to_string(),
            "growth" => self.growth.to_string(),
            "backing" => self.backing.name().to_string(),
            "pool" => match self.pool {
                PoolChoice::Default => "default",
                PoolChoice::Owned => "owned",
                PoolChoice::Ipc => "ipc",
            }
            .to_string(),
            "release_threshold" if self.release_threshold == u64::MAX => "max".to_string(),
            "release_threshold" => self.release_threshold.to_string(),
            "throttle" => self.throttle.to_string(),
            "trim_floor" => self.trim_floor.to_string(),
            "limit" => match self.limit? {
                LimitSpec::Bytes(n) => format!("{n}B"),
                LimitSpec::Fraction(x) => format!("{x:?}"),
            },
            "retry_timeout" => format!("{}ms", self.retry_timeout?.as_millis()),
            "wait_timeout" => format!("{}ms", self.wait_timeout.as_millis()),
            "stats" => self.stats.to_string(),
            "trace" => self.trace.as_ref()?.display().to_string(),
            _ => return None,
        })
    }
}

impl fmt::Display for Config {
    /// Writes the configuration back as a string [`Config::parse`] reads: each key of
    /// [`KEYS`] that the chosen strategy takes (those of every strategy, and the groups its
    /// registry entry lists), in the order of [`KEYS`], but optional keys left unset.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut first = true;
        for (key, _) in KEYS.iter().filter(|(key, _)| self.strategy.takes(key)) {
            if let Some(value) = self.value_of(key) {
                write!(f, "{}{key}={value}", if first { "" } else { "," })?;
                first = false;
            }
        }
        Ok(())
    }
}

/// The smallest `sim_capacity`: a simulated device smaller than this fails every chunked
/// allocation.
const MIN_SIM_CAPACITY: usize = 64 << 20;

/// The largest `sim_capacity` (1 TiB): a simulated device's memory and its pools'
/// reservations (three times its memory each) stay inside its own address window, apart
/// from the next device's.
const MAX_SIM_CAPACITY: usize = 1 << 40;

/// The longest `wait_timeout` (1 day): a longer bound is no bound, and deadlines computed
/// from it would overflow the clock.
const MAX_WAIT_TIMEOUT: Duration = Duration::from_secs(86_400);

/// The smallest plain byte count (no unit) `limit` accepts: a smaller plain number is more
/// likely a mistyped fraction (`limit=1` for all of the memory) than a limit in bytes.
const MIN_PLAIN_LIMIT: usize = 1 << 20;

/// Parses a `limit`: a number with a point is a fraction of device memory in (0, 1]; a size
/// with a unit is bytes; a plain integer is bytes and must be at least [`MIN_PLAIN_LIMIT`].
fn parse_limit(value: &str) -> Option<LimitSpec> {
    if value.contains('.') && value.chars().all(|ch| ch.is_ascii_digit() || ch == '.') {
        return value.parse::<f64>().ok().filter(|f| *f > 0.0 && *f <= 1.0).map(LimitSpec::Fraction);
    }
    let bytes = parse_size(value).filter(|n| *n > 0)?;
    let plain = value.chars().all(|ch| ch.is_ascii_digit());
    (!plain || bytes >= MIN_PLAIN_LIMIT).then_some(LimitSpec::Bytes(bytes))
}

/// What to write instead of a `key:value` pair of PyTorch's `PYTORCH_CUDA_ALLOC_CONF`, if
/// `pair` looks like one (empty otherwise).
fn torch_hint(pair: &str) -> String {
    let Some((key, _)) = pair.split_once(':') else { return String::new() };
    let ours = match key.trim() {
        "expandable_segments" => {
            "backing=segments (PyTorch's expandable segments) or backing=stitched (the default)"
        }
        "backend" => "strategy=async (the driver's pool) or strategy=stream_safe",
        "max_split_size_mb" | "roundup_power2_divisions" | "garbage_collection_threshold" => {
            "nothing: streamalloc's pools split and release on their own (see the keys below)"
        }
        _ => "the keys below",
    };
    format!(
        " (`{}:...` is PyTorch's PYTORCH_CUDA_ALLOC_CONF syntax; STREAMALLOC_CONF takes key=value pairs: \
         here, {ours}; known keys: {})",
        excerpt(key.trim()),
        KEYS.iter().map(|(k, _)| *k).collect::<Vec<_>>().join(", ")
    )
}

/// Parses a size: a number with an optional unit, `B`, `KB`/`MB`/`GB`/`TB` (powers of 1000)
/// or `KiB`/`MiB`/`GiB`/`TiB` (powers of 1024), case-insensitive; fractions allowed
/// (`1.5GiB`).
pub fn parse_size(s: &str) -> Option<usize> {
    let s = s.trim();
    let split = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let unit: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        "tib" => 1 << 40,
        _ => return None,
    };
    if let Ok(n) = num.parse::<u64>() {
        return n.checked_mul(unit).and_then(|b| usize::try_from(b).ok());
    }
    let x: f64 = num.parse().ok().filter(|x: &f64| x.is_finite() && *x >= 0.0)?;
    let bytes = x * unit as f64;
    (bytes < usize::MAX as f64).then_some(bytes as usize)
}

/// Parses a duration: `250ms`, `2s`, `1.5s`, or `0`.
pub fn parse_duration(s: &str) -> Option<Duration> {
    let s = s.trim();
    if s == "0" {
        return Some(Duration::ZERO);
    }
    let (num, scale) = if let Some(n) = s.strip_suffix("ms") {
        (n, 1e-3)
    } else if let Some(n) = s.strip_suffix('s') {
        (n, 1.0)
    } else {
        return None;
    };
    let x: f64 = num.trim().parse().ok().filter(|x: &f64| x.is_finite() && *x >= 0.0)?;
    Duration::try_from_secs_f64(x * scale).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 52: absurd `wait_timeout` and `sim_capacity` values are refused, saying the
    /// bound; an error from `STREAMALLOC_CONF` carries one `configuration:` prefix.
    #[test]
    fn absurd_bounds_are_refused_and_env_errors_have_one_prefix() {
        let err = |s: &str| Config::parse(s).unwrap_err().to_string();
        let e = err("wait_timeout=10000000000000000000s");
        assert!(e.contains("wait_timeout=") && e.contains("at most 1 day"), "{e}");
        assert!(Config::parse("wait_timeout=86400s").is_ok());
        for v in ["20TiB", "18446744073709551615", "2TiB"] {
            let e = err(&format!("sim_capacity={v}"));
            assert!(e.contains("64MiB to 1TiB"), "{e}");
        }
        assert_eq!(Config::parse("sim_capacity=1TiB").unwrap().sim_capacity, 1 << 40);
        let e = Config::parse_env_text("bogus=1").unwrap_err().to_string();
        assert!(e.starts_with("configuration: STREAMALLOC_CONF: unknown key"), "{e}");
        assert_eq!(e.matches("configuration:").count(), 1, "{e}");
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("512MiB"), Some(512 << 20));
        assert_eq!(parse_size("8GiB"), Some(8 << 30));
        assert_eq!(parse_size("8gib"), Some(8 << 30));
        assert_eq!(parse_size("1.5GiB"), Some(3 << 29));
        assert_eq!(parse_size("2GB"), Some(2_000_000_000));
        assert_eq!(parse_size("4096"), Some(4096));
        assert_eq!(parse_size("7B"), Some(7));
        assert_eq!(parse_size("3kB"), Some(3000));
        assert_eq!(parse_size("1TiB"), Some(1 << 40));
        for bad in ["", "GiB", "-1GiB", "1.2.3MiB", "12 parsecs", "99999999999TiB"] {
            assert_eq!(parse_size(bad), None, "{bad}");
        }
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("250ms"), Some(Duration::from_millis(250)));
        assert_eq!(parse_duration("2s"), Some(Duration::from_secs(2)));
        assert_eq!(parse_duration("0"), Some(Duration::ZERO));
        assert_eq!(parse_duration("1.5s"), Some(Duration::from_millis(1500)));
        assert_eq!(parse_duration("5"), None);
        assert_eq!(parse_duration("-1s"), None);
    }

    #[test]
    fn every_key() {
        let caching =
            Config::parse("strategy=stream_safe, growth=2MiB, backing=chunks, wait_timeout=100ms").unwrap();
        assert_eq!(caching.growth, 2 << 20);
        assert_eq!(caching.backing, BackingKind::CHUNKS);
        assert_eq!(caching.wait_timeout, Duration::from_millis(100));
        assert_eq!(Config::parse(&caching.to_string()).unwrap(), caching);
        for (name, backing) in [
            ("stitched", BackingKind::STITCHED),
            ("segments", BackingKind::SEGMENTS),
            ("chunks", BackingKind::CHUNKS),
        ] {
            let c = Config::parse(&format!("strategy=best_fit,backing={name}")).unwrap();
            assert_eq!(c.backing, backing);
            assert_eq!(Config::parse(&c.to_string()).unwrap(), c);
        }
        let c = Config::parse(
            "strategy=async, device=sim, sim_capacity=8GiB, sim_virtual_memory=false, pool=owned, \
             release_threshold=1GiB, throttle=0.5, trim_floor=64MiB, limit=40GiB, retry_timeout=250ms, \
             wait_timeout=300ms, stats=true, trace=/tmp/t.csv",
        )
        .unwrap();
        assert_eq!(c.strategy, Strategy::ASYNC);
        assert_eq!(c.device, DeviceKind::Sim);
        assert_eq!(c.sim_capacity, 8 << 30);
        assert!(!c.sim_virtual_memory);
        assert_eq!(c.pool, PoolChoice::Owned);
        assert_eq!(c.release_threshold, 1 << 30);
        assert_eq!(c.throttle, 0.5);
        assert_eq!(c.trim_floor, 64 << 20);
        assert_eq!(c.limit, Some(LimitSpec::Bytes(40 << 30)));
        assert_eq!(c.retry_timeout, Some(Duration::from_millis(250)));
        assert_eq!(c.wait_timeout, Duration::from_millis(300));
        assert!(c.stats);
        assert_eq!(c.trace, Some(PathBuf::from("/tmp/t.csv")));
        // Every key in KEYS is covered above.
        assert_eq!(KEYS.len(), 15);
        // Display writes back what parse reads.
        assert_eq!(Config::parse(&c.to_string()).unwrap(), c);
        for s in ["plain", "best_fit", "stream_safe", "async"] {
            assert_eq!(Config::parse(&format!("strategy={s}")).unwrap().strategy.name(), s);
        }
        assert_eq!(Config::parse("limit=0.9").unwrap().limit, Some(LimitSpec::Fraction(0.9)));
        assert_eq!(
            Config::parse("strategy=async,release_threshold=max").unwrap().release_threshold,
            u64::MAX
        );
        assert_eq!(Config::parse("").unwrap(), Config::default());
        assert_eq!(Config::parse(&Config::default().to_string()).unwrap(), Config::default());
    }

    #[test]
    fn bad_input_names_the_key_and_accepted_values() {
        let err = |s: &str| Config::parse(s).unwrap_err().to_string();
        assert!(err("strategy=fast").contains("plain, best_fit, stream_safe, async"));
        assert!(err("colour=blue").contains("unknown key `colour`"));
        assert!(err("colour=blue").contains("strategy"));
        assert!(err("growth=lots").contains("growth=lots: expected a size"));
        assert!(err("growth=0").contains("growth=0"));
        assert!(err("throttle=1.5").contains("throttle=1.5"));
        assert!(err("throttle=0").contains("throttle"));
        assert!(err("limit=0").contains("limit=0"));
        assert!(err("device=tpu").contains("cuda | sim"));
        assert!(err("pool=mine").contains("default | owned | ipc"));
        assert!(err("stats=yes").contains("true | false"));
        assert!(err("retry_timeout=soon").contains("a duration"));
        assert!(err("trace=").contains("a file path"));
        assert!(err("release_threshold=lots").contains("release_threshold"));
        assert!(err("sim_capacity=x").contains("sim_capacity"));
        assert!(err("sim_virtual_memory=no").contains("true | false"));
        assert!(err("trim_floor=x").contains("trim_floor"));
        assert!(err("strategy").contains("not key=value"));
    }

    /// Values that parsed and then made every call fail, or meant something else than written.
    /// The backing by name; `expandable`, which chose the stitched backing while the name says
    /// PyTorch's expandable segments (issue 51), is retired with an error naming `backing=`.
    /// PyTorch's `expandable_segments:True` is answered with our key.
    #[test]
    fn the_backing_is_chosen_by_name() {
        for conf in ["expandable=true", "expandable=false", "strategy=async,expandable=true"] {
            let e = Config::parse(conf).unwrap_err().to_string();
            assert!(e.contains("`expandable` is retired") && e.contains("backing=segments"), "{conf}: {e}");
        }
        let e = Config::parse("backing=mapped").unwrap_err().to_string();
        assert!(e.contains("expected one of stitched, segments, chunks"), "{e}");
        let e = Config::parse("expandable_segments:True").unwrap_err().to_string();
        assert!(e.contains("backing=segments") && e.contains("PYTORCH_CUDA_ALLOC_CONF"), "{e}");
        let e = Config::parse("strategy=async,backing=chunks").unwrap_err().to_string();
        assert!(e.contains("does not apply to strategy=async"), "{e}");
    }

    /// A hostile value is quoted bounded and escaped (issue 33: a 1 MB value was echoed
    /// whole, and escape sequences reached the terminal).
    #[test]
    fn errors_quote_values_bounded_and_escaped() {
        let huge = "x".repeat(1 << 20);
        for conf in [format!("growth={huge}"), format!("{huge}=1"), format!("strategy={huge}"), huge.clone()]
        {
            let e = Config::parse(&conf).unwrap_err().to_string();
            assert!(e.len() < 1024, "{} bytes: {}", e.len(), &e[..200]);
            assert!(e.contains("bytes in all"), "{e}");
        }
        let e = Config::parse("growth=\x1b[2J").unwrap_err().to_string();
        assert!(e.contains("\\x1b[2J") && !e.contains('\x1b'), "{e}");
    }

    #[test]
    fn traps_are_errors_at_parse_time() {
        let err =
            |s: &str| Config::parse(s).map(|c| format!("parsed as {c:?}")).unwrap_or_else(|e| e.to_string());
        assert!(err("limit=1.5").contains("limit=1.5: expected"), "{}", err("limit=1.5"));
        assert!(err("limit=100").contains("limit=100: expected"), "{}", err("limit=100"));
        assert!(err("growth=1").contains("growth=1: expected"), "{}", err("growth=1"));
        assert!(err("growth=1MiB").contains("growth=1MiB: expected"), "{}", err("growth=1MiB"));
        assert!(err("sim_capacity=1").contains("sim_capacity=1: expected"), "{}", err("sim_capacity=1"));
        let twice = err("strategy=plain,stats=true,strategy=async");
        assert!(twice.contains("`strategy` is given twice"), "{twice}");
    }

    /// Issue 19: a key the chosen strategy does not take was silently ignored.
    #[test]
    fn a_key_the_strategy_does_not_take_is_an_error_naming_those_that_do() {
        let caching = "taken by best_fit, stream_safe";
        let cases = [
            ("strategy=async,backing=chunks", "`backing` does not apply to strategy=async", caching),
            ("backing=chunks,strategy=async", "`backing` does not apply to strategy=async", caching),
            ("strategy=async,growth=64MiB", "`growth` does not apply to strategy=async", caching),
            ("strategy=plain,growth=64MiB", "`growth` does not apply to strategy=plain", caching),
            ("pool=owned", "`pool` does not apply to strategy=stream_safe", "taken by async"),
            (
                "strategy=best_fit,release_threshold=1GiB",
                "`release_threshold` does not apply",
                "taken by async",
            ),
            ("strategy=plain,throttle=0.5", "`throttle` does not apply to strategy=plain", "taken by async"),
            ("strategy=stream_safe,trim_floor=1GiB", "`trim_floor` does not apply", "taken by async"),
        ];
        for (conf, what, by) in cases {
            let e = Config::parse(conf).unwrap_err().to_string();
            assert!(e.contains(what) && e.contains(by), "{conf}: {e}");
        }
        // Keys of every strategy are taken by all, and printed back for all (issue 51:
        // `wait_timeout`, which bounds the pointer table's wait under every strategy, was
        // refused under plain and async).
        for s in Strategy::all().map(Strategy::name) {
            let c = Config::parse(&format!(
                "strategy={s},limit=1GiB,retry_timeout=1s,wait_timeout=250ms,stats=true,device=sim"
            ))
            .unwrap();
            assert_eq!(c.wait_timeout, Duration::from_millis(250));
            assert_eq!(Config::parse(&c.to_string()).unwrap(), c, "{c}");
        }
    }
}
