//! Named configurations: the ones worth comparing first, which `streamalloc replay` runs
//! when it is given none.

use super::{Config, Strategy};
use crate::allocators::BackingKind;

/// A named [`Config`].
#[derive(Debug, Clone, PartialEq)]
pub struct Preset {
    /// The name, e.g. `stream_safe_chunks`.
    pub name: &'static str,
    /// The configuration (the defaults, except what the name says).
    pub config: Config,
}

impl Config {
    /// One preset per [`Strategy`] of the registry with its defaults, named after it, and,
    /// after `stream_safe`, `stream_safe` over chunks of plain allocations
    /// (`stream_safe_chunks`, `backing=chunks`, what it falls back to on a device without
    /// virtual memory management).
    pub fn presets() -> Vec<Preset> {
        let mut presets = Vec::new();
        for strategy in Strategy::all() {
            let config = Config { strategy, ..Config::default() };
            presets.push(Preset { name: strategy.name(), config: config.clone() });
            if strategy == Strategy::STREAM_SAFE {
                let config = Config { backing: BackingKind::CHUNKS, ..config };
                presets.push(Preset { name: "stream_safe_chunks", config });
            }
        }
        presets
    }

    /// The preset called `name`, or an error listing them all.
    pub fn preset(name: &str) -> crate::Result<Config> {
        let presets = Self::presets();
        presets.iter().find(|p| p.name == name).map(|p| p.config.clone()).ok_or_else(|| {
            let names: Vec<&str> = presets.iter().map(|p| p.name).collect();
            crate::Error::Config(format!(
                "unknown preset `{}`; presets: {}",
                crate::text::excerpt(name),
                names.join(", ")
            ))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_strategy_has_a_preset_and_names_parse_back() {
        let presets = Config::presets();
        for p in &presets {
            assert_eq!(Config::preset(p.name).unwrap(), p.config);
            assert_eq!(Config::parse(&p.config.to_string()).unwrap(), p.config);
        }
        for strategy in Strategy::all() {
            assert!(presets.iter().any(|p| p.name == strategy.name() && p.config.strategy == strategy));
        }
        assert_eq!(Config::preset("stream_safe").unwrap().backing, BackingKind::STITCHED);
        assert_eq!(Config::preset("stream_safe_chunks").unwrap().backing, BackingKind::CHUNKS);
        let err = Config::preset("fast").unwrap_err().to_string();
        assert!(err.contains("unknown preset `fast`; presets: plain, best_fit, stream_safe"), "{err}");
    }
}
