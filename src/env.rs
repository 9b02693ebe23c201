//! Every environment variable the library reads, parsed one way: unset means the
//! default; a bad value is an INVALID_ARGUMENT error at Buffer creation naming the
//! variable, the value and what is accepted (never a silent fallback).
//! Parsers take the value as a parameter so tests need not touch the process env.
use crate::error::{Error, Result};
use crate::log::Level;

pub(crate) const GPU_TIMEOUT_ENV: &str = "DEEPEP_GPU_TIMEOUT_SECS";
/// Ranks [k*n, (k+1)*n) form one node; LL traffic between nodes takes the
/// remote (GIN-protocol) path, emulated over NVLink, and a normal-mode buffer takes the internode
/// path (its scale-out leg emulated over NVLink).
pub(crate) const VIRTUAL_NODE_ENV: &str = "DEEPEP_VIRTUAL_NODE_SIZE";
pub(crate) const LOG_ENV: &str = "DEEPEP_LOG";
/// DeepEP's NUM_TIMEOUT_CYCLES equivalent (100 s).
pub(crate) const DEFAULT_GPU_TIMEOUT_SECS: f64 = 100.0;
/// One day: longer is indistinguishable from a hang for a job, and keeps ns in u64.
pub(crate) const MAX_GPU_TIMEOUT_SECS: f64 = 86400.0;

/// The variable's value; `None` when unset. A non-UTF-8 value is kept (lossily)
/// so that it is reported as bad rather than treated as unset.
pub(crate) fn read(name: &str) -> Option<String> {
    std::env::var_os(name).map(|v| v.to_string_lossy().into_owned())
}

fn bad(name: &str, value: &str, accepted: &str) -> Error {
    Error::invalid(format!("environment variable {name}={value:?} is invalid: accepted {accepted}"))
}

/// Seconds of every bounded GPU wait: positive, finite, at most [`MAX_GPU_TIMEOUT_SECS`].
pub(crate) fn parse_gpu_timeout_secs(value: Option<&str>) -> Result<f64> {
    let Some(text) = value else { return Ok(DEFAULT_GPU_TIMEOUT_SECS) };
    let accepted = format!("seconds, a number > 0 and <= {MAX_GPU_TIMEOUT_SECS} (default {DEFAULT_GPU_TIMEOUT_SECS})");
    match text.trim().parse::<f64>() {
        // The comparison also rejects NaN and inf.
        Ok(secs) if secs > 0.0 && secs <= MAX_GPU_TIMEOUT_SECS => Ok(secs),
        _ => Err(bad(GPU_TIMEOUT_ENV, text, &accepted)),
    }
}

/// Ranks per virtual node: a positive divisor of `num_ranks`; `num_ranks` when unset.
pub(crate) fn parse_virtual_node_size(value: Option<&str>, num_ranks: i32) -> Result<i32> {
    let Some(text) = value else { return Ok(num_ranks) };
    match text.trim().parse::<i32>() {
        Ok(n) if n > 0 && num_ranks % n == 0 => Ok(n),
        _ => Err(bad(
            VIRTUAL_NODE_ENV,
            text,
            &format!("a positive integer dividing the rank count ({num_ranks}): ranks per virtual node"),
        )),
    }
}

/// Whether DEEPEP_VIRTUAL_NODE_SIZE splits `num_ranks` into several nodes (a bad value: no; Buffer
/// creation reports it).
pub(crate) fn virtual_nodes(num_ranks: i32) -> bool {
    parse_virtual_node_size(read(VIRTUAL_NODE_ENV).as_deref(), num_ranks).is_ok_and(|n| n < num_ranks)
}

/// `error`, `warn`, `info` or `debug` (any case); `warn` when unset.
pub(crate) fn parse_log_level(value: Option<&str>) -> Result<Level> {
    let Some(text) = value else { return Ok(Level::Warn) };
    Level::ALL
        .into_iter()
        .find(|l| l.name().eq_ignore_ascii_case(text.trim()))
        .ok_or_else(|| bad(LOG_ENV, text, "error, warn, info or debug (default warn)"))
}

/// What the environment says for one Buffer, read at its creation.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Settings {
    pub(crate) gpu_timeout_secs: f64,
    pub(crate) virtual_node_size: i32,
    pub(crate) log_level: Level,
}

impl Settings {
    pub(crate) fn from_env(num_ranks: i32) -> Result<Self> {
        Ok(Self {
            gpu_timeout_secs: parse_gpu_timeout_secs(read(GPU_TIMEOUT_ENV).as_deref())?,
            virtual_node_size: parse_virtual_node_size(read(VIRTUAL_NODE_ENV).as_deref(), num_ranks)?,
            log_level: parse_log_level(read(LOG_ENV).as_deref())?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::DeepepStatus;

    fn rejects<T: std::fmt::Debug>(r: Result<T>, name: &str, value: &str) {
        let e = r.expect_err(value);
        assert_eq!(e.status, DeepepStatus::DEEPEP_ERROR_INVALID_ARGUMENT);
        assert!(e.message.contains(name) && e.message.contains(&format!("{value:?}")), "{}", e.message);
        assert!(e.message.contains("accepted"), "{}", e.message);
    }

    #[test]
    fn gpu_timeout() {
        assert_eq!(parse_gpu_timeout_secs(None).unwrap(), 100.0);
        assert_eq!(parse_gpu_timeout_secs(Some("20")).unwrap(), 20.0);
        assert_eq!(parse_gpu_timeout_secs(Some(" 0.5 ")).unwrap(), 0.5);
        assert_eq!(parse_gpu_timeout_secs(Some("86400")).unwrap(), 86400.0);
        for v in ["", "abc", "10s", "0", "-0", "-5", "inf", "-inf", "infinity", "nan", "NaN", "86400.5", "1e300"] {
            rejects(parse_gpu_timeout_secs(Some(v)), GPU_TIMEOUT_ENV, v);
        }
    }

    #[test]
    fn virtual_node_size() {
        assert_eq!(parse_virtual_node_size(None, 8).unwrap(), 8);
        assert_eq!(parse_virtual_node_size(Some("2"), 8).unwrap(), 2);
        assert_eq!(parse_virtual_node_size(Some("8"), 8).unwrap(), 8);
        for v in ["", "x", "2.0", "0", "-2", "3", "16", "99999999999"] {
            rejects(parse_virtual_node_size(Some(v), 8), VIRTUAL_NODE_ENV, v);
        }
    }

    #[test]
    fn log_level() {
        assert_eq!(parse_log_level(None).unwrap(), Level::Warn);
        assert_eq!(parse_log_level(Some("info")).unwrap(), Level::Info);
        assert_eq!(parse_log_level(Some("DEBUG")).unwrap(), Level::Debug);
        assert_eq!(parse_log_level(Some("error")).unwrap(), Level::Error);
        for v in ["", "verbose", "2", "warning", "trace"] {
            rejects(parse_log_level(Some(v)), LOG_ENV, v);
        }
    }
}
