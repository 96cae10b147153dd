//! Run limits shared by every layer of tumble: a memory budget and cancellation; and the one
//! rule by which every crate reads its environment switches ([`env_flag`]).
//!
//! **Memory.** A binary installs [`CountingAlloc`] around its global allocator; it keeps the
//! number of live heap bytes (tensors, the dataflow graph, the interpreter's pending evaluations,
//! decoded input: everything). Allocation never fails on the budget — a global allocator that
//! returns null aborts the process — so the places where a run grows ask instead, cheaply and
//! often enough to stop within a fraction of a second of crossing the limit:
//! - an operator about to allocate its output checks the output's size first ([`reserve`]),
//!   so `zeros(shape=[100000, 100000])` is refused before a byte is allocated;
//! - the interpreter polls [`poll`] every few thousand steps (a recursion without a base case,
//!   a dataflow graph that only grows);
//! - input readers check a file's size before reading it and poll while decoding.
//!
//! Without the counting allocator (a library user's own allocator) only the [`reserve`] checks
//! apply, against the bytes the caller asks for.
//!
//! **Cancellation.** [`interrupt`] (a SIGINT handler calls it) makes the next [`poll`] fail, so a
//! run stops at its next safe point and writes nothing.
//!
//! **Time.** [`set_time_limit`] (the CLI's `--timeout`) makes every [`poll`] after the deadline
//! fail the same way: a recursion without a base case in constant memory, which no memory budget
//! stops, stops there.

mod prefault;
pub use prefault::{prefault, PREFAULT_MIN_BYTES};

use std::alloc::{GlobalAlloc, Layout};
use std::cell::Cell;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicIsize, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

/// Whether the environment switch `name` (`TUMBLE_NO_MEMO`, `TUMBLE_HUGE_WEIGHTS`, ...) is on:
/// set to anything but an empty value, `0`, `false`, `no` or `off` (any case), so that
/// `TUMBLE_NO_MEMO=0` leaves the memo on as it reads. (Until the sixty-third session any value,
/// `0` included, turned a switch on.)
pub fn env_flag(name: &str) -> bool {
    std::env::var_os(name).is_some_and(|v| flag_value_on(&v))
}

/// [`env_flag`] of a literal name, read once per process where it is asked (switches are set
/// before a run starts): each call site keeps its answer in a static of its own, so a check on a
/// hot path is one load.
#[macro_export]
macro_rules! switch_on {
    ($name:literal) => {{
        static ON: ::std::sync::OnceLock<bool> = ::std::sync::OnceLock::new();
        *ON.get_or_init(|| $crate::env_flag($name))
    }};
}

/// [`env_flag`]'s reading of a switch's value.
fn flag_value_on(value: &std::ffi::OsStr) -> bool {
    let v = value.to_string_lossy();
    let v = v.trim();
    !(v.is_empty()
        || v == "0"
        || ["false", "no", "off"]
            .iter()
            .any(|f| v.eq_ignore_ascii_case(f)))
}

/// Live heap bytes, summed over threads (each thread adds its changes in steps of [`FLUSH`]).
static USED: AtomicIsize = AtomicIsize::new(0);
/// The budget in bytes; 0 is no limit.
static LIMIT: AtomicUsize = AtomicUsize::new(0);
/// Set once the counting allocator has counted something: `in_use` means something.
static COUNTING: AtomicBool = AtomicBool::new(false);
static INTERRUPTED: AtomicBool = AtomicBool::new(false);
static WATCHED: OnceLock<Arc<AtomicBool>> = OnceLock::new();
/// The time limit and when it runs out (see [`set_time_limit`]).
static DEADLINE: OnceLock<(std::time::Duration, std::time::Instant)> = OnceLock::new();
/// Set once a [`poll`] (or [`halted`]) has told a run that the time limit passed: the run was
/// stopped by it, not merely finished (or failed otherwise) after it.
static TIMED_OUT_SEEN: AtomicBool = AtomicBool::new(false);

/// A thread's allocations reach the shared counter in steps of this many bytes, so that the
/// allocator's fast path touches only a thread-local cell (an atomic per allocation cost the
/// interpreter several percent).
const FLUSH: isize = 256 << 10;

thread_local! {
    static DELTA: Cell<isize> = const { Cell::new(0) };
}

#[inline(always)]
fn count(bytes: isize) {
    let pending = DELTA.try_with(|d| {
        let v = d.get() + bytes;
        // |v| < FLUSH, as one unsigned comparison.
        if (v + FLUSH) as usize >= 2 * FLUSH as usize {
            d.set(0);
            v
        } else {
            d.set(v);
            0
        }
    });
    match pending {
        Ok(0) => {}
        Ok(v) => share(v),
        // The thread's counter is gone (its exit): count straight into the shared one.
        Err(_) => share(bytes),
    }
}

#[cold]
#[inline(never)]
fn share(bytes: isize) {
    USED.fetch_add(bytes, Ordering::Relaxed);
    if !COUNTING.load(Ordering::Relaxed) {
        COUNTING.store(true, Ordering::Relaxed);
    }
}

/// A global allocator that counts live bytes for the memory budget and otherwise is `A`.
pub struct CountingAlloc<A>(pub A);

// SAFETY: every method forwards to the inner allocator with the caller's arguments unchanged and
// only adds bookkeeping on the side; the contract of `GlobalAlloc` is the inner allocator's.
unsafe impl<A: GlobalAlloc> GlobalAlloc for CountingAlloc<A> {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded as is (see the impl).
        let p = unsafe { self.0.alloc(layout) };
        if !p.is_null() {
            count(layout.size() as isize);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded as is (see the impl).
        let p = unsafe { self.0.alloc_zeroed(layout) };
        if !p.is_null() {
            count(layout.size() as isize);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded as is (see the impl).
        unsafe { self.0.dealloc(ptr, layout) };
        count(-(layout.size() as isize));
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded as is (see the impl).
        let p = unsafe { self.0.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            count(new_size as isize - layout.size() as isize);
        }
        p
    }
}

/// Live heap bytes as the counting allocator sees them (0 without it); accurate to within
/// 256 KiB per thread.
pub fn in_use() -> usize {
    let own = DELTA.try_with(Cell::get).unwrap_or(0);
    (USED.load(Ordering::Relaxed) + own).max(0) as usize
}

/// Whether a counting allocator is installed and has counted.
pub fn counting() -> bool {
    COUNTING.load(Ordering::Relaxed)
}

/// Sets the budget (`None`: no limit).
pub fn set_limit(bytes: Option<usize>) {
    LIMIT.store(bytes.unwrap_or(0), Ordering::Relaxed);
}

/// The budget in bytes, if any.
pub fn limit() -> Option<usize> {
    match LIMIT.load(Ordering::Relaxed) {
        0 => None,
        n => Some(n),
    }
}

/// Why a run must stop.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Stop {
    /// The memory budget is (or would be) exceeded.
    Memory {
        /// Bytes in use when it was noticed.
        in_use: usize,
        /// Bytes about to be allocated (0 when noticed by polling).
        more: usize,
        limit: usize,
    },
    /// The run was interrupted (Ctrl-C).
    Interrupted,
    /// The run passed its time limit ([`set_time_limit`]).
    TimedOut { limit: std::time::Duration },
}

/// How a [`Stop::Memory`] reads, first words: a message that carries it, however it was wrapped
/// (a run error naming its instance), is of a run stopped by the memory budget.
pub const MEMORY_EXCEEDED: &str = "memory budget exceeded";

/// Whether `message` is (or wraps) a [`Stop::Memory`]'s.
pub fn is_memory_message(message: &str) -> bool {
    message.contains(MEMORY_EXCEEDED)
}

impl fmt::Display for Stop {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Stop::Memory {
                in_use,
                more: 0,
                limit,
            } => write!(
                f,
                "{MEMORY_EXCEEDED}: {} in use, the limit is {} (raise it with --max-memory)",
                bytes_text(*in_use),
                bytes_text(*limit)
            ),
            Stop::Memory {
                in_use,
                more,
                limit,
            } => write!(
                f,
                "{MEMORY_EXCEEDED}: this needs {} more with {} in use, the limit is {} (raise it with --max-memory)",
                bytes_text(*more),
                bytes_text(*in_use),
                bytes_text(*limit)
            ),
            Stop::Interrupted => write!(f, "interrupted"),
            Stop::TimedOut { limit } => write!(
                f,
                "the time limit of {} passed (raise it with --timeout)",
                duration_text(*limit)
            ),
        }
    }
}

/// Checks that `more` bytes can be allocated within the budget, before allocating them.
pub fn reserve(more: usize) -> Result<(), Stop> {
    let Some(limit) = limit() else {
        return Ok(());
    };
    let in_use = in_use();
    if in_use.saturating_add(more) > limit {
        return Err(Stop::Memory {
            in_use,
            more,
            limit,
        });
    }
    Ok(())
}

/// Whether the run must stop now: interrupted, past its time limit, or over its memory budget —
/// the process's, or the calling thread's own run's ([`with_run_stop`]).
pub fn poll() -> Result<(), Stop> {
    if let Some(stop) = stop_requested() {
        return Err(stop);
    }
    reserve(0)
}

/// Whether the work on this thread must stop for a reason that is not its own: the process's
/// ([`halted`]), or its run's ([`with_run_stop`]) — cancelled, or past the run's deadline.
pub fn stop_requested() -> Option<Stop> {
    halted().or_else(|| {
        RUN_STOP
            .try_with(|s| s.borrow().as_ref().and_then(RunStop::stopped))
            .ok()
            .flatten()
    })
}

/// One computation's own reasons to stop, beside the process's ([`interrupt`],
/// [`set_time_limit`]): a cancellation by its caller, or a deadline of its own. A library call
/// (Python's `Model.run(timeout=..)`, its Ctrl-C) makes one and runs under it
/// ([`with_run_stop`]); [`poll`] on any thread running for that call then fails with
/// [`Stop::Interrupted`] once it is cancelled, or [`Stop::TimedOut`] past its deadline, while
/// other calls of the process go on. Clones share the state.
#[derive(Clone, Debug)]
pub struct RunStop(Arc<RunStopState>);

#[derive(Debug)]
struct RunStopState {
    cancelled: AtomicBool,
    /// The limit and when it passes.
    deadline: Option<(std::time::Duration, std::time::Instant)>,
    /// A safe point has stopped the run for its deadline (a run that failed for its own reasons
    /// after the deadline passed did not time out).
    deadline_seen: AtomicBool,
}

impl RunStop {
    /// A stop with a deadline `limit` from now (`None`: cancellation only). A limit past what
    /// the clock can represent is no limit.
    pub fn new(limit: Option<std::time::Duration>) -> RunStop {
        let deadline = limit.and_then(|l| Some((l, std::time::Instant::now().checked_add(l)?)));
        RunStop(Arc::new(RunStopState {
            cancelled: AtomicBool::new(false),
            deadline,
            deadline_seen: AtomicBool::new(false),
        }))
    }

    /// Asks the computation to stop at its next [`poll`].
    pub fn cancel(&self) {
        self.0.cancelled.store(true, Ordering::Relaxed);
    }

    /// The deadline's limit, once it has passed.
    fn timed_out(&self) -> Option<std::time::Duration> {
        self.0
            .deadline
            .filter(|(_, at)| std::time::Instant::now() >= *at)
            .map(|(limit, _)| limit)
    }

    /// The deadline's limit, if a safe point stopped the run for it ([`poll`] failed with
    /// [`Stop::TimedOut`] on it): what tells a run that timed out from one that failed for its
    /// own reasons after the deadline passed.
    pub fn stopped_by_deadline(&self) -> Option<std::time::Duration> {
        self.0
            .deadline_seen
            .load(Ordering::Relaxed)
            .then_some(self.0.deadline.map(|(limit, _)| limit))
            .flatten()
    }

    fn stopped(&self) -> Option<Stop> {
        if self.0.cancelled.load(Ordering::Relaxed) {
            return Some(Stop::Interrupted);
        }
        let limit = self.timed_out()?;
        self.0.deadline_seen.store(true, Ordering::Relaxed);
        Some(Stop::TimedOut { limit })
    }
}

thread_local! {
    static RUN_STOP: std::cell::RefCell<Option<RunStop>> = const { std::cell::RefCell::new(None) };
}

/// Runs `f` with `stop` as this thread's run stop (see [`RunStop`]); the thread's previous one
/// comes back afterwards, also when `f` panics. A thread that works for the same computation
/// (a worker of a job) runs under the same stop: [`run_stop`] gives it.
pub fn with_run_stop<R>(stop: Option<RunStop>, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<RunStop>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let prev = self.0.take();
            let _ = RUN_STOP.try_with(|s| *s.borrow_mut() = prev);
        }
    }
    let prev = RUN_STOP.try_with(|s| s.replace(stop)).ok().flatten();
    let _restore = Restore(prev);
    f()
}

/// This thread's run stop, if it runs under one ([`with_run_stop`]).
pub fn run_stop() -> Option<RunStop> {
    RUN_STOP.try_with(|s| s.borrow().clone()).ok().flatten()
}

/// Whether the whole command must stop now for a reason that is not one run's own: interrupted,
/// or past its time limit (which is then noted as what stopped it: [`halt_seen`]).
pub fn halted() -> Option<Stop> {
    if interrupted() {
        return Some(Stop::Interrupted);
    }
    let limit = timed_out()?;
    TIMED_OUT_SEEN.store(true, Ordering::Relaxed);
    Some(Stop::TimedOut { limit })
}

/// What stopped the command, once [`poll`] or [`halted`] has said so: an interrupt, or the time
/// limit. `None` for a command that finished, or failed for its own reasons, even after the
/// deadline (no safe point saw it).
pub fn halt_seen() -> Option<Stop> {
    if interrupted() {
        return Some(Stop::Interrupted);
    }
    if !TIMED_OUT_SEEN.load(Ordering::Relaxed) {
        return None;
    }
    DEADLINE.get().map(|&(limit, _)| Stop::TimedOut { limit })
}

/// Makes every [`poll`] fail once `limit` has passed from now. Once per process: a second call
/// keeps the first limit. A limit past what the clock can represent is no limit.
pub fn set_time_limit(limit: std::time::Duration) {
    if let Some(at) = std::time::Instant::now().checked_add(limit) {
        let _ = DEADLINE.set((limit, at));
    }
}

/// The time limit, when it has passed.
pub fn timed_out() -> Option<std::time::Duration> {
    DEADLINE
        .get()
        .filter(|(_, at)| std::time::Instant::now() >= *at)
        .map(|&(limit, _)| limit)
}

/// A duration as a person writes it: `1.5 s`, `2 min`, `250 ms`.
pub fn duration_text(d: std::time::Duration) -> String {
    let s = d.as_secs_f64();
    if s < 0.001 {
        format!("{} µs", (s * 1e6).round())
    } else if s < 1.0 {
        format!("{} ms", (s * 1000.0).round())
    } else if s < 120.0 {
        format!("{} s", (s * 10.0).round() / 10.0)
    } else {
        format!("{} min", (s / 6.0).round() / 10.0)
    }
}

/// Parses a duration: a number of seconds, or a number with a unit `ms`, `s`, `m` or `min`
/// (minutes) or `h` (`30`, `1.5s`, `10m`, `250ms`, `1e3`); at least 1 ms and under ~30 years.
pub fn parse_duration(text: &str) -> Result<std::time::Duration, String> {
    let t = text.trim();
    let lower = t.to_ascii_lowercase();
    // Longest unit first (`ms` before `s`, `min` before `m`); no unit: seconds.
    let (number, scale) = [
        ("ms", 0.001),
        ("min", 60.0),
        ("s", 1.0),
        ("m", 60.0),
        ("h", 3600.0),
    ]
    .iter()
    .find_map(|&(unit, scale)| lower.strip_suffix(unit).map(|n| (n.trim_end(), scale)))
    .unwrap_or((lower.as_str(), 1.0));
    let value: f64 = number.parse().map_err(|_| {
        format!(
            "`{}` is not a duration (a number of seconds, or with a unit ms, s, m or h: `30`, \
             `1.5s`, `10m`)",
            echo(text)
        )
    })?;
    let secs = value * scale;
    if !secs.is_finite() || !(0.001..=1e9).contains(&secs) {
        return Err(format!(
            "`{}`: a time limit must be at least 1 ms and under ~30 years",
            echo(text)
        ));
    }
    Ok(std::time::Duration::from_secs_f64(secs))
}

/// Asks every running computation to stop at its next [`poll`].
pub fn interrupt() {
    INTERRUPTED.store(true, Ordering::Relaxed);
}

/// Ends an [`interrupt`]: later polls go on (a library's caller that interrupted one call, by
/// Ctrl-C in Python, makes more calls in the same process).
pub fn clear_interrupt() {
    INTERRUPTED.store(false, Ordering::Relaxed);
}

/// A flag that a signal handler sets (the CLI's SIGINT handler): once set, the run is interrupted.
pub fn watch_interrupt(flag: Arc<AtomicBool>) {
    // A second call keeps the first flag: there is one handler per process.
    let _ = WATCHED.set(flag);
}

pub fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::Relaxed) || WATCHED.get().is_some_and(|f| f.load(Ordering::Relaxed))
}

/// Reads a whole file within the memory budget: a regular file's size is checked before reading
/// it; a stream (a pipe, `/dev/random`) is read in chunks, each checked before it is read, so an
/// endless one stops at the budget instead of growing until the machine kills the process.
pub fn read_file(path: &std::path::Path) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let mut file = std::fs::File::open(path)?;
    let meta = file.metadata()?;
    if meta.is_dir() {
        return Err(std::io::Error::other("it is a directory"));
    }
    let mut out = Vec::new();
    // A regular file is checked whole, once; a stream chunk by chunk, as it grows.
    let stream = !meta.is_file();
    if !stream {
        let len = usize::try_from(meta.len()).unwrap_or(usize::MAX);
        reserve(len).map_err(|stop| {
            std::io::Error::other(format!("it is {} long: {stop}", bytes_text(len)))
        })?;
        out.reserve_exact(len);
    }
    const CHUNK: usize = 1 << 20;
    loop {
        // A stream's buffer grows here, checked first: the new block is allocated while the old
        // one is still held (left to `read_to_end`, it doubled unchecked: 5 GiB in use under a
        // 3 GiB budget, and past the machine's memory under the default one).
        let grow = if stream && out.capacity() - out.len() < CHUNK {
            out.capacity().saturating_mul(2).max(out.len() + CHUNK)
        } else {
            0
        };
        poll().and_then(|()| reserve(grow)).map_err(|stop| {
            std::io::Error::other(format!("after {} read: {stop}", bytes_text(out.len())))
        })?;
        if grow > 0 {
            out.reserve_exact(grow - out.len());
        }
        if (&mut file).take(CHUNK as u64).read_to_end(&mut out)? == 0 {
            return Ok(out);
        }
    }
}

/// `14678698` → "14,678,698", for counts in limit messages.
pub fn count_text(n: usize) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// `1536` → "1.5 KiB", in binary units.
pub fn bytes_text(n: usize) -> String {
    const UNITS: [&str; 6] = ["bytes", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} bytes")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// Parses a size: a number of bytes with an optional binary unit — `K`, `M`, `G`, `T` (or
/// `KiB`, `MB`, …: all mean powers of 1024) — e.g. `512M`, `1.5G`, `4GiB`, `1000000`; `none` or
/// `unlimited` is no limit.
pub fn parse_size(text: &str) -> Result<Option<usize>, String> {
    let t = text.trim();
    if t.eq_ignore_ascii_case("none") || t.eq_ignore_ascii_case("unlimited") {
        return Ok(None);
    }
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let unit = unit.trim().to_ascii_lowercase();
    let shift = match unit.as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => {
            return Err(format!(
                "`{}` is not a size: use a number with an optional unit K, M, G or T (e.g. 512M, 4G), or `none`",
                echo(text)
            ))
        }
    };
    let value: f64 = number.parse().map_err(|_| {
        format!(
            "`{}` is not a size: use a number with an optional unit K, M, G or T (e.g. 512M, 4G), or `none`",
            echo(text)
        )
    })?;
    let bytes = value * (1u64 << shift) as f64;
    if !bytes.is_finite() || bytes >= usize::MAX as f64 {
        return Err(format!("`{}` is too large", echo(text)));
    }
    if bytes < 1.0 {
        return Err(format!(
            "`{}` is no memory at all; give a positive size or `none`",
            echo(text)
        ));
    }
    Ok(Some(bytes as usize))
}

/// User text quoted in a message, cut to 80 characters with its length (an unknown 50 MB JSON key
/// or environment value is not worth printing whole). The one limit on echoed input: `tumble_io`
/// re-exports it for instance decoding and the CLI.
pub fn echo(s: &str) -> String {
    match s.char_indices().nth(80) {
        Some((at, _)) => format!("{}… ({} bytes in all)", &s[..at], s.len()),
        None => s.to_string(),
    }
}

/// The default budget: half of the machine's memory, or of the control group's limit where that
/// is smaller (a container), or of the process's address-space or data-size limit (`ulimit -v`,
/// `ulimit -d`) where that is smaller still — past those an allocation fails and aborts the process
/// instead of stopping the run; `None` where none can be read.
pub fn default_limit() -> Option<usize> {
    let rlimit = std::fs::read_to_string("/proc/self/limits")
        .ok()
        .and_then(|text| process_memory_limit(&text));
    let machine = machine_limit();
    match (machine, rlimit) {
        (Some(m), Some(r)) => Some(m.min(r / 2)),
        (m, r) => m.or(r.map(|r| r / 2)),
    }
}

/// The smaller soft limit of "Max address space" and "Max data size" in `/proc/self/limits`'s
/// text, in bytes (`None`: both unlimited or unreadable).
fn process_memory_limit(text: &str) -> Option<usize> {
    text.lines()
        .filter(|l| l.starts_with("Max address space") || l.starts_with("Max data size"))
        .filter_map(|l| {
            // "Max address space   4096000000   unlimited   bytes": the first number is the soft one.
            l.split_whitespace()
                .find(|w| w.bytes().all(|b| b.is_ascii_digit()) || *w == "unlimited")
                .and_then(|w| w.parse::<usize>().ok())
        })
        .min()
}

/// Half of the machine's memory, or of the control group's limit where that is smaller.
fn machine_limit() -> Option<usize> {
    let total = std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| {
        m.lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|rest| {
                rest.trim()
                    .trim_end_matches("kB")
                    .trim()
                    .parse::<usize>()
                    .ok()
            })
            .map(|kib| kib.saturating_mul(1024))
    });
    let cgroup = std::fs::read_to_string("/sys/fs/cgroup/memory.max")
        .ok()
        .and_then(|s| s.trim().parse::<usize>().ok());
    let machine = match (total, cgroup) {
        (Some(t), Some(c)) => t.min(c),
        (t, c) => t.or(c)?,
    };
    Some(machine / 2)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A run stop stops polls on the threads running under it (and only there), by its deadline
    /// or its cancellation; the thread's previous stop comes back after.
    #[test]
    fn a_run_stop_stops_only_its_own_threads() {
        assert_eq!(poll(), Ok(()));
        let short = RunStop::new(Some(std::time::Duration::from_millis(1)));
        std::thread::sleep(std::time::Duration::from_millis(5));
        let limit = std::time::Duration::from_millis(1);
        assert_eq!(
            with_run_stop(Some(short.clone()), poll),
            Err(Stop::TimedOut { limit })
        );
        assert_eq!(short.timed_out(), Some(limit));
        assert_eq!(short.stopped_by_deadline(), Some(limit));
        // Past its deadline but never polled: it did not stop anything.
        let unpolled = RunStop::new(Some(limit));
        std::thread::sleep(std::time::Duration::from_millis(5));
        assert_eq!(unpolled.timed_out(), Some(limit));
        assert_eq!(unpolled.stopped_by_deadline(), None);
        assert_eq!(poll(), Ok(()));
        let open = RunStop::new(None);
        with_run_stop(Some(open.clone()), || {
            assert_eq!(poll(), Ok(()));
            // A worker handed this thread's stop sees its cancellation too.
            let handed = run_stop();
            open.cancel();
            let seen = std::thread::spawn(move || with_run_stop(handed, poll)).join();
            assert_eq!(seen.ok(), Some(Err(Stop::Interrupted)));
            // Nested: the inner stop is current, then the outer one again.
            with_run_stop(None, || assert_eq!(poll(), Ok(())));
            assert_eq!(poll(), Err(Stop::Interrupted));
        });
        assert_eq!(open.timed_out(), None);
        assert_eq!(poll(), Ok(()));
        // Another thread, never under the stop, is not stopped.
        assert_eq!(std::thread::spawn(poll).join().ok(), Some(Ok(())));
    }

    #[test]
    fn process_limits_are_read_from_proc_self_limits() {
        let unlimited =
            "Limit                     Soft Limit           Hard Limit           Units     \n\
            Max data size             unlimited            unlimited            bytes     \n\
            Max stack size            8388608              unlimited            bytes     \n\
            Max address space         unlimited            unlimited            bytes     \n";
        assert_eq!(process_memory_limit(unlimited), None);
        let v = unlimited.replace(
            "Max address space         unlimited",
            "Max address space         4096000000",
        );
        assert_eq!(process_memory_limit(&v), Some(4_096_000_000));
        let both = v.replace(
            "Max data size             unlimited",
            "Max data size             1000000   ",
        );
        assert_eq!(process_memory_limit(&both), Some(1_000_000));
        assert_eq!(process_memory_limit(""), None);
    }

    #[test]
    fn sizes_parse_in_binary_units() {
        assert_eq!(parse_size("1000"), Ok(Some(1000)));
        assert_eq!(parse_size("512M"), Ok(Some(512 << 20)));
        assert_eq!(parse_size("4GiB"), Ok(Some(4 << 30)));
        assert_eq!(parse_size("1.5g"), Ok(Some(3 << 29)));
        assert_eq!(parse_size(" 2 kb "), Ok(Some(2048)));
        assert_eq!(parse_size("none"), Ok(None));
        assert_eq!(parse_size("Unlimited"), Ok(None));
        assert!(parse_size("0").is_err());
        assert!(parse_size("12 parsecs").unwrap_err().contains("not a size"));
        assert!(parse_size("").is_err());
        assert!(parse_size("1e400G").is_err());
        assert!(parse_size("99999999999T")
            .unwrap_err()
            .contains("too large"));
    }

    #[test]
    fn byte_counts_read_in_binary_units() {
        assert_eq!(bytes_text(100), "100 bytes");
        assert_eq!(bytes_text(1536), "1.5 KiB");
        assert_eq!(bytes_text(12 << 30), "12.0 GiB");
        assert_eq!(count_text(0), "0");
        assert_eq!(count_text(999), "999");
        assert_eq!(count_text(1000), "1,000");
        assert_eq!(count_text(14678698), "14,678,698");
    }

    #[test]
    fn a_reservation_past_the_limit_is_refused_and_says_so() {
        // No counting allocator in this test binary: only the reservation counts.
        set_limit(Some(1 << 20));
        assert!(reserve(1 << 10).is_ok());
        let stop = reserve(2 << 20).unwrap_err();
        assert!(matches!(stop, Stop::Memory { more, .. } if more == 2 << 20));
        assert!(stop.to_string().contains("--max-memory"), "{stop}");
        set_limit(None);
        assert!(reserve(usize::MAX).is_ok());
    }

    #[test]
    fn durations_parse_with_units_and_read_back() {
        use std::time::Duration;
        assert_eq!(parse_duration("30"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration(" 250ms "), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("10m"), Ok(Duration::from_secs(600)));
        assert_eq!(parse_duration("2 min"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_duration("1e3"), Ok(Duration::from_secs(1000)));
        assert_eq!(parse_duration("5S"), Ok(Duration::from_secs(5)));
        let huge = "9".repeat(400);
        for bad in [
            "", "0", "-3", "abc", "3 days", "nan", "inf", "1e300", "0.0004", "1e-13", &huge,
        ] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
        assert!(parse_duration("1e300")
            .unwrap_err()
            .contains("at least 1 ms"));
        assert!(parse_duration(&huge).unwrap_err().contains("at least 1 ms"));
        assert!(parse_duration("3 fortnights")
            .unwrap_err()
            .contains("not a duration"));
        assert_eq!(duration_text(Duration::from_millis(250)), "250 ms");
        assert_eq!(duration_text(Duration::from_millis(1500)), "1.5 s");
        assert_eq!(duration_text(Duration::from_secs(600)), "10 min");
        let stop = Stop::TimedOut {
            limit: Duration::from_secs(2),
        };
        assert_eq!(
            stop.to_string(),
            "the time limit of 2 s passed (raise it with --timeout)"
        );
    }

    #[test]
    fn switch_values_read_as_people_write_them() {
        use std::ffi::OsStr;
        for on in ["1", "yes", "true", "ON", " 1 ", "2"] {
            assert!(
                flag_value_on(OsStr::new(on)),
                "{on:?} should turn a switch on"
            );
        }
        for off in ["", "0", " 0", "false", "FALSE", "no", "Off"] {
            assert!(
                !flag_value_on(OsStr::new(off)),
                "{off:?} should leave a switch off"
            );
        }
    }

    #[test]
    fn the_default_is_half_the_machine() {
        if let Some(d) = default_limit() {
            assert!(d > 0);
        }
    }
}
