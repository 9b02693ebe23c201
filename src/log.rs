//! Messages to stderr, filtered by `DEEPEP_LOG` (error|warn|info|debug, default
//! warn), each prefixed `[deepep-nccl rank R]` so interleaved ranks stay readable.
use std::fmt;
use std::io::Write;
use std::sync::OnceLock;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Level {
    Error,
    Warn,
    Info,
    Debug,
}

impl Level {
    pub(crate) const ALL: [Self; 4] = [Self::Error, Self::Warn, Self::Info, Self::Debug];
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Error => "error",
            Self::Warn => "warn",
            Self::Info => "info",
            Self::Debug => "debug",
        }
    }
}

/// Parsed once per process. A bad value logs at the default here; Buffer
/// creation reports it as an error (crate::env::Settings).
pub(crate) fn max_level() -> Level {
    static LEVEL: OnceLock<Level> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        crate::env::parse_log_level(crate::env::read(crate::env::LOG_ENV).as_deref()).unwrap_or(Level::Warn)
    })
}

pub(crate) fn enabled(level: Level) -> bool {
    level <= max_level()
}

/// One line as printed (without the newline).
pub(crate) fn format_line(level: Level, rank: Option<i32>, message: fmt::Arguments<'_>) -> String {
    match rank {
        Some(r) => format!("[deepep-nccl rank {r}] {}: {message}", level.name()),
        None => format!("[deepep-nccl] {}: {message}", level.name()),
    }
}

pub(crate) fn emit(level: Level, rank: Option<i32>, message: fmt::Arguments<'_>) {
    if enabled(level) {
        // A closed stderr must not turn into a panic (eprintln! would).
        let _ = writeln!(std::io::stderr().lock(), "{}", format_line(level, rank, message));
    }
}

/// `log_at!(Level::Info, rank, "fmt", args)`; `rank` is an `Option<i32>`.
macro_rules! log_at {
    ($level:expr, $rank:expr, $($fmt:tt)+) => {
        if $crate::log::enabled($level) {
            $crate::log::emit($level, $rank, format_args!($($fmt)+))
        }
    };
}
macro_rules! log_error { ($rank:expr, $($fmt:tt)+) => { $crate::log::log_at!($crate::log::Level::Error, Some($rank), $($fmt)+) }; }
macro_rules! log_warn { ($rank:expr, $($fmt:tt)+) => { $crate::log::log_at!($crate::log::Level::Warn, Some($rank), $($fmt)+) }; }

/// Wall time of named phases (Buffer creation and teardown), one DEEPEP_LOG=debug line: where
/// a create/destroy cycle's time goes (NCCL init, window registration, devComm, checks).
pub(crate) struct PhaseTimes {
    what: &'static str,
    last: std::time::Instant,
    phases: Vec<(&'static str, std::time::Duration)>,
}

impl PhaseTimes {
    pub(crate) fn start(what: &'static str) -> Self {
        Self { what, last: std::time::Instant::now(), phases: Vec::new() }
    }
    /// Ends the phase `name` now (the next one starts).
    pub(crate) fn mark(&mut self, name: &'static str) {
        let now = std::time::Instant::now();
        self.phases.push((name, now - self.last));
        self.last = now;
    }
    pub(crate) fn line(&self) -> String {
        let total: std::time::Duration = self.phases.iter().map(|(_, d)| *d).sum();
        let parts: Vec<String> =
            self.phases.iter().map(|(n, d)| format!("{n} {:.1}", d.as_secs_f64() * 1e3)).collect();
        format!("{} took {:.1} ms: {} (ms)", self.what, total.as_secs_f64() * 1e3, parts.join(", "))
    }
    pub(crate) fn report(&self, rank: i32) {
        log_at!(Level::Debug, Some(rank), "{}", self.line());
    }
}

// Crate-internal: the macros name pub(crate) items.
pub(crate) use {log_at, log_error, log_warn};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_prefixed_and_levels_ordered() {
        assert_eq!(format_line(Level::Warn, Some(3), format_args!("x {}", 1)), "[deepep-nccl rank 3] warn: x 1");
        assert_eq!(format_line(Level::Error, None, format_args!("y")), "[deepep-nccl] error: y");
        assert!(Level::Error < Level::Warn && Level::Warn < Level::Info && Level::Info < Level::Debug);
    }

    #[test]
    fn phase_times_name_every_phase_and_the_total() {
        let mut t = PhaseTimes::start("create");
        t.mark("nccl init");
        t.mark("window");
        let line = t.line();
        assert!(line.starts_with("create took ") && line.contains("nccl init ") && line.contains(", window "), "{line}");
    }
}
