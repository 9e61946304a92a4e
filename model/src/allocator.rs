//! Process-wide allocator tuning for the inference and training loops.
//!
//! libtorch allocates CPU tensors with glibc `malloc`, which serves blocks above its mmap threshold
//! (128 KiB, raised dynamically up to 32 MiB) with fresh `mmap`s and gives freed heap tops back to the
//! kernel. A decode step allocates and frees the same few MiB-sized logits and activations every
//! step, so each step page-faults them in again and zeroes them: at batch 32, 15% of the cycles went
//! to page faults and page clearing (perf). Fixing the thresholds keeps that memory in the heap for
//! reuse: batch-8 decoding of SmolLM2 went from 137 to 154 tokens/s.
//!
//! Blocks above 32 MiB (glibc's ceiling for the threshold) would still be fresh mappings each time:
//! a training step of SmolLM2 makes dozens of them (the 113 MB embedding's gradient and optimiser
//! temporaries, 25–50 MB log-prob chunks), so `mmap` is turned off altogether and they come from
//! the heap too. The reference MAGRPO step's training part went from 4.6–6.3 s to 4.4 s in warm
//! steps, and from 9.7 to 5.6 s in the first (`learner/examples/step_bench`). The cost: freed memory
//! is reused but not returned to the system until the process ends: the process keeps its peak.
//!
//! Every thread allocates from the main heap (one arena). glibc gives other threads arenas of their
//! own, made of heaps of at most 64 MiB, and serves larger blocks there with fresh `mmap`s whatever
//! the settings above say: the policies' concurrent updates (`learner::trainer::rounds`) faulted
//! about a million pages in per step that way, against none when they run on the main thread.

use std::sync::Once;

/// Blocks below this come from the heap (glibc's largest allowed mmap threshold).
const MMAP_THRESHOLD: i32 = 32 << 20;
/// Freed heap tops stay mapped whatever their size (-1: never trim). With a trim threshold of 1 GiB the
/// concurrent policy updates, whose two threads' blocks interleave in the one heap, still faulted
/// 200–370k pages in at every step as the top was given back and taken again; never trimming
/// brought warm steps to 0–71k, for an RSS of 10.2–10.5 GB instead of 9.1–9.5 (step_bench, two agents).
const TRIM_THRESHOLD: i32 = -1;

/// Applies the tuning once per process (glibc only; a no-op elsewhere). Call it early in `main`.
pub fn tune_for_tensors() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        // SAFETY: mallopt only changes allocator parameters; it is thread-safe in glibc.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD);
            libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD);
            libc::mallopt(libc::M_MMAP_MAX, 0);
            libc::mallopt(libc::M_ARENA_MAX, 1);
        }
    });
}
