//! How many threads a CPU decode step uses, chosen by measuring the steps themselves.
//!
//! The kernels run on libtorch's OpenMP team, split each product into equal parts, one per thread,
//! and end every parallel region at a barrier; between regions libgomp's threads spin. That is the
//! fastest schedule on cores the engine has to itself, and the slowest when another process wants
//! one of them: each of the several hundred regions of a step waits at its barrier for whichever
//! thread the kernel's scheduler has just preempted (a time slice, milliseconds), and the spinning
//! threads take CPU time from the process they compete with. Measured on a 2-core AMD EPYC (family
//! 26) with one busy process beside it, 32 samples × 128 tokens of SmolLM2 took 12.5 s on two
//! threads, 6.6 s on one, and 4.0 s on two without the competitor (`scripts/bench/shared_cores.sh`).
//!
//! So the thread count of decode steps is a measured choice ([`DecodeThreads::Adaptive`]). When the
//! process's threads wait for cores ([`RunDelay`], the kernel's per-thread run-queue time) or steps
//! suddenly run much slower than the last ones at the same count and rows, the [`Governor`] runs a
//! few steps at half the count, interleaved with steps at the current one so that drift in step
//! cost (rows, positions) cancels, and keeps the half when its steps are clearly faster. At a
//! reduced count it tries double the count now and then, while no thread waits. Probes back off
//! while they lose. A quiet machine never probes: with no thread waiting for a core, fewer threads
//! cannot be faster.
//!
//! The count only changes how the kernels' outputs are split between threads, never a sum's order,
//! so tokens and log-probs are the same bit for bit at any count; the engine applies the governor
//! only to steps where that holds ([`crate::families::CausalLm::decode_is_thread_invariant`]).

use std::collections::HashMap;
use std::time::Duration;

/// The thread count of CPU decode steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DecodeThreads {
    /// Chosen by measurement, at most the calling thread's libtorch count (see the module docs).
    #[default]
    Adaptive,
    /// Always this many; 0: libtorch's count for the engine's thread (as configured, e.g.
    /// `--threads`).
    Fixed(usize),
}

impl std::str::FromStr for DecodeThreads {
    type Err = String;

    /// `adaptive`, `fixed` (libtorch's count for the engine's thread: the behaviour before
    /// adaptation) or a count.
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "adaptive" => Ok(DecodeThreads::Adaptive),
            "fixed" => Ok(DecodeThreads::Fixed(0)),
            n => n.parse::<usize>().map(DecodeThreads::Fixed).map_err(|_| {
                format!("decode threads `{s}`: expected `adaptive`, `fixed` (the engine's configured count) or a thread count")
            }),
        }
    }
}

/// Steps run at the candidate count in one probe (as many again at the current count, interleaved).
const PROBE_STEPS: usize = 3;
/// The candidate must take at most this fraction of the current count's time to be adopted.
const WIN_RATIO: f64 = 0.92;
/// Steps between probes of more threads right after a change, and the most probes back off to.
const FIRST_INTERVAL: usize = 16;
const MAX_INTERVAL: usize = 256;
/// Steps between two probes of fewer threads, while threads of this process wait for cores;
/// doubled while such probes lose (as on a machine with more cores than the competitors take).
const DOWN_GAP: usize = 8;
/// Run-queue time of this process's threads per second of wall time beyond which its threads are
/// competing for cores (a quarter of a thread waiting, on average).
const CONTENDED_SHARE: f64 = 0.25;
/// A step this much slower than the last steps measured at the same count and rows is "slow"...
const SLOW_FACTOR: f64 = 1.6;
/// ... and this many slow steps in a row start a probe at once.
const SLOW_STREAK: usize = 4;

/// Picks the thread count of each decode step (see the module docs). Pure bookkeeping: the engine
/// asks [`Governor::threads`] before a step and reports its duration with [`Governor::record`].
#[derive(Debug, Clone)]
pub struct Governor {
    max: usize,
    current: usize,
    /// Steps at `current` since the last probe ended.
    since_probe: usize,
    /// Steps between probes of more threads, and between probes of fewer (when they are called for).
    up_interval: usize,
    down_gap: usize,
    probe: Option<Probe>,
    /// Recent step seconds at (threads, rows): the reference for spotting a slowdown.
    typical: HashMap<(usize, usize), f64>,
    slow_streak: usize,
    /// The last contention report ([`Governor::contended`]).
    contended: bool,
}

#[derive(Debug, Clone)]
struct Probe {
    candidate: usize,
    rows: usize,
    /// Seconds of the candidate's steps and of the current count's, in the order run.
    candidate_secs: Vec<f64>,
    current_secs: Vec<f64>,
}

impl Probe {
    /// The count of the probe's next step: candidate and current alternate, candidate first.
    fn next_threads(&self, current: usize) -> usize {
        if self.candidate_secs.len() == self.current_secs.len() {
            self.candidate
        } else {
            current
        }
    }

    fn done(&self) -> bool {
        self.current_secs.len() >= PROBE_STEPS
    }
}

/// The median of pairwise ratios candidate / current: robust to one preempted step.
fn median_ratio(candidate: &[f64], current: &[f64]) -> f64 {
    let mut r: Vec<f64> = candidate
        .iter()
        .zip(current)
        .map(|(a, b)| a / b.max(1e-9))
        .collect();
    r.sort_by(f64::total_cmp);
    r[r.len() / 2]
}

impl Governor {
    /// A governor choosing between 1 and `max` threads, starting at `max`.
    pub fn new(max: usize) -> Self {
        let max = max.max(1);
        Governor {
            max,
            current: max,
            // Contention seen at the first steps probes at once.
            since_probe: DOWN_GAP,
            up_interval: FIRST_INTERVAL,
            down_gap: DOWN_GAP,
            probe: None,
            typical: HashMap::new(),
            slow_streak: 0,
            contended: false,
        }
    }

    /// Reports whether this process's threads have lately been waiting for cores ([`RunDelay`]).
    pub fn contended(&mut self, contended: bool) {
        self.contended = contended;
    }

    /// The most threads it chooses.
    pub fn max(&self) -> usize {
        self.max
    }

    /// The count steps settle on between probes.
    pub fn current(&self) -> usize {
        self.current
    }

    /// The count for the next step of `rows` rows.
    pub fn threads(&mut self, rows: usize) -> usize {
        if self.max == 1 {
            return 1;
        }
        if self.probe.as_ref().is_some_and(|p| p.rows != rows) {
            // The batch changed under the probe: its steps no longer compare.
            self.probe = None;
        }
        if self.probe.is_none() {
            // Fewer threads only help when threads wait for cores (or steps suddenly slow down);
            // more threads only while none wait, now and then.
            let down = (self.current > 1
                && (self.contended || self.slow_streak >= SLOW_STREAK)
                && self.since_probe >= self.down_gap)
                .then(|| (self.current / 2).max(1));
            let up = (self.current < self.max
                && !self.contended
                && self.since_probe >= self.up_interval)
                .then(|| (self.current * 2).min(self.max));
            if let Some(candidate) = down.or(up) {
                self.probe = Some(Probe {
                    candidate,
                    rows,
                    candidate_secs: Vec::new(),
                    current_secs: Vec::new(),
                });
                self.slow_streak = 0;
            }
        }
        match &self.probe {
            Some(p) => p.next_threads(self.current),
            None => self.current,
        }
    }

    /// Reports that a step of `rows` rows at `threads` threads took `elapsed`.
    pub fn record(&mut self, threads: usize, rows: usize, elapsed: Duration) {
        if self.max == 1 {
            return;
        }
        let secs = elapsed.as_secs_f64();
        if let Some(p) = &mut self.probe
            && p.rows == rows
        {
            if threads == p.candidate && p.candidate_secs.len() == p.current_secs.len() {
                p.candidate_secs.push(secs);
            } else if threads == self.current {
                p.current_secs.push(secs);
                let t = self.typical.entry((threads, rows)).or_insert(secs);
                *t = 0.7 * *t + 0.3 * secs;
            }
            if p.done() {
                let p = self.probe.take().expect("probing");
                self.conclude(p);
            }
            return;
        }
        if threads == self.current {
            self.since_probe += 1;
            let slow = self
                .typical
                .get(&(threads, rows))
                .is_some_and(|&t| secs > SLOW_FACTOR * t);
            self.slow_streak = if slow { self.slow_streak + 1 } else { 0 };
            if !slow {
                self.note_typical(threads, rows, secs);
            }
        }
    }

    fn note_typical(&mut self, threads: usize, rows: usize, secs: f64) {
        let t = self.typical.entry((threads, rows)).or_insert(secs);
        *t = 0.7 * *t + 0.3 * secs;
    }

    fn conclude(&mut self, p: Probe) {
        self.since_probe = 0;
        self.slow_streak = 0;
        if median_ratio(&p.candidate_secs, &p.current_secs) <= WIN_RATIO {
            tracing::debug!(
                from = self.current,
                to = p.candidate,
                "decode threads changed"
            );
            self.current = p.candidate;
            self.up_interval = FIRST_INTERVAL;
            self.down_gap = DOWN_GAP;
            // What was typical at the old count says nothing about the new one's slowdowns.
            self.typical.retain(|&(t, _), _| t != p.candidate);
            let mean = p.candidate_secs.iter().sum::<f64>() / p.candidate_secs.len() as f64;
            self.typical.insert((p.candidate, p.rows), mean);
        } else if p.candidate < self.current {
            self.down_gap = (self.down_gap * 2).min(MAX_INTERVAL);
        } else {
            self.up_interval = (self.up_interval * 2).min(MAX_INTERVAL);
        }
    }
}

/// Steps between two readings of [`RunDelay`].
const RUN_DELAY_EVERY: usize = 4;

/// A [`Governor`] fed with its process's run delay: what [`DecodeThreads::Adaptive`] runs.
#[derive(Debug)]
pub(crate) struct Adaptive {
    governor: Governor,
    run_delay: RunDelay,
    steps: usize,
}

impl Adaptive {
    pub(crate) fn new(max: usize) -> Self {
        let mut run_delay = RunDelay::new();
        // The baseline: the first decode step then already reads whether the prefill waited.
        run_delay.share();
        Adaptive {
            governor: Governor::new(max),
            run_delay,
            steps: 0,
        }
    }

    pub(crate) fn max(&self) -> usize {
        self.governor.max()
    }

    /// The count for the next step of `rows` rows.
    pub(crate) fn threads(&mut self, rows: usize) -> usize {
        if self.steps.is_multiple_of(RUN_DELAY_EVERY) {
            let contended = self.run_delay.contended();
            self.governor.contended(contended);
        }
        self.steps += 1;
        self.governor.threads(rows)
    }

    pub(crate) fn record(&mut self, threads: usize, rows: usize, elapsed: Duration) {
        self.governor.record(threads, rows, elapsed);
    }
}

/// How long this process's threads have waited for a core (the kernel's per-thread run delay,
/// `/proc/self/task/*/schedstat`), per second of wall time since the last reading: about 0 when
/// every thread that wants a core gets one. `None` where the kernel does not report it.
#[derive(Debug)]
pub struct RunDelay {
    last: Option<(std::time::Instant, u64)>,
}

impl RunDelay {
    pub fn new() -> Self {
        RunDelay { last: None }
    }

    /// Threads waiting per second since the previous call (`None` at the first call).
    pub fn share(&mut self) -> Option<f64> {
        let now = std::time::Instant::now();
        let total = Self::total_ns()?;
        let share = self.last.map(|(t, ns)| {
            total.saturating_sub(ns) as f64 / 1e9 / now.duration_since(t).as_secs_f64().max(1e-6)
        });
        self.last = Some((now, total));
        share
    }

    /// The sum of every thread's run delay in nanoseconds (threads that ended drop out, so the sum
    /// can shrink: the caller saturates).
    fn total_ns() -> Option<u64> {
        let mut total = 0u64;
        for entry in std::fs::read_dir("/proc/self/task").ok()?.flatten() {
            let Ok(text) = std::fs::read_to_string(entry.path().join("schedstat")) else {
                continue;
            };
            total += text
                .split_whitespace()
                .nth(1)
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0);
        }
        Some(total)
    }

    /// Whether the threads were competing for cores since the previous call.
    pub fn contended(&mut self) -> bool {
        self.share().is_some_and(|s| s > CONTENDED_SHARE)
    }
}

impl Default for RunDelay {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `steps` steps of `rows` rows whose seconds at a thread count come from `cost`.
    fn run(g: &mut Governor, steps: usize, rows: usize, cost: impl Fn(usize) -> f64) -> Vec<usize> {
        (0..steps)
            .map(|_| {
                let t = g.threads(rows);
                g.record(t, rows, Duration::from_secs_f64(cost(t)));
                t
            })
            .collect()
    }

    #[test]
    fn a_quiet_machine_never_probes_and_a_busy_one_drops_threads() {
        let mut g = Governor::new(2);
        // Cores to itself: two threads are faster, and with no thread waiting nothing is tried.
        let quiet = |t: usize| if t == 2 { 0.010 } else { 0.017 };
        assert!(run(&mut g, 1000, 8, quiet).iter().all(|&t| t == 2));
        // A competitor arrives, seen as threads waiting for cores: two threads now wait at every
        // barrier, one is faster; the next steps probe it and keep it.
        let shared = |t: usize| if t == 2 { 0.040 } else { 0.018 };
        g.contended(true);
        let used = run(&mut g, 20, 8, shared);
        assert_eq!(g.current(), 1, "steps {used:?}");
        // While threads still wait, more threads are not tried.
        assert!(run(&mut g, 300, 8, shared).iter().all(|&t| t == 1));
        // It leaves: a probe upwards finds two threads faster again.
        g.contended(false);
        run(&mut g, 100, 8, quiet);
        assert_eq!(g.current(), 2);
    }

    #[test]
    fn a_sudden_slowdown_probes_without_a_contention_report() {
        // Where the kernel reports no run delay, steps much slower than usual start the probe.
        let mut g = Governor::new(2);
        run(&mut g, 50, 8, |t| if t == 2 { 0.010 } else { 0.017 });
        run(&mut g, 30, 8, |t| if t == 2 { 0.040 } else { 0.018 });
        assert_eq!(g.current(), 1);
    }

    #[test]
    fn losing_probes_back_off() {
        // Threads wait (many cores, one competitor) but half the threads is still slower.
        let mut g = Governor::new(8);
        g.contended(true);
        let used = run(&mut g, 1000, 8, |t| 0.010 * 8.0 / t as f64);
        assert_eq!(g.current(), 8);
        let probed = used.iter().filter(|&&t| t != 8).count();
        assert!(
            probed <= 8 * PROBE_STEPS,
            "{probed} of 1000 steps probed fewer threads"
        );
    }

    #[test]
    fn a_probe_whose_batch_changes_is_dropped() {
        let mut g = Governor::new(2);
        g.contended(true);
        let t = g.threads(4);
        assert_eq!(t, 1, "probe starts");
        g.record(t, 4, Duration::from_millis(1));
        // A request finished: four rows became three before the probe could compare.
        g.contended(false);
        assert_eq!(g.threads(3), 2);
        assert_eq!(g.current(), 2);
    }

    #[test]
    fn one_thread_never_probes() {
        let mut g = Governor::new(1);
        assert!(run(&mut g, 100, 1, |_| 0.01).iter().all(|&t| t == 1));
    }

    #[test]
    fn parses_the_flag() {
        assert_eq!(
            "adaptive".parse::<DecodeThreads>().unwrap(),
            DecodeThreads::Adaptive
        );
        assert_eq!(
            "3".parse::<DecodeThreads>().unwrap(),
            DecodeThreads::Fixed(3)
        );
        assert_eq!(
            "fixed".parse::<DecodeThreads>().unwrap(),
            DecodeThreads::Fixed(0)
        );
        assert!(
            "fast"
                .parse::<DecodeThreads>()
                .unwrap_err()
                .contains("`fast`")
        );
    }
}
