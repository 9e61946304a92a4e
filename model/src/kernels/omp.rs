//! libtorch's own OpenMP team (libgomp), reached at run time, and a parallel loop over it.
//!
//! The kernels run on libtorch's team rather than threads of their own: the team spin-waits after
//! each of libtorch's parallel regions, so a thread of our own would compete with it for the cores,
//! while reusing the team wakes threads that are already spinning.

use std::ffi::{c_uint, c_void};
use std::sync::OnceLock;

/// libgomp's entry points, as libtorch loaded them.
pub(crate) struct Gomp {
    pub(crate) parallel: GompParallel,
    pub(crate) thread_num: OmpGetThreadNum,
    pub(crate) num_threads: OmpGetThreadNum,
}

/// `void GOMP_parallel(void (*fn)(void *), void *data, unsigned num_threads, unsigned flags)`.
pub(crate) type GompParallel =
    unsafe extern "C" fn(extern "C" fn(*mut c_void), *mut c_void, c_uint, c_uint);
/// `int omp_get_thread_num(void)`, also the signature of `omp_get_num_threads`.
pub(crate) type OmpGetThreadNum = unsafe extern "C" fn() -> i32;

/// libgomp's `GOMP_parallel` and `omp_get_thread_num`, or `None` when the process has no libgomp
/// (then the kernels run on the calling thread alone).
pub(crate) fn gomp() -> Option<&'static Gomp> {
    static GOMP: OnceLock<Option<Gomp>> = OnceLock::new();
    GOMP.get_or_init(|| {
        // SAFETY: `dlsym` with `RTLD_DEFAULT` only looks names up; all are C strings.
        let (parallel, thread_num, num_threads) = unsafe {
            (
                libc::dlsym(libc::RTLD_DEFAULT, c"GOMP_parallel".as_ptr()),
                libc::dlsym(libc::RTLD_DEFAULT, c"omp_get_thread_num".as_ptr()),
                libc::dlsym(libc::RTLD_DEFAULT, c"omp_get_num_threads".as_ptr()),
            )
        };
        if parallel.is_null() || thread_num.is_null() || num_threads.is_null() {
            return None;
        }
        // SAFETY: these are libgomp's documented ABI signatures for the three symbols.
        unsafe {
            Some(Gomp {
                parallel: std::mem::transmute::<*mut c_void, GompParallel>(parallel),
                thread_num: std::mem::transmute::<*mut c_void, OmpGetThreadNum>(thread_num),
                num_threads: std::mem::transmute::<*mut c_void, OmpGetThreadNum>(num_threads),
            })
        }
    })
    .as_ref()
}

/// Sets the number of OpenMP threads that parallel regions started *from the calling thread* use:
/// libtorch's ops and MKL calls made on it, and cotrain's kernels (they read
/// `tch::get_num_threads()`, this thread's value). Unlike `tch::set_num_threads`, it leaves other
/// threads and the process-wide default alone. False without libgomp.
pub fn set_threads_of_this_thread(n: usize) -> bool {
    static SET: OnceLock<Option<unsafe extern "C" fn(i32)>> = OnceLock::new();
    let set = SET.get_or_init(|| {
        // SAFETY: `dlsym` only looks the name up.
        let f = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"omp_set_num_threads".as_ptr()) };
        // SAFETY: libgomp's `void omp_set_num_threads(int)`.
        (!f.is_null())
            .then(|| unsafe { std::mem::transmute::<*mut c_void, unsafe extern "C" fn(i32)>(f) })
    });
    // MKL's own count, if the process set one (`tch::set_num_threads` does), would otherwise still
    // apply to this thread's MKL calls.
    static SET_MKL: OnceLock<Option<unsafe extern "C" fn(i32) -> i32>> = OnceLock::new();
    let set_mkl = SET_MKL.get_or_init(|| {
        // SAFETY: `dlsym` only looks the name up.
        let f = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"MKL_Set_Num_Threads_Local".as_ptr()) };
        // SAFETY: MKL's C `int MKL_Set_Num_Threads_Local(int)` (the lower-case name is Fortran's, by pointer).
        (!f.is_null()).then(|| unsafe {
            std::mem::transmute::<*mut c_void, unsafe extern "C" fn(i32) -> i32>(f)
        })
    });
    let n = n.clamp(1, i32::MAX as usize) as i32;
    if let Some(f) = set_mkl {
        // SAFETY: sets MKL's thread count for the calling thread only.
        unsafe { f(n) };
    }
    match set {
        Some(f) => {
            // SAFETY: sets an OpenMP internal control variable of the calling thread.
            unsafe { f(n) };
            true
        }
        None => false,
    }
}

/// What each thread of a [`parallel_for`] region gets.
struct ForData<'a> {
    body: &'a (dyn Fn(usize, usize) + Sync),
    items: usize,
    parts: usize,
    gomp: &'static Gomp,
}

/// Runs `body(lo, hi)` over `[0, items)` split into `threads` contiguous parts of nearly equal
/// size, on libtorch's OpenMP team (on the calling thread alone without libgomp, or for one part).
/// Returns when every part has run. A smaller team than asked still covers every part. `body` must
/// not panic: a panic cannot unwind out of an OpenMP region and aborts the process, so callers check
/// their inputs before.
pub(crate) fn parallel_for(items: usize, threads: usize, body: &(dyn Fn(usize, usize) + Sync)) {
    let parts = threads.clamp(1, items.max(1));
    match gomp() {
        Some(g) if parts > 1 => {
            let data = ForData {
                body,
                items,
                parts,
                gomp: g,
            };
            // SAFETY: `GOMP_parallel` runs `for_part` on the team and returns once all threads have
            // finished, so `data` outlives every use.
            unsafe {
                (g.parallel)(
                    for_part,
                    (&raw const data).cast_mut().cast(),
                    parts as c_uint,
                    0,
                )
            };
        }
        _ => body(0, items),
    }
}

extern "C" fn for_part(data: *mut c_void) {
    // SAFETY: `parallel_for` passes a `ForData` that outlives the parallel region.
    let data = unsafe { &*data.cast::<ForData<'_>>() };
    // SAFETY: called inside a parallel region, as libgomp requires.
    let (t, team) = unsafe { ((data.gomp.thread_num)(), (data.gomp.num_threads)()) };
    let (t, team) = (t.max(0) as usize, team.max(1) as usize);
    let bound = |p: usize| data.items * p / data.parts;
    for part in (t..data.parts).step_by(team) {
        (data.body)(bound(part), bound(part + 1));
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    #[test]
    fn thread_counts_are_per_thread() {
        let before = tch::get_num_threads();
        let inner = std::thread::spawn(|| {
            assert!(set_threads_of_this_thread(1));
            tch::get_num_threads()
        })
        .join()
        .unwrap();
        assert_eq!(inner, 1);
        assert_eq!(
            tch::get_num_threads(),
            before,
            "the calling thread's count is untouched"
        );
    }

    #[test]
    fn every_item_runs_exactly_once() {
        for (items, threads) in [(0, 2), (1, 4), (7, 2), (96, 2), (96, 5), (3, 8)] {
            let hits: Vec<AtomicUsize> = (0..items).map(|_| AtomicUsize::new(0)).collect();
            parallel_for(items, threads, &|lo, hi| {
                for h in &hits[lo..hi] {
                    h.fetch_add(1, Ordering::Relaxed);
                }
            });
            assert!(
                hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                "items {items}, threads {threads}"
            );
        }
    }
}
