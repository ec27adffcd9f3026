//! The crate's one retry-on-out-of-memory loop: try, and on [`Error::OutOfMemory`] give
//! memory back and try again, waiting (bounded) between attempts. The
//! [`Retry`](crate::adaptors::Retry) adaptor, [`BestFit`](super::BestFit),
//! [`StreamSafe`](super::StreamSafe) and [`AsyncPool`](super::AsyncPool) differ only in what
//! an attempt, a release and a wait are, which they pass in.

use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// How an allocation went through [`on_out_of_memory`].
pub(crate) struct Retried<T> {
    /// What the last attempt gave, or what a release served.
    pub result: Result<T>,
    /// Attempts that failed with out-of-memory, the last one included when `result` is one.
    pub failed: u64,
    /// Time from the first attempt's failure to the end; zero if it did not run out of memory.
    pub waited: Duration,
    /// The error of a release that failed; the attempt after it was the last.
    pub release_error: Option<Error>,
}

impl<T> Retried<T> {
    /// Whether the result is a success that came only after an attempt ran out of memory.
    pub fn retried(&self) -> bool {
        self.result.is_ok() && self.failed > 0
    }

    /// Whether the loop ended on an out-of-memory error.
    pub fn out_of_memory(&self) -> bool {
        matches!(&self.result, Err(e) if e.is_out_of_memory())
    }
}

/// Runs `attempt`; while it fails with out-of-memory, runs `release` and attempts again,
/// until `timeout` has passed since the first failure, calling `wait` with the time left
/// between attempts (it returns early when memory may have been freed). A zero timeout still
/// makes one release and one more attempt. Other errors end the loop at once, and so does an
/// out-of-memory error for more than the device has in all
/// ([`exceeds_device`](crate::error::OutOfMemory::exceeds_device)): no release is made
/// (DESIGN.md, Note [requests beyond the device]).
///
/// `release` gives memory back before the next attempt; it returns `Ok(Some(_))` when memory
/// freed meanwhile already serves the request (the attempt is then not made), and an error
/// when it could not give memory back: one more attempt is made (memory may have been freed
/// meanwhile) and the loop ends, reporting the error in [`Retried::release_error`].
pub(crate) fn on_out_of_memory<T>(
    timeout: Duration,
    mut attempt: impl FnMut() -> Result<T>,
    mut release: impl FnMut() -> Result<Option<T>>,
    mut wait: impl FnMut(Duration),
) -> Retried<T> {
    let first = attempt();
    match &first {
        Err(Error::OutOfMemory(report)) if report.exceeds_device() => {
            return Retried { result: first, failed: 1, waited: Duration::ZERO, release_error: None }
        }
        Err(Error::OutOfMemory(_)) => {}
        _ => return Retried { result: first, failed: 0, waited: Duration::ZERO, release_error: None },
    }
    let start = Instant::now();
    let mut failed = 1;
    loop {
        let (result, release_error) = match release() {
            Ok(Some(served)) => (Ok(served), None),
            Ok(None) => (attempt(), None),
            Err(e) => (attempt(), Some(e)),
        };
        let out_of_memory = matches!(&result, Err(e) if e.is_out_of_memory());
        failed += u64::from(out_of_memory);
        let left = timeout.saturating_sub(start.elapsed());
        if !out_of_memory || release_error.is_some() || left.is_zero() {
            return Retried { result, failed, waited: start.elapsed(), release_error };
        }
        wait(left);
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;
    use crate::error::OutOfMemory;

    fn oom() -> Error {
        Error::oom(OutOfMemory::default())
    }

    #[test]
    fn a_first_success_or_other_error_makes_no_release() {
        let released = Cell::new(0);
        let r = on_out_of_memory(
            Duration::from_secs(1),
            || Ok(7),
            || {
                released.set(released.get() + 1);
                Ok(None)
            },
            |_| (),
        );
        assert_eq!((r.result.unwrap(), r.failed, released.get()), (7, 0, 0));
        let r: Retried<()> = on_out_of_memory(
            Duration::from_secs(1),
            || Err(Error::InvalidArgument("no".into())),
            || unreachable!(),
            |_| (),
        );
        assert!(matches!(r.result, Err(Error::InvalidArgument(_))) && r.failed == 0 && !r.retried());
    }

    #[test]
    fn a_request_beyond_the_device_makes_no_release() {
        let beyond = || {
            Error::oom(OutOfMemory { requested: 3 << 30, device_total: 2 << 30, ..OutOfMemory::default() })
        };
        let r: Retried<()> =
            on_out_of_memory(Duration::from_secs(1), || Err(beyond()), || unreachable!(), |_| unreachable!());
        assert!(r.out_of_memory() && r.failed == 1 && r.waited.is_zero());
    }

    #[test]
    fn a_zero_timeout_releases_and_attempts_once_more() {
        let (attempts, releases) = (Cell::new(0), Cell::new(0));
        let r: Retried<()> = on_out_of_memory(
            Duration::ZERO,
            || {
                attempts.set(attempts.get() + 1);
                Err(oom())
            },
            || {
                releases.set(releases.get() + 1);
                Ok(None)
            },
            |_| panic!("no wait with a zero timeout"),
        );
        assert_eq!((attempts.get(), releases.get(), r.failed), (2, 1, 2));
        assert!(r.out_of_memory() && !r.retried());
    }

    #[test]
    fn waits_between_attempts_until_one_succeeds() {
        let (attempts, waits) = (Cell::new(0), Cell::new(0));
        let r = on_out_of_memory(
            Duration::from_secs(10),
            || {
                attempts.set(attempts.get() + 1);
                if attempts.get() < 4 {
                    Err(oom())
                } else {
                    Ok("made")
                }
            },
            || Ok(None),
            |left| {
                assert!(left > Duration::ZERO && left <= Duration::from_secs(10));
                waits.set(waits.get() + 1);
            },
        );
        assert_eq!((r.result.as_ref().ok(), r.failed, waits.get()), (Some(&"made"), 3, 2));
        assert!(r.retried());
    }

    #[test]
    fn the_timeout_bounds_the_loop() {
        let timeout = Duration::from_millis(30);
        let start = Instant::now();
        let r: Retried<()> = on_out_of_memory(
            timeout,
            || Err(oom()),
            || Ok(None),
            |left| std::thread::sleep(left.min(Duration::from_millis(2))),
        );
        assert!(r.out_of_memory() && r.failed > 2);
        assert!(r.waited >= timeout && start.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn a_release_can_serve_and_a_failed_release_ends_after_one_more_attempt() {
        let r = on_out_of_memory(Duration::from_secs(10), || Err(oom()), || Ok(Some(3)), |_| ());
        assert_eq!((r.result.unwrap(), r.failed), (3, 1));
        let attempts = Cell::new(0);
        let r: Retried<()> = on_out_of_memory(
            Duration::from_secs(10),
            || {
                attempts.set(attempts.get() + 1);
                Err(oom())
            },
            || Err(Error::Internal("cannot release".into())),
            |_| panic!("no wait after a failed release"),
        );
        assert_eq!((attempts.get(), r.failed), (2, 2));
        assert!(matches!(r.release_error, Some(Error::Internal(_))));
    }
}
